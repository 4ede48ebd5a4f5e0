"""Norms of many small tensors in few CPU ops: those of one shape stacked, the rest fused.

``torch._foreach_norm`` on a CPU runs one full norm op per tensor (a few microseconds each):
on a model of many same-shaped layers (a stack of blocks) that is most of what a step's
gradient and weight norms cost. :class:`Norms` plans once per list of shapes: tensors of a
shape that recurs ``MIN_STACK`` times or more are stacked (one copy; contiguous ones only)
and reduced in one op along their own dimensions, the rest go through one ``_foreach_norm``; the result is one
float32 vector in the tensors' order, bit-identical to ``_foreach_norm``'s (the same
reduction of each tensor's contiguous elements).
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["MIN_STACK", "Norms"]

MIN_STACK = 6  # tensors of one shape stacked: fewer cost more than their own norms
_HALF = (torch.float16, torch.bfloat16)
_AS_IS = contextlib.nullcontext()


class Norms:
    """``ord``-norms of lists of tensors of one device and dtype, as one float32 vector."""

    def __init__(self, ord: float) -> None:
        self.ord = ord
        # shapes -> (groups of indices stacked, indices fused, order of the result or None)
        self._plans: dict[tuple, tuple[list[list[int]], list[int], torch.Tensor | None]] = {}

    def __call__(self, tensors: list[torch.Tensor]) -> torch.Tensor | None:
        """The norms, or ``None`` where the tensors are not all of one dtype, there are
        none, or one to be stacked is not contiguous (the caller's general path:
        ``_stats.norms``). Raises ``RuntimeError`` where they are on several devices."""
        dtypes = {t.dtype for t in tensors}
        if len(dtypes) != 1:
            return None
        (dtype,) = dtypes
        shapes = tuple(t.shape for t in tensors)
        plan = self._plans.get(shapes)
        if plan is None:
            plan = self._plans[shapes] = self._plan(tensors, shapes)
        stacked, fused, order = plan
        accumulate = torch.float32 if dtype in _HALF else None
        parts = []
        # (an optimizer's step runs under ``no_grad`` already: no context to enter)
        with torch.no_grad() if torch.is_grad_enabled() else _AS_IS:
            for group in stacked:
                members = [tensors[i] for i in group]
                if not all(t.is_contiguous() for t in members):
                    return None  # a strided tensor's own norm may round otherwise
                block = torch.stack(members)
                dims = tuple(range(1, block.dim())) or None
                parts.append(torch.linalg.vector_norm(block, self.ord, dim=dims, dtype=accumulate))
            if fused:
                values = torch._foreach_norm(
                    [tensors[i] for i in fused], self.ord, dtype=accumulate
                )
                parts.append(torch.stack(values))
            out = parts[0] if len(parts) == 1 else torch.cat(parts)
            if order is not None:
                if order.device != out.device:  # moved once, kept with the plan
                    order = order.to(out.device)
                    self._plans[shapes] = (stacked, fused, order)
                out = out.index_select(0, order)
        return out.float()

    def _plan(
        self, tensors: list[torch.Tensor], shapes: tuple
    ) -> tuple[list[list[int]], list[int], torch.Tensor | None]:
        if len(self._plans) > 16:  # shapes that keep changing: plan anew, keep few
            self._plans.clear()
        by_shape: dict[tuple, list[int]] = {}
        for i, shape in enumerate(shapes):
            by_shape.setdefault(tuple(shape), []).append(i)
        stacked = [g for s, g in by_shape.items() if len(g) >= MIN_STACK and len(s) > 0]
        taken = {i for g in stacked for i in g}
        fused = [i for i in range(len(tensors)) if i not in taken]
        placed = [i for g in stacked for i in g] + fused
        if placed == list(range(len(tensors))):
            return stacked, fused, None
        where = [0] * len(placed)
        for position, i in enumerate(placed):
            where[i] = position
        return stacked, fused, torch.tensor(where, dtype=torch.long)
