"""summary(): one forward pass, a table of modules with their shapes and parameter counts."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ._format import format_bytes, format_shapes
from ._hooks import HookSet, check_not_compiled, training_mode
from ._tree import tensors

__all__ = ["Summary", "SummaryRow", "summary"]


@dataclass(frozen=True)
class SummaryRow:
    """One module: where it sits, what went in and out of its first call, what it owns."""

    name: str
    type: str
    depth: int
    input_shape: list[list[int]]
    output_shape: list[list[int]]
    params: int  # every parameter under the module, shared ones once
    trainable: int
    bytes: int  # of the tensors the first call returned
    calls: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "type": self.type,
            "input_shape": self.input_shape,
            "output_shape": self.output_shape,
            "params": self.params,
            "trainable": self.trainable,
            "bytes": self.bytes,
        }


class Summary:
    """The result of :func:`summary`: ``str()`` is a fixed-width table, ``rows`` the data."""

    def __init__(self, model_name: str, rows: list[SummaryRow], total: dict[str, int]) -> None:
        self.model = model_name
        self.rows = rows
        self.total = total

    def to_dict(self) -> dict[str, Any]:
        """``{"rows": [...], "total": {...}}``: the ``summary`` record of the log format."""
        return {"rows": [row.to_dict() for row in self.rows], "total": dict(self.total)}

    def _cells(self) -> list[list[str]]:
        out = []
        for row in self.rows:
            name = "  " * row.depth + (row.name or "(root)")
            calls = f" x{row.calls}" if row.calls > 1 else ""
            out.append(
                [
                    name,
                    row.type + calls,
                    format_shapes(row.input_shape),
                    format_shapes(row.output_shape),
                    f"{row.params:,}",
                    format_bytes(row.bytes) if row.calls else "-",
                ]
            )
        return out

    def _total_line(self) -> str:
        t = self.total
        return (
            f"Total params: {t['params']:,}  trainable: {t['trainable']:,}  "
            f"non-trainable: {t['params'] - t['trainable']:,}  "
            f"output size (leaf modules): {format_bytes(t['bytes'])}"
        )

    def __str__(self) -> str:
        header = ["Module", "Type", "Input shape", "Output shape", "Params", "Output"]
        cells = self._cells()
        widths = [max(len(r[i]) for r in [header, *cells]) for i in range(len(header))]
        right = {4, 5}

        def line(r: list[str]) -> str:
            parts = [
                c.rjust(w) if i in right else c.ljust(w)
                for i, (c, w) in enumerate(zip(r, widths, strict=True))
            ]
            return "  ".join(parts).rstrip()

        rule = "-" * len(line(["-" * w for w in widths]))
        body = [line(r) for r in cells]
        return "\n".join([line(header), rule, *body, rule, self._total_line()])

    def __repr__(self) -> str:
        return (
            f"Summary({self.model}, {len(self.rows)} modules, "
            f"{self.total['params']:,} params, {self.total['trainable']:,} trainable)"
        )

    def _repr_html_(self) -> str:
        from ._notebook import summary_html

        return summary_html(self)

    def __rich__(self) -> Any:
        from rich.table import Table  # rich calls __rich__, so it is already imported

        table = Table(title=self.model, caption=self._total_line())
        for col in ("Module", "Type", "Input shape", "Output shape", "Params", "Output"):
            table.add_column(col, justify="right" if col in ("Params", "Output") else "left")
        for cells in self._cells():
            table.add_row(*cells)
        return table


def summary(model: nn.Module, *inputs: Any, eval: bool = True, **kwargs: Any) -> Summary:
    """Run one forward pass and describe every module: type, shapes, parameters, output size.

    The pass runs without gradients; every hook is removed afterwards and each module's
    training flag is restored. Parameters shared between modules (tied embeddings) are
    counted once in the total.

    Args:
        model: The model.
        *inputs: Positional arguments for ``model(...)``.
        eval: Run in eval mode (the default: BatchNorm statistics stay untouched).
        **kwargs: Keyword arguments for ``model(...)``.

    Returns:
        A :class:`Summary`: ``print()`` it for a table, or read ``.rows`` / ``.to_dict()``.

    Example:
        >>> import torch, hookscope as hs, torch.nn as nn
        >>> s = hs.summary(nn.Sequential(nn.Linear(4, 8), nn.ReLU()), torch.zeros(2, 4))
        >>> s.total["params"], s.rows[1].output_shape
        (40, [[2, 8]])
    """
    check_not_compiled(model, "summary")
    seen: dict[str, tuple[list[list[int]], list[list[int]], int]] = {}
    calls: dict[str, int] = {}

    def record(name: str, module: nn.Module, args: Any, kw: Any, output: Any) -> None:
        calls[name] = calls.get(name, 0) + 1
        if name not in seen:
            outs = tensors(output)
            seen[name] = (
                [list(t.shape) for t in tensors((args, kw))],
                [list(t.shape) for t in outs],
                sum(t.numel() * t.element_size() for t in outs),
            )

    modules = list(model.named_modules())
    with HookSet("summary") as hooks, training_mode(model, False if eval else model.training):
        for name, module in modules:
            hooks.forward(module, functools.partial(record, name))
        with torch.no_grad():
            model(*inputs, **kwargs)
    rows = [_row(name, module, seen, calls) for name, module in modules]
    params = list(model.parameters())  # unique: a tied parameter appears once
    leaves = [
        r for r, (_, m) in zip(rows, modules, strict=True) if not any(True for _ in m.children())
    ]
    total = {
        "params": sum(p.numel() for p in params),
        "trainable": sum(p.numel() for p in params if p.requires_grad),
        "bytes": sum(r.bytes for r in leaves),
    }
    return Summary(type(model).__name__, rows, total)


def _row(name: str, module: nn.Module, seen: dict, calls: dict[str, int]) -> SummaryRow:
    ins, outs, nbytes = seen.get(name, ([], [], 0))
    params = list(module.parameters())
    return SummaryRow(
        name=name,
        type=type(module).__name__,
        depth=0 if not name else name.count(".") + 1,
        input_shape=ins,
        output_shape=outs,
        params=sum(p.numel() for p in params),
        trainable=sum(p.numel() for p in params if p.requires_grad),
        bytes=nbytes,
        calls=calls.get(name, 0),
    )
