"""Statistics computed on the tensor's device, as small tensors: no host sync here.

On sampled steps a Monitor reads at most ``sample`` elements of a tensor, spread over all of
it (:class:`Sampler`); these functions turn such a sample into sums, minima and maxima that
a :class:`~hookscope._monitor._step._buffer.StepBuffer` combines across calls and moves to the host.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

__all__ = [
    "MOMENTS",
    "Plan",
    "Rows",
    "Sampler",
    "channel_absmax",
    "channel_dim",
    "channel_extremes",
    "dead_fraction",
    "finite_flag",
    "histogram",
    "moments",
    "norms",
    "plan_for",
    "row_extremes",
    "row_moments",
    "strided_index",
]

# Sums of a sample, in this order; they add up over tensors and calls.
MOMENTS = ("sum", "sumsq", "cube", "quad", "zeros", "sat", "nan", "inf", "n")

_RELU_LIKE = (nn.ReLU, nn.ReLU6)
# Saturated: output within this distance of the activation's bound (tanh(5) = 1 - 9e-5 is
# DeepDiagnosis' "pre-activation outside ±5").
_BOUNDED = {
    nn.Tanh: (-1.0, 1.0),
    nn.Sigmoid: (0.0, 1.0),
    nn.Hardtanh: (-1.0, 1.0),
    nn.Softsign: (-1.0, 1.0),
    nn.Hardsigmoid: (0.0, 1.0),
}
SAT_MARGIN = 1e-3
# A dead-unit estimate looks at every unit on at least this many positions (batch x space).
MIN_POSITIONS = 64
# finite_flag on a CPU: up to this many elements, ``(t * 0).sum()`` (two ops, a copy of
# ``t``) is faster than ``aminmax`` and the three ops that turn it into a flag
SMALL_FLAG = 1 << 16


# Modules whose 3-D output is ``(N, C, L)``, channels first, not ``(batch, sequence, hidden)``.
_CHANNELS_FIRST = (
    nn.Conv1d,
    nn.ConvTranspose1d,
    nn.modules.batchnorm._BatchNorm,
    nn.modules.instancenorm._InstanceNorm,
    nn.GroupNorm,
    nn.MaxPool1d,
    nn.AvgPool1d,
    nn.AdaptiveMaxPool1d,
    nn.AdaptiveAvgPool1d,
    nn.LPPool1d,
)


@dataclass(frozen=True)
class Plan:
    """What to compute on a module's output, resolved once when the Monitor attaches."""

    bounds: tuple[float, float] | None  # saturation bounds of a bounded activation
    dead: bool  # a ReLU-like module: estimate the fraction of dead units
    channels_first: bool = False  # a 3-D output's channels are dim 1 (a Conv1d's (N, C, L))


def plan_for(module: nn.Module) -> Plan:
    bounds = None
    for kind, b in _BOUNDED.items():  # not next(generator, None): Dynamo 2.7 breaks the graph
        if isinstance(module, kind):
            bounds = b
            break
    first = isinstance(module, _CHANNELS_FIRST)
    return Plan(bounds=bounds, dead=isinstance(module, _RELU_LIKE), channels_first=first)


class Sampler:
    """At most ``k`` elements of a tensor, spread over the whole of it; ``k=None``: all.

    Elements are taken at a fixed stride through the tensor in row-major order, the stride
    chosen coprime with the size of the last two dimensions, so that the sample walks over
    every row, column and channel instead of resonating with one of them. The index is built
    once per shape and device; ``torch.take`` gathers through any strides without a copy of
    the whole tensor.
    """

    def __init__(self, k: int | None) -> None:
        if k is not None and k < 1:
            raise ValueError(f"sample must be a positive number of elements or None, got {k}")
        self.k = k
        self._index: dict[tuple, torch.Tensor] = {}
        self._units: dict[tuple, torch.Tensor] = {}

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        if self.k is None or t.numel() <= self.k:
            return t.reshape(-1)
        return torch.take(t, self._index_of(t))

    def _index_of(self, t: torch.Tensor) -> torch.Tensor:
        n = t.numel()
        key = (n, tuple(t.shape[-2:]), t.device)
        index = self._index.get(key)
        if index is None:
            index = self._index[key] = strided_index(n, self.k or n, t.shape, t.device)
        return index

    def keep_at(
        self, t: torch.Tensor, flat: torch.Tensor, start: int, room: int
    ) -> torch.Tensor | None:
        """``self(t)`` written into ``flat`` (1-D, contiguous) from ``start``, cast to its
        dtype, when it holds at most ``room`` elements: a copy of its own, as :meth:`keep`
        makes, with no tensor in between. The part of ``flat`` it wrote (None: too many)."""
        n = t.numel()
        if self.k is None or n <= self.k:
            return flat[start : start + n].copy_(t.reshape(-1)) if n <= room else None
        index = self._index_of(t)
        count = index.numel()
        if count > room:
            return None
        out = flat[start : start + count]
        if t.dtype == flat.dtype and t.device == flat.device:
            return torch.take(t, index, out=out)
        return out.copy_(torch.take(t, index))

    def keep(self, t: torch.Tensor) -> torch.Tensor:
        """``self(t)`` as a tensor of its own, float32 (float64 for float64 input), to keep
        until the step's end: never a view of ``t``, which an in-place op may change later."""
        x = self(t)
        if x.dtype not in (torch.float32, torch.float64):
            return x.float()
        return x.clone() if x.numel() == t.numel() else x  # a view of ``t``: copy it

    def exact(self, t: torch.Tensor) -> torch.Tensor:
        """``self(t)``, float32 (float64 for float64 input), to measure now: a view of ``t``
        where it can be."""
        x = self(t)
        return x if x.dtype in (torch.float32, torch.float64) else x.float()

    def units(self, t: torch.Tensor) -> torch.Tensor:
        """A ``(positions, units)`` sample: every unit, at up to ``max(64, k / units)``
        positions spread over the batch (and space, or sequence)."""
        unit_dim = channel_dim(t)
        c = t.shape[unit_dim]
        positions = t.numel() // max(c, 1)
        want = positions if self.k is None else max(MIN_POSITIONS, self.k // max(c, 1))
        if want >= positions:
            return t.movedim(unit_dim, -1).reshape(-1, c)
        key = (tuple(t.shape), unit_dim, t.device)
        index = self._units.get(key)
        if index is None:
            inner = math.prod(t.shape[unit_dim + 1 :])
            q = torch.arange(want, device=t.device) * positions // want
            start = (q // inner) * (c * inner) + q % inner
            index = start[:, None] + torch.arange(c, device=t.device)[None, :] * inner
            self._units[key] = index
        return torch.take(t, index)


def channel_extremes(t: torch.Tensor, unit_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each channel's largest and smallest value over every value of ``t`` (detached; the
    channel: dim ``unit_dim``), in its dtype, on its device: exact, not a sample's, so that
    a channel made large at a few tokens is seen. Two reductions, not ``abs()``: no copy of
    ``t``. NaN wins, as in ``amax``."""
    dims = [d for d in range(t.dim()) if d != unit_dim]
    return t.amax(dim=dims), t.amin(dim=dims)


def channel_absmax(high: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """The largest magnitudes, float32, from :func:`channel_extremes` (of one output, or of
    several concatenated: one op for all)."""
    return torch.maximum(high, low.neg()).float()


def channel_dim(t: torch.Tensor) -> int:
    """The dim of a module output's units or channels: the last of a 3-D ``(batch,
    sequence, hidden)`` tensor, else dim 1 (``(batch, features)``, ``(N, C, H, W)``)."""
    return t.dim() - 1 if t.dim() == 3 else 1


def strided_index(n: int, k: int, shape: torch.Size, device: torch.device) -> torch.Tensor:
    period = math.prod(shape[-2:]) if len(shape) >= 2 else 1
    stride = max(n // k, 1)
    while _gcd(stride, period) != 1:
        stride += 1
    count = min(k, (n - 1) // stride + 1)
    return torch.arange(count, device=device) * stride


def _gcd(a: int, b: int) -> int:
    """``math.gcd``, which ``torch.compile`` cannot trace on symbolic sizes (a graph break
    at every hook); Euclid's loop specialises them instead (the index is per shape anyway)."""
    while b:
        a, b = b, a % b
    return a


@torch.no_grad()
def moments(x: torch.Tensor, bounds: tuple[float, float] | None) -> torch.Tensor:
    """``MOMENTS`` of a 1-D sample, float32, on its device: :func:`row_moments` of one row
    (a compiled graph's probe measures one output at a time)."""
    x = x.detach()
    if x.dtype not in (torch.float32, torch.float64):
        x = x.float()
    limits = None
    if bounds is not None:
        limits = (
            x.new_full((1, 1), bounds[0] + SAT_MARGIN),
            x.new_full((1, 1), bounds[1] - SAT_MARGIN),
        )
    n = x.new_full((1,), float(x.numel()))
    return row_moments(x.reshape(1, -1), None, n, limits)[0]


class Rows:
    """Samples of several tensors as one zero-padded ``(rows, width)`` tensor, for statistics
    of every sample in a few ops instead of a few per sample.

    The constants that describe a step's rows (their lengths, say) become device tensors once
    per layout and are reused by later steps with the same layout: no host-to-device copy on
    a step like the last.
    """

    BUDGET = 1 << 24  # elements cached, at most (layouts that change every step)

    def __init__(self) -> None:
        self._cache: dict[tuple, torch.Tensor] = {}
        self._size = 0

    def cached(self, key: tuple, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``make()``, made once per ``key``."""
        t = self._cache.get(key)
        if t is None:
            t = make()
            if self._size + t.numel() > self.BUDGET:  # start over
                self._cache.clear()
                self._size = 0
            self._cache[key] = t
            self._size += t.numel()
        return t

    def const(
        self, values: tuple, device: torch.device, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """``torch.tensor(values)`` on ``device``, made once per ``values``."""
        return self.cached(
            ("const", values, device, dtype),
            lambda: torch.tensor(values, dtype=dtype, device=device),
        )

    def padded(self, xs: list[torch.Tensor], value: float) -> torch.Tensor:
        """The 1-D ``xs`` (one dtype, one device) as the rows of one tensor, filled with
        ``value`` past each one's end: three ops, whatever their number (``pad_sequence``
        copies row by row)."""
        lengths = tuple(x.numel() for x in xs)
        width, device = max(lengths), xs[0].device

        def where() -> torch.Tensor:  # each element's place in the flattened rows
            starts = range(0, len(xs) * width, width)
            parts = [torch.arange(s, s + n) for s, n in zip(starts, lengths, strict=True)]
            return torch.cat(parts).to(device)

        index = self.cached(("padded", lengths, device), where)
        rows = torch.full((len(xs) * width,), value, dtype=xs[0].dtype, device=device)
        return rows.index_copy_(0, index, torch.cat(xs)).view(len(xs), width)

    def pad(self, xs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """The 1-D ``xs`` (one dtype, one device) as the rows of one tensor, zero-padded to
        the longest; the mask of their values (``None``: no padding) and their lengths (in
        their dtype)."""
        lengths = tuple(x.numel() for x in xs)
        device, dtype = xs[0].device, xs[0].dtype
        n = self.const(lengths, device, dtype)
        if len(xs) == 1:
            return xs[0].reshape(1, -1), None, n
        if min(lengths) == max(lengths):
            return torch.stack(xs), None, n
        rows = self.padded(xs, 0.0)

        def mask() -> torch.Tensor:
            ends = self.const(lengths, device, torch.long)
            return torch.arange(rows.shape[1], device=device) < ends[:, None]

        return rows, self.cached(("mask", lengths, device), mask), n

    def placed(
        self, block: torch.Tensor, lengths: tuple[int, ...]
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """As :meth:`pad`, for samples already written into the rows of ``block`` (zeros
        past each one's length, one row each from the first): no copy."""
        device, dtype = block.device, block.dtype
        n = self.const(lengths, device, dtype)
        rows = block[: len(lengths), : max(lengths)]
        if min(lengths) == max(lengths):
            return rows, None, n

        def mask() -> torch.Tensor:
            ends = self.const(lengths, device, torch.long)
            return torch.arange(rows.shape[1], device=device) < ends[:, None]

        return rows, self.cached(("mask", lengths, device), mask), n

    def fill(
        self, mask: torch.Tensor, lengths: tuple[int, ...], dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """What :func:`row_extremes` adds to rows padded as ``mask`` says (``lengths``: the
        rows' lengths), made once per layout."""
        key = ("fill", lengths, mask.device, dtype)
        low = self.cached((*key, 0), lambda: _fill(mask, dtype)[0])
        return low, self.cached((*key, 1), lambda: _fill(mask, dtype)[1])


@torch.no_grad()
def row_moments(
    x: torch.Tensor,
    mask: torch.Tensor | None,
    n: torch.Tensor,
    bounds: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """:func:`moments` of each row of ``x`` (``(rows, width)``, float32 or float64, zero past
    each row's ``n`` values where ``mask`` is False; ``n``: the lengths, in ``x``'s dtype):
    ``(rows, len(MOMENTS))``, float32. ``bounds``: per row, ``(rows, 1)`` saturation limits
    (the bound plus or minus :data:`SAT_MARGIN`; NaN where the row has none).

    Counts come from float arithmetic, not comparisons: on the CPU a comparison or a sum of
    booleans reads a tensor ~10x slower than a float op. Each count is a sum of 0/1 floats
    (NaN where the element is NaN, which ``nansum`` leaves out), exact below 2**24 per row;
    wider rows (``sample=None`` on huge outputs) count with comparisons."""
    if x.shape[1] >= _EXACT_COUNT:
        return _row_moments_compared(x, mask, n, bounds)
    width = float(x.shape[1])
    square = x.square()
    sums = [x.sum(1), square.sum(1)]
    scratch = torch.mul(square, x)
    sums.append(scratch.sum(1))
    sums.append(torch.mul(square, square, out=scratch).sum(1))
    magnitude = x.abs()
    inf = torch.sub(magnitude, torch.finfo(x.dtype).max, out=scratch).clamp_(0, 1).nansum(1)
    nonzero = magnitude.clamp_(max=1).ceil_()  # 1, 0 for a zero, NaN for a NaN
    zeros = n - nonzero.nansum(1)
    nan = width - nonzero.mul_(0).add_(1).nansum(1)  # the padding's zeros are not NaN
    zeros = zeros - nan
    if bounds is None:
        sat = torch.zeros_like(n)
    else:
        # x <= lo: 1 - ceil(clamp(x - lo, 0, 1)); x >= hi: 1 - ceil(clamp(hi - x, 0, 1));
        # NaN (left out) for a NaN value or a row without bounds (clamp keeps a NaN, where
        # relu and sign do not). The padding's zeros are taken back out.
        lo, hi = bounds
        low = 1 - (x - lo).clamp_(0, 1).ceil_()
        high = 1 - (hi - x).clamp_(0, 1).ceil_()
        sat = low.nansum(1) + high.nansum(1)
        if mask is not None:
            zero = (1 - (-lo).clamp_(0, 1).ceil_()) + (1 - hi.clamp(0, 1).ceil_())
            sat = sat - (width - n) * torch.nan_to_num(zero[:, 0], nan=0.0)
    return torch.stack([*sums, zeros, sat, nan, inf, n], 1).float()


_EXACT_COUNT = 1 << 24  # float32 counts past this many are no longer exact


def _row_moments_compared(
    x: torch.Tensor,
    mask: torch.Tensor | None,
    n: torch.Tensor,
    bounds: tuple[torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    """:func:`row_moments` with the counts from comparisons (exact integers at any width)."""
    square = x.square()
    zeros = (x == 0).sum(1).to(x.dtype)
    if mask is not None:  # the padding is zeros
        zeros = zeros - (x.shape[1] - n)
    if bounds is None:
        sat = torch.zeros_like(n)
    else:
        out = (x <= bounds[0]) | (x >= bounds[1])
        sat = (out if mask is None else out & mask).sum(1).to(x.dtype)
    return torch.stack(
        [
            x.sum(1),
            square.sum(1),
            (square * x).sum(1),
            square.square().sum(1),
            zeros,
            sat,
            torch.isnan(x).sum(1).to(x.dtype),
            torch.isinf(x).sum(1).to(x.dtype),
            n,
        ],
        1,
    ).float()


@torch.no_grad()
def row_extremes(
    x: torch.Tensor,
    mask: torch.Tensor | None,
    fill: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The smallest and the largest value of each row of ``x`` (NaN where a row holds one;
    padding left out): ``(rows, 2)``, float32. ``fill``: what :meth:`Rows.fill` makes of
    ``mask`` (made here without it), added to leave the padding out with float ops only."""
    if mask is None:
        # not aminmax: along a dim it reads ~10x slower on the CPU than amin and amax
        return torch.stack([x.amin(1), x.amax(1)], 1).float()
    if fill is None:
        fill = _fill(mask, x.dtype)
    return torch.stack([(x + fill[0]).amin(1), (x + fill[1]).amax(1)], 1).float()


def _fill(mask: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Added to padded rows: -0.0 on their values (which leaves every value as it is, a
    -0.0 too) and +inf (for a minimum) or -inf (for a maximum) on the padding."""
    zero = torch.full(mask.shape, -0.0, dtype=dtype, device=mask.device)
    return zero.masked_fill(~mask, math.inf), zero.masked_fill(~mask, -math.inf)


def dead_fraction(units: torch.Tensor, dead_at: float) -> torch.Tensor:
    """Fraction of units (columns) that are <= 0 on at least ``dead_at`` of their rows.

    ``1 - ceil(clamp(x, 0, 1))`` is 1 where ``x <= 0``, 0 where it is positive and NaN where
    it is NaN (``nansum`` leaves it out, as the comparison would): float ops where a
    comparison of the whole sample reads ~10x slower on the CPU."""
    units = units.detach()
    if not units.is_floating_point():
        units = units.float()
    off = (1 - units.clamp(0, 1).ceil_()).nansum(0) / units.shape[0]
    return (off >= dead_at).float().mean()


def histogram(t: torch.Tensor, bins: int) -> torch.Tensor:
    """``[lo, hi, counts...]``, bucketed on the device (no sync); non-finite values count as 0."""
    x = torch.nan_to_num(t.detach().float().flatten(), nan=0.0, posinf=0.0, neginf=0.0)
    if x.numel() == 0:
        return torch.zeros(bins + 2, device=t.device)
    lo, hi = torch.aminmax(x)
    width = (hi - lo).clamp_min(1e-12) / bins
    index = ((x - lo) / width).long().clamp_(0, bins - 1)
    # not bincount: on a GPU it reads the largest index back to size its output (a sync)
    counts = torch.zeros(bins, dtype=torch.long, device=x.device).index_add_(
        0, index, torch.ones_like(index)
    )
    counts = counts.float()
    return torch.cat([lo.reshape(1), hi.reshape(1), counts])


_HALF = (torch.float16, torch.bfloat16)


def finite_flag(t: torch.Tensor) -> torch.Tensor:
    """0 when every element of ``t`` is finite, NaN when one is not (float32, one pass).

    Exact where a sum is not: the sum of a large finite tensor overflows to Inf (float32
    past 3.4e38 in all, float16 past 65504), which would be taken for one. The largest
    magnitude never overflows and keeps a NaN; times 0 it is 0 or NaN, so flags add up
    (several outputs, calls, ranks) without overflowing either. On the CPU it comes from
    ``aminmax``, which reads as fast as a sum (torch's CPU infinity norm reads ~12x slower,
    and a 16-bit sum accumulated in float32 ~20x); a small tensor is multiplied by 0 first
    and summed (each element 0 or NaN: nothing to overflow).
    """
    t = t.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    if not t.is_floating_point() or t.numel() == 0:
        return torch.zeros((), device=t.device)
    if t.device.type == "cpu":
        if t.numel() <= SMALL_FLAG:  # times 0 first: 0 or NaN each, so the sum cannot
            return t.mul(0).sum(dtype=torch.float32)  # overflow; 2 ops where this is 4
        low, high = torch.aminmax(t)
        peak = torch.maximum(high, -low)
    else:
        peak = torch.linalg.vector_norm(t, math.inf)
    return (peak * 0).float()


def squared_norms(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The squares of the L2 norms of ``tensors`` as one float32 vector: one fused norm and
    two ops (a fused square of every norm would be a kernel per tensor). None when they
    are on several devices or of several dtypes (:func:`norms` takes those)."""
    if not tensors:
        return None
    first = tensors[0]
    device, dtype = first.device, first.dtype
    for t in tensors:
        if t.device != device or t.dtype is not dtype:
            return None
    with torch.no_grad():
        half = dtype in _HALF  # accumulate 16-bit floats in float32
        values = torch._foreach_norm(tensors, 2, dtype=torch.float32 if half else None)
        return torch.stack(values).float().square_()


def norms(
    tensors: list[torch.Tensor], ord: float = 2, *, squared: bool = False
) -> list[torch.Tensor]:
    """``ord``-norms of many tensors (float32; ``squared``: their squares), one fused kernel
    per device and dtype (no per-tensor op: under ``no_grad``, nothing to detach)."""
    if not tensors:
        return []
    out: list[torch.Tensor | None] = [None] * len(tensors)
    groups: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    with torch.no_grad():
        for indices in groups.values():
            dtype = tensors[indices[0]].dtype
            half = dtype in _HALF  # accumulate 16-bit floats in float32
            values = torch._foreach_norm(
                [tensors[i] for i in indices], ord, dtype=torch.float32 if half else None
            )
            if not half and dtype != torch.float32:
                values = [v.float() for v in values]
            if squared:
                values = torch._foreach_mul(values, values)
            for i, norm in zip(indices, values, strict=True):
                out[i] = norm
    return out  # type: ignore[return-value]
