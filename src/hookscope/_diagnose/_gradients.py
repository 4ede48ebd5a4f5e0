"""Rules on one sampled step's gradients: exploding, vanishing, all zero; and the overflow.

They read the gradient norm of each weight against its norm (scale-free), and the RMS output
gradient of each module along the graph (which side of the model is starved, where the
backward amplifies). The module with the largest gradient for its weight is kept as the
suspect that a later divergence of the loss names.
"""

from __future__ import annotations

import math

from .._log import StepRecord
from ._finding import Finding
from ._graph import Graph, chain, is_norm, largest_jump, module_of, near, side_ratio
from ._runs import Run
from ._thresholds import Thresholds
from ._training import Training

__all__ = ["Gradients"]


class Gradients:
    """The gradient rules, and what they remember across sampled steps."""

    def __init__(
        self, thresholds: Thresholds, shapes: dict[str, list[int]], types: dict[str, str]
    ) -> None:
        self.t = thresholds
        self.types = types  # module name -> class name
        self.shapes = shapes
        self.numel = {name: math.prod(shape) for name, shape in shapes.items()}
        self.suspect = ""  # the module with the largest gradient for its weight, last sampled
        self._zero = Run()  # every parameter's gradient exactly zero
        self._learnt = False  # some gradient was non-zero at a sampled step

    def check(
        self, step: int, record: StepRecord, graph: Graph, training: Training
    ) -> list[Finding]:
        rel = self._relative(record.param, graph)
        if rel:
            self.suspect = self._culprit(record, graph, max(rel, key=rel.__getitem__))
        found = self._exploding(step, record, graph, rel)
        if not found:
            everything = self._relative(record.param, graph, normalised=True)
            found = self._exploding(step, record, graph, everything, factor=100.0)
        if not found and not training.loss_rose():
            found = self._vanishing(step, record, graph, everything)
        return found or self._all_zero(step, record.param)

    def _relative(
        self, param: dict[str, dict[str, float]], graph: Graph, *, normalised: bool = False
    ) -> dict[str, float]:
        """``grad_norm / norm`` of every weight matrix or kernel that is not tiny, and not
        scale-invariant (a weight whose output a normalisation layer rescales gets a
        gradient that grows as its own norm shrinks: its ratio says nothing)."""
        rescaled = {p for p, c in graph.edges if is_norm(self.types.get(c, ""))}
        out = {}
        for name, s in param.items():
            if module_of(name) in rescaled and not normalised:
                continue
            numel, norm, grad = self.numel.get(name), s.get("norm"), s.get("grad_norm")
            if numel is None or norm is None or grad is None or not math.isfinite(grad):
                continue
            if len(self.shapes[name]) < 2 or norm / math.sqrt(numel) < self.t.tiny_rms:
                continue
            out[name] = grad / norm
        return out

    def _all_zero(self, step: int, param: dict[str, dict[str, float]]) -> list[Finding]:
        """Every gradient exactly zero, for a span, in a model that learnt before: nothing
        learns any more (a policy collapsed to certainty, a saturated output, a constant loss)."""
        norms = [s["grad_norm"] for s in param.values() if s.get("grad_norm") is not None]
        if not norms:
            return []
        zero = not any(norms)
        self._learnt = self._learnt or not zero
        self._zero.see(step, zero and self._learnt)
        if not (self._zero.state and self._zero.lasted(self.t.update_span)):
            return []
        return [
            Finding(
                "vanishing_gradient",
                "",
                step,
                0.0,
                f"every parameter's gradient has been exactly zero from step {self._zero.since} "
                f"to step {step}, after the model had learnt: nothing learns any more. The loss "
                "no longer depends on the weights: a policy or classifier collapsed to "
                "certainty, a saturated output, or a constant loss; a learning rate far too "
                "high often causes it. Check the learning rate and the loss",
            )
        ]

    def _exploding(
        self,
        step: int,
        record: StepRecord,
        graph: Graph,
        rel: dict[str, float],
        factor: float = 1.0,
    ) -> list[Finding]:
        """Exploding gradients; with ``factor``, judge the weights a normalisation layer
        rescales too, against a threshold that much higher (healthy MobileNets reach ~3e3
        there), and only by the scale-free rule."""
        grads = math.sqrt(sum(record.param[p]["grad_norm"] ** 2 for p in rel))
        weights = math.sqrt(sum(record.param[p]["norm"] ** 2 for p in rel))
        overall = grads / weights if weights > 0 else 0.0
        if overall <= self.t.explode_relative * factor:
            return (
                [] if factor != 1.0 else self._other_explosions(step, record, graph, rel, overall)
            )
        top_param = max(rel, key=rel.__getitem__)
        module = self._culprit(record, graph, top_param)
        s = record.param[top_param]
        return [
            Finding(
                "exploding_gradient",
                module,
                step,
                overall,
                f"the weights' gradients have norm {grads:.3g} against a weight norm of "
                f"{weights:.3g} (x{overall:.3g}; healthy networks stay below about 20) at "
                f"step {step}: one SGD step at lr 1e-2 would change them by {overall:.0%}. "
                f"The largest is {top_param!r} (gradient {s['grad_norm']:.3g}, weight "
                f"{s['norm']:.3g}). Check the initialization scale of {module!r} and the loss "
                "scale, lower the learning rate or clip gradients",
            )
        ]

    def _other_explosions(
        self, step: int, record: StepRecord, graph: Graph, rel: dict[str, float], worst: float
    ) -> list[Finding]:
        t = self.t
        rms = self._rms(record)
        jump = largest_jump(graph, rms)
        ratio, bottom, top = side_ratio(graph, rms)
        if ratio > t.explode_ratio and worst > t.explode_relative / 10 and jump is not None:
            gain, producer, consumer = jump
            return [
                Finding(
                    "exploding_gradient",
                    consumer,
                    step,
                    ratio,
                    f"RMS gradient {rms[bottom]:.3g} at {bottom!r} (input side) vs "
                    f"{rms[top]:.3g} at {top!r} (loss side), ratio {ratio:.3g}, and weights "
                    f"whose gradient is x{worst:.3g} their norm, at step {step}; the largest "
                    f"jump (x{gain:.3g}) happens in the backward of {consumer!r} (from its "
                    f"output to that of {producer!r}, which feeds it). Lower the learning "
                    "rate, clip gradients, or check its scale",
                )
            ]
        return []

    @staticmethod
    def _rms(record: StepRecord) -> dict[str, float]:
        return {n: g["rms"] for n, g in record.grad.items() if math.isfinite(g["rms"])}

    def _culprit(self, record: StepRecord, graph: Graph, top_param: str | None) -> str:
        """Where a gradient explodes: the module whose backward amplifies it most, when one
        does; else the module of the weight with the largest gradient for its size."""
        jump = largest_jump(graph, self._rms(record))
        if jump is not None and jump[0] >= 4:
            return jump[2]
        return module_of(top_param) if top_param else ""

    def _vanishing(
        self, step: int, record: StepRecord, graph: Graph, rel: dict[str, float]
    ) -> list[Finding]:
        t = self.t
        rms = self._rms(record)
        ratio, bottom, top = side_ratio(graph, rms)
        if not (ratio < t.vanish_ratio and rms.get(bottom, 1.0) < t.vanish_rms):
            return []
        starved = near(graph, bottom, set(rms))
        learning = [rel[p] for p in rel if module_of(p) in starved]
        if not learning or max(learning) >= t.vanish_relative:
            return []
        path = chain(graph, rms, bottom, top)
        drops = ", ".join(f"x{g:.2g} in {c!r}" for g, c in path[:3])
        return [
            Finding(
                "vanishing_gradient",
                bottom,
                step,
                ratio,
                f"RMS gradient {rms[bottom]:.3g} at {bottom!r} (input side) vs {rms[top]:.3g} "
                f"at {top!r} (loss side), ratio {ratio:.3g}, and the weights near the input "
                f"get gradients of at most {max(learning):.2g} of their norm, at step {step}: "
                f"they have stopped learning. Largest drops: {drops}. Check saturating "
                "activations and the initialization, or add normalization/residual "
                "connections",
            )
        ]

    def overflow(self, nonfinite: Finding) -> Finding | None:
        """An Inf made from finite values in the backward pass is an exploding gradient first
        (an overflow), and a non-finite value as its consequence."""
        if (
            nonfinite.phase != "backward"
            or nonfinite.op is None
            or "made Inf" not in nonfinite.message
        ):
            return None
        if nonfinite.op in _SINGULAR_OPS:
            return None
        return Finding(
            "exploding_gradient",
            nonfinite.module,
            nonfinite.step,
            math.inf,
            f"the gradient overflowed to Inf in the backward of {nonfinite.op} in "
            f"{nonfinite.module!r} at step {nonfinite.step}, from finite values: it grew "
            "past the largest float (through time, in a recurrent layer). Clip gradients, "
            "lower the learning rate, or check the recurrent weights' scale",
            phase="backward",
            op=nonfinite.op,
            source=nonfinite.source,
        )


# Ops whose gradient is infinite at a point (a singularity), not because values grew.
_SINGULAR_OPS = frozenset(
    {
        "aten.sqrt",
        "aten.rsqrt",
        "aten.log",
        "aten.log2",
        "aten.log10",
        "aten.log1p",
        "aten.div",
        "aten.reciprocal",
        "aten.pow",
        "aten.acos",
        "aten.asin",
        "aten.atanh",
        "aten.norm",
        "aten.linalg_vector_norm",
    }
)
