"""The report's HTML: one page, inline CSS, images as data URIs; nothing is fetched."""

from __future__ import annotations

import base64
import math
from html import escape
from typing import Any

from .._format import format_bytes, format_shapes

__all__ = ["HINTS", "fmt", "img", "page", "section", "table"]

HINTS = {
    "nonfinite": "A NaN/Inf first appeared here while its inputs were finite: check divisions, "
    "log/sqrt/exp of this layer's inputs and the learning rate; Monitor(on_nonfinite='raise') stops at that step.",
    "exploding_gradient": "Gradients grow too large here: lower the learning rate, clip gradients "
    "(torch.nn.utils.clip_grad_norm_) or add normalization.",
    "vanishing_gradient": "Gradients barely reach this layer: use residual connections, normalization, "
    "a non-saturating activation or a better initialization (Kaiming/Xavier).",
    "dead_units": "Units here never activate: lower the learning rate, check biases and initialization, "
    "or use LeakyReLU/GELU.",
    "saturated_units": "Units sit at the activation's limits: normalize the inputs, scale down the "
    "initialization or use a non-saturating activation.",
    "update_ratio": "Updates are far from ~1e-3 of the weights: adjust this layer's learning rate.",
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
img{max-width:100%;display:block;margin:6px 0}
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


def img(png: bytes, alt: str) -> str:
    data = base64.b64encode(png).decode("ascii")
    return f'<img class="plot" alt="{escape(alt)}" src="data:image/png;base64,{data}">'


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


def page(title: str, subtitle: str, body: str) -> str:
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f'<meta name="viewport" content="width=device-width, initial-scale=1"><title>{escape(title)}</title>'
        f"<style>{_CSS}</style></head><body><header><h1>{escape(title)}</h1>"
        f"<p>{escape(subtitle)}</p></header><main>{body}</main></body></html>\n"
    )
