"""Helpers for users' own tests: check that no hook was left behind on a model.

Example:
    >>> import torch, hookscope as hs, torch.nn as nn
    >>> from hookscope.testing import assert_no_hooks
    >>> model = nn.Sequential(nn.Linear(2, 2))
    >>> with hs.capture(model, "0"):
    ...     _ = model(torch.ones(1, 2))
    >>> assert_no_hooks(model)
"""

from __future__ import annotations

from torch import nn
from torch.optim import optimizer as _optimizer

from ._hooks import live_handle_sets, live_handles, patched

__all__ = ["assert_no_hooks", "assert_torch_untouched", "hooks_on"]

_MODULE_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_hooks",
    "_backward_pre_hooks",
    "_backward_hooks",
)
_GLOBAL_HOOK_DICTS = ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks")


def hooks_on(model: nn.Module, *, only_hookscope: bool = False) -> list[str]:
    """Describe every hook found on ``model``'s modules, parameters and buffers, and torch's
    global optimizer step hooks (which a Monitor uses to find the optimizer), except those
    hookscope holds for another model only (a copy of a watched model is clean while the
    original's Monitor runs).

    Args:
        model: The model to inspect.
        only_hookscope: Report only hooks that hookscope added and has not removed yet.

    Returns:
        One line per hook, e.g. ``"layer1.0.conv1: _forward_hooks"``.
    """
    ours = {(id(h.hooks_dict_ref()), h.id) for h in live_handles()} if only_hookscope else None
    found = []
    for name, module in model.named_modules():
        label = name or "<root>"
        for attr in _MODULE_HOOK_DICTS:
            for hook_id in getattr(module, attr, {}) or {}:
                if ours is None or (id(getattr(module, attr)), hook_id) in ours:
                    found.append(f"{label}: {attr}")
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        for attr in ("_backward_hooks", "_post_accumulate_grad_hooks"):
            hooks = getattr(tensor, attr, None) or {}
            for hook_id in hooks:
                if ours is None or (id(hooks), hook_id) in ours:
                    found.append(f"{name}: {attr}")
    elsewhere = _global_hooks_of_other_models(model)
    for attr in _GLOBAL_HOOK_DICTS:
        hooks = getattr(_optimizer, attr, None) or {}
        for hook_id in hooks:
            if hook_id in elsewhere:
                continue
            if ours is None or (id(hooks), hook_id) in ours:
                found.append(f"torch.optim.optimizer: {attr}")
    return found


def _global_hooks_of_other_models(model: nn.Module) -> set[int]:
    """Ids of the global optimizer hooks of HookSets whose other hooks are all on modules
    and tensors outside ``model``: they serve another model (the original of a copy)."""
    on_model = {
        id(hooks)
        for module in model.modules()
        for attr in _MODULE_HOOK_DICTS
        if (hooks := getattr(module, attr, None)) is not None
    }
    on_model |= {
        id(hooks)
        for tensor in [*model.parameters(), *model.buffers()]
        for attr in ("_backward_hooks", "_post_accumulate_grad_hooks")
        if (hooks := getattr(tensor, attr, None)) is not None
    }
    global_dicts = {id(getattr(_optimizer, attr, None)) for attr in _GLOBAL_HOOK_DICTS}
    elsewhere: set[int] = set()
    for handles in live_handle_sets():
        local = [
            id(h.hooks_dict_ref()) for h in handles if id(h.hooks_dict_ref()) not in global_dicts
        ]
        if local and not on_model.intersection(local):
            elsewhere.update(h.id for h in handles if id(h.hooks_dict_ref()) in global_dicts)
    return elsewhere


def assert_no_hooks(model: nn.Module, *, only_hookscope: bool = False) -> None:
    """Fail if ``model`` still carries hooks.

    Args:
        model: The model to check.
        only_hookscope: Check only for hooks added by hookscope, ignoring the user's own and
            other libraries' hooks.

    Raises:
        AssertionError: Listing each hook found and where.
    """
    found = hooks_on(model, only_hookscope=only_hookscope)
    if found:
        whose = "hookscope hooks" if only_hookscope else "hooks"
        raise AssertionError(f"{len(found)} {whose} left on the model:\n  " + "\n  ".join(found))


def assert_torch_untouched() -> None:
    """Fail if hookscope still holds anything of torch's replaced (a function, a method,
    ``nn.Module.__getstate__``): after every Monitor, capture and intervention is closed,
    each is torch's own object again.

    Raises:
        AssertionError: Naming each attribute still replaced and how many users hold it.
    """
    held = patched()
    if held:
        names = [f"{getattr(o, '__name__', type(o).__name__)}.{n} ({u} users)" for o, n, u in held]
        raise AssertionError("hookscope still replaces:\n  " + "\n  ".join(names))
