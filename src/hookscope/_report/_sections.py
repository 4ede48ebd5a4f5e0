"""The report's sections, in page order: each builds its HTML from the runs, and the page's
script draws its charts (``report.js``'s ``DRAWERS``, by the section's id).

To add a section (an "Explanations" part, say): write its builder here or in a module of its
own, put a :class:`Section` for it in :data:`SECTIONS` where it belongs on the page, and, for
charts, give it ``data`` (its JSON in each run's payload, under the section's id) and a drawer
in ``report.js`` under the same id. Nothing else changes: the header's links, the per-run
headings and the payload follow the registry.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from html import escape
from typing import Any

from ._data import Run
from ._explain import explanations, explanations_data
from ._html import HINTS, section, summary_table, table

__all__ = ["SECTIONS", "Section"]


@dataclass(frozen=True)
class Section:
    """One part of the report.

    Attributes:
        ident: Its ``<section id>``: the header's link and the key of its drawer in
            ``report.js``; with several runs, a per-run section's id is ``ident-<run>``.
        nav: Its link's text in the header (``""``: no link).
        build: Its HTML from the runs; ``""`` when they have nothing for it (no section).
        per_run: ``build`` is called with each run alone; with several runs, each part is
            headed by the run's name.
        data: Its JSON for the page's script, from one run (payload ``runs[i][ident]``).
    """

    ident: str
    nav: str
    build: Callable[[list[Run]], str]
    per_run: bool = False
    data: Callable[[Run], Any] | None = None


_NO_LOSS = (
    '<p class="note">No loss was logged: no step of this run holds a <code>loss</code> scalar. '
    "The Monitor logs the scalar whose <code>backward()</code> ran when it can find it (a loss "
    'module\'s output, <code>output.loss</code>, <code>output["loss"]</code>, the one 0-dim '
    "tensor a model returns); here it found none, e.g. because no backward ran inside the "
    "watched steps or the loss was not computed from the model's output. Pass "
    "<code>mon.step(loss=loss)</code> to log it.</p>"
)


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
    elif cleared and events:  # not green: a NaN appearing is not "cleared" by what follows
        parts.append(
            '<p class="note">No condition is current: every finding below has cleared. The '
            "events above happened at their step all the same.</p>"
        )
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


def _one(build: Callable[[Run], str]) -> Callable[[list[Run]], str]:
    """A per-run builder as a section's ``build`` (called with one run)."""
    return lambda runs: build(runs[0])


SECTIONS: tuple[Section, ...] = (
    Section("findings", "Findings", _one(_findings), per_run=True),
    Section("nan", "", _nan),
    Section("curves", "Curves", _curves),
    Section("windows", "", _windows),
    Section("modules", "Per module", _modules),
    Section("evals", "Evaluation", _evals),
    Section("explanations", "Explanations", explanations, data=explanations_data),
    Section("heatmaps", "Layers × steps", _heatmaps),
    Section("feature-maps", "Feature maps", _feature_maps),
    Section("summary", "Summary", _one(_summary), per_run=True),
    Section("latest", "", _one(_latest), per_run=True),
    Section("events", "", _one(_events), per_run=True),
)
