"""One open Monitor per model, and what a Monitor refuses once closed.

A notebook cell that builds a Monitor, run again, makes a second Monitor on the same model:
it replaces the first (closing it: every hook removed, its log complete) instead of
stacking a second set of hooks on the model. A closed Monitor's ``step()`` says so.
"""

from __future__ import annotations

import weakref
from typing import Any

from torch import nn

from .._errors import HookscopeError

__all__ = ["Lifetime", "check_materialized", "idle_message", "open_monitor"]

# model -> its open Monitor (weak both ways: neither keeps the other alive)
_OPEN: weakref.WeakKeyDictionary[nn.Module, weakref.ref] = weakref.WeakKeyDictionary()


def open_monitor(model: nn.Module) -> Any:
    """The Monitor open on ``model``, or ``None``."""
    ref = _OPEN.get(model)
    return ref() if ref is not None else None


class Lifetime:
    """A Monitor's place in the registry: ``take`` replaces the model's open Monitor,
    ``release`` frees the place, ``closed_message`` says why ``step()`` cannot run."""

    def __init__(self, model: nn.Module) -> None:
        self._model = weakref.ref(model)
        self.closed = False
        self.replaced_by: str | None = None  # the model's class, once replaced
        self.told_idle = False  # idle_message given

    def take(self, monitor: Any) -> None:
        """Register ``monitor`` as its model's one open Monitor, closing an earlier one."""
        model = self._model()
        if model is None:
            return
        previous = open_monitor(model)
        if previous is not None and previous is not monitor:
            previous._lifetime.replaced_by = type(model).__name__
            previous.close()
        _OPEN[model] = weakref.ref(monitor)

    def release(self, monitor: Any) -> None:
        self.closed = True
        model = self._model()
        if model is not None and open_monitor(model) is monitor:
            del _OPEN[model]

    def closed_message(self, step: int) -> str:
        if self.replaced_by is not None:
            why = (
                f"a newer Monitor on the same model ({self.replaced_by}) replaced it (one "
                "open Monitor per model: a cell that builds a Monitor, run again, closes the "
                "Monitor it built before)"
            )
            fix = "call step() on the new Monitor"
        else:
            why = "close() ran (or its `with` block ended), which removed every hook"
            fix = "make a new Monitor (hs.Monitor(model, ...)) to go on watching"
        return f"this Monitor is closed after {step} steps: {why}.\nFix: {fix}."


def check_materialized(model: nn.Module) -> None:
    """A Monitor measures values: refuse a model whose parameters or buffers hold none (on
    the meta device)."""
    meta = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if meta:
        raise HookscopeError(
            f"hs.Monitor: {type(model).__name__} has {len(meta)} parameters/buffers on the "
            f"meta device ({meta[0]!r}, ...), which hold no values to measure.\nFix: "
            "materialise the model first (model.to_empty(device=...) and load its weights); "
            "hs.summary and hs.capture work on a meta model for shapes."
        )


def idle_message(step: int, model: str) -> str:
    """``step()`` closed a step in which nothing of the model ran."""
    return (
        f"hookscope: Monitor.step() at step {step}: nothing of {model} ran since the last "
        "step() (no forward or backward pass reached its hooks, no optimizer step, no "
        "gradient), so this step's record is empty. Call mon.step() once per training step, "
        "after optimizer.step(); a model run through `.forward(...)` skips every hook: call "
        "the model itself."
    )
