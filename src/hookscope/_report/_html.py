"""The report's HTML: one page with its CSS, its data and its scripts inline; nothing is
fetched. The charts are drawn by uPlot (vendored in ``vendor/``, MIT) from the JSON in
``#hs-data``; the tables are plain HTML, readable with scripts off."""

from __future__ import annotations

import math
from functools import cache
from html import escape
from pathlib import Path
from typing import Any

from .._format import format_bytes, format_shapes

__all__ = ["HINTS", "fmt", "page", "section", "table"]

_HERE = Path(__file__).parent

HINTS = {
    "nonfinite": "A NaN/Inf first appeared here while its inputs were finite: check divisions, "
    "log/sqrt/exp of this layer's inputs and the learning rate; on_nonfinite='raise' (under hookscope watch: --on-nonfinite raise) stops at that step.",
    "exploding_gradient": "Gradients grow too large here: lower the learning rate, clip gradients "
    "(torch.nn.utils.clip_grad_norm_) or add normalization.",
    "vanishing_gradient": "Gradients barely reach this layer: use residual connections, normalization, "
    "a non-saturating activation or a better initialization (Kaiming/Xavier).",
    "dead_units": "Units here never activate: lower the learning rate, check biases and initialization, "
    "or use LeakyReLU/GELU.",
    "saturated_units": "Units sit at the activation's limits: normalize the inputs, scale down the "
    "initialization or use a non-saturating activation.",
    "update_ratio": "Updates are far from ~1e-3 of the weights: adjust this layer's learning rate.",
    "loss_spike": "The loss jumped far above its recent range: look at that step's batch, and at "
    "the group named here, whose gradients rose first (the window below); lower the learning "
    "rate or clip gradients if spikes recur.",
    "massive_activations": "A few values dwarf the rest of this output (absmax/RMS >= 100): they "
    "break low-precision formats and quantization; consider normalization or outlier-aware "
    "quantization.",
    "not_updated": "The optimizer step left these weights unchanged: check that they are in the "
    "optimizer's parameter groups (build it after moving or wrapping the model) and trainable.",
    "stale_gradients": "Gradients from the previous step were added to this one: call "
    "optimizer.zero_grad() every step (or every N steps when accumulating on purpose).",
    "eval_randomness": "Random numbers drawn in eval mode: call model.eval() on this module too, "
    "or pass training=self.training to functional dropout.",
    "eval_mismatch": "Evaluation outputs are on another scale than training ones: check "
    "BatchNorm running statistics, train/eval branches and a forgotten model.train().",
    "autocast_skipped": "This layer ran outside autocast's dtype: it keeps full precision (and "
    "speed); check for explicit casts or a custom op autocast does not cover.",
    "frozen_changed": "A frozen module's weights or buffers changed: set requires_grad_(False), "
    "keep them out of the optimizer and put BatchNorm in eval mode.",
    "replica_divergence": "Ranks hold different copies of a replicated parameter: check that every "
    "rank starts from the same seed/checkpoint and no rank-local update bypasses DDP.",
}

_CSS = """
body{font-family:system-ui,-apple-system,'Segoe UI',Roboto,sans-serif;margin:0;color:#1d2430;background:#f6f7f9}
header{background:#1d2430;color:#fff;padding:14px 28px}
header h1{margin:0;font-size:20px} header p{margin:4px 0 0;color:#b8c0cc;font-size:13px}
main{padding:8px 28px 40px;max-width:1400px}
section{background:#fff;border:1px solid #dde1e7;border-radius:6px;margin:16px 0;padding:12px 18px}
h2{font-size:16px;margin:4px 0 10px} h3{font-size:14px;margin:12px 0 6px}
table{border-collapse:collapse;font-size:12px;margin:4px 0}
th,td{border-bottom:1px solid #e6e9ee;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#f0f2f5} td.num{text-align:right;font-variant-numeric:tabular-nums}
tr.kind-nonfinite td:first-child,tr.kind-exploding_gradient td:first-child{color:#b3261e;font-weight:600}
tr.kind-vanishing_gradient td:first-child,tr.kind-dead_units td:first-child{color:#a15c00;font-weight:600}
tr.kind-loss_spike td:first-child{color:#b3261e;font-weight:600}
nav{font-size:13px;margin:10px 0 0} nav a{color:#9cc8f0;margin-right:14px;text-decoration:none}
.grid{display:flex;flex-wrap:wrap;gap:6px 14px} .panel{margin:4px 0}
.uplot{font-family:system-ui,sans-serif} .u-title{font-size:12px!important;font-weight:600!important}
.u-legend{font-size:11px} .u-legend .u-value{font-variant-numeric:tabular-nums}
.heat{position:relative;margin:6px 0} .heat-title{font-size:12px;font-weight:600;margin:2px 0}
.heat canvas{display:block;cursor:crosshair}
.tip{position:absolute;display:none;background:#1d2430;color:#fff;font-size:11px;padding:3px 6px;border-radius:3px;pointer-events:none;white-space:nowrap;z-index:5}
.maps canvas{margin:2px;image-rendering:pixelated} .maps{margin:8px 0}
table.explain-strip td,table.explain-strip th{border:0;padding:1px 2px;text-align:center;font-weight:400;background:none}
table.explain-strip canvas{display:block} .explain-class{font-size:10px;color:#5b6573}
.nan{background:#fdecea;border:1px solid #f1b0a8;padding:8px 12px;border-radius:4px;font-size:13px}
.run-label{display:inline-block;width:10px;height:10px;border-radius:2px;margin-right:4px}
.help{color:#5b6573;font-size:12px;margin:0 0 6px}
.note{background:#fff8e1;border:1px solid #f0d98a;padding:8px 12px;border-radius:4px;font-size:13px}
.ok{color:#1b7f3b;font-weight:600} code{background:#f0f2f5;padding:1px 4px;border-radius:3px}
.mono{font-family:ui-monospace,Menlo,Consolas,monospace}
"""


def fmt(value: Any) -> str:
    """A number as a short string: ``0.00123`` -> ``1.23e-03``; non-finite spelled out."""
    if isinstance(value, bool) or value is None:
        return "" if value is None else str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        if value == 0:
            return "0"
        return f"{value:.3g}" if 1e-3 <= abs(value) < 1e5 else f"{value:.2e}"
    return str(value)


def table(
    head: list[str], rows: list[list[Any]], *, cls: str = "", row_cls: list[str] | None = None
) -> str:
    """An HTML table; numbers right-aligned, every cell escaped."""
    out = [f'<table class="{escape(cls)}"><thead><tr>']
    out += [f"<th>{escape(h)}</th>" for h in head]
    out.append("</tr></thead><tbody>")
    for i, row in enumerate(rows):
        rc = f' class="{escape(row_cls[i])}"' if row_cls else ""
        cells = []
        for cell in row:
            num = isinstance(cell, (int, float)) and not isinstance(cell, bool)
            cells.append(
                f'<td class="num">{escape(fmt(cell))}</td>'
                if num
                else f"<td>{escape(fmt(cell))}</td>"
            )
        out.append(f"<tr{rc}>{''.join(cells)}</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def section(ident: str, title: str, body: str) -> str:
    return f'<section id="{escape(ident)}"><h2>{escape(title)}</h2>{body}</section>'


def summary_table(record: dict[str, Any]) -> str:
    rows = []
    for r in record.get("rows", []):
        name = r.get("name") or "(root)"
        depth = 0 if not r.get("name") else name.count(".") + 1
        rows.append(
            [
                "\u00a0\u00a0" * depth + name,
                r.get("type", ""),
                _shapes(r.get("input_shape")),
                _shapes(r.get("output_shape")),
                int(r.get("params", 0)),
                format_bytes(r.get("bytes", 0)),
            ]
        )
    total = record.get("total") or {}
    foot = (
        f"<p>Total params: {fmt(int(total.get('params', 0)))} · trainable: "
        f"{fmt(int(total.get('trainable', 0)))} · output size: {format_bytes(total.get('bytes', 0))}</p>"
    )
    head = ["Module", "Type", "Input shape", "Output shape", "Params", "Output"]
    return table(head, rows, cls="summary mono") + foot


def _shapes(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(isinstance(v, int) for v in value):
        value = [value]
    return format_shapes(value)


@cache
def _asset(name: str) -> str:
    return (_HERE / name).read_text(encoding="utf-8")


def page(title: str, subtitle: str, body: str, data: str, nav: str = "") -> str:
    """The whole file: ``data`` is the charts' JSON, already safe inside ``<script>``."""
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f'<meta name="viewport" content="width=device-width, initial-scale=1"><title>{escape(title)}</title>'
        f"<style>{_asset('vendor/uPlot.min.css')}{_CSS}</style></head><body><header>"
        f"<h1>{escape(title)}</h1><p>{escape(subtitle)}</p>{nav}</header><main>{body}</main>"
        f'<script id="hs-data" type="application/json">{data}</script>'
        f"<script>/* uPlot 1.6.32, MIT License, (c) 2022 Leon Sorokin */\n"
        f"{_asset('vendor/uPlot.iife.min.js')}</script>"
        f"<script>{_asset('report.js')}</script></body></html>\n"
    )
