"""A finding: something wrong with a training run, at one module and step, with its evidence.

Every rule of the diagnosis, every check of the Monitor and the non-finite localiser makes
these; the log, the sinks and the report read them as plain data.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = ["Finding", "mark_cleared"]


@dataclass(frozen=True)
class Finding:
    """Something wrong with a training run, at one module and step.

    Attributes:
        kind: ``"nonfinite"``, ``"exploding_gradient"``, ``"vanishing_gradient"``,
            ``"dead_units"``, ``"saturated_units"`` or ``"update_ratio"``; the checks of
            silent errors (``_monitor/_checks/``): ``"not_updated"``, ``"stale_gradients"``,
            ``"eval_randomness"``, ``"eval_mismatch"``, ``"autocast_skipped"``,
            ``"frozen_changed"`` and ``"replica_divergence"``; the large-model signals
            (``_monitor/_signals.py``): ``"loss_spike"`` (``module``: the parameter group
            whose gradient norm left its range first, ``""`` when none did) and
            ``"massive_activations"``; from the attention modules' largest pre-softmax
            logit (``_monitor/_attention.py``), ``"attention_logit_growth"``; with ``Monitor(precision=...)`` (``_monitor/_precision.py``),
            ``"precision_underflow"`` and ``"precision_overflow"`` (``value``: the largest
            fraction, over the module's output and its gradient and the dtypes named).
        module: Qualified name of the module (for ``update_ratio``, the parameter's module).
        step: The step it was first seen at (steps count from 0).
        value: The measured value that crossed the threshold.
        message: What was seen, with the evidence, and what it means.
        phase: For ``nonfinite``: ``"forward"``, ``"backward"``, or ``"update"`` (the
            weights became non-finite in an optimizer update); else ``None``.
        op: For ``nonfinite``, when traced: the first op that produced it (``"aten.log"``).
        source: For ``nonfinite``, when traced: the user's source line that called that op.
        rank: Under ``torch.distributed``: the rank where it first appeared.
        cleared_at: The first step at which its condition no longer held, once it has stayed
            away for the rule's span; ``None`` while the finding is current.
    """

    kind: str
    module: str
    step: int
    value: float
    message: str
    phase: str | None = None
    op: str | None = None
    source: str | None = None
    rank: int | None = None
    cleared_at: int | None = None

    def __str__(self) -> str:
        cleared = "" if self.cleared_at is None else f" (cleared at step {self.cleared_at})"
        return f"[step {self.step}] {self.kind} at {self.module!r}: {self.message}{cleared}"

    def _repr_html_(self) -> str:
        from .._notebook import finding_html

        return finding_html(self)


def mark_cleared(findings: list[Finding], done: Finding) -> list[Finding]:
    """``findings`` with the current finding that ``done`` (from :meth:`Diagnosis.cleared`)
    clears replaced by ``done``: the latest of its kind and module not cleared yet."""
    out, kept = list(findings), replace(done, cleared_at=None)
    for i in range(len(out) - 1, -1, -1):
        if out[i] == kept:
            out[i] = done
            break
    return out
