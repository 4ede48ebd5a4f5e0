"""Helpers for users' own tests: check that no hook was left behind on a model.

:func:`step_state` and :func:`internals` are the one seam through which hookscope's own tests
read a Monitor's parts: they are not for users and may change between releases.

Example:
    >>> import torch, hookscope as hs, torch.nn as nn
    >>> from hookscope.testing import assert_no_hooks
    >>> model = nn.Sequential(nn.Linear(2, 2))
    >>> with hs.capture(model, "0"):
    ...     _ = model(torch.ones(1, 2))
    >>> assert_no_hooks(model)
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.optim import optimizer as _optimizer

from ._hooks import live_handle_sets, live_handles, patched

if TYPE_CHECKING:
    from ._monitor import Monitor
    from ._monitor._nonfinite._decide import NonFiniteDecision
    from ._monitor._step._buffer import Host
    from ._monitor._step._state import StepState
    from ._monitor._wiring._modules import ModuleHooks

__all__ = [
    "Internals",
    "assert_no_hooks",
    "assert_torch_untouched",
    "hooks_on",
    "internals",
    "step_state",
]

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


# -- the seam of hookscope's own tests: every read of a Monitor's private parts is here ------


def step_state(monitor: Monitor) -> StepState:
    """The state ``monitor``'s hooks write in the current step (flags, statistics buffer,
    the loss heard, the graph of the modules that ran); a new one after each ``step()``.

    For hookscope's own tests of the Monitor's internals: not for users, and its type and
    fields may change between releases.
    """
    return monitor._now


def internals(monitor: Monitor) -> Internals:
    """The parts of ``monitor`` that hookscope's own tests look into (see :class:`Internals`).

    For hookscope's own tests: not for users, and it may change between releases.
    """
    return Internals(monitor)


class Internals:
    """A Monitor's private parts, named once for hookscope's own tests, so that a rename
    inside the Monitor is followed here and nowhere else. Not for users: any of it may change
    between releases."""

    def __init__(self, monitor: Monitor) -> None:
        self._monitor = monitor

    @property
    def module_hooks(self) -> ModuleHooks:
        """The hooks on the model's modules (``_monitor/_wiring/_modules.py``)."""
        return self._monitor._module_hooks

    @property
    def decision(self) -> NonFiniteDecision:
        """What decides a non-finite step (``_monitor/_nonfinite/_decide.py``)."""
        return self._monitor._decision

    @property
    def taped_calls(self) -> list[Any]:
        """The model calls the flight recorder kept this step (``_nonfinite/_trace.py``)."""
        return list(self._monitor._tape.calls)

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizers adopted so far (still alive), in the order they were adopted."""
        return [opt for ref in self._monitor._optim.adopted if (opt := ref()) is not None]

    @property
    def update_samples(self) -> dict[str, torch.Tensor]:
        """The parameters' samples kept from before the update to measure its ratio."""
        return self._monitor._probes.params._before

    def host_values(self) -> Host:
        """What the step's one transfer would move to the host now (the step goes on)."""
        return self._monitor._transfer.to_host(step_state(self._monitor))

    @contextmanager
    def replaying(self) -> Iterator[None]:
        """Run the body as the Monitor's own replays run: the flight recorder keeps no call
        and no statistic counts it."""
        tape = self._monitor._tape
        before, tape.paused = tape.paused, True
        try:
            yield
        finally:
            tape.paused = before
