"""report(): one self-contained HTML file built from a hookscope log alone.

Findings come first, then the training curves, per-module statistics as small multiples,
heatmaps, feature maps and the model summary. Plots need matplotlib (``hookscope[plot]``);
without it the report still holds every table and says how to get the plots.
"""

from __future__ import annotations

import importlib.util
import math
import time
from pathlib import Path
from typing import Any

from ._data import Run, load_run
from ._html import HINTS, img, page, section, summary_table, table

__all__ = ["report"]

_NO_PLOTS = (
    '<p class="note">Plots need matplotlib, which is not installed: '
    "<code>pip install 'hookscope[plot]'</code>. The tables below hold the numbers.</p>"
)


_NO_LOSS = (
    '<p class="note">No loss was logged: no step of this run holds a <code>loss</code> scalar. '
    "The Monitor logs the scalar whose <code>backward()</code> ran when it can find it (a loss "
    'module\'s output, <code>output.loss</code>, <code>output["loss"]</code>, the one 0-dim '
    "tensor a model returns); here it found none, e.g. because no backward ran inside the "
    "watched steps or the loss was not computed from the model's output. Pass "
    "<code>mon.step(loss=loss)</code> to log it.</p>"
)


def report(log_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write a self-contained HTML report of a monitored run, read from its log alone.

    Args:
        log_dir: The Monitor's ``log_dir`` (holding ``hookscope.jsonl``) or the log file.
        out: Where to write; defaults to ``report.html`` next to the log.

    Returns:
        The path of the HTML file. It embeds its images and fetches nothing, so it opens
        offline in any browser.

    Raises:
        HookscopeError: If there is no log at ``log_dir``, a line of it is not JSON, or the
            file is not a hookscope log (its first line is not a hookscope header).

    Example:
        >>> import hookscope as hs
        >>> hs.report("runs/exp1")  # doctest: +SKIP
        PosixPath('runs/exp1/report.html')
    """
    run = load_run(log_dir)
    target = Path(out) if out is not None else run.path.parent / "report.html"
    plots = _plots_module()
    body = [_findings(run)]
    if plots is None:
        body.insert(0, _NO_PLOTS)
    body += [_curves(run, plots), _modules(run, plots), _heatmaps(run, plots)]
    body += [_feature_maps(run, plots), _summary(run), _latest(run), _events(run)]
    header = run.header
    title = f"hookscope report: {header.get('model', 'model')}"
    sampled = len(run.sampled)
    subtitle = (
        f"{run.path} · {len(run.steps)} steps ({sampled} sampled) · "
        f"{len(header.get('modules') or {})} modules watched · hookscope {header.get('hookscope', '?')}"
        f" · generated {time.strftime('%Y-%m-%d %H:%M')}"
    )
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(page(title, subtitle, "".join(b for b in body if b)), encoding="utf-8")
    return target


def _plots_module() -> Any:
    try:
        if importlib.util.find_spec("matplotlib") is None:
            return None
        from . import _plots
    except ImportError:
        return None
    return _plots


def _findings(run: Run) -> str:
    current, cleared = run.split_findings()
    never = _never_ran(run)
    if not current and not cleared:
        ok = '<p class="ok">No findings: every check passed.</p>'
        return section("findings", "Findings", ok + never)
    head = ["Kind", "Module", "Where (phase, op, line)", "Step", "Value", "Evidence", "Hint"]
    parts = []
    if current:
        rows = [_finding_row(f) for f in current]
        classes = [f"kind-{f.get('kind', '')}" for f in current]
        parts.append(f"<h3>Current ({len(current)})</h3>")
        parts.append(table(head, rows, cls="findings", row_cls=classes))
    else:
        parts.append('<p class="ok">No current finding: every one below has cleared.</p>')
    if cleared:
        rows = [[*_finding_row(f)[:4], f["cleared_at"], *_finding_row(f)[4:]] for f in cleared]
        parts.append(
            f"<h3>Cleared ({len(cleared)}): their condition stopped holding at the step "
            "shown and stayed away</h3>"
        )
        parts.append(table([*head[:4], "Cleared at", *head[4:]], rows, cls="cleared"))
    title = f"Findings ({len(current) + len(cleared)})"
    return section("findings", title, "".join(parts) + never)


def _finding_row(f: dict[str, Any]) -> list[Any]:
    kind = str(f.get("kind", ""))
    return [
        kind,
        f.get("module", ""),
        " ".join(str(f[k]) for k in ("phase", "op", "source") if f.get(k)),
        f.get("step", ""),
        f.get("value"),
        f.get("message", ""),
        HINTS.get(kind, ""),
    ]


def _never_ran(run: Run) -> str:
    names = run.never_ran()
    if not names:
        return ""
    types = run.header.get("modules") or {}
    rows = [[n, types.get(n, ""), "watched, but in no sampled step's statistics"] for n in names]
    note = (
        f'<p class="note">{len(names)} watched module(s) never ran in training mode, so no '
        "rule judged them: a module used only by its weight (as "
        "<code>nn.MultiheadAttention.out_proj</code>), or one the forward skips.</p>"
    )
    return (
        "<h3>Modules that never ran</h3>"
        + note
        + table(["Module", "Type", "Why it has no statistics"], rows, cls="never-ran")
    )


def _curves(run: Run, plots: Any) -> str:
    series = run.scalars()
    note = "" if "loss" in series or not run.steps else _NO_LOSS
    if not series:
        return section("curves", "Loss and learning rate", note) if note else ""
    if plots is not None:
        body = img(plots.curves(series), "scalars over steps")
    else:
        rows = [[name, xs[-1], _last(ys), _min(ys), _max(ys)] for name, (xs, ys) in series.items()]
        body = table(["Scalar", "Last step", "Last", "Min", "Max"], rows, cls="scalars")
    return section("curves", "Loss and learning rate", note + body)


def _modules(run: Run, plots: Any) -> str:
    if plots is None or not run.sampled:
        return ""
    parts = []
    mean, std = run.stat("act", "mean"), run.stat("act", "std")
    if mean:
        band = {name: std.get(name, (xs, [0.0] * len(xs)))[1] for name, (xs, _) in mean.items()}
        parts.append(
            img(
                plots.small_multiples(mean, title="activation mean ± std", band=band),
                "activation mean and std",
            )
        )
    zero = run.stat("act", "zero_frac")
    if zero:
        parts.append(
            img(
                plots.small_multiples(zero, title="fraction of zeros in the output"),
                "zero fraction",
            )
        )
    grad = run.stat("grad", "norm")
    if grad:
        parts.append(
            img(
                plots.small_multiples(grad, title="gradient norm of the output", log=True),
                "gradient norm",
            )
        )
    ratio = run.update_ratios()
    if ratio:
        parts.append(
            img(
                plots.small_multiples(
                    ratio, title="update ratio ‖ΔW‖/‖W‖ (dashed: 1e-3)", log=True, guide=1e-3
                ),
                "update ratio",
            )
        )
    return section("modules", "Per module, over steps", "".join(parts)) if parts else ""


def _heatmaps(run: Run, plots: Any) -> str:
    if plots is None:
        return ""
    parts = []
    grad = run.stat("grad", "norm")
    if grad:
        parts.append(img(plots.grad_heatmap(grad), "gradient norm heatmap"))
    hists = run.hists()
    if hists:
        parts.append(img(plots.hist_heatmaps(hists), "activation histograms"))
    return section("heatmaps", "Layers × steps", "".join(parts)) if parts else ""


def _feature_maps(run: Run, plots: Any) -> str:
    if not run.feature_maps:
        return ""
    if plots is None:
        rows = [
            [r.get("module", ""), r.get("step", ""), str(r.get("shape", ""))]
            for r in run.feature_maps
        ]
        return section("feature-maps", "Feature maps", table(["Module", "Step", "Shape"], rows))
    parts = [
        img(plots.feature_grid(r), f"feature maps of {r.get('module', '')}")
        for r in run.feature_maps
    ]
    return section("feature-maps", "Feature maps", "".join(parts))


def _summary(run: Run) -> str:
    if run.summary is None:
        return ""
    return section("summary", "Model summary", summary_table(run.summary))


def _latest(run: Run) -> str:
    sampled = run.sampled
    if not sampled:
        return ""
    last = sampled[-1]
    act, grad = last.get("act") or {}, last.get("grad") or {}
    names = [n for n in (run.header.get("modules") or {}) if n in act or n in grad]
    names += [n for n in [*act, *grad] if n not in names]
    rows = []
    for name in names:
        a, g = act.get(name, {}), grad.get(name, {})
        rows.append(
            [
                name,
                a.get("mean"),
                a.get("std"),
                a.get("absmax"),
                a.get("zero_frac"),
                a.get("sat_frac"),
                g.get("norm"),
            ]
        )
    head = ["Module", "Mean", "Std", "|x| max", "Zero frac", "Saturated", "Grad norm"]
    return section(
        "latest",
        f"Statistics at the last sampled step ({last.get('step')})",
        table(head, rows, cls="latest"),
    )


def _events(run: Run) -> str:
    if not run.events:
        return ""
    rows = [[e.get("step", ""), e.get("kind", ""), e.get("message", "")] for e in run.events]
    return section("events", "Events", table(["Step", "Kind", "Message"], rows))


def _finite(ys: list[float]) -> list[float]:
    return [y for y in ys if math.isfinite(y)]


def _last(ys: list[float]) -> float:
    return ys[-1] if ys else math.nan


def _min(ys: list[float]) -> float:
    return min(_finite(ys), default=math.nan)


def _max(ys: list[float]) -> float:
    return max(_finite(ys), default=math.nan)
