"""Rules on one sampled step's optimizer updates: ``update_ratio`` too large, too small, or none.

||ΔW||/||W|| of each weight matrix or kernel is judged over ``update_span`` training steps,
not during a learning-rate warm-up, and not on the high side during Adam's first updates
while the loss falls nor while the loss falls by a tenth over the run of high ratios, and not on the low side for lookup tables (embeddings: a step moves
only the rows its batch used). A parameter whose module's output went on detached and that
gets no gradient is an ``update_ratio`` finding too: its optimizer never changes it.
"""

from __future__ import annotations

import math

from ._finding import Finding
from ._graph import Graph, module_of
from ._runs import Run
from ._thresholds import Thresholds
from ._training import Training

__all__ = ["UpdateRules"]


class UpdateRules:
    """The update rules, and the runs of each parameter's side across sampled steps."""

    def __init__(
        self,
        thresholds: Thresholds,
        shapes: dict[str, list[int]],
        types: dict[str, str] | None = None,
    ) -> None:
        self.t = thresholds
        self.numel = {name: math.prod(shape) for name, shape in shapes.items()}
        # Lookup tables (``nn.Embedding`` and its kin): a step updates only the rows its
        # batch used, so the ratio over the whole table is small by design (a 13k-row
        # vocabulary of which a batch uses a few hundred): never "too small".
        self._tables = {
            name for name in shapes if "Embedding" in (types or {}).get(module_of(name), "")
        }
        self._ratio: dict[str, Run] = {}  # parameter -> run of "high" / "low" / False
        self._no_grad: dict[str, Run] = {}
        self._initial: dict[str, float] = {}  # RMS of each weight when first seen

    def check(
        self, step: int, param: dict[str, dict[str, float]], graph: Graph, training: Training
    ) -> list[Finding]:
        found = []
        for name, s in param.items():
            if "grad_norm" in s and s["grad_norm"] is None:
                # Only where the module's output went on, detached: a parameter left unused
                # by design (a pooler, a mask token, an unused head) is no bug.
                if module_of(name) in graph.detached:
                    found += self._no_gradient(step, name)
                continue
            self._no_grad.pop(name, None)
            ratio = s.get("update_ratio")
            if ratio is None:
                continue
            run = self._ratio.setdefault(name, Run())
            side = self._side(name, s, ratio)
            if training.warming or (side == "high" and training.adam_transient()):
                run.forget()  # a transient: not judged, and no run goes on across it
                continue
            run.see(step, side)
            # Updates a run learns through are no fault: an optimizer's early transient
            # (Adagrad's first updates are ~lr per element and shrink as 1/sqrt(t), SGD's
            # follow the untrained model's large gradients) moves small weights by more than
            # a tenth while the loss falls fast; a learning rate too high stalls it.
            if side == "high" and training.losses.learning(run.since, step):
                continue
            if run.state and run.lasted(self.t.update_span):
                found.append(self._update_finding(step, name, ratio, run))
        return found

    def _side(self, name: str, s: dict[str, float], ratio: float) -> str | bool:
        """``"high"``, ``"low"``, or False when the ratio says nothing wrong."""
        numel, norm = self.numel.get(name), s.get("norm", 0.0)
        rms = norm / math.sqrt(numel) if numel else math.inf
        self._initial.setdefault(name, rms)
        # Started at zero or deliberately tiny: its ratio is ~1/(t+1) at any lr.
        tiny = min(rms, self._initial[name]) < self.t.tiny_rms
        if ratio > self.t.update_high and not tiny:
            return "high"
        if ratio < self.t.update_low and s.get("grad_norm") != 0.0 and name not in self._tables:
            return "low"
        return False

    def _update_finding(self, step: int, name: str, ratio: float, run: Run) -> Finding:
        high = run.state == "high"
        return Finding(
            "update_ratio",
            module_of(name),
            step,
            ratio,
            f"update/weight ratio ||ΔW||/||W|| of {name!r} is {ratio:.3g}, out of range from "
            f"step {run.since} to step {step} ({run.seen} sampled steps; healthy: about "
            f"1e-3, allowed [{self.t.update_low:g}, {self.t.update_high:g}]): updates are too "
            + ("large; lower" if high else "small; raise")
            + " the learning rate",
        )

    def _no_gradient(self, step: int, name: str) -> list[Finding]:
        run = self._no_grad.setdefault(name, Run())
        run.see(step, True)
        if not run.lasted(self.t.no_grad_span):
            return []
        return [
            Finding(
                "update_ratio",
                module_of(name),
                step,
                0.0,
                f"{name!r} receives no gradient: its module ran, but its output reached the loss "
                "only detached, or not at all (computed and thrown away), and its .grad was None "
                f"from step {run.since} to step {step} ({run.seen} sampled steps), so its "
                "optimizer never changes it. Remove the .detach() or torch.no_grad() after it, "
                "use its output, or freeze it on purpose with requires_grad=False",
            )
        ]
