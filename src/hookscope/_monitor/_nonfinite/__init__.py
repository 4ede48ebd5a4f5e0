"""Where a step's first NaN/Inf arose: the trail of flags kept on every step (``_trail.py``),
the decision (``_decide.py``), the op-level replay (``_trace.py``), the flight recorder's
bundles (``_replay.py``) and weights poisoned by an update (``_poisoned.py``).
"""
