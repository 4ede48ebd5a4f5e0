"""What lower precisions would do to each module's activations and output gradients.

``Monitor(precision=("bf16", "fp16", ...))`` asks, on sampled steps and from the same sample
the other statistics read, how many values of a watched module's output and of the gradient
of that output would be lost in each named dtype: those that round to zero (underflow) and
those beyond its largest finite value (overflow), with the largest magnitude (``amax``) and
the dynamic range the values span. All of it is a few comparisons and reductions on the
sample, on its device, moved to the host with the step's one transfer.

Gradients are judged as backpropagated: under a ``GradScaler`` that is the scaled gradient,
the one a float16 backward pass holds (the scale is there to keep it from underflowing).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from ..._log import StepRecord
from ..._stats import Sampler
from .._step._buffer import Host, StepBuffer
from .._step._dist import Entry

__all__ = ["DTYPES", "Format", "PrecisionProbe", "formats"]

# The names ``precision=`` takes, and their torch dtypes (fp8: the "fn" E4M3 of OCP/NVIDIA,
# finite only, and IEEE-like E5M2).
DTYPES = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
KINDS = ("act", "grad")  # activations (module outputs), gradients of those outputs


@dataclass(frozen=True)
class Format:
    """A dtype's limits, as the thresholds the counts compare against.

    ``zero_at``: half the smallest subnormal. Round-to-nearest-even sends a magnitude up to
    and including it to zero (the tie goes to zero, whose last mantissa bit is even), and any
    magnitude above it to the smallest subnormal or further. ``max``: the largest finite
    value; a magnitude above it is out of range (Inf in bf16, fp16 and fp8_e5m2 once past
    rounding to the maximum, NaN or a clipped value in fp8_e4m3, which has no Inf).
    """

    name: str
    zero_at: float
    max: float


def formats(names: Iterable[str]) -> list[Format]:
    """The formats named, in order, without repeats; an unknown name raises, listing the
    valid ones."""
    names = [names] if isinstance(names, str) else list(names)
    unknown = [n for n in names if n not in DTYPES]
    if unknown:
        raise ValueError(
            f"precision={tuple(names)!r}: unknown dtype name(s) {', '.join(map(repr, unknown))}."
            f" Valid names: {', '.join(DTYPES)}; e.g. precision=('bf16', 'fp16')."
        )
    out = []
    for name in dict.fromkeys(names):
        info = torch.finfo(DTYPES[name])
        smallest_subnormal = info.smallest_normal * info.eps
        out.append(Format(name, smallest_subnormal / 2, info.max))
    return out


class PrecisionProbe:
    """Per watched module, for its output and its output's gradient on sampled steps: the
    fraction of the sampled values each format would round to zero (they were not zero) and
    would not hold (beyond its largest finite value), ``amax`` (the largest magnitude, Inf
    included, NaN left out) and ``dynamic_range`` (``log2`` of the largest finite magnitude
    over the smallest non-zero one)."""

    def __init__(self, names: Sequence[str], sampler: Sampler, modules: Iterable[str]) -> None:
        self.formats = formats(names)
        self.sampler = sampler
        self.modules = list(modules)
        self._limits: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def names(self) -> list[str]:
        return [f.name for f in self.formats]

    def forward(self, buf: StepBuffer, name: str, outs: list[torch.Tensor]) -> None:
        for t in outs:
            self._add(buf, "act", name, self.sampler(t.detach()))

    def backward(self, buf: StepBuffer, name: str, grad: torch.Tensor) -> None:
        self._add(buf, "grad", name, self.sampler(grad.detach()))

    @torch.no_grad()
    def _add(self, buf: StepBuffer, kind: str, name: str, x: torch.Tensor) -> None:
        """Counts (``n``, then underflows and overflows per format) add up over calls and
        tensors; ``amax`` and the largest finite magnitude combine by max, the smallest
        non-zero one by min."""
        a = x.abs() if x.dtype in (torch.float32, torch.float64) else x.float().abs()
        zero_at, big = self._thresholds(a.device, a.dtype)
        nonzero = a > 0
        under = (nonzero & (a <= zero_at[:, None])).sum(1)
        over = (a > big[:, None]).sum(1)
        n = a.new_full((1,), float(a.numel()))
        buf.add(("prec", kind, name), torch.cat([n, under.to(a.dtype), over.to(a.dtype)]).float())
        finite = torch.isfinite(a)
        empty = a.numel() == 0
        amax = a.new_zeros(()) if empty else torch.nan_to_num(a, nan=0.0).max()
        fmax = a.new_zeros(()) if empty else torch.where(finite, a, 0.0).max()
        fmin = (
            a.new_full((), math.inf) if empty else torch.where(finite & nonzero, a, math.inf).min()
        )
        buf.add(("prec_max", kind, name), torch.stack([amax, fmax]).float(), "max")
        buf.add(("prec_min", kind, name), fmin.float(), "min")

    def _thresholds(
        self, device: torch.device, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        key = (device, dtype)
        limits = self._limits.get(key)
        if limits is None:
            zero_at = torch.tensor([f.zero_at for f in self.formats], dtype=dtype, device=device)
            big = torch.tensor([f.max for f in self.formats], dtype=dtype, device=device)
            limits = self._limits[key] = (zero_at, big)
        return limits

    def layout(self) -> list[Entry]:
        """Keys and combining rules, for a collective across ranks."""
        size = 1 + 2 * len(self.formats)
        return [
            entry
            for name in self.modules
            for kind in KINDS
            for entry in (
                Entry(("prec", kind, name), size, "sum"),
                Entry(("prec_max", kind, name), 2, "max"),
                Entry(("prec_min", kind, name), 1, "min"),
            )
        ]

    def read(self, host: Host, record: StepRecord) -> None:
        k = len(self.formats)
        for name in self.modules:
            stats = {}
            for kind in KINDS:
                counts = host.get(("prec", kind, name))
                if counts is None:
                    continue
                n = max(counts[0], 1.0)
                amax, fmax = host[("prec_max", kind, name)]
                fmin = host[("prec_min", kind, name)][0]
                stats[kind] = {
                    "amax": amax,
                    "dynamic_range": _log2_ratio(fmax, fmin),
                    "underflow": {
                        f.name: c / n for f, c in zip(self.formats, counts[1 : 1 + k], strict=True)
                    },
                    "overflow": {
                        f.name: c / n for f, c in zip(self.formats, counts[1 + k :], strict=True)
                    },
                }
            if stats:
                record.precision[name] = stats


def _log2_ratio(largest: float, smallest: float) -> float:
    """``log2(largest / smallest)``; NaN where there is no non-zero finite value."""
    if not (math.isfinite(smallest) and smallest > 0 and largest > 0):
        return math.nan
    return math.log2(largest) - math.log2(smallest)
