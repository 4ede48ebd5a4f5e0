"""What a Monitor measures of module outputs and their gradients, on sampled steps.

The hooks only take each output's (and each output gradient's) sample and keep it in the
step's :class:`StepBuffer`; at the step's end :meth:`Activations.collect` settles the buffer
and every module's statistics come from one pass over a zero-padded ``(rows, width)`` tensor
of the samples (``_stats.Rows``), combined per module over its calls, under the keys that
:meth:`read` and :meth:`layout` use. ``sample=None`` measures in the hook, with the same row
functions. Each channel's largest magnitude is the exception: read over the whole output in
the hook (a ``[C]`` tensor per call, left on the device), as a sample misses a channel
large at a few tokens; only each module's top channels travel. After the one host transfer
each probe fills its part of the :class:`StepRecord`.
"""

import itertools
import math
from collections.abc import Iterable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..._log import StepRecord
from ..._stats import (
    MOMENTS,
    SAT_MARGIN,
    Plan,
    Rows,
    Sampler,
    channel_absmax,
    channel_dim,
    channel_extremes,
    dead_fraction,
    histogram,
    plan_for,
    row_extremes,
    row_moments,
)
from .._step._buffer import Host, StepBuffer
from .._step._dist import Entry, from_rank0

__all__ = ["TOP_CHANNELS", "Activations", "OutputGrads"]

TOP_CHANNELS = 4  # outlier channels kept per module and sampled step
_FUSED = ("act_chan", None)  # a pass's channel maxima, every module's in one vector


class _Out(NamedTuple):
    """A module output's sample, kept until the step's end."""

    name: str
    x: torch.Tensor  # the sample (float32 or float64)
    numel: int  # the output's size
    shape: tuple[int, ...]
    # each channel's largest and smallest value (exact, not sampled), in the output's dtype
    channels: tuple[torch.Tensor, torch.Tensor] | None
    row: int  # its row in the step's block (``_Block``), -1: a tensor of its own
    # a ReLU-like module's ``(positions, units)`` sample (``Sampler.units``), in the
    # sample's dtype, for the dead-unit estimate of the step's pass; None: not estimated
    units: torch.Tensor | None = None


class _Grad(NamedTuple):
    """An output gradient's sample, kept until the step's end."""

    name: str
    x: torch.Tensor
    numel: int
    row: int  # as ``_Out.row``


class _Block:
    """The rows a step's samples are written into as their hooks run, one zero-padded
    ``(rows, width)`` tensor per device and dtype, sized as the last stacked pass was: the
    pass reads them as they are, with no copy into padded rows (``Rows.pad``). A sample
    that does not fit (more rows or a longer sample than last time, the first step) is a
    tensor of its own, and its pass pads as before."""

    def __init__(self) -> None:
        self._size: dict[tuple, tuple[int, int]] = {}  # (device, dtype): (rows, width)
        self._open: dict[tuple, list] = {}  # (device, dtype): [flat block, used, rows, width]

    def write(self, sampler: Sampler, t: torch.Tensor) -> tuple[torch.Tensor, int]:
        """``sampler.keep(t)``, in a row of the block where it fits: the sample and its row
        (-1: not in the block)."""
        dtype = torch.float64 if t.dtype == torch.float64 else torch.float32
        key = (t.device, dtype)
        place = self._open.get(key)
        if place is None:
            size = self._size.get(key)
            if size is None:
                return sampler.keep(t), -1
            block = t.new_zeros(size, dtype=dtype)
            place = self._open[key] = [block.view(-1), 0, size[0], size[1]]
        flat, row, rows, width = place
        if row < rows:
            x = sampler.keep_at(t, flat, row * width, width)
            if x is not None:
                place[1] = row + 1
                return x, row
        return sampler.keep(t), -1

    def rows(
        self, table: Rows, xs: list[torch.Tensor], placed: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """The samples ``xs`` (one device and dtype; ``placed``: their rows) as ``Rows.pad``
        gives them: the block itself when they are its rows from the first, in order."""
        first = xs[0]
        key = (first.device, first.dtype)
        lengths = tuple(x.numel() for x in xs)
        self._size[key] = (len(xs), max(lengths))  # the next step's block
        place = self._open.get(key)
        if place is not None and place[1] == len(xs) and placed == list(range(len(xs))):
            return table.placed(place[0].view(place[2], place[3]), lengths)
        return table.pad(xs)

    def close(self) -> None:
        """The step's pass ran: the next sample starts a new block."""
        self._open.clear()


class Activations:
    """Moments, extremes, zero/saturated/dead fractions and histograms of module outputs.

    On a sampled step each output's hook only takes its sample (at most ``sample`` elements)
    and keeps it in the step's buffer; at the step's end :meth:`collect` computes every
    module's statistics from all the samples at once (:meth:`_finish`: a few ops on one
    padded tensor, not a few per output). With ``sample=None`` the sample is the whole
    output: its statistics are computed at once in the hook, nothing is kept.
    """

    def __init__(
        self,
        modules: dict[str, nn.Module],
        sampler: Sampler,
        *,
        dead_at: float,
        dead_min: tuple[int, int] = (1, 1),
        bins: int | None,
    ) -> None:
        self.plans: dict[str, Plan] = {name: plan_for(m) for name, m in modules.items()}
        self.sampler, self.dead_at, self.bins = sampler, dead_at, bins
        self.min_units, self.min_samples = dead_min
        self.rows = Rows()
        self.block = _Block()
        self._keys: dict[tuple, tuple[tuple, ...]] = {}  # ``_keys``' cache
        self._fused: tuple[tuple[str, int], ...] = ()  # the modules' channels in ``_FUSED``
        # a module's channels may wait under its own key (``_channels``) since the last
        # :meth:`collect`: read them all by key
        self._split = False

    def forward(self, buf: StepBuffer, name: str, outs: list[torch.Tensor]) -> None:
        plan = self.plans[name]
        first = None
        for t in outs:
            t = t.detach()
            if not t.numel():
                self._empty(buf, name, t)
                continue
            exact = self.sampler.k is None  # the whole output: measured now, not kept
            row = -1
            if exact:
                x = self.sampler.exact(t)
            else:
                x, row = self.block.write(self.sampler, t)
            first = x if first is None else first
            channels = None
            unit_dim = 1 if plan.channels_first and t.dim() == 3 else channel_dim(t)
            if t.dim() >= 2 and t.shape[unit_dim] >= 2:
                # read whole on a sampled step too (a [C] tensor per call, left on the
                # device): a channel large at a few tokens escapes a sample
                channels = channel_extremes(t, unit_dim)
                if exact:
                    _channels(buf, name, channel_absmax(*channels))
                    self._split = True
                    channels = None
            units = None
            if plan.dead and t.dim() >= 2:
                units = self.sampler.units(t)
                if units.shape[1] < self.min_units or units.shape[0] < self.min_samples:
                    units = None
                elif exact:
                    buf.add(("act_dead", name), dead_fraction(units, self.dead_at), "max")
                    units = None
                elif units.dtype != x.dtype:
                    units = units.to(x.dtype)
                elif units._is_view():
                    units = units.clone()  # a view of ``t``, which an in-place op may change
            out = _Out(name, x, t.numel(), tuple(t.shape), channels, row, units)
            if exact:
                self._finish(buf, [out])
            else:
                buf.keep(self._finish, out)
        if self.bins and first is not None:
            buf.set(("act_hist", name), histogram(first, self.bins))

    @staticmethod
    def _empty(buf: StepBuffer, name: str, t: torch.Tensor) -> None:
        """An output with no elements: counted, with nothing in it."""
        zero = t.new_zeros((), dtype=torch.float32)
        buf.add(("act", name), t.new_zeros(len(MOMENTS), dtype=torch.float32))
        buf.add(("act_min", name), zero, "min")
        buf.add(("act_max", name), zero, "max")
        buf.add(("act_numel", name), zero)

    def _finish(self, buf: StepBuffer, outs: list[_Out]) -> None:
        """Every kept sample's statistics in one pass per dtype: moments, extremes and
        channel maxima of each row, combined over the calls of each module."""
        groups: dict[tuple, list[_Out]] = {}
        for out in outs:
            groups.setdefault((out.x.device, out.x.dtype), []).append(out)
        for group in groups.values():
            self._finish_group(buf, group)
        self.block.close()

    def _finish_group(self, buf: StepBuffer, outs: list[_Out]) -> None:
        rows, mask, n = self.block.rows(self.rows, [o.x for o in outs], [o.row for o in outs])
        device, dtype = rows.device, rows.dtype
        names, slot, calls = _slots([o.name for o in outs])
        bounds = None
        if any(self.plans[o.name].bounds is not None for o in outs):
            lo, hi = zip(*(_sat_limits(self.plans[o.name].bounds) for o in outs), strict=True)
            bounds = (
                self.rows.const(lo, device, dtype)[:, None],
                self.rows.const(hi, device, dtype)[:, None],
            )
        numel = self.rows.const(tuple(float(o.numel) for o in outs), device)
        sums = torch.cat([row_moments(rows, mask, n, bounds), numel[:, None]], 1)
        fill = (
            None if mask is None else self.rows.fill(mask, tuple(o.x.numel() for o in outs), dtype)
        )
        extremes = row_extremes(rows, mask, fill)
        if len(names) < len(outs):  # a module called more than once: combine its calls
            sums = sums.new_zeros(len(names), sums.shape[1]).index_add_(
                0, self.rows.const(slot, device, torch.long), sums
            )
            extremes = _combine_calls(self.rows, extremes, calls)
        width = len(MOMENTS)
        keys = _keys(self._keys, names, ("act", "act_numel", "act_min", "act_max"))
        buf.add_rows(keys[0], sums[:, :width])
        buf.add_rows(keys[1], sums[:, width])
        buf.add_rows(keys[2], extremes[:, 0], "min")
        buf.add_rows(keys[3], extremes[:, 1], "max")
        self._finish_channels(buf, outs, device)
        dead = [o for o in outs if o.units is not None]
        if dead:
            self._finish_dead(buf, dead)

    def _finish_dead(self, buf: StepBuffer, outs: list[_Out]) -> None:
        """Every ReLU-like call's dead-unit fraction (:func:`dead_fraction` of its units
        sample) in one pass over all of them, the max over each module's calls: a dozen ops
        for all the calls, not eight per call. The same figures, bit for bit: the counts
        are sums of 0/1 floats either way."""
        units = [o.units for o in outs]
        shapes = tuple(tuple(u.shape) for u in units)  # (positions, units) each
        device = units[0].device

        def index() -> torch.Tensor:  # each element's unit, among every call's units
            parts, first = [], 0
            for p, c in shapes:
                parts.append((torch.arange(c) + first).repeat(p))
                first += c
            return torch.cat(parts).to(device)

        dtype = units[0].dtype
        where = self.rows.cached(("dead_units", shapes, device), index)
        call_of = self.rows.cached(
            ("dead_calls", shapes, device),
            lambda: torch.cat([torch.full((c,), i) for i, (_, c) in enumerate(shapes)]).to(device),
        )
        # each unit's count of positions, and each call's count of units (made once per
        # layout, as the indices are: not a tuple of every unit's count each step)
        positions = self.rows.cached(
            ("dead_positions", shapes, device, dtype),
            lambda: torch.tensor([float(p) for p, c in shapes for _ in range(c)], dtype=dtype).to(
                device
            ),
        )
        counts = self.rows.const(tuple(float(c) for _, c in shapes), device, dtype)
        x = torch.cat([u.reshape(-1) for u in units])
        # 1 where a value is <= 0, 0 where positive, NaN (left out, as nansum does) for NaN
        off = x.clamp_(0, 1).ceil_().neg_().add_(1).nan_to_num_(0.0)
        per_unit = off.new_zeros(positions.numel()).index_add_(0, where, off) / positions
        dead = (per_unit >= self.dead_at).to(off.dtype)
        fraction = dead.new_zeros(len(outs)).index_add_(0, call_of, dead) / counts
        names, _, calls = _slots([o.name for o in outs])
        if len(names) < len(outs):  # a module called more than once: its largest
            fraction = _combine_calls(self.rows, fraction[:, None], calls, high=True)[:, 0]
        buf.add_rows(_keys(self._keys, names, ("act_dead",))[0], fraction, "max")

    def _finish_channels(self, buf: StepBuffer, outs: list[_Out], device: torch.device) -> None:
        """Every module's channel maxima in one vector (a module's first call fixes its
        channels; a later call with another count of them is left out; calls of one module
        combine by max in one scatter)."""
        self._unfuse(buf)  # an earlier pass of this step: its channels by module
        sizes: dict[str, int] = {}
        for o in outs:
            if o.channels is not None and o.name not in sizes:
                old = buf.value(("act_chan", o.name))  # from an earlier pass this step
                sizes[o.name] = o.channels[0].numel() if old is None else old.numel()
        kept = [
            o for o in outs if o.channels is not None and o.channels[0].numel() == sizes[o.name]
        ]
        if len(kept) < len(outs):  # a module none of whose calls has its count of channels
            present = {o.name for o in kept}
            sizes = {name: n for name, n in sizes.items() if name in present}
        if not sizes:
            return
        # every call's largest magnitudes in one op: a few ops per pass, not per call
        highs = torch.cat([o.channels[0] for o in kept])
        values = channel_absmax(highs, torch.cat([o.channels[1] for o in kept]))
        if len(kept) > len(sizes):  # a module called more than once: the max over its calls
            starts = dict(zip(sizes, itertools.accumulate([0, *sizes.values()]), strict=False))

            def index() -> torch.Tensor:  # each value's place in the modules' vector
                parts = [torch.arange(sizes[o.name]) + starts[o.name] for o in kept]
                return torch.cat(parts).to(device)

            names = tuple(o.name for o in kept)
            key = ("channels", names, tuple(sizes.values()), device)
            where = self.rows.cached(key, index)
            total = sum(sizes.values())
            values = values.new_zeros(total).scatter_reduce_(0, where, values, "amax")
        # kept whole, with what splits it by module (:meth:`_unfuse`), until :meth:`collect`
        # reads every module's top channels from it at once
        buf.set(_FUSED, values)
        self._fused = tuple(sizes.items())

    def _unfuse(self, buf: StepBuffer) -> None:
        """The channels of a pass kept whole (``_FUSED``) put under each module's key, to
        combine with another pass's."""
        amax = buf.take(_FUSED)
        if amax is None:
            return
        sizes = dict(self._fused)
        for name, block in zip(sizes, amax.split(list(sizes.values())), strict=True):
            _channels(buf, name, block)
        self._split = True

    def collect(self, buf: StepBuffer) -> None:
        """Every kept sample's statistics (the buffer's kept samples: this probe's and the
        others'); then only the top channels travel: their largest magnitudes and their
        indices, padded to ``TOP_CHANNELS`` (index -1)."""
        buf.settle()
        fused = buf.value(_FUSED)
        split, self._split = self._split, False
        if fused is None and not split:
            return  # no channels this step (or read by an earlier call)
        if fused is not None and not split:
            # one pass this step (the usual): every module's channels from its vector
            buf.take(_FUSED)
            sizes = dict(self._fused)
            names = list(sizes)
            chans = self._channel_rows(fused, tuple(sizes.values()))
        else:
            self._unfuse(buf)
            names, values = [], []
            for name in self.plans:
                amax = buf.take(("act_chan", name))
                if amax is not None:
                    names.append(name)
                    values.append(amax)
            self._split = False  # every module's key read
            if not names:
                return
            pad = max(TOP_CHANNELS - max(v.numel() for v in values), 0)
            chans = self.rows.padded(values, -1.0)
            chans = F.pad(chans, (0, pad), value=-1.0) if pad else chans
        top, index = chans.topk(TOP_CHANNELS, dim=1)
        kept = ~(top < 0)  # not padding (a NaN maximum is kept, as topk ranks it first)
        # the typical channel's largest magnitude: the median over the channels that are
        # not padding and not all zero (dead ReLU channels), for a whole outlier channel
        typical = torch.where(chans > 0, chans, torch.nan).nanmedian(dim=1).values
        tops = torch.cat(
            [
                torch.where(kept, top, 0.0),
                torch.where(kept, index, -1).to(top.dtype),
                typical.unsqueeze(1).to(top.dtype),
            ],
            1,
        )
        buf.set_rows(_keys(self._keys, names, ("act_top",))[0], tops)

    def _channel_rows(self, amax: torch.Tensor, sizes: tuple[int, ...]) -> torch.Tensor:
        """The modules' blocks of ``amax`` (``sizes`` long each) as the rows of one tensor,
        -1 past each one's end and at least ``TOP_CHANNELS`` wide: one gather."""
        width = max(*sizes, TOP_CHANNELS)
        total = sum(sizes)

        def index() -> torch.Tensor:  # each row's place in ``amax``; ``total``: padding
            rows = []
            for start, size in zip(itertools.accumulate([0, *sizes]), sizes, strict=False):
                rows.append(list(range(start, start + size)) + [total] * (width - size))
            return torch.tensor(rows, dtype=torch.long, device=amax.device)

        where = self.rows.cached(("channel_rows", sizes, amax.device), index)
        return torch.cat([amax, amax.new_full((1,), -1.0)])[where]

    def layout(self, rank: int) -> list[Entry]:
        """Keys and combining rules, for a collective across ranks (histograms and top
        channels: rank 0's)."""
        entries = []
        for name in self.plans:
            entries += [
                Entry(("act", name), len(MOMENTS), "sum"),
                Entry(("act_min", name), 1, "min"),
                Entry(("act_max", name), 1, "max"),
                Entry(("act_numel", name), 1, "sum"),
                Entry(("act_dead", name), 1, "max"),
            ]
            entries.append(Entry(("act_top", name), 2 * TOP_CHANNELS + 1, from_rank0(rank)))
            if self.bins:
                entries.append(Entry(("act_hist", name), self.bins + 2, from_rank0(rank)))
        return entries

    def read(self, host: Host, record: StepRecord) -> None:
        for name in self.plans:
            sums = host.get(("act", name))
            if sums is None:
                continue
            m = dict(zip(MOMENTS, sums, strict=True))
            n = max(m["n"], 1.0)
            mean = m["sum"] / n
            var = max(m["sumsq"] / n - mean * mean, 0.0) if math.isfinite(mean) else math.nan
            lo, hi = host[("act_min", name)][0], host[("act_max", name)][0]
            stats = {
                "mean": mean,
                "std": math.sqrt(var) if math.isfinite(var) else math.nan,
                "min": lo,
                "max": hi,
                "absmax": max(abs(lo), abs(hi)),
                "zero_frac": m["zeros"] / n,
                "sat_frac": m["sat"] / n,
                "dead_frac": host.get(("act_dead", name), [0.0])[0],
                "nan": int(m["nan"]),
                "inf": int(m["inf"]),
                "numel": int(host[("act_numel", name)][0]),
                "sampled": int(m["n"]),
                **_outliers(m, n, mean, var, max(abs(lo), abs(hi))),
            }
            hist = host.get(("act_hist", name))
            if hist is not None:
                stats["hist"] = {"lo": hist[0], "hi": hist[1], "counts": hist[2:]}
            top = host.get(("act_top", name))
            if top is not None:
                kept = [
                    (int(i), v)
                    for v, i in zip(
                        top[:TOP_CHANNELS], top[TOP_CHANNELS : 2 * TOP_CHANNELS], strict=True
                    )
                    if i >= 0
                ]
                stats["channels"] = {
                    "index": [i for i, _ in kept],
                    "absmax": [v for _, v in kept],
                    "median_absmax": top[2 * TOP_CHANNELS],
                }
            record.act[name] = stats


class OutputGrads:
    """Norm, RMS and largest magnitude of the gradient of each module's output (divided by
    the GradScaler scale that multiplied the loss, if any: the loss's own gradient)."""

    def __init__(self, sampler: Sampler, names: Iterable[str], *, world: int = 1) -> None:
        self.sampler = sampler
        self.names = list(names)
        self.order: list[str] = []  # modules in the order their gradients arrived
        self._seen: set[str] = set()  # of those, this step's (their samples wait)
        self.rows = Rows()
        self.block = _Block()
        self._keys: dict[tuple, tuple[tuple, ...]] = {}  # ``_keys``' cache
        # Data-parallel training averages the ranks' losses: the gradient of the global loss
        # with respect to one rank's output is that rank's gradient divided by the world.
        self.scale = 1.0 / world
        self.loss_scale = 1.0  # a GradScaler's, this step: the hooks see scaled gradients

    def backward(self, buf: StepBuffer, name: str, grad: torch.Tensor) -> None:
        """Keep the gradient's sample for :meth:`_finish` at the step's end (with
        ``sample=None``: its whole, measured now)."""
        if name not in self._seen:
            self.order.append(name)
            self._seen.add(name)
        grad = grad.detach()
        if not grad.numel():
            buf.add(("grad", name), grad.new_zeros(3, dtype=torch.float32))
            buf.add(("grad_absmax", name), grad.new_zeros((), dtype=torch.float32), "max")
        elif self.sampler.k is None:
            self._finish(buf, [_Grad(name, self.sampler.exact(grad), grad.numel(), -1)])
        else:
            x, row = self.block.write(self.sampler, grad)
            buf.keep(self._finish, _Grad(name, x, grad.numel(), row))

    def _finish(self, buf: StepBuffer, grads: list[_Grad]) -> None:
        """Every kept sample's sum of squares and largest magnitude, in one pass per dtype,
        combined over the gradients of each module."""
        groups: dict[tuple, list[_Grad]] = {}
        for g in grads:
            groups.setdefault((g.x.device, g.x.dtype), []).append(g)
        for group in groups.values():
            rows, _, n = self.block.rows(self.rows, [g.x for g in group], [g.row for g in group])
            device = rows.device
            numel = self.rows.const(tuple(float(g.numel) for g in group), device)
            # the padding is zeros: nothing to mask for a sum of squares or a magnitude
            sums = torch.stack([rows.square().sum(1).float(), n.float(), numel], 1)
            absmax = rows.abs().amax(1).float()
            names, slot, calls = _slots([g.name for g in group])
            if len(names) < len(group):
                sums = sums.new_zeros(len(names), 3).index_add_(
                    0, self.rows.const(slot, device, torch.long), sums
                )
                absmax = _combine_calls(self.rows, absmax[:, None], calls, high=True)[:, 0]
            keys = _keys(self._keys, names, ("grad", "grad_absmax"))
            buf.add_rows(keys[0], sums)
            buf.add_rows(keys[1], absmax, "max")
        self.block.close()

    def layout(self) -> list[Entry]:
        entries = []
        for name in self.names:
            entries += [Entry(("grad", name), 3, "sum"), Entry(("grad_absmax", name), 1, "max")]
        return entries

    def read(self, host: Host, record: StepRecord) -> None:
        if len(self.order) < len(self.names):  # modules other ranks' gradients reached
            self.order += [n for n in self.names if ("grad", n) in host and n not in self.order]
        for name in self.order:
            sumsq, n, numel = host[("grad", name)]
            scale = self.scale / self.loss_scale
            ms = sumsq / max(n, 1.0) * scale**2
            record.grad[name] = {
                "norm": math.sqrt(ms * numel),
                "rms": math.sqrt(ms),
                "absmax": host[("grad_absmax", name)][0] * scale,
                "numel": int(numel),
                "sampled": int(n),
            }
        record.grad_order = list(self.order)

    def unscale(self, loss_scale: float | None) -> None:
        """This step's loss was multiplied by ``loss_scale`` (a GradScaler's): divide the
        gradients by it when reading them, so that they are the loss's own."""
        ok = loss_scale is not None and math.isfinite(loss_scale) and loss_scale > 0
        self.loss_scale = loss_scale if ok else 1.0

    def reset(self) -> None:
        self.order.clear()
        self._seen.clear()
        self.loss_scale = 1.0
        self.block.close()


def _channels(buf: StepBuffer, name: str, amax: torch.Tensor) -> None:
    """Each channel's largest magnitude over the sample, the max over calls (a call with
    another count of channels than the first is left out)."""
    old = buf.value(("act_chan", name))
    if old is None or old.shape == amax.shape:
        buf.add(("act_chan", name), amax, "max")


def _keys(
    cache: dict[tuple, tuple[tuple, ...]], names: list[str], kinds: tuple[str, ...]
) -> tuple[tuple, ...]:
    """Per kind, the keys ``(kind, name)`` of ``names``, made once per names and kinds (a
    pass's rows: :meth:`StepBuffer.add_rows`)."""
    at = (tuple(names), kinds)
    found = cache.get(at)
    if found is None:
        if len(cache) > 64:
            cache.clear()
        found = cache[at] = tuple(tuple((kind, name) for name in names) for kind in kinds)
    return found


def _slots(names: list[str]) -> tuple[list[str], tuple[int, ...], tuple[tuple[int, ...], ...]]:
    """The distinct ``names`` in order, each row's index among them, and each one's rows."""
    distinct: dict[str, list[int]] = {}
    for row, name in enumerate(names):
        distinct.setdefault(name, []).append(row)
    slot = {name: i for i, name in enumerate(distinct)}
    return list(distinct), tuple(slot[n] for n in names), tuple(map(tuple, distinct.values()))


def _combine_calls(
    rows: Rows, extremes: torch.Tensor, calls: tuple[tuple[int, ...], ...], *, high: bool = False
) -> torch.Tensor:
    """Per module, the min (column 0) and max (column 1) of ``extremes`` over its rows
    (``calls``: each module's rows); ``high``: the max of the only column. NaN wins, as
    in ``torch.minimum``/``maximum``."""
    width = max(len(c) for c in calls)
    pad = extremes.shape[0]  # the index of the neutral row appended below

    def index() -> torch.Tensor:
        padded = [list(c) + [pad] * (width - len(c)) for c in calls]
        return torch.tensor(padded, dtype=torch.long, device=extremes.device)

    where = rows.cached(("calls", calls, extremes.device), index)
    if high:
        neutral = extremes.new_full((1, 1), -math.inf)
        return torch.cat([extremes, neutral])[where].amax(1)
    neutral = torch.stack([extremes.new_full((), math.inf), extremes.new_full((), -math.inf)])
    both = torch.cat([extremes, neutral[None]])[where]  # (modules, calls, 2)
    return torch.stack([both[..., 0].amin(1), both[..., 1].amax(1)], 1)


def _sat_limits(bounds: tuple[float, float] | None) -> tuple[float, float]:
    """A row's saturation limits: within ``SAT_MARGIN`` of its activation's bounds; NaN
    (no value compares true) for an unbounded one."""
    if bounds is None:
        return math.nan, math.nan
    return bounds[0] + SAT_MARGIN, bounds[1] - SAT_MARGIN


def _outliers(m: dict[str, float], n: float, mean: float, var: float, absmax: float) -> dict:
    """Kurtosis (fourth central moment over the squared variance; 3 for a normal, far above
    for a few huge channels) and the largest magnitude over the RMS, from the sample's raw
    moments (NaN where they are not finite or the values are constant)."""
    rms = math.sqrt(max(m["sumsq"] / n, 0.0)) if math.isfinite(m["sumsq"]) else math.nan
    e3, e4 = m["cube"] / n, m["quad"] / n
    fourth = e4 - 4 * mean * e3 + 6 * mean**2 * (m["sumsq"] / n) - 3 * mean**4
    ok = math.isfinite(fourth) and math.isfinite(var) and var > 0
    return {
        "kurtosis": max(fourth, 0.0) / var**2 if ok else math.nan,
        "absmax_over_rms": absmax / rms if math.isfinite(rms) and rms > 0 else math.nan,
    }
