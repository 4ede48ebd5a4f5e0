"""``Diagnosis``: runs every rule on each step and keeps the findings' lifecycle.

It only orchestrates: each family of rules keeps its own state in its own module, and
:class:`~._lifecycle.Lifecycle` decides what is new, current and cleared.
"""

from __future__ import annotations

from .._log import StepRecord
from ._activations import units
from ._finding import Finding
from ._gradients import Gradients
from ._graph import Graph
from ._large_model import LogitGrowth, MassiveActivations
from ._lifecycle import Lifecycle
from ._precision import Precision
from ._thresholds import Thresholds
from ._training import Training
from ._updates import Updates

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
        self._updates = Updates(thresholds, shapes)
        self._massive = MassiveActivations(thresholds)
        self._logits = LogitGrowth(thresholds)
        self._precision = Precision(thresholds)

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
        self, step: int, scalars: dict[str, float], *, updates: int = 1
    ) -> list[Finding]:
        """Findings from the scalars of one training step (``loss``, ``grad_norm``: the total
        gradient norm before clipping, ``lr``, ``lr/*``), sampled or not. ``updates``: the
        optimizer updates applied in this step. Call it before :meth:`sampled` on the same
        step; :meth:`sampled` calls it itself when a step was not seen (then a learning rate
        and the loss are judged on sampled steps only)."""
        if step <= self._training.last_step:
            return []
        found = self._training.see(step, scalars, updates, self._gradients.suspect)
        self._lifecycle.track(step, found, "step")
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
        self._lifecycle.track(step, made, "sampled")
        return found + made

    def overflow(self, nonfinite: Finding) -> Finding | None:
        """An Inf made from finite values in the backward pass is an exploding gradient first
        (an overflow), and a non-finite value as its consequence."""
        return self._gradients.overflow(nonfinite)
