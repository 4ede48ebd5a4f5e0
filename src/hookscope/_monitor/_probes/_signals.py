"""Large-model training signals: a rolling window of cheap per-step scalars, and loss spikes.

On every step the Monitor already reads, for its non-finite check, the L2 norm of every
parameter's gradient just before the update (one fused ``_foreach_norm``, moved to the host
with the step's one transfer). :class:`SpikeWatch` reuses those numbers: it combines them per
parameter group (the group's L2 norm) (:func:`group_of`: one transformer block, one embedding, ...) and keeps the
last steps' loss, total gradient norm and group norms on the host: no kernel and no transfer
of its own, a few microseconds of Python per step.

A loss spike is judged with robust rolling statistics of the last ``spike_window`` losses
(:class:`Rolling`: their median, and the MAD of their step-to-step changes) and against the
run's own heavy tail (:class:`LossTail`: how far each batch rose above the loss's short trend,
and the largest of those rises): near convergence healthy batches jump 10x their neighbours,
and a spike must rise well above what the run's own batches did; when one starts, the group
whose gradient norm left its own rolling range first is named, with its lead in steps, and the
window is handed back to be logged.

Gradients alone cannot name a block whose *weights* changed (scaled by a bad merge or
checkpoint surgery, or by an update that a tiny Adam epsilon blew up): the loss spikes in the
same forward pass, and the gradient that grows most is the one of the block *below*, which
flows through the changed weights. So the window also keeps, per group, the L1 norm of a
fixed sample of its weights just before each update (:class:`WeightNorms`: one more fused
``_foreach_norm`` over at most 4096 weights per parameter, carried by the same transfer) and
judges the change of that norm from step to step, the update norm's shadow, by the same
rule.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from ..._diagnose import Finding, Thresholds
from ..._log import Window
from ..._stats import norms
from .._step._buffer import Host, StepBuffer
from .._step._dist import local
from .._step._norms import Norms

__all__ = ["LossTail", "Rolling", "SkipList", "Spike", "SpikeWatch", "WeightNorms", "group_of"]

# MAD x 1.4826 estimates the standard deviation of normal data.
MAD_TO_STD = 1.4826
WEIGHT_SAMPLE = 4096  # weights read per parameter and step by WeightNorms
LEAD_GAP = 2  # a group's departure may end this many steps before the spike and still lead
TREND_RECENT = 5  # LossTail: losses whose median is the trend's level
TREND_SLOPE = 10  # ... and step-to-step changes whose median is its slope
TREND_START = 8  # ... losses before the first trend
TAIL_RANGE = 1.25  # the long median's rule: a spike rises this x the largest rise, at least
TAIL_READY = 5  # rises kept before they judge a spike
TREND_HISTORY = 30  # rises kept before a rise over the trend is a spike on its own
TREND_EARLY = 12  # ... or from this many, EARLY_BAR x as far above the largest
EARLY_BAR = 3.0


def group_of(param: str) -> str:
    """The block a parameter belongs to: its name up to the first layer index
    (``transformer.h.3.attn.c_attn.weight`` -> ``transformer.h.3``), else its module
    (``transformer.wte.weight`` -> ``transformer.wte``; ``""`` for the model's own)."""
    parts = param.split(".")[:-1]
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return ".".join(parts)


class Rolling:
    """Robust range of the values before a point: their median, and the noise's scale from
    the MAD of their step-to-step changes, in logarithms while every value is positive.

    Changes, not the values themselves: early training's steep descent spreads the values
    wide, not their noise. Logarithms: a loss or a norm grows by factors, and a small batch's
    loss is skewed to the right (in plain units its common 3x batches would be outliers).
    """

    def __init__(
        self,
        k: float,
        rel: float,
        min_history: int,
        *,
        jump: float | None = None,
        jump_k: float = 12.0,
        recent: int = 5,
    ) -> None:
        self.k, self.rel, self.min_history = k, rel, min_history
        self.jump, self.jump_k, self.recent = jump, jump_k, recent

    def score(self, history: Iterable[float], value: float) -> float | None:
        """How far ``value`` lies above the median of ``history``, in units of the allowed
        excess ``max(k * noise, rel * |median|)`` (in logarithms: ``log(1 + rel)``), where
        ``noise = 1.4826 * MAD(changes) / sqrt(2)`` estimates the standard deviation of
        normal noise; above 1: out of range; ``None`` with too little finite history.

        With ``jump`` (positive values only), also how far it lies above the median of the
        last ``recent`` values, in units of ``max(jump_k * noise, log(jump))``; the larger score
        counts. A run still falling fast never rises above its long median, but a jump to
        several times its last values is out of range all the same."""
        parts = self.parts(history, value)
        return None if parts is None else max(p for p in parts if p is not None)

    def parts(self, history: Iterable[float], value: float) -> tuple[float, float | None] | None:
        """:meth:`score`'s two scores apart: over the long median, and over the recent one
        (``None`` without ``jump`` or where values are not positive)."""
        past = [v for v in history if math.isfinite(v)]
        if len(past) < self.min_history or not math.isfinite(value):
            return None
        logs = value > 0 and min(past) > 0
        if logs:
            past, value = [math.log(v) for v in past], math.log(value)
            floor = math.log1p(self.rel)
        else:
            floor = None
        median = _median(past)  # plain Python: on 50 numbers, 20x faster than numpy's
        changes = [b - a for a, b in itertools.pairwise(past)]
        middle = _median(changes)
        noise = MAD_TO_STD * _median([abs(c - middle) for c in changes]) / math.sqrt(2)
        floor = self.rel * abs(median) if floor is None else floor
        score = (value - median) / max(self.k * noise, floor, 1e-12)
        if logs and self.jump is not None:
            recent = _median(past[-self.recent :])
            return score, (value - recent) / max(self.jump_k * noise, math.log(self.jump))
        return score, None


class LossTail:
    """The loss's rises above its own short trend, and the largest of them: the heavy tail
    of the run's own batches, against which a spike must stand out.

    The trend: the median of the last ``TREND_RECENT`` log-losses carried forward along the
    median step-to-step change of the last ``TREND_SLOPE`` (only while it falls: a fast
    descent is not a rise, a rising loss does not excuse a spike). A rise: the loss minus
    the trend in plain units. Plain units, not logarithms: near convergence a batch's loss
    is a mean over examples of which a few hard ones carry it (GPT-2 at 0.01 with healthy
    batches at 0.1-0.3), so its logarithm is heavy-tailed and its tail grows as the run
    converges, where the plain rises of those batches stay about as large. The largest
    rise: of the last ``window`` kept, and a maximum that halves every ``halflife`` steps
    (a rare hard batch recurs less often than once per window). A few floats per step on
    the host: the loss is already there (the step's one transfer brought it).
    """

    def __init__(self, window: int, halflife: int) -> None:
        self._logs: deque[float] = deque(maxlen=TREND_SLOPE + 1)
        self.rises: deque[float] = deque(maxlen=window)
        self._decay = 0.5 ** (1.0 / max(halflife, 1))
        self._long = 0.0  # the largest rise, halving every ``halflife`` steps

    def trend(self) -> float | None:
        """The loss the run's trend expects at this step (``None`` before 8 losses)."""
        logs = list(self._logs)
        if len(logs) < TREND_START:
            return None
        slope = min(0.0, _median([b - a for a, b in itertools.pairwise(logs)]))
        return math.exp(_median(logs[-TREND_RECENT:]) + slope * (TREND_RECENT + 1) / 2)

    def largest(self) -> float:
        """The largest rise of the last steps (0 when none rose)."""
        return max(0.0, self._long, max(self.rises, default=0.0))

    def width(self) -> float:
        """A robust standard deviation of the kept rises: 1.4826 x their MAD."""
        rises = list(self.rises)
        middle = _median(rises)
        return MAD_TO_STD * _median([abs(r - middle) for r in rises])

    def add(self, loss: float, rise: float | None) -> None:
        """After the step is judged: its loss, and its rise (``None``: no trend yet)."""
        if rise is not None:
            self.rises.append(rise)
            self._long = max(rise, self._long * self._decay)
        if loss > 0 and math.isfinite(loss):
            self._logs.append(math.log(loss))


class WeightNorms:
    """Per parameter, the L1 norm of a fixed strided sample of its weights (at most
    ``WEIGHT_SAMPLE`` elements, the same ones every step), just before the step's first
    update.

    A sample, not every weight: a weight scaled or replaced changes its sample as much, an
    update changes it alike, and a pass over every weight on every step would cost as much
    as the gradient check (a few percent of a step on a CPU) where the sample costs nothing.
    One ``torch._foreach_norm`` per device and dtype, stacked, put in the step's buffer (no
    transfer of its own): :meth:`measure` is called before the update, once per step;
    :meth:`read` returns them summed per group after the step's transfer.
    """

    def __init__(self, params: dict[str, torch.nn.Parameter]) -> None:
        self.group = [group_of(n) for n in params]
        kinds: dict[tuple, tuple[list[int], list[tuple[torch.Tensor, int]]]] = {}
        for i, p in enumerate(params.values()):
            shard = local(p)  # a DTensor's own shard: its norm changes as the whole does
            indices, tensors = kinds.setdefault((shard.device, shard.dtype), ([], []))
            indices.append(i)
            tensors.append((p, max(1, -(-shard.numel() // WEIGHT_SAMPLE))))
        self._kinds = list(kinds.values())
        # per kind, (position in its stacked norms, group) of each parameter
        self._pairs = [
            tuple((j, self.group[i]) for j, i in enumerate(indices)) for indices, _ in self._kinds
        ]
        self._params = [[p for p, _ in tensors] for _, tensors in self._kinds]
        # no DTensor among them: each is its own shard (no ``local`` per parameter and step)
        self._plain = [all(local(p) is p for p in params) for params in self._params]
        self._norms = [Norms(1) for _ in self._kinds]  # of one device and dtype each
        # per kind, the sample views of the last step and the data pointers they view: made
        # again only when a weight's memory moved (``model.to()``, ``p.data = ...``, a
        # reshard), not per step (two ops per parameter and step otherwise)
        self._views: list[tuple[list[int], list[torch.Tensor]] | None] = [None] * len(kinds)
        self._measured = False

    def measure(self, buf: StepBuffer) -> None:
        if self._measured:
            return  # a second optimizer of the step: its update is not the step's first
        self._measured = True
        for k, (_, tensors) in enumerate(self._kinds):
            params = self._params[k]
            shards = params if self._plain[k] else [local(p) for p in params]
            where = [t.data_ptr() for t in shards]
            cached = self._views[k]
            if cached is None or cached[0] != where:
                with torch.no_grad():  # views of the weights, nothing to detach
                    flat = [t.reshape(-1) for t in shards]  # a copy where not contiguous
                    views = [
                        x if n == 1 else x[::n] for x, (_, n) in zip(flat, tensors, strict=True)
                    ]
                cached = (where, views)
                contiguous = all(t.is_contiguous() for t in shards)
                self._views[k] = cached if contiguous else None
            views = cached[1]  # (``Norms`` reads them under ``no_grad``)
            values = self._norms[k](views)  # None: a sample view to stack is strided
            if values is None:
                with torch.no_grad():
                    values = torch.stack(norms(views, 1))
            buf.set(("weights", k), values)

    def read(self, host: Host) -> dict[str, float]:
        """The step's norms, summed per group."""
        return self.read_later(host).get()

    def read_later(self, host: Host) -> _Sums:
        """The step's norms, summed per group when first asked (:class:`_Sums`)."""
        self._measured = False
        parts = []
        for k, pairs in enumerate(self._pairs):
            values = host.get(("weights", k))
            if values:
                parts.append((values, pairs if len(values) >= len(pairs) else pairs[: len(values)]))
        return _Sums(parts, square=False)


class _Grouping(NamedTuple):
    """The parameters of one gradient reading that have a group: ``rows`` ``(position,
    parameter, group)``; ``pairs`` ``(position, group)``; their ``positions``."""

    rows: tuple[tuple[int, str, str], ...]
    pairs: tuple[tuple[int, str], ...]
    positions: list[int]


@dataclass(frozen=True)
class Spike:
    """A loss spike: its finding and the window of steps around it, for the log."""

    finding: Finding
    window: Window


@dataclass(frozen=True)
class _Verdict:
    """Why a loss spikes: ``how`` (``"range"``: above the long median's range; ``"jump"``:
    over the median of the last losses; ``"trend"``: over its trend, beyond the run's heavy
    tail), by how many times the allowed excess, and the trend, rise and largest recent rise
    it was judged against (``None`` before the tail has enough steps)."""

    how: str
    score: float
    level: float | None
    rise: float | None
    top: float | None


class _Sums:
    """Per group, the sum of one step's per-parameter numbers (of their squares, then its
    square root: an L2 norm, with ``square``), made when first asked. Only a spike reads a
    group's norms (:meth:`SpikeWatch._leader`, the window it logs): every other step keeps
    the lists its transfer brought, as they came, and sums nothing.

    ``parts``: host lists, each with the ``(position, group)`` of the numbers that count, in
    the order they are summed (the order of the parameters: the same floats as a sum made
    at once)."""

    __slots__ = ("_parts", "_square", "_sums")

    def __init__(
        self, parts: list[tuple[list[float], Sequence[tuple[int, str]]]], *, square: bool
    ) -> None:
        self._parts, self._square = parts, square
        self._sums: dict[str, float] | None = None

    @classmethod
    def made(cls, sums: _Sums | dict[str, float]) -> _Sums:
        """``sums`` itself, or sums already made (a window built by hand)."""
        if isinstance(sums, _Sums):
            return sums
        made = cls([], square=False)
        made._sums = sums
        return made

    def get(self) -> dict[str, float]:
        if self._sums is None:
            sums: dict[str, float] = {}
            for values, pairs in self._parts:
                for i, g in pairs:
                    value = values[i] ** 2 if self._square else values[i]
                    sums[g] = sums[g] + value if g in sums else value
            self._sums = {g: math.sqrt(v) for g, v in sums.items()} if self._square else sums
            self._parts = []
        return self._sums


class _Row:
    """One step of the window: its scalars, and per group the L2 norm of its gradients and
    the L1 norm of its weights before the update (summed when first read: :class:`_Sums`)."""

    __slots__ = ("_grads", "_weights", "scalars", "step")

    def __init__(
        self,
        step: int,
        scalars: dict[str, float],
        grads: _Sums | dict[str, float],
        weights: _Sums | dict[str, float],
    ) -> None:
        self.step, self.scalars = step, scalars
        self._grads, self._weights = _Sums.made(grads), _Sums.made(weights)

    @property
    def grads(self) -> dict[str, float]:
        return self._grads.get()

    @property
    def weights(self) -> dict[str, float]:
        return self._weights.get()


class SpikeWatch:
    """The rolling window and the ``loss_spike`` rule.

    Per step (:meth:`observe`): the loss, ``grad_norm`` when the script clips, the learning
    rates, and per parameter group the L2 norm of its gradients (read from the non-finite
    check's per-parameter flags, :meth:`flags` says which) and of its weights (measured by
    :meth:`weights` before the update). A spike is a loss above the range of the
    ``spike_window`` losses before it (:class:`Rolling`: ``spike_k`` noise units and at least
    ``spike_rel`` above their median, or ``spike_jump`` x the last few) after
    ``spike_min_history`` steps, whose rise over the loss's trend clears the run's heavy tail
    (:class:`LossTail`, :meth:`_over_tail`), or a rise over the trend far beyond both the tail
    and the rises' robust width; only the first step of a run of spiking steps is reported.
    The loss is a host float (the step's one transfer brought it): no device work here.
    """

    def __init__(self, params: dict[str, torch.nn.Parameter], thresholds: Thresholds) -> None:
        self.group = {p: group_of(p) for p in params}
        self._weights = WeightNorms(params)
        self.n = thresholds.spike_window
        self.lead_max = thresholds.spike_lead
        t = thresholds
        self.loss_rule = Rolling(
            t.spike_k,
            t.spike_rel,
            t.spike_min_history,
            jump=t.spike_jump,
            jump_k=t.spike_jump_k,
            recent=t.spike_recent,
        )
        self.tail = LossTail(t.spike_window, t.spike_tail_halflife)
        self.tail_k, self.k, self.rel = t.spike_tail, t.spike_k, t.spike_rel
        self._rows: deque[_Row] = deque(maxlen=self.n + self.lead_max + 1)
        self._losses: deque[float] = deque(maxlen=self.n)
        # this step's readings of gradient norms: (first flag, its parameters' groups)
        self._blocks: list[tuple[int, _Grouping]] = []
        self._grouping: dict[tuple[str, ...], _Grouping] = {}
        self._read: tuple[_Sums, float | None] | None = None  # ``_gradients``
        self._spiking = False

    def flags(self, start: int, params: Sequence[str]) -> None:
        """The non-finite flags from ``start`` on hold the L2 gradient norms of ``params``,
        one each (a gradient read again, by a closure optimizer after its closure, replaces
        the earlier reading)."""
        self._blocks.append((start, self._grouped(params)))
        self._read = None

    def _grouped(self, params: Sequence[str]) -> _Grouping:
        """The parameters among ``params`` that have a group, cached per list of names (an
        optimizer reads the same ones every step)."""
        names = tuple(params)
        found = self._grouping.get(names)
        if found is None:
            group = self.group
            rows = tuple((i, p, group[p]) for i, p in enumerate(names) if p in group)
            found = _Grouping(rows, tuple((i, g) for i, _, g in rows), [i for i, _, _ in rows])
            if len(self._grouping) > 64:
                self._grouping.clear()
            self._grouping[names] = found
        return found

    def _gradients(self, host: Host) -> tuple[_Sums, float | None]:
        """Per group, the L2 norm of its gradients read this step (summed when a spike asks,
        :class:`_Sums`), and the sum of squares over all (``None`` when no gradient was
        read); asked once a step."""
        if self._read is not None:
            return self._read
        blocks = self._blocks
        total = 0.0
        whole = host.get(("block", "flag", blocks[0][0])) if len(blocks) == 1 else None
        if whole is not None:  # the one reading, moved as one list (``StepBuffer``)
            grouping = blocks[0][1]
            for i in grouping.positions:
                total += whole[i] ** 2
            read = _Sums([(whole, grouping.pairs)], square=True)
            self._read = (read, total if grouping.positions else None)
            return self._read
        if len(blocks) > 1:  # read again: the last reading of each parameter counts
            last = {p: (start + i, g) for start, grouped in blocks for i, p, g in grouped.rows}
            rows = [(index, g) for index, g in last.values()]
        else:
            rows = [(start + i, g) for start, grouped in blocks for i, _, g in grouped.rows]
        values: list[float] = []
        pairs: list[tuple[int, str]] = []
        for index, group in rows:
            value = host.get(("flag", index))
            if value is not None:
                pairs.append((len(values), group))
                values.append(value[0])
                total += value[0] ** 2
        self._read = (_Sums([(values, pairs)], square=True), total if values else None)
        return self._read

    def weights(self, buf: StepBuffer) -> None:
        """Before an update: measure the weights the step's forward used."""
        self._weights.measure(buf)

    def total(self, host: Host) -> float | None:
        """The L2 norm of every gradient read this step (``None`` when none was)."""
        total = self._gradients(host)[1]
        return None if total is None else math.sqrt(total)

    def observe(self, step: int, scalars: dict[str, float], host: Host) -> Spike | None:
        """Add one step to the window; the spike that starts at it, if any."""
        grads = self._gradients(host)[0]
        self._blocks, self._read = [], None
        loss = scalars.get("loss")
        verdict = None if loss is None else self._judge(loss)
        self._rows.append(_Row(step, dict(scalars), grads, self._weights.read_later(host)))
        if loss is not None:
            self._losses.append(loss)
        spiking = verdict is not None
        started, self._spiking = spiking and not self._spiking, spiking
        return self._spike(step, loss, verdict) if started else None

    def _judge(self, loss: float) -> _Verdict | None:
        """Whether ``loss`` spikes, and by which rule; its rise goes to the tail either way,
        a spike's no larger than the tail it rose above (a spike is not the run's own noise:
        one, or a loss that stays high for a while, does not hide the next for hundreds of
        steps)."""
        tail = self.tail
        level = tail.trend()
        rise = loss - level if level is not None and loss > 0 and math.isfinite(loss) else None
        if rise is None or len(tail.rises) < TAIL_READY:  # too early for the tail
            verdict = None
            if not self._calm(loss):
                parts = self.loss_rule.parts(self._losses, loss)
                if parts is not None and max(p for p in parts if p is not None) > 1.0:
                    ranged, jumped = parts
                    how = "range" if ranged > 1.0 else "jump"
                    verdict = _Verdict(how, max(ranged, jumped or 0.0), level, rise, None)
            tail.add(loss, rise)
            return verdict
        top = tail.largest()
        verdict = None
        if rise >= min(TAIL_RANGE, self.tail_k) * top:  # else surely within the tail
            verdict = self._over_tail(loss, rise, level, top)
        tail.add(loss, rise if verdict is None else min(rise, top))
        return verdict

    def _over_tail(self, loss: float, rise: float, level: float, top: float) -> _Verdict | None:
        """A rise at least ``TAIL_RANGE`` x the largest of the run's recent ones that is
        above the long median's range, or ``spike_tail`` x it that jumps over the last
        losses (:class:`Rolling`) or stands ``spike_k`` robust widths above the trend."""
        parts = self.loss_rule.parts(self._losses, loss)
        ranged, jumped = parts if parts is not None else (None, None)
        if ranged is not None and ranged > 1.0 and rise >= TAIL_RANGE * top:
            return _Verdict("range", ranged, level, rise, top)
        if rise < self.tail_k * top:
            return None
        if jumped is not None and jumped > 1.0:
            return _Verdict("jump", jumped, level, rise, top)
        rises = len(self.tail.rises)
        if rises >= TREND_EARLY and loss >= (1.0 + self.rel) * level:
            # fewer rises: their largest may not be the run's yet, the bar is higher
            early = 1.0 if rises >= TREND_HISTORY else EARLY_BAR
            bar = max(self.k * self.tail.width(), early * self.tail_k * top, 1e-12)
            if rise >= bar:
                return _Verdict("trend", rise / bar, level, rise, top)
        return None

    def _calm(self, loss: float) -> bool:
        """Whether ``loss`` is surely in range, by bounds cheaper than the rule's score (a
        sort, no logarithms): at most ``1 + spike_rel`` times the lower middle of the
        window's losses and at most ``spike_jump`` times the median of the recent ones,
        with a margin for rounding. Where it cannot tell, the rule decides."""
        rule = self.loss_rule
        past = [v for v in self._losses if math.isfinite(v)]
        if len(past) < rule.min_history or not math.isfinite(loss) or loss <= 0:
            return len(past) < rule.min_history  # too little history: no score at all
        ordered = sorted(past)
        if ordered[0] <= 0:
            return False
        low_middle = ordered[(len(ordered) - 1) // 2]
        if loss > low_middle * (1.0 + rule.rel) * (1.0 - 1e-9):
            return False
        if rule.jump is None:
            return True
        if rule.jump <= 1.0:
            return False
        recent = sorted(past[-rule.recent :])
        return loss <= recent[(len(recent) - 1) // 2] * rule.jump * (1.0 - 1e-9)

    def _spike(self, step: int, loss: float, verdict: _Verdict) -> Spike:
        score = verdict.score
        rows = list(self._rows)
        before = [v for v in list(self._losses)[:-1] if math.isfinite(v)]
        median = _median(before)
        rose = _lr_change(rows)
        lead = self._leader(rows, weights=not rose)
        if lead is None:
            module, where = "", "no parameter group's gradient norm left its own range first"
        else:
            module, at, what = lead
            if what == "weight norm":
                where = f"the weights of {module!r} changed out of their own rolling range first, "
                where += _weight_change(rows, module, at, step)
            else:
                when = (
                    f"{_steps(step - at)} before the loss (at step {at})"
                    if at < step
                    else "at the same step (the batch itself, or the update just before it)"
                )
                where = f"the {what} of {module!r} left its own rolling range first, {when}"
        if verdict.how == "range":
            against = (
                f"above its rolling range (median {median:.4g} of the last {len(before)} steps"
            )
        else:  # over the last losses or the trend: a run still falling fast, or a noisy one
            recent = _median(before[-self.loss_rule.recent :])
            against = (
                f"{loss / recent:.3g}x the median of the {min(len(before), self.loss_rule.recent)}"
                f" losses before it ({recent:.4g})"
            )
            if verdict.level is not None:
                against += f", {loss / verdict.level:.3g}x its trend ({verdict.level:.4g})"
            if verdict.top:
                against += (
                    f", a rise {verdict.rise / verdict.top:.3g}x the largest of its recent "
                    "batches over their trend"
                )
            against += f" (median {median:.4g} of the last {len(before)} steps"
        message = (
            f"the loss jumped to {loss:.4g}, {against}; {score:.1f}x the allowed excess) at "
            f"step {step}; {where}{rose}"
        )
        finding = Finding("loss_spike", module, step, loss, message)
        return Spike(finding, self._window(step, rows))

    def _leader(self, rows: list[_Row], *, weights: bool) -> tuple[str, int, str] | None:
        """The group whose gradient norm, or the change of whose weight norm, left its own
        range first in the ``spike_lead`` steps up to the spike (the largest excess breaks
        ties): ``(group, that step, which)``. Only a departure that lasts into the spike
        counts, or that ended at most ``LEAD_GAP`` steps before it (a block whose update blew
        up may go quiet after): its lead runs from the first step of its run of
        out-of-range steps. An excursion long gone (a fast-falling run's early steps, its
        norms drifting out of their range and back) leads nothing. Weights are left out
        when a learning rate rose (every group's weights then change at once)."""
        best: tuple[int, float, str, str] | None = None
        last = len(rows) - 1
        for what, series in self._series(rows, weights=weights):
            for group, values in series.items():
                run: list[tuple[int, float]] = []  # (row, score) of the latest run
                for i in range(max(0, last - self.lead_max), last + 1):
                    score = self.loss_rule.score(values[max(0, i - self.n) : i], values[i])
                    if score is not None and score > 1.0:
                        run = [*run, (i, score)] if run and run[-1][0] == i - 1 else [(i, score)]
                if not run or last - run[-1][0] > LEAD_GAP:
                    continue
                i, score = run[0]
                if best is None or (rows[i].step, -score) < best[:2]:
                    best = (rows[i].step, -score, group, what)
        return None if best is None else (best[2], best[0], best[3])

    @staticmethod
    def _series(rows: list[_Row], *, weights: bool):
        groups = sorted({g for row in rows for g in row.grads})
        yield "gradient norm", {g: [row.grads.get(g, math.nan) for row in rows] for g in groups}
        if weights:
            groups = sorted({g for row in rows for g in row.weights})
            yield (
                "weight norm",
                {g: _changes([r.weights.get(g, math.nan) for r in rows]) for g in groups},
            )

    def _window(self, step: int, rows: list[_Row]) -> Window:
        rows = rows[-(self.lead_max + 1) :]
        keys = sorted({k for r in rows for k in r.scalars})
        groups = sorted({g for r in rows for g in r.grads})
        weights = sorted({g for r in rows for g in r.weights})
        return Window(
            step=step,
            kind="loss_spike",
            steps=[r.step for r in rows],
            scalars={k: [r.scalars.get(k, math.nan) for r in rows] for k in keys},
            groups={g: [r.grads.get(g, math.nan) for r in rows] for g in groups},
            weights={g: [r.weights.get(g, math.nan) for r in rows] for g in weights},
        )


class SkipList:
    """The batches of spiking steps, for a trainer to skip when it resumes from a checkpoint
    before the spike (as large runs do: rewind a few hundred steps, skip the batches that
    spiked).

    A JSON file, rewritten whole at each spike (write to a temporary file, then rename: a
    reader never sees half of it): ``{"steps": [...], "samples": [...], "spikes": [{"step",
    "loss", "samples"}]}``; ``steps`` are the spiking steps (the batch positions in a
    deterministic data order), ``samples`` the data-set indices the script gave
    ``Monitor.step(batch_indices=...)`` for those steps. Under several ranks, each rank keeps
    its own file (``skip.rank1.json``): their batches differ.
    """

    def __init__(self, path: str | Path, rank: int = 0, world: int = 1) -> None:
        path = Path(path)
        if world > 1:
            path = path.with_name(f"{path.stem}.rank{rank}{path.suffix}")
        if path.exists() and path.is_dir():
            raise ValueError(
                f"skip_list={str(path)!r} is a directory.\nFix: pass a file path for the "
                "skip list, e.g. skip_list='runs/exp1/skip.json'."
            )
        self.path = path
        self.spikes: list[dict] = []
        if path.exists():  # a resumed run adds to the list it was started with
            self.spikes = json.loads(path.read_text()).get("spikes", [])

    def add(self, step: int, loss: float, samples: list[int] | None) -> None:
        self.spikes.append({"step": step, "loss": loss, "samples": samples or []})
        content = {
            "steps": sorted({s["step"] for s in self.spikes}),
            "samples": sorted({i for s in self.spikes for i in s["samples"]}),
            "spikes": self.spikes,
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(content, indent=1))
        os.replace(tmp, self.path)


def _changes(norms: list[float]) -> list[float]:
    """How much a norm changed from each step to the next, as ``|log(after / before)|``
    (NaN where either is missing or zero): the update's size relative to the weights."""
    out = [math.nan]
    for a, b in itertools.pairwise(norms):
        ok = a > 0 and b > 0 and math.isfinite(a) and math.isfinite(b)
        out.append(abs(math.log(b / a)) if ok else math.nan)
    return out


def _weight_change(rows: list[_Row], group: str, at: int, step: int) -> str:
    """When and by how much the leader's weights changed, and what does that."""
    i = [r.step for r in rows].index(at)
    a, b = rows[i - 1].weights[group], rows[i].weights[group]
    when = "before this step's forward" if at == step else f"{_steps(step - at)} before the loss"
    return (
        f"{when}: the L1 norm of its weights went from {a:.4g} (step {rows[i - 1].step}) to "
        f"{b:.4g} (step {at}), x{b / a:.3g} (weights scaled or replaced outside the optimizer, "
        "or an update that blew up, e.g. Adam's epsilon too small for tiny gradients)"
    )


def _steps(n: int) -> str:
    return f"{n} step" if n == 1 else f"{n} steps"


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _lr_change(rows: list[_Row]) -> str:
    """``"; the learning rate rose ..."`` when one rose over the window (a schedule's jump)."""
    first, last = rows[0].scalars, rows[-1].scalars
    for key in sorted(last):
        rose = key in first and last[key] > first[key] * 1.5
        if (key == "lr" or key.startswith("lr/")) and rose:
            return f"; the learning rate {key} rose from {first[key]:.3g} to {last[key]:.3g}"
    return ""
