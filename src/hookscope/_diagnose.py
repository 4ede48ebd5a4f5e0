"""Rules that turn a Monitor's per-step statistics into findings.

Thresholds start from the published ones (DeepDiagnosis, ICSE'22; AutoTrainer, ICSE'21) and
are all parameters of :class:`Thresholds`. Every finding carries its evidence in the message.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ._log import StepRecord

__all__ = ["Diagnosis", "Finding", "Thresholds"]


@dataclass(frozen=True)
class Finding:
    """Something wrong with a training run, at one module and step.

    Attributes:
        kind: ``"nonfinite"``, ``"exploding_gradient"``, ``"vanishing_gradient"``,
            ``"dead_units"``, ``"saturated_units"`` or ``"update_ratio"``.
        module: Qualified name of the module (for ``update_ratio``, the parameter's module).
        step: The step it was first seen at (steps count from 0).
        value: The measured value that crossed the threshold.
        message: What was seen, with the evidence, and what it means.
        phase: For ``nonfinite``: ``"forward"`` or ``"backward"``; else ``None``.
        op: For ``nonfinite``, when traced: the first op that produced it (``"aten.log"``).
        source: For ``nonfinite``, when traced: the user's source line that called that op.
        rank: Under ``torch.distributed``: the rank where it first appeared.
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

    def __str__(self) -> str:
        return f"[step {self.step}] {self.kind} at {self.module!r}: {self.message}"


@dataclass(frozen=True)
class Thresholds:
    """When a statistic becomes a finding. Defaults and their sources:

    Attributes:
        dead_unit: A ReLU unit is dead on a step when at least this fraction of its
            activations is <= 0 (DeepDiagnosis: 0.7).
        dead_layer: ``dead_units`` when at least this fraction of a layer's units is dead.
        saturated: ``saturated_units`` when more than this fraction of a bounded activation's
            (tanh, sigmoid, ...) outputs lie within 1e-3 of its bounds, i.e. its inputs lie
            outside about ±5 for tanh (DeepDiagnosis: 0.5 outside ±5).
        explode_ratio: ``exploding_gradient`` when the RMS gradient of the module closest to
            the input exceeds this multiple of that of the module closest to the loss
            (AutoTrainer: 70).
        vanish_ratio / vanish_rms: ``vanishing_gradient`` when that ratio falls below
            ``vanish_ratio`` (AutoTrainer: 1e-3) and the input-side RMS gradient is below
            ``vanish_rms`` (AutoTrainer: 1e-4 on norms; DeepDiagnosis: mean |g| < 1e-7).
        update_low / update_high: ``update_ratio`` when ||ΔW||/||W|| of a weight matrix or
            kernel stays outside [update_low, update_high] (two orders of magnitude around the
            1e-3 rule of thumb; DeepDiagnosis uses [1e-5, 1e-1]) ...
        update_patience: ... for this many sampled steps in a row.
    """

    dead_unit: float = 0.7
    dead_layer: float = 0.7
    saturated: float = 0.5
    explode_ratio: float = 70.0
    vanish_ratio: float = 1e-3
    vanish_rms: float = 1e-4
    update_low: float = 1e-5
    update_high: float = 1e-1
    update_patience: int = 3


class Diagnosis:
    """Stateful rules: remembers what was reported, and streaks across steps."""

    def __init__(self, thresholds: Thresholds) -> None:
        self.t = thresholds
        self._reported: set[tuple[str, str]] = set()
        self._streak: dict[str, int] = {}

    def is_new(self, finding: Finding) -> bool:
        return (finding.kind, finding.module) not in self._reported

    def first_time(self, finding: Finding) -> bool:
        key = (finding.kind, finding.module)
        if key in self._reported:
            return False
        self._reported.add(key)
        return True

    # -- sampled steps ---------------------------------------------------------------------
    def sampled(self, step: int, record: StepRecord) -> list[Finding]:
        """Findings from the statistics of one sampled step."""
        found = self._units(step, record.act)
        found += self._gradients(step, record.grad, record.grad_order)
        found += self._updates(step, record.param)
        return found

    def _units(self, step: int, act: dict[str, dict[str, float]]) -> list[Finding]:
        found = []
        for name, s in act.items():
            if s.get("dead_frac", 0.0) >= self.t.dead_layer:
                found.append(
                    Finding(
                        "dead_units",
                        name,
                        step,
                        s["dead_frac"],
                        f"{s['dead_frac']:.0%} of the units of {name!r} are <= 0 on at least "
                        f"{self.t.dead_unit:.0%} of their inputs (zero fraction "
                        f"{s['zero_frac']:.0%}) at step {step}: dying ReLUs; lower the "
                        "learning rate, check the bias/initialization, or try LeakyReLU",
                    )
                )
            if s.get("sat_frac", 0.0) > self.t.saturated:
                found.append(
                    Finding(
                        "saturated_units",
                        name,
                        step,
                        s["sat_frac"],
                        f"{s['sat_frac']:.0%} of the outputs of {name!r} sit at the "
                        f"activation's bounds at step {step} (mean {s['mean']:.3g}, "
                        f"min {s['min']:.3g}, max {s['max']:.3g}): its gradients vanish; "
                        "normalize its inputs or lower the initialization scale",
                    )
                )
        return found

    def _gradients(self, step: int, grad: dict, order: list[str]) -> list[Finding]:
        rms = [(name, grad[name]["rms"]) for name in order if name in grad]
        rms = [(n, r) for n, r in rms if math.isfinite(r)]
        if len(rms) < 2 or rms[0][1] <= 0:
            return []
        (near_loss, top), (near_input, bottom) = rms[0], rms[-1]
        ratio = bottom / top
        gains = [
            (rms[k + 1][1] / r if r > 0 else math.inf, rms[k][0])
            for k, (_, r) in enumerate(rms[:-1])
        ]
        evidence = (
            f"RMS gradient {bottom:.3g} at {near_input!r} (input side) vs {top:.3g} at "
            f"{near_loss!r} (loss side), ratio {ratio:.3g}, at step {step}"
        )
        if ratio > self.t.explode_ratio:
            gain, culprit = max(gains)
            return [
                Finding(
                    "exploding_gradient",
                    culprit,
                    step,
                    ratio,
                    f"{evidence}; the largest jump (x{gain:.3g}) happens in the backward of "
                    f"{culprit!r}. Lower the learning rate, clip gradients, or check its scale",
                )
            ]
        if ratio < self.t.vanish_ratio and bottom < self.t.vanish_rms:
            gain, culprit = min(gains)
            return [
                Finding(
                    "vanishing_gradient",
                    culprit,
                    step,
                    ratio,
                    f"{evidence}; the largest drop (x{gain:.3g}) happens in the backward of "
                    f"{culprit!r}. Check saturating activations, initialization, or add "
                    "normalization/residual connections",
                )
            ]
        return []

    def _updates(self, step: int, param: dict[str, dict[str, float]]) -> list[Finding]:
        found = []
        for name, s in param.items():
            ratio = s.get("update_ratio")
            if ratio is None:
                continue
            out = not (self.t.update_low <= ratio <= self.t.update_high)
            self._streak[name] = self._streak.get(name, 0) + 1 if out else 0
            if self._streak[name] >= self.t.update_patience:
                module = name.rsplit(".", 1)[0] if "." in name else ""
                side = "large" if ratio > self.t.update_high else "small"
                found.append(
                    Finding(
                        "update_ratio",
                        module,
                        step,
                        ratio,
                        f"update/weight ratio ||ΔW||/||W|| of {name!r} is {ratio:.3g} for "
                        f"{self._streak[name]} sampled steps in a row (healthy: about "
                        f"1e-3, allowed [{self.t.update_low:g}, {self.t.update_high:g}]): "
                        f"updates are too {side}; adjust the learning rate",
                    )
                )
        return found
