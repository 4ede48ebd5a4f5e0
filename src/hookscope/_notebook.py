"""HTML for notebooks: what ``_repr_html_`` of a Monitor, a Finding, a Record, a Capture, a
summary and a FeatureStore shows. Plain HTML with inline styles (a notebook strips
``<style>`` blocks in some front ends) and an inline SVG sparkline; no script, nothing
fetched, so it renders in Jupyter, VS Code and a saved ``.ipynb`` alike.

The objects call in with one line each; everything they show is read through their public
attributes, so this module imports none of them.
"""

from __future__ import annotations

import math
from html import escape
from typing import Any

__all__ = [
    "capture_html",
    "feature_store_html",
    "finding_html",
    "monitor_html",
    "record_html",
    "sparkline",
    "summary_html",
]

_BOX = "font-family:system-ui,sans-serif;font-size:12px;line-height:1.4"
_TH = "text-align:left;padding:2px 8px;border-bottom:1px solid #ccd;font-weight:600"
_TD = "text-align:left;padding:2px 8px;border-bottom:1px solid #eef"
_NUM = "text-align:right;padding:2px 8px;border-bottom:1px solid #eef;font-variant-numeric:tabular-nums"
_KIND_COLORS = {"nonfinite": "#b3261e", "exploding_gradient": "#b3261e"}
_ROWS = 30  # table rows shown before "... and N more"


def _num(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return "" if value is None else str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if not math.isfinite(value) or value == 0:
            return str(value) if value else "0"
        return f"{value:.4g}" if 1e-3 <= abs(value) < 1e5 else f"{value:.3e}"
    return str(value)


def _table(head: list[str], rows: list[list[Any]]) -> str:
    shown = rows[:_ROWS]
    out = ['<table style="border-collapse:collapse;margin:4px 0"><tr>']
    out += [f'<th style="{_TH}">{escape(h)}</th>' for h in head]
    out.append("</tr>")
    for row in shown:
        out.append("<tr>")
        for cell in row:
            number = isinstance(cell, (int, float)) and not isinstance(cell, bool)
            out.append(f'<td style="{_NUM if number else _TD}">{escape(_num(cell))}</td>')
        out.append("</tr>")
    out.append("</table>")
    if len(rows) > len(shown):
        out.append(f"<div>… and {len(rows) - len(shown)} more</div>")
    return "".join(out)


def _box(title: str, body: str) -> str:
    return f'<div style="{_BOX}"><b>{escape(title)}</b>{body}</div>'


def sparkline(values: list[float], width: int = 160, height: int = 32) -> str:
    """An inline SVG polyline of ``values`` (non-finite ones skipped; the last point dotted),
    or ``""`` when fewer than two are finite."""
    points = [
        (i, v) for i, v in enumerate(values) if isinstance(v, (int, float)) and math.isfinite(v)
    ]
    if len(points) < 2:
        return ""
    lo, hi = min(v for _, v in points), max(v for _, v in points)
    span, n = (hi - lo) or 1.0, max(len(values) - 1, 1)

    def xy(i: int, v: float) -> tuple[float, float]:
        return 2 + i / n * (width - 4), 2 + (1 - (v - lo) / span) * (height - 4)

    path = " ".join(f"{x:.1f},{y:.1f}" for x, y in (xy(i, v) for i, v in points))
    cx, cy = xy(*points[-1])
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" style="vertical-align:middle">'
        f'<polyline fill="none" stroke="#1f6fb4" stroke-width="1.3" points="{path}"/>'
        f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="2" fill="#1f6fb4"/></svg>'
    )


def _finding_rows(findings: list[Any]) -> list[list[Any]]:
    return [
        [
            f.step,
            f.kind,
            f.module or "(model)",
            f.message,
            "current" if f.cleared_at is None else f"cleared at {f.cleared_at}",
        ]
        for f in findings
    ]


def monitor_html(mon: Any) -> str:
    """Live: steps so far, the loss as a sparkline with its last value, the findings."""
    losses = [
        r["scalars"]["loss"]
        for r in mon.records
        if r.get("type") == "step" and "loss" in (r.get("scalars") or {})
    ][-500:]
    loss = ""
    if losses:
        loss = f" · loss {sparkline(losses)} {escape(_num(losses[-1]))}"
    findings = list(mon.findings)
    current = sum(1 for f in findings if f.cleared_at is None)
    head = (
        f"<div>{len(mon.modules)} modules watched · every {mon.every} · "
        f"step {mon.step_count}{loss}</div>"
    )
    if not findings:
        body = '<div style="color:#1b7f3b">No findings so far.</div>'
    else:
        body = f"<div>Findings: {current} current, {len(findings) - current} cleared</div>"
        body += _table(["Step", "Kind", "Module", "Evidence", "State"], _finding_rows(findings))
    return _box("hookscope Monitor", head + body)


def finding_html(f: Any) -> str:
    color = _KIND_COLORS.get(f.kind, "#a15c00")
    where = " ".join(str(x) for x in (f.phase, f.op, f.source) if x)
    state = "current" if f.cleared_at is None else f"cleared at step {f.cleared_at}"
    rows = [
        ["module", f.module or "(model)"],
        ["step", f.step],
        ["value", f.value],
        ["state", state],
    ]
    if where:
        rows.insert(2, ["where", where])
    if f.rank is not None:
        rows.append(["rank", f.rank])
    return (
        f'<div style="{_BOX}"><b style="color:{color}">{escape(f.kind)}</b> '
        f"{escape(f.message)}{_table(['', ''], rows)}</div>"
    )


def record_html(record: Any, describe: Any) -> str:
    """``describe`` is the library's one-line description of a value (shapes and dtypes)."""
    rows = [[key, describe(value)] for key, value in record._fields()]
    return _box(f"Record {record.name!r}, call {record.call}", _table(["Field", "Value"], rows))


def capture_html(cap: Any, describe: Any) -> str:
    rows = []
    for name in cap:
        for record in cap.all(name):
            for key, value in record._fields():
                rows.append([name, record.call, key, describe(value)])
    body = _table(["Module", "Call", "Field", "Value"], rows)
    if cap.missing:
        body += f"<div>Never ran: {escape(', '.join(cap.missing))}</div>"
    return _box(f"Capture: {len(cap)} of {len(cap.names)} modules", body)


def summary_html(s: Any) -> str:
    rows = [
        [
            "\u00a0\u00a0" * row.depth + (row.name or "(root)"),
            row.type + (f" x{row.calls}" if row.calls > 1 else ""),
            str(row.input_shape),
            str(row.output_shape),
            row.params,
        ]
        for row in s.rows
    ]
    body = _table(["Module", "Type", "Input shape", "Output shape", "Params"], rows)
    body += f"<div>{escape(s._total_line())}</div>"
    return _box(s.model, body)


def feature_store_html(store: Any) -> str:
    rows = [[n, str(s.get("dtype", "")), str(s.get("shape", ""))] for n, s in store._sites.items()]
    state = "complete" if store.complete else "incomplete (an extraction is running or stopped)"
    body = f"<div>{str(store.path)!r}: {len(store):,} rows, {escape(state)}</div>"
    return _box("FeatureStore", body + _table(["Module", "Dtype", "Shape per row"], rows))
