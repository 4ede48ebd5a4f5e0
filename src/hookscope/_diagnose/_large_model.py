"""Large-model signals on sampled steps: massive activations and growing attention logits.

Both precede the divergence of large transformers; both are judged over a span of training
steps, so one outlying step is no finding.
"""

from __future__ import annotations

import math

from ._finding import Finding
from ._runs import Run
from ._thresholds import Thresholds
from ._training import LossTrail

__all__ = ["LogitGrowth", "MassiveActivations"]


class MassiveActivations:
    """``massive_activations``: a module whose largest output stays ``massive`` times its RMS
    or more, or whose largest channel stays ``massive_channel`` times the median channel
    (their largest magnitudes), for ``massive_span`` training steps.

    Both: where a whole channel is the outlier (one output channel x1000, the kind that
    breaks int8/fp8 per-tensor scales) it carries most of the RMS itself, so the largest
    value over the RMS cannot pass ~sqrt(positions) (about 25 for 768 channels). The
    channels' largest magnitudes are exact (every position of a sampled step, not the
    sample), so a channel made large at a few tokens only is judged as one large everywhere.

    Trained transformers grow massive activations of their own (a few fixed dims 100-1000x
    at the first or delimiter tokens, Sun et al. 2024); on the runs this was checked on (tiny
    GPT-2, BERT, ViT, ResNet, CNNs and MLPs, at init and trained until they learn:
    ``benchmarks/heldout.py``, ``benchmarks/outlier_shapes.py``) the largest channel stays
    within 6x the median one, and where a model grows one past these thresholds it is the
    same precursor of low-precision overflow the message names."""

    def __init__(self, thresholds: Thresholds) -> None:
        self.t = thresholds
        self._runs: dict[str, Run] = {}  # module -> run of massive outputs

    def check(self, step: int, act: dict[str, dict[str, float]]) -> list[Finding]:
        found = []
        for name, s in act.items():
            ratio = s.get("absmax_over_rms", math.nan)
            channel = _channel_ratio(s)
            run = self._runs.setdefault(name, Run())
            # NaN: not massive
            run.see(step, ratio >= self.t.massive or channel >= self.t.massive_channel)
            if run.state and run.lasted(self.t.massive_span):
                if not ratio >= self.t.massive:  # one channel (whole or at a few tokens)
                    chans = s["channels"]
                    what = (
                        f"channel {chans['index'][0]} of {name!r} reaches {chans['absmax'][0]:.3g}"
                        f", {channel:.0f}x the median channel's largest magnitude "
                        f"({chans['median_absmax']:.3g}; kurtosis "
                        f"{s.get('kurtosis', math.nan):.3g}) since step {run.since}: one "
                        "channel carries values tens to hundreds of times the others' largest, "
                        "at every position or at a few tokens (an outlier channel, which a "
                        "per-tensor int8/fp8 scale cannot represent beside the others)"
                    )
                    value = channel
                else:
                    what = (
                        f"the largest output of {name!r} is {ratio:.0f}x its RMS (kurtosis "
                        f"{s.get('kurtosis', math.nan):.3g}) since step {run.since}"
                        f"{_massive_channels(s, self.t.massive)}: a few channels carry values "
                        "hundreds of times the rest"
                    )
                    value = ratio
                found.append(
                    Finding(
                        "massive_activations",
                        name,
                        step,
                        value,
                        f"{what}, a known precursor of divergence and of low-precision "
                        "overflow in transformers; check the normalisation before it, weight "
                        "decay, or the learning rate",
                    )
                )
        return found


class LogitGrowth:
    """``attention_logit_growth``: an attention module whose largest logit is at least
    ``attn_logit`` and grew ``attn_growth``-fold or more over the last ``attn_span`` training
    steps."""

    def __init__(self, thresholds: Thresholds) -> None:
        self.t = thresholds
        self._recent: dict[str, list[tuple[int, float]]] = {}  # module -> recent (step, logit)
        self._losses = LossTrail()

    def loss(self, step: int, value: float | None) -> None:
        """Every training step's loss (the rule holds its fire while the loss falls: a
        nanoGPT run's logits 12.6 -> 53 while its loss fell 4.4 -> 2.9 is a model that
        learns, see :meth:`LossTrail.learning`)."""
        self._losses.see(step, value)

    def check(self, step: int, attn: dict[str, dict[str, float]]) -> list[Finding]:
        found = []
        for name, s in attn.items():
            value = s.get("logit_max", math.nan)
            if not math.isfinite(value):
                continue
            recent = [(t, v) for t, v in self._recent.get(name, []) if t >= step - self.t.attn_span]
            self._recent[name] = [*recent, (step, value)]
            if not recent or value < self.t.attn_logit:
                continue
            low_step, low = min(recent, key=lambda tv: tv[1])
            grew = value >= self.t.attn_growth * max(low, 0.0) and value > low
            if grew and not self._losses.learning(low_step, step):
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


def _massive_channels(stats: dict, massive: float) -> str:
    """``", in channels 7 and 12 (absmax 812, 640)"``: the top channels whose largest
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


def _channel_ratio(stats: dict) -> float:
    """The largest channel's largest magnitude over the median channel's, both over every
    position (NaN when the output has fewer than 4 channels)."""
    channels = stats.get("channels")
    if not channels or not channels.get("absmax"):
        return math.nan
    typical = channels.get("median_absmax", math.nan)
    shape_ok = len(channels["index"]) >= 4  # at least 4 channels (the top ones kept)
    if not shape_ok or not typical > 0:
        return math.nan
    return channels["absmax"][0] / typical
