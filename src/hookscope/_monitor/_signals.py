"""Large-model training signals: a rolling window of cheap per-step scalars, and loss spikes.

On every step the Monitor already reads, for its non-finite check, the L1 norm of every
parameter's gradient just before the update (one fused ``_foreach_norm``, moved to the host
with the step's one transfer). :class:`SpikeWatch` reuses those numbers: it sums them per
parameter group (:func:`group_of`: one transformer block, one embedding, ...) and keeps the
last steps' loss, total gradient norm and group norms on the host: no kernel and no transfer
of its own, a few microseconds of Python per step.

A loss spike is judged with robust rolling statistics of the last ``spike_window`` losses
(:class:`Rolling`: their median, and the MAD of their step-to-step changes); when one starts, the group whose gradient norm left its own rolling
range first is named, with its lead in steps, and the window is handed back to be logged.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .._diagnose import Finding, Thresholds
from .._log import Window
from ._buffer import Host

__all__ = ["Rolling", "Spike", "SpikeWatch", "group_of"]

# MAD x 1.4826 estimates the standard deviation of normal data.
MAD_TO_STD = 1.4826


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

    def __init__(self, k: float, rel: float, min_history: int) -> None:
        self.k, self.rel, self.min_history = k, rel, min_history

    def score(self, history: Iterable[float], value: float) -> float | None:
        """How far ``value`` lies above the median of ``history``, in units of the allowed
        excess ``max(k * noise, rel * |median|)`` (in logarithms: ``log(1 + rel)``), where
        ``noise = 1.4826 * MAD(changes) / sqrt(2)`` estimates the standard deviation of
        normal noise; above 1: out of range; ``None`` with too little finite history."""
        past = [v for v in history if math.isfinite(v)]
        if len(past) < self.min_history or not math.isfinite(value):
            return None
        if value > 0 and min(past) > 0:
            past, value = [math.log(v) for v in past], math.log(value)
            floor = math.log1p(self.rel)
        else:
            floor = None
        median = _median(past)  # plain Python: on 50 numbers, 20x faster than numpy's
        changes = [b - a for a, b in itertools.pairwise(past)]
        middle = _median(changes)
        noise = MAD_TO_STD * _median([abs(c - middle) for c in changes]) / math.sqrt(2)
        floor = self.rel * abs(median) if floor is None else floor
        return (value - median) / max(self.k * noise, floor, 1e-12)


@dataclass(frozen=True)
class Spike:
    """A loss spike: its finding and the window of steps around it, for the log."""

    finding: Finding
    window: Window


class SpikeWatch:
    """The rolling window and the ``loss_spike`` rule.

    Per step (:meth:`observe`): the loss, ``grad_norm`` when the script clips, the learning
    rates, and per parameter group the L1 norm of its gradients (read from the non-finite
    check's per-parameter flags, :meth:`flags` says which). A spike is a loss above the
    range of the ``spike_window`` losses before it (:class:`Rolling`: ``spike_k`` noise
    units and at least ``spike_rel`` above their median) after ``spike_min_history`` steps; only
    the first step of a run of spiking steps is reported.
    """

    def __init__(self, params: Sequence[str], thresholds: Thresholds) -> None:
        self.group = {p: group_of(p) for p in params}
        self.n = thresholds.spike_window
        self.lead_max = thresholds.spike_lead
        self.rule = Rolling(thresholds.spike_k, thresholds.spike_rel, thresholds.spike_min_history)
        self._rows: deque[tuple[int, dict[str, float], dict[str, float]]] = deque(
            maxlen=self.n + self.lead_max + 1
        )
        self._losses: deque[float] = deque(maxlen=self.n)
        self._flags: list[tuple[int, str]] = []  # (flag index, group) of this step
        self._spiking = False

    def flags(self, start: int, stop: int, params: Sequence[str | None]) -> None:
        """The non-finite flags ``start:stop`` hold the L1 gradient norms of ``params``."""
        for index, param in zip(range(start, stop), params, strict=True):
            if param in self.group:
                self._flags.append((index, self.group[param]))

    def observe(self, step: int, scalars: dict[str, float], host: Host) -> Spike | None:
        """Add one step to the window; the spike that starts at it, if any."""
        norms: dict[str, float] = {}
        for index, group in self._flags:
            value = host.get(("flag", index))
            if value is not None:
                norms[group] = norms.get(group, 0.0) + value[0]
        self._flags = []
        loss = scalars.get("loss")
        score = None if loss is None else self.rule.score(self._losses, loss)
        self._rows.append((step, dict(scalars), norms))
        if loss is not None:
            self._losses.append(loss)
        spiking = score is not None and score > 1.0
        started, self._spiking = spiking and not self._spiking, spiking
        return self._spike(step, loss, score) if started else None

    def _spike(self, step: int, loss: float, score: float) -> Spike:
        lead = self._leader()
        rows = list(self._rows)
        before = [v for v in list(self._losses)[:-1] if math.isfinite(v)]
        median = _median(before)
        if lead is None:
            module, where = "", "no parameter group's gradient norm left its own range first"
        else:
            module, at = lead
            when = (
                f"{_steps(step - at)} before the loss (at step {at})"
                if at < step
                else ("at the same step (the batch itself, or the update just before it)")
            )
            where = f"the gradient norm of {module!r} left its own rolling range first, {when}"
        message = (
            f"the loss jumped to {loss:.4g}, above its rolling range (median {median:.4g} of "
            f"the last {len(before)} steps; {score:.1f}x the allowed excess) at step {step}; "
            f"{where}{_lr_change(rows)}"
        )
        finding = Finding("loss_spike", module, step, loss, message)
        return Spike(finding, self._window(step, rows))

    def _leader(self) -> tuple[str, int] | None:
        """The group whose gradient norm first left its own range in the ``spike_lead``
        steps up to the spike (the largest excess breaks ties): ``(group, that step)``.
        A group need not stay out of range: a block whose update blew up may go quiet after."""
        rows = list(self._rows)
        best: tuple[int, float, str] | None = None
        for group in sorted({g for row in rows for g in row[2]}):
            values = [row[2].get(group, math.nan) for row in rows]
            for i in range(max(0, len(rows) - 1 - self.lead_max), len(rows)):
                score = self.rule.score(values[max(0, i - self.n) : i], values[i])
                if score is not None and score > 1.0:
                    if best is None or (rows[i][0], -score) < best[:2]:
                        best = (rows[i][0], -score, group)
                    break
        return None if best is None else (best[2], best[0])

    def _window(self, step: int, rows: list) -> Window:
        rows = rows[-(self.lead_max + 1) :]
        keys = sorted({k for r in rows for k in r[1]})
        groups = sorted({g for r in rows for g in r[2]})
        return Window(
            step=step,
            kind="loss_spike",
            steps=[r[0] for r in rows],
            scalars={k: [r[1].get(k, math.nan) for r in rows] for k in keys},
            groups={g: [r[2].get(g, math.nan) for r in rows] for g in groups},
        )


def _steps(n: int) -> str:
    return f"{n} step" if n == 1 else f"{n} steps"


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _lr_change(rows: list) -> str:
    """``"; the learning rate rose ..."`` when one rose over the window (a schedule's jump)."""
    first, last = rows[0][1], rows[-1][1]
    for key in sorted(last):
        rose = key in first and last[key] > first[key] * 1.5
        if (key == "lr" or key.startswith("lr/")) and rose:
            return f"; the learning rate {key} rose from {first[key]:.3g} to {last[key]:.3g}"
    return ""
