"""The result of a patching sweep: a tensor that knows what its rows are."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["LogitLens", "Patching"]


class _Labelled(torch.Tensor):
    """A tensor carrying what its dimensions are (attributes set from ``meta``); whatever
    torch computes from it is a plain tensor, since the labels would not hold for it."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, **meta: Any) -> Any:
        result = torch.Tensor._make_subclass(cls, data.detach(), False)
        for key, value in meta.items():
            setattr(result, key, value)
        return result

    def __init__(self, data: torch.Tensor, **meta: Any) -> None:
        pass

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))

    def as_tensor(self) -> torch.Tensor:
        """The values as a plain tensor (the same memory)."""
        return self.as_subclass(torch.Tensor)


class Patching(_Labelled):
    """The metric for each patched site: a tensor ``[modules, (positions), (heads)]``.

    It is a plain ``torch.Tensor`` (index it, plot it, ``.argmax()`` it; what torch returns
    from it is a plain tensor) with what the sweep was:

    Attributes:
        sites: The name of each row: the module's qualified name (``"name (call k)"`` for
            the k-th call of a module that ran more than once in a forward pass).
        dims: What each dimension is: ``("module",)``, then ``"position"``, ``"head"``.
        positions: The positions of the ``"position"`` dimension (``None`` without one).
        clean: The metric of the clean run, unpatched (a 0-dim tensor).
        corrupted: The metric of the corrupted run, unpatched.
        method: ``"exact"`` or ``"attribution"``.
    """

    sites: tuple[str, ...]
    dims: tuple[str, ...]
    positions: tuple[int, ...] | None
    clean: torch.Tensor
    corrupted: torch.Tensor
    method: str

    def effect(self) -> torch.Tensor:
        """``(value - corrupted) / (clean - corrupted)``: 0 where patching restored nothing,
        1 where it restored the clean metric (a plain tensor)."""
        return (self.as_tensor() - self.corrupted) / (self.clean - self.corrupted)

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        head = (
            f"Patching({self.method}, {' x '.join(self.dims)} = {tuple(self.shape)}, "
            f"clean={float(self.clean):.6g}, corrupted={float(self.corrupted):.6g})"
        )
        names = ", ".join(self.sites[:6]) + (", ..." if len(self.sites) > 6 else "")
        return f"{head}\n  sites: {names}\n{self.as_tensor()!r}"

    def __reduce_ex__(self, protocol: Any) -> Any:
        meta = {key: getattr(self, key) for key in _META}
        return (_rebuild, (self.as_tensor().clone(), meta))


_META = ("sites", "dims", "positions", "clean", "corrupted", "method")


def _rebuild(data: torch.Tensor, meta: dict[str, Any]) -> Patching:
    return Patching(data, **meta)


class LogitLens(_Labelled):
    """Log-probabilities ``[modules, N, T, vocab]`` read from each module; a plain tensor
    (what torch returns from it is one) with ``.sites`` naming its rows.

    ``.top(k)`` gives the ``k`` most likely tokens per module, sample and position;
    notebooks show the most likely token at each module and position (sample 0).
    """

    sites: tuple[str, ...]

    def top(self, k: int = 5) -> torch.return_types.topk:
        """``(values, indices)``, each ``[modules, N, T, k]``: log-probabilities and token ids
        of the ``k`` most likely tokens."""
        return self.as_tensor().topk(k, dim=-1)

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        names = ", ".join(self.sites[:6]) + (", ..." if len(self.sites) > 6 else "")
        return f"LogitLens(modules x N x T x vocab = {tuple(self.shape)})\n  sites: {names}"

    def _repr_html_(self) -> str:
        import html

        probs, ids = self.top(1)
        length = self.shape[2]
        head = "".join(f"<th>{t}</th>" for t in range(length))
        body = []
        for i, site in enumerate(self.sites):
            cells = "".join(
                f"<td title='p={float(probs[i, 0, t, 0].exp()):.3f}' style='background:"
                f"rgba(70,130,180,{float(probs[i, 0, t, 0].exp()):.2f})'>"
                f"{int(ids[i, 0, t, 0])}</td>"
                for t in range(length)
            )
            body.append(f"<tr><th style='text-align:left'>{html.escape(site)}</th>{cells}</tr>")
        return (
            f"<div><b>LogitLens</b> {tuple(self.shape)}: most likely next token (sample 0; "
            "shade and tooltip: its probability)<table><tr><th>module \\ position</th>"
            f"{head}</tr>{''.join(body)}</table></div>"
        )

    def __reduce_ex__(self, protocol: Any) -> Any:
        return (_rebuild_lens, (self.as_tensor().clone(), self.sites))


def _rebuild_lens(data: torch.Tensor, sites: tuple[str, ...]) -> LogitLens:
    return LogitLens(data, sites=sites)
