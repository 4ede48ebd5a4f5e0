"""Precision rules, with ``Monitor(precision=...)``: values a narrower dtype would lose.

``precision_underflow`` / ``precision_overflow``: a module whose output or output gradient
loses more than ``underflow`` / ``overflow`` of its values in a dtype named, for
``precision_span`` training steps (a GradScaler's own overflow-and-back-off passes).
"""

from __future__ import annotations

from ._finding import Finding
from ._runs import Run
from ._thresholds import Thresholds

__all__ = ["PrecisionRules"]


class PrecisionRules:
    """The precision findings of each sampled step, from the fractions each dtype loses."""

    def __init__(self, thresholds: Thresholds) -> None:
        self.t = thresholds
        self._lossy: dict[tuple[str, str], Run] = {}  # (kind, module) -> run of values lost

    def check(self, step: int, precision: dict[str, dict]) -> list[Finding]:
        found = []
        for name, kinds in precision.items():
            for kind, limit in (("underflow", self.t.underflow), ("overflow", self.t.overflow)):
                lost = [
                    (fraction, dtype, tensor)
                    for tensor, s in kinds.items()
                    for dtype, fraction in s[kind].items()
                    if fraction > limit
                ]
                run = self._lossy.setdefault((kind, name), Run())
                run.see(step, bool(lost))
                if lost and run.lasted(self.t.precision_span):
                    found.append(_precision_finding(kind, name, step, run.since, max(lost)))
        return found


_LOST = {
    "underflow": (
        "would round to zero",
        "values that small lose their signal: keep that tensor in a wider dtype, scale it "
        "(a GradScaler for float16 gradients; per-tensor scaling for fp8), or look for the "
        "layer that shrinks it",
    ),
    "overflow": (
        "would exceed the largest finite value",
        "one Inf makes the step non-finite: keep that tensor in a wider dtype (bfloat16 has "
        "float32's range), lower a GradScaler's scale, or look for the growth that made them "
        "so large (massive activations, a high learning rate)",
    ),
}


def _precision_finding(
    kind: str, module: str, step: int, since: int, lost: tuple[float, str, str]
) -> Finding:
    fraction, dtype, tensor = lost
    what = "output" if tensor == "act" else "output gradient (as backpropagated)"
    happens, fix = _LOST[kind]
    return Finding(
        f"precision_{kind}",
        module,
        step,
        fraction,
        f"{fraction:.3g} of the {what} values of {module!r} {happens} in {dtype}, since step "
        f"{since}: {fix}",
    )
