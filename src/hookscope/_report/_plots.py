"""matplotlib figures for the report, returned as PNG bytes. Imported only when matplotlib is.

Figures are built with ``matplotlib.figure.Figure`` (the Agg canvas), never pyplot, so the
report touches no global state and needs no display.
"""

from __future__ import annotations

import io
import math
from typing import Any

import numpy as np
from matplotlib.figure import Figure

__all__ = ["curves", "feature_grid", "grad_heatmap", "hist_heatmaps", "small_multiples"]

_COLS = 4
_GUIDE = 1e-3  # a healthy update-to-weight ratio (Karpathy, CS231n)


def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80)
    return buf.getvalue()


def _positive(values: list[float]) -> bool:
    return any(math.isfinite(v) and v > 0 for v in values)


def curves(series: dict[str, tuple[list[int], list[float]]]) -> bytes:
    """One panel per scalar (loss, lr, ...) over steps; lr and positive-only scalars log-scaled."""
    names = list(series)
    fig = Figure(figsize=(4.2 * len(names), 2.8), layout="constrained")
    for i, name in enumerate(names):
        ax = fig.add_subplot(1, len(names), i + 1)
        xs, ys = series[name]
        ax.plot(xs, ys, lw=1.2, color="C0" if not name.startswith("lr") else "C1")
        finite = [v for v in ys if math.isfinite(v)]
        if name.startswith("lr") and finite and min(finite) > 0 and max(finite) / min(finite) > 20:
            ax.set_yscale("log")
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    return _png(fig)


def small_multiples(
    panels: dict[str, tuple[list[int], list[float]]],
    *,
    title: str,
    log: bool = False,
    band: dict[str, list[float]] | None = None,
    guide: float | None = None,
) -> bytes:
    """One small panel per module, all sharing x and y axes.

    ``band`` gives a half-width per point (mean ± std); ``guide`` draws a dashed line.
    """
    names = list(panels)
    cols = min(_COLS, len(names))
    rows = math.ceil(len(names) / cols)
    width, height = 2.6 * cols, 1.7 * rows + 0.5
    fig = Figure(figsize=(width, height))
    # Fixed margins in inches: constrained layout measures every tick of every panel, which
    # took seconds per figure on a model with a few dozen modules.
    fig.subplots_adjust(
        left=0.5 / width,
        right=1 - 0.1 / width,
        bottom=0.3 / height,
        top=1 - 0.55 / height,
        wspace=0.08,
        hspace=0.3,
    )
    axes = fig.subplots(rows, cols, sharex=True, sharey=True, squeeze=False)
    use_log = log and any(_positive(ys) for _, ys in panels.values())
    for ax, name in zip(axes.flat, names, strict=False):
        xs, ys = panels[name]
        y = np.asarray(ys, dtype=float)
        if use_log:
            y = np.where(y > 0, y, np.nan)
        if band is not None:
            w = np.asarray(band[name], dtype=float)
            ax.fill_between(xs, y - w, y + w, alpha=0.3, color="C0", lw=0)
        ax.plot(xs, y, lw=1, color="C0")
        if guide is not None:
            ax.axhline(guide, ls="--", lw=0.8, color="C3")
        ax.set_title(name, fontsize=8)
        ax.tick_params(labelsize=6)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(names) :]:
        ax.set_visible(False)
    if use_log:
        axes.flat[0].set_yscale("log")
    else:
        axes.flat[0].locator_params(axis="y", nbins=4)
    axes.flat[0].locator_params(axis="x", nbins=4)
    fig.suptitle(title, fontsize=10)
    return _png(fig)


def grad_heatmap(norms: dict[str, tuple[list[int], list[float]]]) -> bytes:
    """Layers x steps: log10 of each module's output-gradient norm at every sampled step."""
    names = list(norms)
    steps = sorted({x for xs, _ in norms.values() for x in xs})
    col = {s: j for j, s in enumerate(steps)}
    grid = np.full((len(names), len(steps)), np.nan)
    for i, name in enumerate(names):
        for x, v in zip(*norms[name], strict=True):
            grid[i, col[x]] = math.log10(v) if v > 0 and math.isfinite(v) else np.nan
    fig = Figure(figsize=(8, 0.9 + 0.22 * len(names)), layout="constrained")
    ax = fig.add_subplot()
    extent = (steps[0] - 0.5, steps[-1] + 0.5, len(names) - 0.5, -0.5) if steps else None
    image = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap="magma", extent=extent)
    ax.set_yticks(range(len(names)), names, fontsize=7)
    ax.set_xlabel("step", fontsize=8)
    ax.tick_params(axis="x", labelsize=7)
    fig.colorbar(image, ax=ax, label="log10 ‖grad‖")
    ax.set_title("gradient norm of each module's output", fontsize=10)
    return _png(fig)


def _rebin(entries: list[tuple[int, float, float, list[float]]], bins: int = 32) -> Any:
    lo = min(e[1] for e in entries)
    hi = max(e[2] for e in entries)
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi <= lo:
        hi = lo + 1 if math.isfinite(lo) else 1.0
        lo = lo if math.isfinite(lo) else 0.0
    edges = np.linspace(lo, hi, bins + 1)
    grid = np.zeros((bins, len(entries)))
    for j, (_, a, b, counts) in enumerate(entries):
        n = len(counts)
        centers = a + (np.arange(n) + 0.5) * ((b - a) / n if math.isfinite(b - a) else 0)
        col, _ = np.histogram(centers, bins=edges, weights=np.nan_to_num(counts))
        total = col.sum()
        grid[:, j] = col / total if total > 0 else col
    return grid, lo, hi


def hist_heatmaps(hists: dict[str, list[tuple[int, float, float, list[float]]]]) -> bytes:
    """Per module, value (rows) x step (columns): how the activation distribution moves."""
    names = list(hists)
    cols = min(_COLS, len(names))
    rows = math.ceil(len(names) / cols)
    fig = Figure(figsize=(2.6 * cols, 1.9 * rows + 0.5), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False)
    for ax, name in zip(axes.flat, names, strict=False):
        entries = hists[name]
        grid, lo, hi = _rebin(entries)
        steps = [e[0] for e in entries]
        ax.imshow(
            np.log1p(grid * 100),
            aspect="auto",
            origin="lower",
            cmap="viridis",
            extent=(steps[0] - 0.5, steps[-1] + 0.5, lo, hi),
            interpolation="nearest",
        )
        ax.set_title(name, fontsize=8)
        ax.tick_params(labelsize=6)
    for ax in list(axes.flat)[len(names) :]:
        ax.set_visible(False)
    fig.suptitle("activation histograms over steps (value vs step)", fontsize=10)
    return _png(fig)


def feature_grid(record: dict[str, Any], limit: int = 32) -> bytes:
    """The channels of one ``feature_maps`` record as a grid of images, one sample."""
    data = np.asarray(record["data"], dtype=float)
    if data.ndim == 2:
        data = data[None]
    channels = min(len(data), limit)
    cols = min(8, channels)
    rows = math.ceil(channels / cols)
    fig = Figure(figsize=(1.1 * cols, 1.1 * rows + 0.4), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False)
    for c, ax in enumerate(axes.flat):
        ax.set_axis_off()
        if c < channels:
            ax.imshow(np.nan_to_num(data[c]), cmap="viridis", interpolation="nearest")
            ax.set_title(str(c), fontsize=6)
    more = f" (first {channels} of {len(data)} channels)" if len(data) > channels else ""
    fig.suptitle(f"{record.get('module', '?')} at step {record.get('step', '?')}{more}", fontsize=9)
    return _png(fig)
