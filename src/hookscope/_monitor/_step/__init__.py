"""One step's state and its one transfer: what the hooks write while a step runs
(``_state.py``), the device buffer (``_buffer.py``), its move to the host (``_transfer.py``)
and, under ``torch.distributed``, the step's one collective (``_dist.py``).
"""
