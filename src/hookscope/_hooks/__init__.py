"""The hook layer: the one place that registers and removes hooks, decides what a call
means, and replaces anything in torch.

- ``_set.py``: :class:`HookSet`, every hook one hookscope object added (and what it holds
  replaced in torch), removed together; pickling leaves hookscope's hooks out.
- ``_points.py``: sites, calls counted per forward pass, recomputes mapped to the call they
  repeat, and the copies whose hooks see one module's gradients.
- ``_compile.py``: hooks and compiled models.
- ``_taps.py``: the tap that hands values and gradients to Python from compiled graphs.
- ``_patches.py``: the one owner of every replaced attribute of torch or Python.
"""

from ._compile import (
    break_graph_for,
    check_not_compiled,
    compiled_wrappers,
    eager_calls,
    eager_model,
    eager_only,
    guard_module_hooks,
    in_backward_recompute,
    live_objects,
    uncompiled,
    unwrap_parallel,
)
from ._patches import patched, use
from ._points import (
    POINTS,
    CallClock,
    Site,
    alias_grad_inputs,
    alias_grad_outputs,
    forward_failed,
    is_replaying,
    no_grad_in_model_message,
    replaying,
    same_layout_copy,
)
from ._set import HookSet, live_handle_sets, live_handles, training_mode
from ._taps import close_tap, open_tap, refill, tap, taps_compile

__all__ = [
    "POINTS",
    "CallClock",
    "HookSet",
    "Site",
    "alias_grad_inputs",
    "alias_grad_outputs",
    "break_graph_for",
    "check_not_compiled",
    "close_tap",
    "compiled_wrappers",
    "eager_calls",
    "eager_model",
    "eager_only",
    "forward_failed",
    "guard_module_hooks",
    "in_backward_recompute",
    "is_replaying",
    "live_handle_sets",
    "live_handles",
    "live_objects",
    "no_grad_in_model_message",
    "open_tap",
    "patched",
    "refill",
    "replaying",
    "same_layout_copy",
    "tap",
    "taps_compile",
    "training_mode",
    "uncompiled",
    "unwrap_parallel",
    "use",
]
