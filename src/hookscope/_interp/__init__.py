"""Interpretability on the models people already load: activation and attribution patching,
the logit lens, and steering during ``generate()``, with no per-architecture code.

- ``_patching.py``: :func:`patching`, exact sweeps (batched) and attribution patching.
- ``_lens.py``: :func:`logit_lens`, the final norm and unembedding found or given.
- ``_steer.py``: :func:`steer`, steering vectors by position, also during ``generate()``.
- ``_heads.py``: the attention output projection and head count, found generically.
- ``_result.py``: :class:`Patching`, the result tensor that names its rows.
- ``_values.py``: model inputs, and the one tensor of a module's value.
"""

from ._lens import logit_lens
from ._patching import patching
from ._result import LogitLens, Patching
from ._steer import Steering, steer

__all__ = ["LogitLens", "Patching", "Steering", "logit_lens", "patching", "steer"]
