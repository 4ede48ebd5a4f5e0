"""One training step as the Monitor's hooks see it: what they write while the step runs.

The Monitor holds one :class:`StepState` and starts a new one when ``step()`` ends, so that
nothing of a step outlives it. A replay of the step with every module flagged
(``_nonfinite/_decide.py``) runs the same hooks into a state of its own, which the Monitor swaps in for
the replay and out after it: the replay leaves the step's state as it found it.
"""

from __future__ import annotations

from typing import Any

import torch

from ..._diagnose import Finding, Graph
from ..._record import version
from ._buffer import StepBuffer
from ._heard import Heard
from ._trail import NonFiniteTrail

__all__ = ["StepState"]


class StepState:
    """What the hooks gathered this step: the device tensors for the step's one transfer,
    the non-finite trail, which outputs needed and got a gradient, the updates that ran, the
    step's non-finite finding once made and what was heard of the script's calls."""

    __slots__ = (
        "backward_ran",
        "buf",
        "carried",
        "early",
        "finite_flags",
        "flagging",
        "got_grad",
        "heard",
        "hooks_ran",
        "light",
        "made",
        "no_grad_names",
        "nonfinite",
        "reached",
        "reading",
        "returned",
        "sampled",
        "skipped",
        "trail",
        "updates",
    )

    def __init__(self, *, sampled: bool, light: bool, flagging: bool = False) -> None:
        self.sampled = sampled  # the step collects statistics
        self.light = light  # only the model's edges are flagged (a replay localises)
        self.flagging = flagging  # a replay of the step, every watched module flagged
        # The module calls add to the statistics (a sampled step), until a closure is
        # evaluated again in one ``step()`` (``ModuleHooks.closure_again``)
        self.reading = sampled
        self.buf = StepBuffer()
        self.trail = NonFiniteTrail()
        self.heard = Heard()  # the loss, loss scale, clips (``_step/_heard.py``)
        self.made: dict[str, set[int]] = {}  # sampled steps: outputs needing a gradient
        self.got_grad: set[str] = set()  # modules whose output gradient arrived
        self.returned: set[int] = set()  # outputs that a container returned
        self.no_grad_names: set[str] = set()  # modules that ran without autograd
        self.updates = 0  # optimizer updates that ran
        self.skipped = 0  # of those, skipped for a NaN/Inf (``on_nonfinite="skip"``)
        self.nonfinite: Finding | None = None  # the step's non-finite finding, once found
        self.early: list[Finding] = []  # findings reported before the update
        # how many of the trail's flags a check before an update found finite (-1: none)
        self.finite_flags = -1
        # scalars heard before the update that went with its transfer: key -> (tensor, version)
        self.carried: dict[str, tuple[torch.Tensor, int | None]] = {}
        # Did any hook on the model run, did a backward pass run? (A compiled graph from
        # before the hooks runs the model without them.)
        self.hooks_ran = self.backward_ran = False
        # Did a backward pass reach the model (another model's, a teacher's, does not)?
        self.reached = False

    def carry_scalars(self) -> None:
        """Put the scalars heard so far (the loss, the clip's norm: ``Heard.scalars()``) into
        the buffer, for the transfer before an update: on an unsampled step ``step()`` then
        has nothing left to move, and the step costs one host sync, not two."""
        heard = self.heard.scalars()
        # (the loss as heard is moved as it is: no conversion per step)
        given = heard if all(_ready(v) for v in heard.values()) else split_scalars(heard)[0]
        for key, value in given.items():
            self.buf.set(("scalar", key), value)
            self.carried[key] = (heard[key], version(heard[key]))

    def put_scalars(self, scalars: dict[str, Any]) -> tuple[list[str], dict[str, float]]:
        """At ``step()``: the scalars heard and those given to it (which win), checked; the
        tensors go into the buffer unless they moved before the update already. Returns the
        tensors' keys, sorted, and the numbers."""
        named = {**self.heard.scalars(), **scalars}
        carried = [
            k for k, v in named.items() if isinstance(v, torch.Tensor) and self._was_carried(k, v)
        ]
        # (those that moved already are not converted again)
        fresh = {k: v for k, v in named.items() if k not in carried} if carried else named
        given, plain = split_scalars(fresh)
        for key, value in given.items():
            self.buf.set(("scalar", key), value)
        return sorted([*given, *carried]), plain

    def _was_carried(self, key: str, value: torch.Tensor) -> bool:
        """``value`` (given to ``step()`` or heard) is the scalar already moved under ``key``:
        the same memory, unchanged since (``loss`` and ``loss.detach()`` both are)."""
        carried = self.carried.get(key)
        if carried is None:
            return False
        moved, then = carried
        if value is moved:  # the tensor heard (``loss``)
            return then is not None and version(value) == then
        return (
            then is not None  # an inference tensor keeps no version: moved again
            and value.data_ptr() == moved.data_ptr()
            and value.dtype == moved.dtype
            and value.device == moved.device
            and value.numel() == moved.numel() == 1
            and version(value) == then
        )

    def graph(self) -> Graph:
        """Which watched module fed which, and which ones' outputs went on detached."""
        detached = self.trail.detached | self.dead_ends()
        return Graph(frozenset(self.trail.edges), frozenset(detached))

    def dead_ends(self) -> set[str]:
        """Modules whose output needed a gradient and got none although backward ran, and
        that neither a container returned nor fed a module whose output was returned: their
        result went on detached (or was thrown away)."""
        if not self.got_grad:
            return set()
        live = {n for n, ptrs in self.made.items() if ptrs & self.returned}
        feeds: dict[str, set[str]] = {}
        for producer, consumer in self.trail.edges:
            feeds.setdefault(consumer, set()).add(producer)
        todo = [n for n in self.made if n in self.got_grad] + list(live)
        live.update(todo)
        while todo:  # whatever fed a live module is live
            for producer in feeds.get(todo.pop(), ()):
                if producer not in live:
                    live.add(producer)
                    todo.append(producer)
        return {n for n in self.made if n not in live}

    def skip_message(self, step: int, scale: float | None, adopted: bool) -> str | None:
        """The step's ``skipped_step`` event, if its update did not run: GradScaler skipped
        it, or an adopted optimizer did not step although the step ran (the flags say so)."""
        if self.heard.scaler_skips:
            return self.heard.skip_message(step, scale)
        if adopted and self.updates == self.skipped == 0 and self.trail.flags:
            return (
                f"step {step}: optimizer.step() did not run (e.g. GradScaler skipped it after "
                "finding Inf/NaN gradients)"
            )
        return None


def _ready(value: torch.Tensor) -> bool:
    """A scalar tensor as the step's transfer takes it: detached, ``float32``, shape ``(1,)``
    (the loss a backward pass heard is, ``_wiring/_calls.py``)."""
    return (
        type(value) is torch.Tensor
        and value.dtype is torch.float32
        and not value.requires_grad
        and value.shape == (1,)
    )


def split_scalars(scalars: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """``step()``'s scalars, each checked: the tensors (detached, one ``float32`` element
    each, for the step's one transfer) and the numbers."""
    given: dict[str, torch.Tensor] = {}
    plain: dict[str, float] = {}
    for key, value in scalars.items():
        if isinstance(value, torch.Tensor):
            given[key] = _scalar_tensor(key, value)
        else:
            plain[key] = _scalar_number(key, value)
    return given, plain


def _scalar_tensor(key: str, value: torch.Tensor) -> torch.Tensor:
    if value.numel() != 1:
        raise ValueError(
            f"step({key}=...): a scalar must be a number or a one-element tensor, got a tensor "
            f"of shape {tuple(value.shape)}. Fix: reduce it first, e.g. {key}={key}.mean()."
        )
    return value.detach().float().reshape(1)


def _scalar_number(key: str, value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(
            f"step({key}=...): a scalar must be a number or a one-element tensor, got "
            f"{type(value).__name__} {value!r:.60}. Fix: pass the value itself, e.g. "
            f"mon.step({key}=loss) with loss a tensor or a float."
        ) from None
