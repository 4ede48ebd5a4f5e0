"""Interpretability on the models people already load: activation and attribution patching,
the logit lens, and steering during ``generate()``, with no per-architecture code.

- ``_patching.py``: :func:`patching`, exact sweeps (batched) and attribution patching.
- ``_heads.py``: the attention output projection and head count, found generically.
- ``_result.py``: :class:`Patching`, the result tensor that names its rows.
- ``_values.py``: model inputs, and the one tensor of a module's value.
"""

from ._patching import patching
from ._result import Patching

__all__ = ["Patching", "patching"]
