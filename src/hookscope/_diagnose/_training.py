"""What the scalars of every training step say, sampled or not.

The learning-rate schedule (a warm-up step is not judged by the update rule), the optimizer
updates so far, the loss's growth (read by the gradient and update rules), and the one rule
judged on every step: training diverges when the loss, or the gradient norm before clipping,
stays far above its lowest value.
"""

from __future__ import annotations

import math
import statistics

from ._finding import Finding
from ._runs import Growth, Run
from ._thresholds import Thresholds

__all__ = ["LossTrail", "Training"]

LEARNING = 0.9  # a run learns while its loss falls below this fraction over a span
LEARN_WINDOW = 5  # losses whose median stands for the loss at a step
TRAIL = 4096  # training steps of losses kept


class LossTrail:
    """The finite losses of the last ``TRAIL`` training steps, and whether the run learned
    over a span of them."""

    def __init__(self) -> None:
        self._losses: dict[int, float] = {}  # step -> loss, oldest first

    def see(self, step: int, value: float | None) -> None:
        if value is not None and math.isfinite(value):
            self._losses[step] = value
        if len(self._losses) > 2 * TRAIL:  # prune in one go, not per step
            self._losses = {s: v for s, v in self._losses.items() if s > step - TRAIL}

    def at(self, step: int) -> float | None:
        """The median of the losses of the ``LEARN_WINDOW`` steps up to ``step``, of those
        logged (``None`` when none was)."""
        near = [
            self._losses[s] for s in range(step - LEARN_WINDOW + 1, step + 1) if s in self._losses
        ]
        return statistics.median(near) if near else None

    def learning(self, since: int, step: int) -> bool:
        """The loss fell to ``LEARNING`` of its value or below from ``since`` to ``step``
        (medians of the ``LEARN_WINDOW`` losses up to each): what a large update, or an
        attention that sharpens, does to a run that learns; the instabilities these rules
        stand for come with a loss that stalls or rises."""
        then, now = self.at(since), self.at(step)
        return then is not None and now is not None and now < LEARNING * then


class Training:
    """The scalars of the training steps seen so far, and the divergence rule on them."""

    def __init__(self, thresholds: Thresholds) -> None:
        self.t = thresholds
        self.last_step = -1
        self.updated = 0  # training steps with an optimizer update so far
        self.warming = False  # a learning rate rose at this step
        self.loss, self.norm, self.total = Growth(), Growth(), Growth()
        self.losses = LossTrail()
        self.judged = True  # the latest step's loss or gradient norm could be judged
        self._lrs: dict[str, float] = {}
        self._diverging = Run()
        # the module the ongoing divergence was first reported on: one finding per
        # divergence, not one per module that holds the largest gradient at a later step
        self._blamed: str | None = None

    def see(
        self,
        step: int,
        scalars: dict[str, float],
        updates: int,
        suspect: str,
        *,
        grad_total: float | None = None,
    ) -> list[Finding]:
        """Findings from the scalars of a training step later than any seen. ``updates``: the
        optimizer updates applied in it; ``suspect``: the module with the largest gradient for
        its weight at the last sampled step (``""`` when none); ``grad_total``: the L2 norm of
        all the step's gradients (see :meth:`_divergence`)."""
        self.last_step = step
        self.losses.see(step, scalars.get("loss"))
        self.updated += updates > 0
        # A warm-up raises the learning rate by at most about x2 a step (a linear one from
        # zero doubles it once); a jump of more is a change the ratios must be judged under.
        rising = [
            k
            for k, v in _lrs(scalars).items()
            if (before := self._lrs.get(k, math.inf)) * 1.000001 < v <= 2.01 * before
            or before == 0 < v
        ]
        self.warming = bool(rising)
        self._lrs.update(_lrs(scalars))
        return self._divergence(step, scalars, suspect, grad_total)

    def loss_rose(self) -> bool:
        """The loss is at least halfway (in orders of magnitude) to a divergence: gradients
        small next to weights that blew up (clipped ones, say) are not vanishing."""
        return (self.loss.growth or 0.0) >= math.sqrt(self.t.explode_growth)

    def adam_transient(self) -> bool:
        """Within the first ``update_skip`` updates, and the loss not above its first value
        (or unknown)."""
        if self.updated > self.t.update_skip:
            return False
        first, now = self.loss.first, self.loss.latest
        return first is None or now is None or now <= first

    def _divergence(
        self, step: int, scalars: dict[str, float], suspect: str, grad_total: float | None
    ) -> list[Finding]:
        """Where the loss has no scale (it has been <= 0: a log-likelihood that can fall
        without bound, a policy gradient) or is not known, the gradients alone judge: the
        clipped norm ``grad_norm``, else ``grad_total`` at ``explode_growth`` squared (a
        gradient 1e6 times its lowest: no healthy run's noise, but a loss on its way to
        -inf)."""
        t = self.t
        loss, norm = scalars.get("loss"), scalars.get("grad_norm")
        loss_grew = self.loss.see(loss, t.explode_growth)
        unscaled = loss is None or not self.loss.judged
        growth, label = self.norm, "the gradient norm before clipping"
        if norm is None and unscaled and grad_total is not None:
            norm, growth, label = grad_total, self.total, "the gradients' total L2 norm"
        norm_grew = growth.see(norm, t.explode_growth)
        # judged at explode_growth squared where the loss cannot tell
        norm_score = (
            norm_grew / t.explode_growth if growth is self.total and norm_grew else norm_grew
        )
        falling = (
            self.loss.judged
            and self.loss.first is not None
            and loss is not None
            and loss < self.loss.first
        )
        grew = max(loss_grew or 0.0, 0.0 if falling else norm_score or 0.0)
        self.judged = not (loss_grew is None and (norm_grew is None or falling))
        if not self.judged:
            return []  # nothing to judge at this step
        worse = (  # far worse than the untrained model it started as
            loss_grew is not None
            and loss >= 10 * self.loss.first
            and loss_grew >= t.explode_growth / 10
        )
        self._diverging.see(step, grew >= t.explode_growth or worse)
        if not self._diverging.state:
            self._blamed = None
        if not (self._diverging.state and self._diverging.lasted(t.diverge_span)):
            return []
        if self._blamed is None:
            self._blamed = suspect
        what = []
        if loss_grew is not None:
            what.append(
                f"the loss grew x{loss_grew:.3g} above its lowest value ({self.loss.low:.3g}) "
                f"to {loss:.3g}"
            )
        if norm_grew is not None:
            what.append(f"{label} is {norm:.3g} (x{norm_grew:.3g} its lowest, {growth.low:.3g})")
        return [_diverges(step, self._diverging.since, grew, what, self._blamed)]


def _diverges(step: int, since: int, grew: float, what: list[str], suspect: str) -> Finding:
    where = (
        f" The largest gradient for its weight was in {suspect!r} at the last sampled step."
        if suspect
        else ""
    )
    return Finding(
        "exploding_gradient",
        suspect,
        step,
        grew,
        f"{' and '.join(what)}, from step {since} to step {step}: training diverges."
        f"{where} "
        "Gradient clipping does not stop it (it caps the gradients the optimizer sees, "
        "not the loss, and keeps their logged norm at the clip value). Lower the "
        "learning rate, add a warm-up, or check the loss and the data",
    )


def _lrs(scalars: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in scalars.items() if k == "lr" or k.startswith("lr/")}
