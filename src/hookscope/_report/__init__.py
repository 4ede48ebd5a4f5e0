"""report(): one self-contained HTML file built from hookscope logs alone.

Findings come first (a timeline with current and cleared ones, then the tables), then where
a NaN began with the statistics just before it, the training curves, per-module statistics
as small multiples, layers x steps heatmaps, histograms over steps, feature maps and the
model summary. The charts are interactive (uPlot, vendored: values on hover, drag to zoom,
one step cursor across every chart) and the file fetches nothing. Several logs overlay
their runs on the same charts.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from html import escape
from pathlib import Path
from typing import Any

from ._data import Run, load_run
from ._html import HINTS, page, section, summary_table, table

__all__ = ["report"]

_NO_LOSS = (
    '<p class="note">No loss was logged: no step of this run holds a <code>loss</code> scalar. '
    "The Monitor logs the scalar whose <code>backward()</code> ran when it can find it (a loss "
    'module\'s output, <code>output.loss</code>, <code>output["loss"]</code>, the one 0-dim '
    "tensor a model returns); here it found none, e.g. because no backward ran inside the "
    "watched steps or the loss was not computed from the model's output. Pass "
    "<code>mon.step(loss=loss)</code> to log it.</p>"
)

_HELP = (
    '<p class="help">Hover a chart for its values; drag across it to zoom every chart to '
    "those steps, double-click to zoom out. The step cursor is shared by all charts. "
    "Red line: the step where a NaN/Inf began; dashed: a finding's step.</p>"
)

_COLORS = ["#1f6fb4", "#d6402b", "#2a9d4b", "#8a55c0", "#e08a10", "#148f8f"]


def report(log_dir: str | Path | Sequence[str | Path], out: str | Path | None = None) -> Path:
    """Write a self-contained, interactive HTML report of monitored runs, from their logs.

    Args:
        log_dir: The Monitor's ``log_dir`` (holding ``hookscope.jsonl``) or the log file;
            or a list of them, to overlay the runs on the same charts (before and after a
            change, eager and compiled, fp32 and bf16). :func:`hookscope.compare` says
            where two runs first part.
        out: Where to write; defaults to ``report.html`` next to the log (for several
            logs, ``runs.html`` next to the first).

    Returns:
        The path of the HTML file. It embeds its data and its scripts and fetches nothing,
        so it opens offline in any browser.

    Raises:
        HookscopeError: If there is no log at ``log_dir``, a line of it is not JSON, or the
            file is not a hookscope log (its first line is not a hookscope header).

    Example:
        >>> import hookscope as hs
        >>> hs.report("runs/exp1")  # doctest: +SKIP
        PosixPath('runs/exp1/report.html')
        >>> hs.report(["runs/fp32", "runs/bf16"])  # doctest: +SKIP
        PosixPath('runs/fp32/runs.html')
    """
    from ._payload import dump, payload  # numpy: imported when a report is written

    many = not isinstance(log_dir, (str, Path))
    dirs = list(log_dir) if many else [log_dir]  # type: ignore[list-item]
    if not dirs:
        raise ValueError("report() needs at least one log directory")
    runs = [load_run(d) for d in dirs]
    _name_runs(runs)
    default = "runs.html" if many else "report.html"
    target = Path(out) if out is not None else runs[0].path.parent / default
    body = [_HELP if any(r.steps for r in runs) else ""]
    for run in runs:
        body.append(_per_run(run, many, _findings(run), "findings"))
    body.append(_nan(runs))
    body += [_curves(runs), _windows(runs), _modules(runs), _evals(runs)]
    body += [_heatmaps(runs), _feature_maps(runs)]
    for run in runs:
        body += [
            _per_run(run, many, _summary(run), "summary"),
            _per_run(run, many, _latest(run), "latest"),
            _per_run(run, many, _events(run), "events"),
        ]
    title = f"hookscope report: {_models(runs)}"
    target.parent.mkdir(parents=True, exist_ok=True)
    html = page(
        title, _subtitle(runs), "".join(b for b in body if b), dump(payload(runs)), _nav(runs)
    )
    target.write_text(html, encoding="utf-8")
    return target


def _name_runs(runs: list[Run]) -> None:
    """Overlaid runs need distinct names: their directories', made unique."""
    seen: dict[str, int] = {}
    for run in runs:
        name = run.label
        seen[name] = seen.get(name, 0) + 1
        if seen[name] > 1:
            run.name = f"{name} ({seen[name]})"


def _models(runs: list[Run]) -> str:
    names = [str(r.header.get("model", "model")) for r in runs]
    return names[0] if len(set(names)) == 1 else " vs ".join(names)


def _subtitle(runs: list[Run]) -> str:
    parts = []
    for run in runs:
        parts.append(
            f"{run.path} · {len(run.steps)} steps ({len(run.sampled)} sampled) · "
            f"{len(run.header.get('modules') or {})} modules watched"
        )
    version = runs[0].header.get("hookscope", "?")
    return (
        " | ".join(parts) + f" · hookscope {version} · generated {time.strftime('%Y-%m-%d %H:%M')}"
    )


def _nav(runs: list[Run]) -> str:
    links = [("findings", "Findings"), ("curves", "Curves"), ("modules", "Per module")]
    links += [("heatmaps", "Layers × steps"), ("summary", "Summary")]
    if len(runs) > 1:
        keys = "".join(
            f'<span class="run-label" style="background:{_COLORS[i % len(_COLORS)]}"></span>'
            f"{escape(r.label)} "
            for i, r in enumerate(runs)
        )
        return f"<nav>{keys}</nav>"
    return "<nav>" + "".join(f'<a href="#{a}">{t}</a>' for a, t in links) + "</nav>"


def _per_run(run: Run, many: bool, html: str, ident: str) -> str:
    """A run's own section; with several runs, named after the run."""
    if not many or not html:
        return html
    label = escape(run.label)
    return html.replace(f'id="{ident}"><h2>', f'id="{ident}-{label}"><h2>{label}: ', 1)


def _findings(run: Run) -> str:
    current, cleared = run.split_findings()
    events = run.event_findings()
    never = _never_ran(run)
    if not current and not cleared and not events:
        ok = '<p class="ok">No findings: every check passed.</p>'
        return section("findings", "Findings", ok + never)
    head = ["Kind", "Module", "Where (phase, op, line)", "Step", "Value", "Evidence", "Hint"]
    parts = ['<div id="hs-timeline"></div>']
    if events:
        rows = [_finding_row(f) for f in events]
        rows = [[*r[:3], f"at step {r[3]}", *r[4:]] for r in rows]
        parts.append(
            f"<h3>Events ({len(events)}): they happened at the step shown (a NaN appearing, "
            "the loss spiking); they neither persist nor clear</h3>"
        )
        parts.append(
            table(head, rows, cls="events", row_cls=[f"kind-{f.get('kind', '')}" for f in events])
        )
    if current:
        rows = [_finding_row(f) for f in current]
        classes = [f"kind-{f.get('kind', '')}" for f in current]
        parts.append(f"<h3>Current ({len(current)})</h3>")
        parts.append(table(head, rows, cls="findings", row_cls=classes))
    elif cleared:
        parts.append('<p class="ok">No current finding: every one below has cleared.</p>')
    if cleared:
        rows = [[*_finding_row(f)[:4], f["cleared_at"], *_finding_row(f)[4:]] for f in cleared]
        parts.append(
            f"<h3>Cleared ({len(cleared)}): their condition stopped holding at the step "
            "shown and stayed away</h3>"
        )
        parts.append(table([*head[:4], "Cleared at", *head[4:]], rows, cls="cleared"))
    title = f"Findings ({len(events) + len(current) + len(cleared)})"
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


def _nan(runs: list[Run]) -> str:
    """Where a NaN/Inf began, and every module's statistics at the last sampled step
    before it: what the values looked like while they were still finite."""
    parts = []
    for run in runs:
        start = run.nan_start()
        if start is None:
            continue
        who = escape(str(start.get("module") or "?"))
        how = " ".join(escape(str(start[k])) for k in ("phase", "op", "source") if start.get(k))
        name = f"{escape(run.label)}: " if len(runs) > 1 else ""
        parts.append(
            f'<p class="nan">{name}Non-finite values began at step <b>{start["step"]}</b> in '
            f"<b>{who}</b>{' (' + how + ')' if how else ''}; every chart marks that step with a "
            "red line.</p>"
        )
        before = run.last_sampled_before(int(start["step"]))
        if before is None:
            parts.append(
                '<p class="note">No sampled step before it holds statistics (sample more '
                "often with <code>Monitor(every=1)</code> to see the steps before a NaN).</p>"
            )
        else:
            parts.append(
                f"<h3>Statistics at step {before['step']}, the last sampled step before it</h3>"
            )
            parts.append(_stats_table(run, before, cls="before-nan"))
    return section("nan", "Where the NaN began", "".join(parts)) if parts else ""


def _curves(runs: list[Run]) -> str:
    notes = "".join(
        _NO_LOSS.replace("this run", escape(r.label)) if len(runs) > 1 else _NO_LOSS
        for r in runs
        if r.steps and "loss" not in r.scalars()
    )
    if not any(r.scalars() for r in runs):
        return section("curves", "Loss and learning rate", notes) if notes else ""
    rows = []
    for run in runs:
        for name, (xs, ys) in run.scalars().items():
            label = f"{run.label}: {name}" if len(runs) > 1 else name
            rows.append([label, xs[-1], _last(ys), _min(ys), _max(ys)])
    summary = table(["Scalar", "Last step", "Last", "Min", "Max"], rows, cls="scalars")
    return section(
        "curves",
        "Loss and learning rate",
        notes + '<div id="hs-curves" class="grid"></div>' + summary,
    )


def _windows(runs: list[Run]) -> str:
    """The steps before each loss spike: the loss and each parameter group's gradient norm,
    so the group whose gradients rose first shows as the line that leaves its range first."""
    windows = [(run, w) for run in runs for w in run.windows]
    if not windows:
        return ""
    rows = []
    for run, w in windows:
        found = next(
            (
                f
                for f in run.findings
                if f.get("kind") == w.get("kind") and f.get("step") == w.get("step")
            ),
            {},
        )
        name = f"{run.label}: " if len(runs) > 1 else ""
        rows.append(
            [
                f"{name}{w.get('kind', '')}",
                w.get("step", ""),
                found.get("module") or "",
                found.get("message", ""),
            ]
        )
    note = (
        '<p class="help">Each window: the steps the Monitor kept up to the spike (red line); '
        "left, the step's scalars; right, the L2 norm of each parameter group's gradients (log).</p>"
    )
    return section(
        "windows",
        "Around each loss spike",
        note
        + '<div id="hs-windows"></div>'
        + table(["Kind", "Step", "Group that rose first", "Message"], rows, cls="windows"),
    )


def _evals(runs: list[Run]) -> str:
    """Evaluation passes apart from training: their output RMS per module, and the last
    one's statistics next to the training step before it."""
    if not any(r.evals for r in runs):
        return ""
    parts = [
        '<p class="help">Forwards run in eval mode, logged apart: training statistics never '
        "include them. A module whose evaluation RMS is 100x off its training RMS is an "
        "<code>eval_mismatch</code> finding.</p>",
        '<div id="hs-evals" class="grid"></div>',
    ]
    for run in runs:
        if not run.evals:
            continue
        last = run.evals[-1]
        step = int(last.get("step") or 0)
        train = run.last_sampled_before(step + 1) or {}
        act = train.get("act") or {}
        rows = []
        for name, e in (last.get("modules") or {}).items():
            t = act.get(name) or {}
            rms = math.hypot(t["mean"], t["std"]) if "mean" in t and "std" in t else None
            rows.append([name, e.get("rms"), e.get("absmax"), e.get("calls"), rms])
        label = f"{escape(run.label)}: " if len(runs) > 1 else ""
        where = f", training at step {train['step']}" if train else ""
        parts.append(f"<h3>{label}Evaluation at step {step} ({len(run.evals)} in all){where}</h3>")
        head = ["Module", "Eval RMS", "Eval |x| max", "Calls", "Training RMS"]
        parts.append(table(head, rows, cls="evals"))
    return section("evals", "Evaluation passes", "".join(parts))


def _modules(runs: list[Run]) -> str:
    if not any(r.sampled for r in runs):
        return ""
    order = ", ".join(runs[0].order()[:12])
    more = "…" if len(runs[0].order()) > 12 else ""
    note = f'<p class="help">Modules in the order they ran: {escape(order)}{more}</p>'
    return section("modules", "Per module, over steps", note + '<div id="hs-modules"></div>')


def _heatmaps(runs: list[Run]) -> str:
    if not any(r.sampled for r in runs):
        return ""
    return section(
        "heatmaps",
        "Layers × steps",
        '<div id="hs-heat"></div><h3>Activation histograms over steps (value × step)</h3>'
        '<p class="help">Logged with <code>Monitor(histograms=True)</code>; each column is a '
        'step\'s distribution of the output values.</p><div id="hs-hists"></div>'
        if any(r.hists() for r in runs)
        else '<div id="hs-heat"></div>',
    )


def _feature_maps(runs: list[Run]) -> str:
    maps = [r for run in runs for r in run.feature_maps]
    if not maps:
        return ""
    rows = [[r.get("module", ""), r.get("step", ""), str(r.get("shape", ""))] for r in maps]
    return section(
        "feature-maps",
        "Feature maps",
        '<div id="hs-maps"></div>' + table(["Module", "Step", "Shape"], rows, cls="maps-index"),
    )


def _summary(run: Run) -> str:
    if run.summary is None:
        return ""
    return section("summary", "Model summary", summary_table(run.summary))


def _latest(run: Run) -> str:
    sampled = [s for s in run.sampled if s.get("act") or s.get("grad")]
    if not sampled:
        return ""
    last = sampled[-1]
    return section(
        "latest",
        f"Statistics at the last sampled step ({last.get('step')})",
        _stats_table(run, last, cls="latest"),
    )


def _stats_table(run: Run, step: dict[str, Any], *, cls: str) -> str:
    """Every module's statistics at one sampled step, in the order the modules ran."""
    act, grad = step.get("act") or {}, step.get("grad") or {}
    names = [n for n in run.order() if n in act or n in grad]
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
    return table(head, rows, cls=cls)


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
