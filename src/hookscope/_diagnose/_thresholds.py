"""When a statistic becomes a finding: every threshold of the diagnosis, with its source."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Thresholds"]


@dataclass(frozen=True)
class Thresholds:
    """When a statistic becomes a finding. Defaults and their sources.

    Spans count training steps (see the docstring of ``_diagnose``). The rules on one step's
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
            not judged on either side: the ratio follows the schedule there. Nor are
            updates too large while the loss falls by a tenth or more over the run of high
            ratios (medians of 5 losses at its ends): Adagrad's first updates (~lr per
            element, shrinking as 1/sqrt(t)) and SGD's on an untrained model move small
            weights by more than a tenth while the run learns fast; a learning rate too
            high stalls the loss or makes it rise, and is found then.
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
        spike_jump / spike_jump_k / spike_recent: ... or when the loss is at least
            ``spike_jump`` times the median of the ``spike_recent`` losses before it and that
            jump (in logarithms) is more than ``spike_jump_k`` noise units (the same noise): a
            run still falling fast stays below the median of its last 50 losses, and a loss
            7x its last ones is a spike there too. A median of five: one noisy batch among
            them moves it little. Both bounds, measured on healthy runs not tuned on (digits
            MLPs under SGD with momentum and Adam, batch 16 to 64, 300 steps; small GPT-2s):
            their largest jumps over the last five are 3.6x at 8 noise units (a noisy run) or
            30 units at 1.4x (a smooth descent), never both; an injected 7x spike on a
            falling run is 37 units.
        spike_tail / spike_tail_halflife: The heavy tail of the run's own batches. Each
            loss's *rise* above its short trend (the median of the last 5 losses carried
            along the median step-to-step change of the last 10 in logarithms while the run
            falls, so a fast descent is not a rise), in plain units, is kept for the last
            ``spike_window`` steps, and the largest one also as a maximum that halves every
            ``spike_tail_halflife`` steps (a converged run's rare hard batch, 0.005 -> 0.3,
            recurs less often than once in 50 steps). A spike by the two rules above must
            also rise at least ``spike_tail`` times that largest rise (1.25 times for the
            long median's rule: a plateau's noise is its whole range); and, after 30 rises,
            a loss ``spike_tail`` times the largest rise and ``spike_k`` robust widths of the
            rises (1.4826 x their MAD) above its trend is a spike too (a x7 batch on a noisy
            run that neither 3x its last five nor the long median's range can see; from 12
            rises, three times as far above the largest: a x3 early in a fast descent). Small
            GPT-2s near convergence have batches 10-30x their neighbours on healthy runs
            (SGD with momentum, AdamW at 1e-2, Adam with betas (0.9, 0.95), 4 layers x 128):
            in plain units their rises stay within twice the largest of the last steps, and
            an injected x7 on an MLP mid-run is 2.5-3.5x it (``benchmarks/heldout.py``).
        spike_lead: A group's gradient norm, or the step-to-step change of its weight norm,
            that has been out of its own range (the same rule over its own window) for up to
            this many steps before a spike is said to lead it.
        massive / massive_span: ``massive_activations`` when a module's largest output is at
            least this multiple of its RMS (``absmax_over_rms``) for this many training steps
            (two observations at least). Massive activations in LLMs reach thousands of times
            the median magnitude (Sun et al. 2024, "Massive activations in large language
            models"); the largest of 4096 normal values is about 4x their RMS.
        massive_channel: ... or when a module's largest channel (its largest magnitude over
            every position of a sampled step: exact, not sampled, so a channel large at a few
            tokens counts) is at least this multiple of the median channel's (a whole
            outlier channel: it carries most of the RMS itself, so the ratio above
            stays near sqrt(positions), ~25, even for a channel x1000; Dettmers et al.
            2022, "LLM.int8()": outlier features 20x and more break int8 quantisation). A
            channel of normal values differs from the median one by a few times: at most
            6x on healthy MLPs, CNNs with BatchNorm and GPT-2s under SGD and Adam
            (``benchmarks/heldout.py``), so 50 leaves a margin of 8 and finds a channel
            x100 even where its own values are half the median channel's (at 100, a channel
            x100 was found only where its values happened to be above the median's).
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
            Not while the loss falls by a tenth or more over that span: a model that learns
            sharpens its attention (a small nanoGPT-like run: logits 5 -> 128 while its
            loss fell 4.2 -> 0.5); the growth that precedes divergence comes with a loss
            that stalls or rises.
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
    spike_jump: float = 3.0
    spike_jump_k: float = 12.0
    spike_recent: int = 5
    spike_tail: float = 2.0
    spike_tail_halflife: int = 200
    spike_lead: int = 20
    massive: float = 100.0
    massive_span: int = 20
    massive_channel: float = 50.0
    underflow: float = 0.1
    overflow: float = 0.0
    precision_span: int = 20
    attn_logit: float = 50.0
    attn_growth: float = 2.0
    attn_span: int = 20
