"""extract(): features from chosen modules in one forward pass that stops as early as it can."""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch
from torch import nn

from ._errors import HookscopeError, StopForward, never_ran_message
from ._hooks import HookSet, eager_calls, training_mode, uncompiled
from ._record import Keeper
from ._select import Where, select

__all__ = ["extract"]


def extract(
    model: nn.Module,
    *inputs: Any,
    where: Where,
    eval: bool = True,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    **kwargs: Any,
) -> dict[str, Any]:
    """Run one forward pass without gradients and return the outputs of the chosen modules.

    The pass stops right after the last chosen module has run, so extracting an early layer
    costs only the layers before it. A module called several times gives its first call.

    Args:
        model: The model. Its training mode is restored and no hook is left behind.
        *inputs: Positional arguments for ``model(...)``.
        where: Which modules (name, glob, regex, type, predicate, or a list).
        eval: Run in eval mode (the default: dropout off, BatchNorm running statistics left
            untouched by the partial pass); ``False`` keeps the current mode.
        device: Move the features to this device.
        dtype: Cast floating-point features to this dtype.
        **kwargs: Keyword arguments for ``model(...)``.

    Returns:
        ``{name: output}`` in ``named_modules()`` order; each output is detached and copied.

    Raises:
        SelectionError: If ``where`` matches nothing.
        HookscopeError: If a chosen module never ran (the message says why that happens).

    Example:
        >>> import torch, hookscope as hs, torch.nn as nn
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> feats = hs.extract(model, torch.randn(5, 4), where="1")
        >>> feats["1"].shape
        torch.Size([5, 8])
    """
    model = uncompiled(model)  # a one-off pass: run eagerly, nothing to recompile
    chosen = select(model, where)
    keeper = Keeper(device, dtype)
    found: dict[str, Any] = {}
    pending = set(chosen)

    def keep(name: str, module: nn.Module, args: Any, kw: Any, output: Any) -> None:
        if name in found:
            return
        found[name] = keeper.value(output, name)
        pending.discard(name)
        if not pending:
            raise StopForward  # the last chosen module ran: end the pass here

    with HookSet("extract") as hooks, training_mode(model, False if eval else model.training):
        for name, module in chosen.items():
            hooks.forward(module, functools.partial(keep, name))
        with torch.no_grad(), eager_calls(), contextlib.suppress(StopForward):
            model(*inputs, **kwargs)
    if pending:
        missing = [name for name in chosen if name in pending]
        raise HookscopeError("extract: " + never_ran_message(missing))
    return {name: found[name] for name in chosen}
