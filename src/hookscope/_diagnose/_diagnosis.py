"""``Diagnosis``: runs every rule on each step and keeps the findings' lifecycle.

It only orchestrates: each family of rules keeps its own state in its own module, and
:class:`~._lifecycle.Lifecycle` decides what is new, current and cleared.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from .._log import StepRecord
from ._activations import units
from ._finding import Finding
from ._gradients import Gradients
from ._graph import Graph, module_of
from ._large_model import LogitGrowth, MassiveActivations
from ._lifecycle import Lifecycle
from ._precision import PrecisionRules
from ._thresholds import Thresholds
from ._training import Training
from ._updates import UpdateRules

__all__ = ["Diagnosis"]


class Diagnosis:
    """Stateful rules: remembers what was reported, and runs of conditions across steps.

    Call :meth:`training_step` on every step (the loss, ``grad_norm`` and learning-rate
    rules), then :meth:`sampled` on sampled steps, pass the findings through
    :meth:`first_time`, and collect :meth:`cleared` after.
    """

    def __init__(
        self,
        thresholds: Thresholds,
        shapes: dict[str, list[int]] | None = None,
        types: dict[str, str] | None = None,
    ) -> None:
        self.t = thresholds
        shapes = shapes or {}
        self._lifecycle = Lifecycle(thresholds)
        self._training = Training(thresholds)
        self._gradients = Gradients(thresholds, shapes, types or {})
        self._updates = UpdateRules(thresholds, shapes, types)
        self._massive = MassiveActivations(thresholds)
        self._logits = LogitGrowth(thresholds)
        self._precision = PrecisionRules(thresholds)

    def is_new(self, finding: Finding) -> bool:
        return self._lifecycle.is_new(finding)

    def first_time(self, finding: Finding) -> bool:
        """Whether ``finding`` is new (not reported, or reported and cleared since); a new
        finding made by these rules becomes current, to be cleared when it no longer holds."""
        return self._lifecycle.first_time(finding)

    def cleared(self) -> list[Finding]:
        """The current findings whose condition stopped holding for their span since the last
        call, each as :meth:`first_time` kept it with ``cleared_at`` set (the first step it
        no longer held at). Their kind and module can be found again after."""
        return self._lifecycle.cleared()

    def training_step(
        self,
        step: int,
        scalars: dict[str, float],
        *,
        updates: int = 1,
        grad_total: float | None = None,
    ) -> list[Finding]:
        """Findings from the scalars of one training step (``loss``, ``grad_norm``: the total
        gradient norm before clipping, ``lr``, ``lr/*``), sampled or not. ``updates``: the
        optimizer updates applied in this step; ``grad_total``: the L2 norm of every
        parameter's gradient, measured on every step (judged only where the loss cannot
        be: a loss that has been <= 0, or none). Call it before :meth:`sampled` on the same
        step; :meth:`sampled` calls it itself when a step was not seen (then a learning rate
        and the loss are judged on sampled steps only)."""
        if step <= self._training.last_step:
            return []
        found = self._training.see(
            step, scalars, updates, self._gradients.suspect, grad_total=grad_total
        )
        judged = self._training.judged
        self._logits.loss(step, scalars.get("loss"))
        self._lifecycle.track(step, found, "step", lambda _: judged)
        return found

    def sampled(self, step: int, record: StepRecord, graph: Graph | None = None) -> list[Finding]:
        """Findings from the statistics of one sampled step."""
        graph = graph or Graph(frozenset())
        updates = step - self._training.last_step
        found = self.training_step(step, record.scalars, updates=updates)
        made = units(self.t, step, record.act)
        made += self._massive.check(step, record.act)
        made += self._precision.check(step, record.precision)
        made += self._logits.check(step, record.attn)
        made += self._gradients.check(step, record, graph, self._training)
        made += self._updates.check(step, record.param, graph, self._training)
        self._lifecycle.track(step, made, "sampled", _judged(record))
        return found + made

    def overflow(self, nonfinite: Finding) -> Finding | None:
        """An Inf made from finite values in the backward pass is an exploding gradient first
        (an overflow), and a non-finite value as its consequence."""
        return self._gradients.overflow(nonfinite)


def _judged(record: StepRecord) -> Callable[[str], bool]:
    """Which modules a sampled step's statistics judge: none where any of them, or the
    loss, is NaN/Inf (a run whose weights turned NaN has not recovered), else those it
    logged (and the model as a whole, ``""``)."""
    loss = record.scalars.get("loss")
    if loss is not None and not math.isfinite(loss):
        return lambda _: False
    for group in (record.act, record.param, record.grad, record.attn):
        for stats in group.values():
            for key, value in stats.items():
                bad = key in ("nan", "inf") and value  # counts of non-finite elements
                if bad or (isinstance(value, float) and not math.isfinite(value)):
                    return lambda _: False
    present = {"", *record.act, *record.grad, *record.attn, *record.precision}
    present |= {module_of(p) for p in record.param}
    return present.__contains__
