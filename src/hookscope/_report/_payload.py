"""The data a report's charts draw, as compact JSON: nothing here knows HTML or JavaScript.

A chart cannot show more points than it has pixels, so long series are decimated before
they are written: each pixel column (a bucket of consecutive steps) keeps its smallest and
its largest value, in the order they came, so a spike or a dip survives at any zoom-out.
Every module of a run shares the same buckets, so a run's step axis is written once.
Heatmaps are written as one byte per cell (base64): a quantized log10 or a share of counts.
"""

from __future__ import annotations

import base64
import json
import math
from typing import Any

import numpy as np

from ._data import Run

__all__ = ["LINE_STATS", "dump", "payload"]

LINE_BUCKETS = 320  # pixel columns of a small-multiple panel: 2 points each
CURVE_BUCKETS = 900  # pixel columns of a training-curve panel
HEAT_COLUMNS = 600  # columns of a layers x steps heatmap
HIST_COLUMNS = 200  # columns of a histogram-over-steps view
HIST_BINS = 32
MAP_CHANNELS = 32  # feature-map channels drawn per record

# (group, statistic, log axis): the per-module small multiples, in page order.
LINE_STATS = (
    ("act", "mean", False),
    ("act", "std", False),
    ("act", "zero_frac", False),
    ("grad", "norm", True),
    ("act", "kurtosis", True),  # 3 for normal values; outliers drive it to 100s
    ("act", "absmax_over_rms", True),  # massive activations: >= thresholds.massive (100)
    ("attn", "logit_max", False),  # the largest pre-softmax attention logit
)
EVAL_MODULES = 12  # modules drawn on the evaluation chart (all are in its table)


class Raw(str):
    """JSON text to be written as is (numeric arrays formatted once, compactly)."""


def payload(runs: list[Run]) -> dict[str, Any]:
    """Everything the page's script draws, for one run or several overlaid; ``steps``: the
    step range every chart on the shared step axis spans (each run's steps, evaluation
    passes and findings included: an evaluation logged after the last training step is on
    the axis, not clipped at its edge)."""
    return {"runs": [_run(run) for run in runs], "steps": _domain(runs)}


def _domain(runs: list[Run]) -> list[int]:
    steps = [int(s["step"]) for run in runs for s in run.steps[:1] + run.steps[-1:]]
    steps += [int(e.get("step") or 0) for run in runs for e in run.evals]
    steps += [int(f["step"]) for run in runs for f in run.findings if _is_int(f.get("step"))]
    return [min(steps), max(steps)] if steps else [0, 0]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _run(run: Run) -> dict[str, Any]:
    order = run.order()
    sampled = [
        s
        for s in run.sampled
        if s.get("act") or s.get("grad") or s.get("param") or s.get("attn") or s.get("precision")
    ]
    steps = np.array([s["step"] for s in sampled], dtype=np.int64)
    groups = _matrices(sampled, order)
    cuts = _buckets(len(steps), LINE_BUCKETS)
    lines = {}
    for group, key, log in LINE_STATS:
        m = groups.get(group, {}).get(key)
        if m is not None and _any_value(m, log):  # no attention logit on a CNN: no series
            lines[f"{group}.{key}"] = _series(m, cuts, log)
    params, ratio = _ratios(run, sampled)
    nan = run.nan_start()
    return {
        "label": run.label,
        "modules": order,
        "types": {name: str(t) for name, t in (run.header.get("modules") or {}).items()},
        "x": _ints(_bucket_x(steps, cuts)),
        "lines": lines,
        "ratio": {"names": params, "y": _series(ratio, cuts, True)},
        "curves": _curves(run),
        "heat": _heat(groups.get("grad", {}).get("norm"), steps, order),
        "hists": _hists(run, order),
        "findings": _findings(run),
        "events": [{"step": e.get("step"), "kind": e.get("kind")} for e in run.events],
        "nan": nan,
        "maps": [_feature_map(r) for r in run.feature_maps],
        "windows": [_window(w) for w in run.windows],
        "evals": _evals(run, order),
        "precision": _precision(sampled, order, cuts),
        "first": int(run.steps[0]["step"]) if run.steps else 0,
        "last": int(run.steps[-1]["step"]) if run.steps else 0,
    }


def _matrices(sampled: list[dict[str, Any]], order: list[str]) -> dict[str, dict[str, Any]]:
    """``{group: {stat: array [module, sampled step]}}`` for the line statistics, NaN where a
    module has no value at a step; one pass over the records."""
    row = {name: i for i, name in enumerate(order)}
    wanted: dict[str, list[str]] = {}
    for group, key, _ in LINE_STATS:
        wanted.setdefault(group, []).append(key)
    out = {
        g: {k: np.full((len(order), len(sampled)), np.nan) for k in keys}
        for g, keys in wanted.items()
    }
    for j, s in enumerate(sampled):
        for group, keys in wanted.items():
            for name, stats in (s.get(group) or {}).items():
                i = row.get(name)
                if i is None:
                    continue
                for k in keys:
                    v = stats.get(k)
                    if isinstance(v, (int, float)):
                        out[group][k][i, j] = v
    return out


def _precision(sampled: list[dict[str, Any]], order: list[str], cuts: Any) -> dict[str, Any]:
    """``{side: {"bf16 underflow": [row per module], ...}}`` for ``Monitor(precision=...)``:
    the fraction of a module's output (``act``) or output gradient (``grad``) values that
    each dtype would lose; a series only where some value is not zero."""
    row = {name: i for i, name in enumerate(order)}
    found: dict[str, dict[str, Any]] = {}
    for j, s in enumerate(sampled):
        for name, sides in (s.get("precision") or {}).items():
            i = row.get(name)
            for side, stats in sides.items() if i is not None else ():
                for kind in ("underflow", "overflow"):
                    for dtype, value in (stats.get(kind) or {}).items():
                        key = f"{dtype} {kind}"
                        m = found.setdefault(side, {}).get(key)
                        if m is None:
                            m = found[side][key] = np.full((len(order), len(sampled)), np.nan)
                        m[i, j] = value
    return {
        side: {key: _series(m, cuts, False) for key, m in series.items() if np.any(m > 0)}
        for side, series in found.items()
    }


def _any_value(m: Any, log: bool) -> bool:
    """Whether a statistic has a value to draw: a finite one (a positive one on a log axis)."""
    return bool(np.any(m > 0) if log else np.isfinite(m).any())


def _ratios(run: Run, sampled: list[dict[str, Any]]) -> tuple[list[str], Any]:
    shapes = run.header.get("params") or {}
    names: list[str] = []
    for s in sampled:
        names += [
            n
            for n, p in (s.get("param") or {}).items()
            if "update_ratio" in p and n not in names and len(shapes.get(n, [0, 0])) >= 2
        ]
    m = np.full((len(names), len(sampled)), np.nan)
    col = {n: i for i, n in enumerate(names)}
    for j, s in enumerate(sampled):
        for n, p in (s.get("param") or {}).items():
            if n in col and isinstance(p.get("update_ratio"), (int, float)):
                m[col[n], j] = p["update_ratio"]
    return names, m


# -- decimation -------------------------------------------------------------------------------


def _buckets(n: int, buckets: int) -> Any:
    """Bucket boundaries over ``n`` points; ``None`` when every point fits."""
    if n <= 2 * buckets:
        return None
    return np.linspace(0, n, buckets + 1).astype(np.int64)


def _bucket_x(steps: Any, cuts: Any) -> Any:
    """The step axis of decimated series: each bucket's first and last step."""
    if cuts is None:
        return steps
    out = np.empty(2 * (len(cuts) - 1), dtype=np.int64)
    out[0::2] = steps[cuts[:-1]]
    out[1::2] = steps[cuts[1:] - 1]
    return out


def decimate(rows: Any, cuts: Any) -> Any:
    """Per bucket of each row, its smallest and largest finite value in the order they
    came (NaN when a bucket holds none): the shape of the line at pixel resolution, spikes
    kept. Vectorized over rows and buckets: ``reduceat`` finds each bucket's extremes, and
    the first column holding each extreme decides which is drawn first."""
    rows = np.atleast_2d(np.asarray(rows, dtype=float))
    if cuts is None:
        return rows
    starts, n = cuts[:-1], rows.shape[1]
    finite = np.isfinite(rows)
    low, high = np.where(finite, rows, np.inf), np.where(finite, rows, -np.inf)
    mn = np.minimum.reduceat(low, starts, axis=1)
    mx = np.maximum.reduceat(high, starts, axis=1)
    bucket = np.repeat(np.arange(len(starts)), np.diff(cuts))
    cols = np.broadcast_to(np.arange(n), rows.shape)
    at_mn = np.minimum.reduceat(np.where(low == mn[:, bucket], cols, n), starts, axis=1)
    at_mx = np.minimum.reduceat(np.where(high == mx[:, bucket], cols, n), starts, axis=1)
    min_first = at_mn <= at_mx
    out = np.empty((len(rows), 2 * len(starts)))
    out[:, 0::2] = np.where(min_first, mn, mx)
    out[:, 1::2] = np.where(min_first, mx, mn)
    out[~np.isfinite(out)] = np.nan
    return out


def _series(rows: Any, cuts: Any, log: bool) -> list[Raw]:
    """Each row (a module's values at the sampled steps) decimated and encoded."""
    rows = np.atleast_2d(np.asarray(rows, dtype=float))
    if not rows.size:
        return []
    if log:
        rows = np.where(rows > 0, rows, np.nan)  # a log axis cannot place 0
    return [_floats(r) for r in decimate(rows, cuts)]


def _curves(run: Run) -> dict[str, Any]:
    """Scalars over every step (loss, lr, grad_norm, ...), decimated together."""
    names: list[str] = []
    for s in run.steps:
        names += [n for n in s.get("scalars") or {} if n not in names]
    if not names:
        return {"x": Raw("[]"), "series": {}}
    steps = np.array([s["step"] for s in run.steps], dtype=np.int64)
    m = np.full((len(names), len(steps)), np.nan)
    col = {n: i for i, n in enumerate(names)}
    for j, s in enumerate(run.steps):
        for n, v in (s.get("scalars") or {}).items():
            if isinstance(v, (int, float)):
                m[col[n], j] = v
    cuts = _buckets(len(steps), CURVE_BUCKETS)
    return {
        "x": _ints(_bucket_x(steps, cuts)),
        "series": dict(zip(names, [_floats(r) for r in decimate(m, cuts)], strict=True)),
    }


# -- heatmaps ---------------------------------------------------------------------------------


def _heat(norms: Any, steps: Any, order: list[str]) -> dict[str, Any] | None:
    """Layers x steps of log10 ‖grad‖, one byte a cell (255: no value); a column holds the
    largest value of the steps it covers."""
    if norms is None or not steps.size:
        return None
    with np.errstate(divide="ignore", invalid="ignore"):
        logs = np.where(norms > 0, np.log10(norms), np.nan)
    keep = ~np.isnan(logs).all(axis=1)
    if not keep.any():
        return None
    logs = logs[keep]
    cols = min(len(steps), HEAT_COLUMNS)
    cuts = np.linspace(0, len(steps), cols + 1).astype(np.int64)
    grid = np.fmax.reduceat(logs, cuts[:-1], axis=1)  # fmax: NaN only where all are
    lo, hi = _finite_range(grid)  # an infinite norm takes the top colour
    return {
        "modules": [n for n, k in zip(order, keep, strict=True) if k],
        "steps": _ints(steps[cuts[:-1]]),
        "end": int(steps[-1]),
        "lo": lo,
        "hi": hi,
        "cells": _bytes(grid, lo, hi),
    }


def _hists(run: Run, order: list[str]) -> list[dict[str, Any]]:
    """Per module, value (rows) x step (columns): the share of each value bin, rebinned
    onto one value range so that a drifting distribution shows as a drifting band."""
    entries: dict[str, list[tuple[int, float, float, list[float]]]] = {}
    for s in run.sampled:
        for name, stats in (s.get("act") or {}).items():
            h = stats.get("hist")
            if h and h.get("counts"):
                entries.setdefault(name, []).append(
                    (s["step"], _f(h.get("lo")), _f(h.get("hi")), h["counts"])
                )
    rank = {n: i for i, n in enumerate(order)}
    out = []
    for name in sorted(entries, key=lambda n: rank.get(n, len(rank))):
        view = _hist_grid(entries[name])
        if view is not None:
            out.append({"module": name, **view})
    return out


def _hist_grid(entries: list[tuple[int, float, float, list[float]]]) -> dict[str, Any] | None:
    usable = [e for e in entries if math.isfinite(e[1]) and math.isfinite(e[2]) and e[2] > e[1]]
    if not usable:
        return None
    width = max(len(e[3]) for e in usable)
    usable = [e for e in usable if len(e[3]) == width]
    lo = np.array([e[1] for e in usable])
    hi = np.array([e[2] for e in usable])
    counts = np.nan_to_num(np.array([e[3] for e in usable], dtype=float))
    glo, ghi = float(lo.min()), float(hi.max())
    centers = lo[:, None] + (np.arange(width) + 0.5)[None, :] * ((hi - lo) / width)[:, None]
    rows = np.clip(((centers - glo) / (ghi - glo) * HIST_BINS).astype(np.int64), 0, HIST_BINS - 1)
    cols = min(len(usable), HIST_COLUMNS)
    col_of = (np.arange(len(usable)) * cols) // len(usable)
    grid = np.zeros((HIST_BINS, cols))
    np.add.at(grid, (rows, np.broadcast_to(col_of[:, None], rows.shape)), counts)
    total = grid.sum(axis=0, keepdims=True)
    share = np.divide(grid, total, out=np.zeros_like(grid), where=total > 0)
    steps = np.array([e[0] for e in usable])
    first = np.searchsorted(col_of, np.arange(cols))
    return {
        "steps": _ints(steps[first]),
        "end": int(steps[-1]),
        "lo": glo,
        "hi": ghi,
        "bins": HIST_BINS,
        "cells": _bytes(np.sqrt(share), 0.0, float(np.sqrt(share).max()) or 1.0),
    }


def _feature_map(record: dict[str, Any]) -> dict[str, Any]:
    data = np.asarray(record.get("data") or [], dtype=float)
    if data.ndim == 2:
        data = data[None]
    if data.ndim != 3 or not data.size:
        return {"module": record.get("module", ""), "step": record.get("step"), "shape": []}
    shown = data[:MAP_CHANNELS]
    out = []
    for channel in shown:  # each channel on its own range, as the eye compares shapes
        finite = channel[np.isfinite(channel)]
        lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
        out.append(_bytes(channel, lo, hi if hi > lo else lo + 1))
    return {
        "module": record.get("module", ""),
        "step": record.get("step"),
        "shape": list(data.shape),
        "channels": out,
    }


# -- findings ---------------------------------------------------------------------------------


def _findings(run: Run) -> list[dict[str, Any]]:
    current, cleared = run.split_findings()
    keys = ("kind", "module", "step", "cleared_at", "message")
    events = [{**f, "event": True} for f in run.event_findings()]
    return [
        {k: f.get(k) for k in (*keys, "event")}
        for f in sorted([*current, *cleared, *events], key=_at)
    ]


# -- signals: loss-spike windows and evaluation passes ----------------------------------------


def _window(record: dict[str, Any]) -> dict[str, Any]:
    """The steps around a loss spike as the Monitor kept them: the step scalars and each
    parameter group's gradient L2 norm and weight-sample L1 norm (a few dozen points:
    nothing to decimate)."""
    steps = np.asarray(record.get("steps") or [], dtype=np.int64)
    return {
        "step": record.get("step"),
        "kind": record.get("kind"),
        "x": _ints(steps),
        "scalars": {n: _floats(np.asarray(v, dtype=float)) for n, v in _rows(record, "scalars")},
        "groups": {n: _floats(np.asarray(v, dtype=float)) for n, v in _rows(record, "groups")},
        "weights": {n: _floats(np.asarray(v, dtype=float)) for n, v in _rows(record, "weights")},
    }


def _rows(record: dict[str, Any], key: str) -> list[tuple[str, list[float]]]:
    width = len(record.get("steps") or [])
    return [
        (str(n), [_f(x) for x in v])
        for n, v in (record.get(key) or {}).items()
        if isinstance(v, list) and len(v) == width
    ]


def _evals(run: Run, order: list[str]) -> dict[str, Any] | None:
    """Output RMS of each module at each evaluation, in execution order; the first
    ``EVAL_MODULES`` modules are drawn."""
    if not run.evals:
        return None
    names: list[str] = []
    for e in run.evals:
        names += [n for n in e.get("modules") or {} if n not in names]
    rank = {n: i for i, n in enumerate(order)}
    names.sort(key=lambda n: rank.get(n, len(rank)))
    names = names[:EVAL_MODULES]
    m = np.full((len(names), len(run.evals)), np.nan)
    for j, e in enumerate(run.evals):
        for i, n in enumerate(names):
            m[i, j] = _f(((e.get("modules") or {}).get(n) or {}).get("rms"))
    return {
        "x": _ints([int(e.get("step") or 0) for e in run.evals]),
        "modules": names,
        "rms": [_floats(np.where(r > 0, r, np.nan)) for r in m],
    }


def _at(f: dict[str, Any]) -> tuple[int, str]:
    return (int(f.get("step") or 0), str(f.get("kind", "")))


# -- compact encoding -------------------------------------------------------------------------


def _f(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def _floats(values: Any) -> Raw:
    """Four significant digits (what a tooltip shows); null for NaN and infinities, which
    a chart draws as a gap (the NaN step is marked apart)."""
    return Raw(
        "[" + ",".join(f"{v:.4g}" if math.isfinite(v) else "null" for v in values.tolist()) + "]"
    )


def _ints(values: Any) -> Raw:
    return Raw("[" + ",".join(str(v) for v in np.asarray(values).tolist()) + "]")


def _finite_range(values: Any) -> tuple[float, float]:
    """The smallest and largest finite value (``(0, 0)`` when none is)."""
    finite = np.asarray(values, dtype=float)
    finite = finite[np.isfinite(finite)]
    return (float(finite.min()), float(finite.max())) if finite.size else (0.0, 0.0)


def _bytes(grid: Any, lo: float, hi: float) -> str:
    """Cells scaled to 0..254 over ``[lo, hi]`` (finite; values beyond them, infinities
    included, take the end's byte), 255 where there is no value (NaN); base64. Halves are
    subtracted, so that no finite range overflows (a log holding 3e38 and -3e38)."""
    g = np.asarray(grid, dtype=float)
    clipped = np.clip(np.nan_to_num(g, nan=lo, posinf=hi, neginf=lo), lo, hi)
    span = hi * 0.5 - lo * 0.5
    scaled = (clipped * 0.5 - lo * 0.5) / span if span > 0 else np.zeros_like(clipped)
    q = np.where(np.isnan(g), 255, np.round(scaled * 254)).astype(np.uint8)
    return base64.b64encode(q.tobytes()).decode("ascii")


def dump(obj: Any) -> str:
    """JSON text of ``obj`` with :class:`Raw` pieces written as they are, made safe to
    embed in a ``<script>`` element (no ``</`` inside)."""
    return _dump(obj).replace("</", "<\\/")


def _dump(obj: Any) -> str:
    if isinstance(obj, Raw):
        return str(obj)
    if isinstance(obj, dict):
        return "{" + ",".join(f"{json.dumps(str(k))}:{_dump(v)}" for k, v in obj.items()) + "}"
    if isinstance(obj, (list, tuple)):
        return "[" + ",".join(_dump(v) for v in obj) + "]"
    if isinstance(obj, float) and not math.isfinite(obj):
        return "null"
    if isinstance(obj, np.generic):
        return _dump(obj.item())
    return json.dumps(obj)
