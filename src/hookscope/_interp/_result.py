"""The result of a patching sweep: a tensor that knows what its rows are."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["Patching"]


class Patching(torch.Tensor):
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

    @staticmethod
    def __new__(cls, data: torch.Tensor, **meta: Any) -> Patching:
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
        # Whatever torch computes from a result is a plain tensor: the rows' names would
        # not hold for it.
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))

    def as_tensor(self) -> torch.Tensor:
        """The values as a plain tensor (the same memory)."""
        return self.as_subclass(torch.Tensor)

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
