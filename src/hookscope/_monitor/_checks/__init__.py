"""Silent errors: checks of invariants that a healthy run never breaks.

Statistics rarely show the bugs that ruin a run without a NaN: a missing ``zero_grad()``, an
optimizer that steps nothing, dropout left on in evaluation. Each check here tests one
invariant instead, each a small class with its own evidence and advice, cheap enough to be
on in every Monitor (a few tiny gathers per step, hooks that return at once in training):

- ``not_updated`` (:class:`NotUpdated`): an optimizer step left parameters with a gradient
  unchanged, or stepped only parameters that cannot change;
- ``stale_gradients`` (:class:`StaleGradients`): a step's backward started on the gradients of
  the previous optimizer step;
- ``frozen_changed`` (:class:`FrozenChanged`): parameters declared frozen changed;
- ``eval_randomness`` (:class:`EvalRandomness`): a module drew random numbers in eval mode;
- ``eval_mismatch`` (:class:`EvalMismatch`): a module's output scale in evaluation passes
  differs from its training scale by orders of magnitude (evaluation statistics are logged as
  ``eval`` records);
- ``autocast_skipped`` (:class:`AutocastSkipped`): a Linear/Conv-like layer inside an autocast
  region returned another dtype than autocast's;
- ``replica_divergence`` (:class:`ReplicaDivergence`): replicated parameters differ across
  ranks.

A check registers the hooks it needs through the Monitor's :class:`HookSet`, may put device
values into the step's buffer in :meth:`Check.collect` (they reach the host with the step's one
transfer) and turns them into findings in :meth:`Check.read`.
"""

from __future__ import annotations

from typing import Any, Protocol

from ..._diagnose import Finding
from ..._log import StepRecord
from ..._select import Where, select
from .._step._buffer import Host, StepBuffer
from .._step._dist import Entry
from ._common import Context
from ._forward import AutocastSkipped, EvalMismatch, EvalRandomness
from ._grads import StaleGradients
from ._replicas import ReplicaDivergence
from ._updates import FrozenChanged, NotUpdated

__all__ = ["Check", "Checks", "Context"]


class Check(Protocol):
    """One invariant. Hooks are registered in ``__init__``; the Monitor calls the rest."""

    kind: str

    def collect(self, buf: StepBuffer, sampled: bool) -> None:
        """Put this step's device values into ``buf``, before its one host transfer."""

    def layout(self, rank: int) -> list[Entry]:
        """Keys combined across ranks by the step's collective (sampled steps)."""

    def read(self, host: Host, record: StepRecord) -> list[Finding]:
        """This step's findings, from the transferred values and the step's record."""


class Checks:
    """Every check of a Monitor, called at its well-defined points."""

    def __init__(
        self, ctx: Context, *, frozen: Where | None = None, replicated: Where | None = None
    ) -> None:
        frozen_modules = select(ctx.model, frozen) if frozen is not None else {}
        self.checks: list[Any] = [
            NotUpdated(ctx),
            StaleGradients(ctx),
            EvalRandomness(ctx),
            EvalMismatch(ctx),
            AutocastSkipped(ctx),
        ]
        if frozen_modules:
            self.checks.append(FrozenChanged(ctx, frozen_modules))
        if ctx.rank is not None and ctx.world > 1:
            picked = select(ctx.model, replicated) if replicated is not None else None
            self.checks.append(ReplicaDivergence(ctx, picked))
        self._backward = [c for c in self.checks if hasattr(c, "before_backward")]
        self._begin = [c for c in self.checks if hasattr(c, "begin")]

    def before_backward(self) -> None:
        """A backward pass is about to start (``loss.backward()``)."""
        for check in self._backward:
            check.before_backward()

    def backward_missed(self) -> None:
        """The backward pass just started never reached the model (another model's)."""
        for check in self._backward:
            missed = getattr(check, "backward_missed", None)
            if missed is not None:
                missed()

    def begin(self, buf: StepBuffer) -> None:
        """A step starts (``buf`` is its buffer): what a check reads late goes in it."""
        for check in self._begin:
            check.begin(buf)

    def collect(self, buf: StepBuffer, sampled: bool) -> None:
        for check in self.checks:
            check.collect(buf, sampled)

    def layout(self, rank: int) -> list[Entry]:
        return [entry for check in self.checks for entry in check.layout(rank)]

    def read(self, host: Host, record: StepRecord) -> list[Finding]:
        return [f for check in self.checks for f in check.read(host, record)]

    def close(self) -> None:
        """The run ends: what a check still holds (an evaluation's statistics) is written."""
        for check in self.checks:
            flush = getattr(check, "flush", None)
            if flush is not None:
                flush()
