"""The report's *Explanations* part: what a ``Monitor(explain=hs.Probe(...))`` logged.

Per explained module, each probe image is a row: the image, then its heatmap overlaid at
each explained step (a strip over training), drawn on canvases by ``report.js``'s
``drawExplanations`` from this part's data (``runs[i]["explanations"]``): the probe images
and the maps as bytes (base64), exactly as logged (uint8, the maps min-max scaled per
sample). A long run shows at most :data:`COLUMNS` steps, evenly spread, first and last
included. The table under it (module, method, steps) reads without scripts.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np

from ._data import Run
from ._html import section, table

__all__ = ["COLUMNS", "explanations", "explanations_data"]

COLUMNS = 16  # explained steps drawn per module at most


def explanations(runs: list[Run]) -> str:
    """The section's HTML: a note, the drawing's place, and a table of what was explained."""
    if not any(r.explanations for r in runs):
        return ""
    rows = []
    for run in runs:
        for module, recs in _by_module(run).items():
            steps = [int(r["step"]) for r in recs]
            name = f"{run.label}: {module}" if len(runs) > 1 else module
            shown = ", ".join(map(str, steps[:12])) + (" …" if len(steps) > 12 else "")
            rows.append([name, recs[-1].get("method", ""), len(steps), shown])
    note = (
        '<p class="help">A fixed batch explained during training '
        "(<code>Monitor(explain=hs.Probe(...))</code>): each row is one probe image, then "
        "its heatmap (jet: blue low, red high; each map scaled to its own range) over the "
        "image at each explained step. Hover a picture for the class explained and its "
        "score.</p>"
    )
    head = ["Module", "Method", "Explained steps", "Steps"]
    return section(
        "explanations",
        "Explanations",
        note + '<div id="hs-explain"></div>' + table(head, rows, cls="explained"),
    )


def explanations_data(run: Run) -> dict[str, Any] | None:
    """One run's probe images and maps for the page's script (``None``: nothing explained)."""
    if not run.explanations:
        return None
    probe = run.explain_probe or {}
    images = probe.get("images")
    image = None
    if images:
        pixels = np.asarray(images, dtype=np.uint8)
        if pixels.ndim == 3:  # grey [N, H, W]
            pixels = pixels[..., None]
        n, h, w, c = pixels.shape
        image = {"n": n, "h": h, "w": w, "c": c, "data": _b64(pixels)}
    modules = []
    for module, recs in _by_module(run).items():
        recs = _spread(recs, COLUMNS)
        grid = [int(v) for v in recs[-1].get("grid") or [1, 1]]
        modules.append(
            {
                "module": module,
                "method": recs[-1].get("method", ""),
                "grid": grid,
                "steps": [int(r["step"]) for r in recs],
                "maps": [_b64(np.asarray(r.get("maps") or [], dtype=np.uint8)) for r in recs],
                "target": [r.get("target") for r in recs],
                "score": [r.get("score") for r in recs],
            }
        )
    return {"image": image, "modules": modules}


def _by_module(run: Run) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for rec in run.explanations:
        out.setdefault(str(rec.get("module", "")), []).append(rec)
    return out


def _spread(recs: list[dict[str, Any]], most: int) -> list[dict[str, Any]]:
    """At most ``most`` records, evenly spread over the run, the first and last kept."""
    if len(recs) <= most:
        return recs
    picks = np.unique(np.round(np.linspace(0, len(recs) - 1, most)).astype(int))
    return [recs[i] for i in picks]


def _b64(a: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(a, dtype=np.uint8).tobytes()).decode("ascii")
