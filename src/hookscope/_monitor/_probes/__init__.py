"""What a Monitor measures: the probes, each putting device tensors into the step's buffer.

``_set.py`` holds them as one collection; ``_outputs.py`` (module outputs and their
gradients), ``_params.py`` (parameters, BatchNorm statistics), ``_precision.py``,
``_attention.py``, ``_signals.py`` (the rolling window of per-step scalars, loss spikes) and
``_compiled.py`` (the same measurements inside a ``torch.compile`` graph).
"""
