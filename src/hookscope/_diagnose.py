"""Rules that turn a Monitor's per-step statistics into findings.

Thresholds start from the published ones (DeepDiagnosis, ICSE'22; AutoTrainer, ICSE'21) and
are all parameters of :class:`Thresholds`. Every finding carries its evidence in the message.

A rule judges a condition over a span of *training steps*, not of sampled ones, so ``every``
changes when a finding is first seen, not whether: the condition must hold on at least two
observations in a row that lie at least the rule's span apart (span 0: one observation). A
finding clears the same way: when its condition has failed on two observations in a row, at
least its span apart; :meth:`Diagnosis.cleared` hands it back with ``cleared_at`` set.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ._log import StepRecord

__all__ = ["Diagnosis", "Finding", "Thresholds", "mark_cleared"]


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
        from ._notebook import finding_html

        return finding_html(self)


@dataclass(frozen=True)
class Graph:
    """Which watched module's output fed which module's input in the last forward pass.

    ``edges`` are ``(producer, consumer)`` pairs; a module that returned its input unchanged
    (``nn.Identity``, a view) is not a point of its own. ``detached`` are modules whose
    output reached the loss only detached from autograd, or not at all.
    """

    edges: frozenset[tuple[str, str]]
    detached: frozenset[str] = frozenset()

    def inputs_side(self, have: set[str]) -> list[str]:
        """Modules in ``have`` that no other module in ``have`` feeds."""
        fed = {c for p, c in self.edges if p in have and c in have and p != c}
        return sorted(have - fed)

    def loss_side(self, have: set[str]) -> list[str]:
        """Modules in ``have`` that feed no other module in ``have``."""
        feeding = {p for p, c in self.edges if p in have and c in have and p != c}
        return sorted(have - feeding)


@dataclass(frozen=True)
class Thresholds:
    """When a statistic becomes a finding. Defaults and their sources.

    Spans count training steps (see the module's docstring). The rules on one step's
    statistics (``dead_units``, ``saturated_units``, ``exploding_gradient`` and
    ``vanishing_gradient`` by their ratios) have span 0: one sampled step shows them.

    Attributes:
        dead_unit: A ReLU unit is dead on a step when at least this fraction of its
            activations is <= 0 (DeepDiagnosis: 0.7).
        dead_layer: ``dead_units`` when at least this fraction of a layer's units is dead
            (DeepDiagnosis: 0.7), in a layer of at least ``dead_min_units`` units.
        dead_min_units / dead_min_samples: Layers with fewer units than this (a
            squeeze-excite bottleneck), or units seen fewer times than that in a step, say
            too little to judge.
        saturated: ``saturated_units`` when more than this fraction of a bounded activation's
            (tanh, sigmoid, ...) outputs lie within 1e-3 of its bounds, i.e. its inputs lie
            outside about ±5 for tanh (DeepDiagnosis: 0.5 outside ±5).
        explode_relative: ``exploding_gradient`` when the weights' gradient norm exceeds
            this multiple of their norm (over weight matrices and kernels, leaving out tiny
            ones and those a normalisation layer rescales): one SGD step at a usual learning
            rate (1e-2) would then change them by their whole norm. Scale-free; healthy
            networks, from tiny test widths to real ones, stay below about 20 (129
            architectures measured).
        explode_ratio: ... or when the RMS gradient on the input side exceeds this multiple
            of that on the loss side (AutoTrainer: 70) while the weights' gradients are at
            least ``explode_relative / 10`` of their norm (an activation-gradient ratio alone
            also fires on healthy models that normalise a deliberately tiny input, such as
            RWKV's 1e-4 embeddings feeding a LayerNorm).
        explode_growth / diverge_span: ... or, judged on every training step, when the loss
            (or the total gradient norm before clipping, the scalar ``grad_norm``, while the
            loss is not below its first value) stays at least this factor above its lowest
            value so far for ``diverge_span`` training steps (two observations at least):
            training diverges; so does a loss at least ten times its first value and a tenth
            of this factor above its lowest (a run now far worse than untrained). Clipping
            cannot hide it: it caps the gradients the optimizer sees, not the loss. The lowest value is floored at the first one over this
            factor (a loss near zero that comes back by a little is no divergence), and a
            loss that has been <= 0 (policy gradients, GANs) has no scale to grow from.
        vanish_ratio / vanish_rms: ``vanishing_gradient`` when the input-side RMS gradient
            falls below ``vanish_ratio`` of the loss side's (AutoTrainer: 1e-3) and below
            ``vanish_rms`` (AutoTrainer: 1e-4 on norms; DeepDiagnosis: mean |g| < 1e-7) ...
        vanish_relative: ... and the input-side weights' gradients are below this fraction
            of their norms: those layers have stopped learning (pooling and fan-out lower
            the RMS gradient of healthy audio encoders and encoder–decoders too, but their
            input layers still learn).
        update_low / update_high: ``update_ratio`` when ||ΔW||/||W|| of a weight matrix or
            kernel stays outside [update_low, update_high] (two orders of magnitude around the
            1e-3 rule of thumb; DeepDiagnosis uses [1e-5, 1e-1]) ...
        update_span: ... for this many training steps (two observations at least, whatever
            ``every`` is; it replaces the round-1 ``update_patience``, counted in sampled
            steps, which made findings depend on the sampling rate).
        update_skip: During the first this many training steps with an optimizer update,
            updates that are too large are judged only while the loss is above its first
            value: Adam's bias-corrected first updates are about ``lr * sign(g)`` per
            element, huge for small weights, until its first moment averages over
            ~1/(1 - beta1) = 10 steps, and a run that learns through them is fine (a learning
            rate too high for Adam makes the loss rise at once). Steps where a learning rate
            (the scalars ``lr``, ``lr/*``) is higher than at the step before (a warm-up) are
            not judged on either side: the ratio follows the schedule there.
        no_grad_span: ``update_ratio`` (no gradient) when a parameter of a module whose
            output went on detached had no gradient for this many training steps.
        tiny_rms: Weights whose RMS is below this (zero-initialised cls tokens, gates and
            position tables; deliberately tiny inits) are not judged by ratios to their own
            norm: those ratios are ~1/(t+1) at any learning rate.
        spike_window / spike_k / spike_rel / spike_min_history: ``loss_spike`` when the
            log of the loss exceeds the median of the logs of the ``spike_window`` losses
            before it by more than ``spike_k`` noise units (1.4826 x the MAD of their
            step-to-step changes / sqrt(2): a robust standard deviation of the noise that a
            steep early descent does not inflate; Iglewicz and Hoaglin's robust outlier rule
            uses 3.5, raised to 6 for heavy-tailed batch losses: the healthy runs of
            ``benchmarks/spikes.py`` and the tests stay silent) and by at least ``spike_rel``
            of the loss (a converged loss with almost no noise), after ``spike_min_history``
            steps. 50 steps: enough for a robust median, short enough to follow a decaying
            loss.
        spike_lead: A group's gradient norm, or the step-to-step change of its weight norm,
            that has been out of its own range (the same rule over its own window) for up to
            this many steps before a spike is said to lead it.
        massive / massive_span: ``massive_activations`` when a module's largest output is at
            least this multiple of its RMS (``absmax_over_rms``) for this many training steps
            (two observations at least). Massive activations in LLMs reach thousands of times
            the median magnitude (Sun et al. 2024, "Massive activations in large language
            models"); the largest of 4096 normal values is about 4x their RMS.
        underflow / overflow / precision_span: with ``Monitor(precision=...)``,
            ``precision_underflow`` when more than ``underflow`` of a module's output or
            output-gradient values would round to zero in a dtype named, and
            ``precision_overflow`` when more than ``overflow`` (default: any) would exceed its
            largest finite value, for ``precision_span`` training steps (two observations at
            least): a dtype that loses a tenth of a tensor to zero loses that signal (float16
            gradients without a loss scale; Micikevicius et al. 2018, "Mixed precision
            training"), and one Inf in float16 makes the step's gradients non-finite. The
            span lets a GradScaler's own overflow-and-back-off (one step in thousands) pass.
        attn_logit / attn_growth / attn_span: ``attention_logit_growth`` when an attention
            module's largest pre-softmax logit is at least ``attn_logit`` and at least
            ``attn_growth`` times its smallest value over the ``attn_span`` training steps
            before. Logits in the tens saturate the softmax to one-hot attention and precede
            the loss divergence of large transformers trained without QK normalisation
            (Dehghani et al. 2023, "Scaling vision transformers to 22 billion parameters":
            logits of order 50 and above; Wortsman et al. 2023, "Small-scale proxies for
            large-scale transformer training instabilities"); a healthy network's logits
            stay at a few units, and their slow drift over training is not a doubling.
    """

    dead_unit: float = 0.7
    dead_layer: float = 0.7
    dead_min_units: int = 8
    dead_min_samples: int = 16
    saturated: float = 0.5
    explode_relative: float = 100.0
    explode_ratio: float = 70.0
    explode_growth: float = 1e3
    diverge_span: int = 1
    vanish_ratio: float = 1e-3
    vanish_rms: float = 1e-4
    vanish_relative: float = 1e-6
    update_low: float = 1e-5
    update_high: float = 1e-1
    update_span: int = 3
    update_skip: int = 10
    no_grad_span: int = 2
    tiny_rms: float = 1e-3
    spike_window: int = 50
    spike_k: float = 6.0
    spike_rel: float = 0.05
    spike_min_history: int = 20
    spike_lead: int = 20
    massive: float = 100.0
    massive_span: int = 20
    underflow: float = 0.1
    overflow: float = 0.0
    precision_span: int = 20
    attn_logit: float = 50.0
    attn_growth: float = 2.0
    attn_span: int = 20


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
        self.types = types or {}  # module name -> class name
        self.shapes = shapes or {}
        self.numel = {name: math.prod(shape) for name, shape in self.shapes.items()}
        self._reported: set[tuple[str, str]] = set()
        self._ratio: dict[str, _Run] = {}  # parameter -> run of "high" / "low" / False
        self._no_grad: dict[str, _Run] = {}
        self._massive: dict[str, _Run] = {}  # module -> run of absmax_over_rms above threshold
        self._lossy: dict[tuple[str, str], _Run] = {}  # (kind, module) -> run of values lost
        self._logits: dict[str, list[tuple[int, float]]] = {}  # module -> recent (step, logit)
        self._initial: dict[str, float] = {}  # RMS of each weight when first seen
        self._loss, self._norm = _Growth(), _Growth()
        self._diverging = _Run()
        self._zero = _Run()  # every parameter's gradient exactly zero
        self._learnt = False  # some gradient was non-zero at a sampled step
        self._suspect = ""  # the module with the largest gradient for its weight, last sampled
        self._last_step = -1
        self._updated = 0  # training steps with an optimizer update so far
        self._lrs: dict[str, float] = {}
        self._warming = False  # a learning rate rose at this step
        self._made: dict[tuple[str, str], tuple[str, int]] = {}  # key -> (family, span)
        self._current: dict[tuple[str, str], Finding] = {}
        self._gone: dict[tuple[str, str], _Run] = {}  # current key -> run of "not seen"
        self._cleared: list[Finding] = []

    def is_new(self, finding: Finding) -> bool:
        return (finding.kind, finding.module) not in self._reported

    def first_time(self, finding: Finding) -> bool:
        """Whether ``finding`` is new (not reported, or reported and cleared since); a new
        finding made by these rules becomes current, to be cleared when it no longer holds."""
        key = (finding.kind, finding.module)
        if key in self._reported:
            return False
        self._reported.add(key)
        if key in self._made:
            self._current[key] = finding
            self._gone.pop(key, None)
        return True

    def cleared(self) -> list[Finding]:
        """The current findings whose condition stopped holding for their span since the last
        call, each as :meth:`first_time` kept it with ``cleared_at`` set (the first step it
        no longer held at). Their kind and module can be found again after."""
        done, self._cleared = self._cleared, []
        return done

    # -- every training step ---------------------------------------------------------------
    def training_step(
        self, step: int, scalars: dict[str, float], *, updates: int = 1
    ) -> list[Finding]:
        """Findings from the scalars of one training step (``loss``, ``grad_norm``: the total
        gradient norm before clipping, ``lr``, ``lr/*``), sampled or not. ``updates``: the
        optimizer updates applied in this step. Call it before :meth:`sampled` on the same
        step; :meth:`sampled` calls it itself when a step was not seen (then a learning rate
        and the loss are judged on sampled steps only)."""
        if step <= self._last_step:
            return []
        self._last_step = step
        self._updated += updates > 0
        # A warm-up raises the learning rate by at most about x2 a step (a linear one from
        # zero doubles it once); a jump of more is a change the ratios must be judged under.
        rising = [
            k
            for k, v in _lrs(scalars).items()
            if (before := self._lrs.get(k, math.inf)) * 1.000001 < v <= 2.01 * before
            or before == 0 < v
        ]
        self._warming = bool(rising)
        self._lrs.update(_lrs(scalars))
        found = self._divergence(step, scalars)
        self._track(step, found, "step")
        return found

    def _divergence(self, step: int, scalars: dict[str, float]) -> list[Finding]:
        t = self.t
        loss, norm = scalars.get("loss"), scalars.get("grad_norm")
        loss_grew = self._loss.see(loss, t.explode_growth)
        norm_grew = self._norm.see(norm, t.explode_growth)
        falling = self._loss.first is not None and loss is not None and loss < self._loss.first
        grew = max(loss_grew or 0.0, 0.0 if falling else norm_grew or 0.0)
        if loss_grew is None and (norm_grew is None or falling):
            return []  # nothing to judge at this step
        worse = (  # far worse than the untrained model it started as
            loss_grew is not None
            and loss >= 10 * self._loss.first
            and loss_grew >= t.explode_growth / 10
        )
        self._diverging.see(step, grew >= t.explode_growth or worse)
        if not (self._diverging.state and self._diverging.lasted(t.diverge_span)):
            return []
        since = self._diverging.since
        what = []
        if loss_grew is not None:
            what.append(
                f"the loss grew x{loss_grew:.3g} above its lowest value ({self._loss.low:.3g}) "
                f"to {loss:.3g}"
            )
        if norm_grew is not None:
            what.append(
                f"the gradient norm before clipping is {norm:.3g} (x{norm_grew:.3g} its lowest, "
                f"{self._norm.low:.3g})"
            )
        where = (
            f" The largest gradient for its weight was in {self._suspect!r} at the last sampled "
            "step."
            if self._suspect
            else ""
        )
        return [
            Finding(
                "exploding_gradient",
                self._suspect,
                step,
                grew,
                f"{' and '.join(what)}, from step {since} to step {step}: training diverges."
                f"{where} "
                "Gradient clipping does not stop it (it caps the gradients the optimizer sees, "
                "not the loss, and keeps their logged norm at the clip value). Lower the "
                "learning rate, add a warm-up, or check the loss and the data",
            )
        ]

    def _track(self, step: int, made: list[Finding], family: str) -> None:
        """Note the keys ``made`` at ``step`` by one family of rules, and clear the current
        findings of that family whose condition failed for their span."""
        here = {(f.kind, f.module) for f in made}
        for key in here:
            self._made[key] = (family, self._span(key[0], family))
        for key, finding in list(self._current.items()):
            fam, span = self._made[key]
            if fam != family:
                continue
            run = self._gone.setdefault(key, _Run())
            run.see(step, key not in here)
            if run.state and run.lasted(span, least=2):
                del self._current[key]
                self._reported.discard(key)
                self._cleared.append(replace(finding, cleared_at=run.since))

    def _span(self, kind: str, family: str) -> int:
        if family == "step":
            return self.t.diverge_span
        spans = {
            "update_ratio": self.t.update_span,
            "massive_activations": self.t.massive_span,
            "precision_underflow": self.t.precision_span,
            "precision_overflow": self.t.precision_span,
            "attention_logit_growth": self.t.attn_span,
        }
        return spans.get(kind, 0)

    # -- sampled steps ---------------------------------------------------------------------
    def sampled(self, step: int, record: StepRecord, graph: Graph | None = None) -> list[Finding]:
        """Findings from the statistics of one sampled step."""
        graph = graph or Graph(frozenset())
        found = self.training_step(step, record.scalars, updates=step - self._last_step)
        made = self._units(step, record.act)
        made += self._outliers(step, record.act)
        made += self._precision(step, record.precision)
        made += self._logit_growth(step, record.attn)
        made += self._gradients(step, record, graph)
        made += self._updates(step, record.param, graph)
        self._track(step, made, "sampled")
        return found + made

    def _outliers(self, step: int, act: dict[str, dict[str, float]]) -> list[Finding]:
        """``massive_activations``: a module whose largest output stays ``massive`` times its
        RMS or more for ``massive_span`` training steps."""
        found = []
        for name, s in act.items():
            ratio = s.get("absmax_over_rms", math.nan)
            run = self._massive.setdefault(name, _Run())
            run.see(step, ratio >= self.t.massive)  # NaN: not massive
            if run.state and run.lasted(self.t.massive_span):
                found.append(
                    Finding(
                        "massive_activations",
                        name,
                        step,
                        ratio,
                        f"the largest output of {name!r} is {ratio:.0f}x its RMS (kurtosis "
                        f"{s.get('kurtosis', math.nan):.3g}) since step {run.since}"
                        f"{_massive_channels(s, self.t.massive)}: a few "
                        "channels carry values hundreds of times the rest, a known precursor "
                        "of divergence and of low-precision overflow in transformers; check "
                        "the normalisation before it, weight decay, or the learning rate",
                    )
                )
        return found

    def _logit_growth(self, step: int, attn: dict[str, dict[str, float]]) -> list[Finding]:
        """``attention_logit_growth``: an attention module whose largest logit is at least
        ``attn_logit`` and grew ``attn_growth``-fold or more over the last ``attn_span``
        training steps."""
        found = []
        for name, s in attn.items():
            value = s.get("logit_max", math.nan)
            if not math.isfinite(value):
                continue
            recent = [(t, v) for t, v in self._logits.get(name, []) if t >= step - self.t.attn_span]
            self._logits[name] = [*recent, (step, value)]
            if not recent or value < self.t.attn_logit:
                continue
            low_step, low = min(recent, key=lambda tv: tv[1])
            if value >= self.t.attn_growth * max(low, 0.0) and value > low:
                found.append(
                    Finding(
                        "attention_logit_growth",
                        name,
                        step,
                        value,
                        f"the largest pre-softmax attention logit of {name!r} is {value:.3g}, "
                        f"{value / low if low > 0 else math.inf:.3g}x its {low:.3g} at step "
                        f"{low_step}: growing logits saturate the softmax to one-hot attention "
                        "and precede divergence in transformers; normalise the queries and "
                        "keys (QK-norm), lower the learning rate, or add weight decay",
                    )
                )
        return found

    def _precision(self, step: int, precision: dict[str, dict]) -> list[Finding]:
        """``precision_underflow`` / ``precision_overflow``: a module whose output or output
        gradient loses more than ``underflow`` / ``overflow`` of its values in a dtype named
        in ``Monitor(precision=...)``, for ``precision_span`` training steps."""
        found = []
        for name, kinds in precision.items():
            for kind, limit in (("underflow", self.t.underflow), ("overflow", self.t.overflow)):
                lost = [
                    (fraction, dtype, tensor)
                    for tensor, s in kinds.items()
                    for dtype, fraction in s[kind].items()
                    if fraction > limit
                ]
                run = self._lossy.setdefault((kind, name), _Run())
                run.see(step, bool(lost))
                if lost and run.lasted(self.t.precision_span):
                    found.append(_precision_finding(kind, name, step, run.since, max(lost)))
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

    # -- gradients -------------------------------------------------------------------------
    def _relative(
        self, param: dict[str, dict[str, float]], graph: Graph, *, normalised: bool = False
    ) -> dict[str, float]:
        """``grad_norm / norm`` of every weight matrix or kernel that is not tiny, and not
        scale-invariant (a weight whose output a normalisation layer rescales gets a
        gradient that grows as its own norm shrinks: its ratio says nothing)."""
        rescaled = {p for p, c in graph.edges if _is_norm(self.types.get(c, ""))}
        out = {}
        for name, s in param.items():
            if _module_of(name) in rescaled and not normalised:
                continue
            numel, norm, grad = self.numel.get(name), s.get("norm"), s.get("grad_norm")
            if numel is None or norm is None or grad is None or not math.isfinite(grad):
                continue
            if len(self.shapes[name]) < 2 or norm / math.sqrt(numel) < self.t.tiny_rms:
                continue
            out[name] = grad / norm
        return out

    def _gradients(self, step: int, record: StepRecord, graph: Graph) -> list[Finding]:
        rel = self._relative(record.param, graph)
        if rel:
            self._suspect = self._culprit(record, graph, max(rel, key=rel.__getitem__))
        found = self._exploding(step, record, graph, rel)
        if not found:
            everything = self._relative(record.param, graph, normalised=True)
            found = self._exploding(step, record, graph, everything, factor=100.0)
        if not found and not self._loss_rose():
            found = self._vanishing(step, record, graph, everything)
        return found or self._all_zero(step, record.param)

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

    def _loss_rose(self) -> bool:
        """The loss is at least halfway (in orders of magnitude) to a divergence: gradients
        small next to weights that blew up (clipped ones, say) are not vanishing."""
        return (self._loss.growth or 0.0) >= math.sqrt(self.t.explode_growth)

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
        jump = _largest_jump(graph, rms)
        ratio, bottom, top = _side_ratio(graph, rms)
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
        jump = _largest_jump(graph, self._rms(record))
        if jump is not None and jump[0] >= 4:
            return jump[2]
        return _module_of(top_param) if top_param else ""

    def _vanishing(
        self, step: int, record: StepRecord, graph: Graph, rel: dict[str, float]
    ) -> list[Finding]:
        t = self.t
        rms = self._rms(record)
        ratio, bottom, top = _side_ratio(graph, rms)
        if not (ratio < t.vanish_ratio and rms.get(bottom, 1.0) < t.vanish_rms):
            return []
        starved = _near(graph, bottom, set(rms))
        learning = [rel[p] for p in rel if _module_of(p) in starved]
        if not learning or max(learning) >= t.vanish_relative:
            return []
        chain = _chain(graph, rms, bottom, top)
        drops = ", ".join(f"x{g:.2g} in {c!r}" for g, c in chain[:3])
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

    # -- updates ---------------------------------------------------------------------------
    def _updates(
        self, step: int, param: dict[str, dict[str, float]], graph: Graph
    ) -> list[Finding]:
        found = []
        for name, s in param.items():
            if "grad_norm" in s and s["grad_norm"] is None:
                # Only where the module's output went on, detached: a parameter left unused
                # by design (a pooler, a mask token, an unused head) is no bug.
                if _module_of(name) in graph.detached:
                    found += self._no_gradient(step, name)
                continue
            self._no_grad.pop(name, None)
            ratio = s.get("update_ratio")
            if ratio is None:
                continue
            run = self._ratio.setdefault(name, _Run())
            side = self._side(name, s, ratio)
            if self._warming or (side == "high" and self._adam_transient()):
                run.forget()  # a transient: not judged, and no run goes on across it
                continue
            run.see(step, side)
            if run.state and run.lasted(self.t.update_span):
                found.append(self._update_finding(step, name, ratio, run))
        return found

    def _adam_transient(self) -> bool:
        """Within the first ``update_skip`` updates, and the loss not above its first value
        (or unknown)."""
        if self._updated > self.t.update_skip:
            return False
        first, now = self._loss.first, self._loss.latest
        return first is None or now is None or now <= first

    def _side(self, name: str, s: dict[str, float], ratio: float) -> str | bool:
        """``"high"``, ``"low"``, or False when the ratio says nothing wrong."""
        numel, norm = self.numel.get(name), s.get("norm", 0.0)
        rms = norm / math.sqrt(numel) if numel else math.inf
        self._initial.setdefault(name, rms)
        # Started at zero or deliberately tiny: its ratio is ~1/(t+1) at any lr.
        tiny = min(rms, self._initial[name]) < self.t.tiny_rms
        if ratio > self.t.update_high and not tiny:
            return "high"
        if ratio < self.t.update_low and s.get("grad_norm") != 0.0:
            return "low"
        return False

    def _update_finding(self, step: int, name: str, ratio: float, run: _Run) -> Finding:
        high = run.state == "high"
        return Finding(
            "update_ratio",
            _module_of(name),
            step,
            ratio,
            f"update/weight ratio ||ΔW||/||W|| of {name!r} is {ratio:.3g}, out of range from "
            f"step {run.since} to step {step} ({run.seen} sampled steps; healthy: about "
            f"1e-3, allowed [{self.t.update_low:g}, {self.t.update_high:g}]): updates are too "
            + ("large; lower" if high else "small; raise")
            + " the learning rate",
        )

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

    def _no_gradient(self, step: int, name: str) -> list[Finding]:
        run = self._no_grad.setdefault(name, _Run())
        run.see(step, True)
        if not run.lasted(self.t.no_grad_span):
            return []
        return [
            Finding(
                "update_ratio",
                _module_of(name),
                step,
                0.0,
                f"{name!r} receives no gradient: its module ran, but its output reached the loss "
                "only detached, or not at all (computed and thrown away), and its .grad was None "
                f"from step {run.since} to step {step} ({run.seen} sampled steps), so its "
                "optimizer never changes it. Remove the .detach() or torch.no_grad() after it, "
                "use its output, or freeze it on purpose with requires_grad=False",
            )
        ]


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


def mark_cleared(findings: list[Finding], done: Finding) -> list[Finding]:
    """``findings`` with the current finding that ``done`` (from :meth:`Diagnosis.cleared`)
    clears replaced by ``done``: the latest of its kind and module not cleared yet."""
    out, kept = list(findings), replace(done, cleared_at=None)
    for i in range(len(out) - 1, -1, -1):
        if out[i] == kept:
            out[i] = done
            break
    return out


@dataclass
class _Run:
    """The latest run of observations of one condition with the same outcome (``state``:
    True/False, or a side such as ``"high"``), over training steps."""

    state: object = None  # None: nothing observed since the last forget()
    since: int = 0  # the training step of the run's first observation
    last: int = 0
    seen: int = 0

    def see(self, step: int, state: object) -> None:
        if state != self.state or self.seen == 0:
            self.state, self.since, self.seen = state, step, 0
        self.last, self.seen = step, self.seen + 1

    def forget(self) -> None:
        self.state, self.seen = None, 0

    def lasted(self, span: int, least: int = 2) -> bool:
        """At least ``least`` observations (one for span 0) over at least ``span`` steps."""
        return self.seen >= (least if span > 0 else 1) and self.last - self.since >= span


@dataclass
class _Growth:
    """How far a positive scalar (the loss, a gradient norm) rose above its lowest value so
    far; a scalar that was ever <= 0 has no scale and is not judged."""

    first: float | None = None
    low: float = math.inf
    growth: float | None = None  # at the latest observation
    latest: float | None = None
    judged: bool = True

    def see(self, value: float | None, factor: float) -> float | None:
        """The growth at this value over the lowest before it (floored at the first value
        / ``factor``); ``None`` when there is nothing to judge."""
        if value is None or math.isnan(value) or not self.judged:
            return None
        self.latest = value
        if value <= 0:
            self.judged, self.growth = False, None
            return None
        if self.first is None:
            self.first = value
        base = max(self.low, self.first / factor)
        self.growth = value / base if math.isfinite(base) else None
        self.low = min(self.low, value)
        return self.growth


def _lrs(scalars: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in scalars.items() if k == "lr" or k.startswith("lr/")}


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


def _is_norm(type_name: str) -> bool:
    return "Norm" in type_name  # BatchNorm2d, LayerNorm, GroupNorm, RMSNorm, LlamaRMSNorm...


def _module_of(param: str) -> str:
    return param.rsplit(".", 1)[0] if "." in param else ""


def _side_ratio(graph: Graph, rms: dict[str, float]) -> tuple[float, str, str]:
    """RMS gradient of the input side over the loss side: ``(ratio, input module, loss
    module)``, each side's best-fed module (attention's query and key projections get
    small gradients in healthy transformers: one starved branch is not the input side)."""
    have = {n for n, r in rms.items() if r >= 0}
    inputs, losses = graph.inputs_side(have), graph.loss_side(have)
    losses = [n for n in losses if rms[n] > 0]
    if not inputs or not losses or not graph.edges:
        return 1.0, "", ""
    bottom = max(inputs, key=rms.__getitem__)
    top = max(losses, key=rms.__getitem__)
    if bottom == top:
        return 1.0, bottom, top
    return rms[bottom] / rms[top], bottom, top


def _largest_jump(graph: Graph, rms: dict[str, float]) -> tuple[float, str, str] | None:
    """``(gain, producer, consumer)``: the edge whose consumer's backward scales the gradient
    up the most."""
    gains = [
        (rms[p] / rms[c], p, c)
        for p, c in graph.edges
        if p != c and rms.get(p, 0) > 0 and rms.get(c, 0) > 0
    ]
    return max(gains, default=None)


def _near(graph: Graph, start: str, have: set[str], hops: int = 2) -> set[str]:
    """``start`` and the modules up to ``hops`` edges downstream of it."""
    near, frontier = {start}, {start}
    for _ in range(hops):
        frontier = {c for p, c in graph.edges if p in frontier and c in have} - near
        near |= frontier
    return near


def _chain(graph: Graph, rms: dict[str, float], bottom: str, top: str) -> list[tuple[float, str]]:
    """Drops ``(gain, consumer)`` along the path from the loss side down to ``bottom``,
    smallest first."""
    consumers: dict[str, list[str]] = {}
    for p, c in graph.edges:
        consumers.setdefault(p, []).append(c)
    path, seen, node = [], {bottom}, bottom
    while node != top:
        nxt = [c for c in consumers.get(node, []) if c not in seen and c in rms]
        if not nxt:
            break
        nxt_node = max(nxt, key=rms.__getitem__)
        if rms[nxt_node] > 0:
            path.append((rms[node] / rms[nxt_node], nxt_node))
        seen.add(nxt_node)
        node = nxt_node
    return sorted(path)


def _massive_channels(stats: dict, massive: float) -> str:
    """``", in channels 7 and 12 (absmax 812, 640)"``: the sampled channels whose largest
    magnitude is ``massive`` times the output's RMS or more (else the largest one)."""
    channels = stats.get("channels")
    ratio, absmax = stats.get("absmax_over_rms", math.nan), stats.get("absmax", math.nan)
    if not channels or not channels["index"] or not ratio > 0:
        return ""
    rms = absmax / ratio
    pairs = [
        (i, v)
        for i, v in zip(channels["index"], channels["absmax"], strict=True)
        if v >= massive * rms
    ]
    pairs = pairs or [(channels["index"][0], channels["absmax"][0])]
    index = ", ".join(str(i) for i, _ in pairs)
    values = ", ".join(f"{v:.3g}" for _, v in pairs)
    return f", in channel{'s' if len(pairs) > 1 else ''} {index} (absmax {values})"
