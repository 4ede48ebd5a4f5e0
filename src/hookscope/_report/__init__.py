"""report(): one self-contained HTML file built from hookscope logs alone.

Findings come first (a timeline with current and cleared ones, then the tables), then where
a NaN began with the statistics just before it, the training curves, per-module statistics
as small multiples, evaluation passes, layers x steps heatmaps, histograms over steps,
feature maps and the model summary: the sections of ``_sections.SECTIONS``, in that order.
The charts are interactive (uPlot, vendored: values on hover, drag to zoom, one step cursor
and one step range across every chart) and the file fetches nothing. Several logs overlay
their runs on the same charts.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from html import escape
from pathlib import Path

from .._errors import HookscopeError
from .._log import report_name
from ._data import Run, load_run
from ._html import page
from ._sections import SECTIONS, Section

__all__ = ["report"]

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
        out: Where to write; defaults to ``report.html`` next to the log
            (``report-<n>.html`` for a later run's ``hookscope-<n>.jsonl``; for several
            logs, ``runs.html`` next to the first).

    Returns:
        The path of the HTML file. It embeds its data and its scripts and fetches nothing,
        so it opens offline in any browser.

    Raises:
        HookscopeError: If there is no log at ``log_dir``, a line of it is not JSON, the
            file is not a hookscope log (its first line is not a hookscope header), or
            ``out`` cannot be written.

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
    default = "runs.html" if many else report_name(runs[0].path)  # report-2.html: 2nd run's
    target = Path(out) if out is not None else runs[0].path.parent / default
    built = [(s, _build(s, runs, many)) for s in SECTIONS]
    body = [_HELP if any(r.steps for r in runs) else ""] + [part for _, part in built]
    data = payload(runs)
    for s in SECTIONS:
        if s.data is not None:
            for run, entry in zip(runs, data["runs"], strict=True):
                entry[s.ident] = s.data(run)
    title = f"hookscope report: {_models(runs)}"
    html = page(
        title,
        _subtitle(runs),
        "".join(b for b in body if b),
        dump(data),
        _nav(runs, [(s, part) for s, part in built if part]),
    )
    _write(target, html)
    return target


def _build(s: Section, runs: list[Run], many: bool) -> str:
    """A section's HTML; a per-run one once per run, headed by the run's name when many."""
    if not s.per_run:
        return s.build(runs)
    parts = []
    for run in runs:
        html = s.build([run])
        if many and html:
            label = escape(run.label)
            html = html.replace(f'id="{s.ident}"><h2>', f'id="{s.ident}-{label}"><h2>{label}: ', 1)
        parts.append(html)
    return "".join(parts)


def _write(target: Path, html: str) -> None:
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(html, encoding="utf-8")
    except OSError as exc:
        raise HookscopeError(
            f"cannot write the report to {str(target)!r}: {exc.strerror or exc}. Pass "
            "out= (`hookscope report LOG_DIR --out FILE`) a path in a directory you can write to."
        ) from exc


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


def _nav(runs: list[Run], built: list[tuple[Section, str]]) -> str:
    """Links to the sections on the page (the first run's part of a per-run one); with
    several runs, each run's colour key first."""
    links = []
    for s, html in built:
        if s.nav:
            ident = html.split('id="', 1)[1].split('"', 1)[0]  # its own, or its first run's
            links.append(f'<a href="#{escape(ident)}">{escape(s.nav)}</a>')
    keys = ""
    if len(runs) > 1:
        keys = "".join(
            f'<span class="run-label" style="background:{_COLORS[i % len(_COLORS)]}"></span>'
            f"{escape(r.label)} "
            for i, r in enumerate(runs)
        )
        keys = f'<span class="run-keys">{keys}</span>'
    return "<nav>" + keys + "".join(links) + "</nav>"
