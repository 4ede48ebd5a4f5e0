"""What a capture keeps of one module call: a :class:`Record`, and the rules for keeping tensors."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from ._errors import HookscopeError
from ._tree import describe, map_tensors

__all__ = ["Keeper", "Record", "version"]


def version(t: torch.Tensor) -> int | None:
    """``t._version``, the count of in-place changes to ``t``; ``None`` for a tensor made under
    ``torch.inference_mode()``, which keeps no count (reading it raises): such a tensor's
    changes cannot be told, so callers treat it as possibly changed."""
    return None if t.is_inference() else t._version


class Keeper:
    """How a captured tensor is stored: detached, copied, optionally moved or cast.

    Copying is the default because the model may change a tensor in place after the hook ran
    (``nn.ReLU(inplace=True)`` right after a BatchNorm); a detached alias would silently show
    the changed value. ``clone=False`` keeps aliases and instead checks ``_version`` on read
    (a tensor made under ``torch.inference_mode()`` has none, and is copied all the same).
    """

    __slots__ = ("clone", "device", "dtype")

    def __init__(self, device: Any = None, dtype: torch.dtype | None = None, clone: bool = True):
        if dtype is not None and not (dtype.is_floating_point or dtype.is_complex):
            raise ValueError(f"dtype must be a floating dtype (it casts kept values), got {dtype}")
        self.device = torch.device(device) if device is not None else None
        self.dtype = dtype
        self.clone = clone

    def tensor(self, t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        dtype = self.dtype if (self.dtype is not None and t.is_floating_point()) else None
        if self.device is not None or dtype is not None:
            moved = t.to(device=self.device, dtype=dtype, non_blocking=False)
            return moved.clone() if (moved is t and self.clone) else moved
        if self.clone or t.is_inference():  # an inference tensor's changes cannot be told
            return t.clone()
        t._hs_version = version(t)  # an alias: remember its version to detect later changes
        return t

    def value(self, obj: Any, name: str | None = None) -> Any:
        """``obj`` with each tensor kept (:meth:`tensor`); ``name``: the module it came from,
        for the error about a generator, whose items no capture can keep."""
        if _one_shot(obj):
            where = f" of {name!r}" if name is not None else ""
            raise HookscopeError(
                f"a {type(obj).__name__} is among the values{where}: its items exist only as "
                "the caller iterates it, so a capture could keep only an exhausted iterator "
                "(or would take the caller's items).\nFix: have the module return a list or a "
                "tuple (`return list(items)`), or capture the modules that make each item."
            )
        return map_tensors(self.tensor, obj)


class Record:
    """One call of one module: what went in, what came out, and the gradients of both.

    Attributes:
        name: The module's qualified name.
        call: Index of this call among the module's calls in the same forward pass (0 for the
            first; a shared block called twice has calls 0 and 1).
        input: Tuple of the positional arguments (``None`` when not captured).
        kwargs: Dict of the keyword arguments (``None`` when not captured).
        output: The value as the module returned it: tensor, tuple, dict, dataclass, ...
        grad_input: Tuple with one gradient per positional argument (``None`` where the
            argument is not a tensor or got no gradient), filled during ``backward()``.
        grad_output: Tuple with one gradient per tensor in the output, in the order
            :func:`hookscope` walks structures (tuple/list order, dict insertion order,
            dataclass field order), filled during ``backward()``.
    """

    __slots__ = ("_grad_in", "_grad_out", "_pass", "call", "input", "kwargs", "name", "output")

    def __init__(self, name: str, call: int, pass_: int) -> None:
        self.name = name
        self.call = call
        self._pass = pass_
        self.input: tuple[Any, ...] | None = None
        self.kwargs: dict[str, Any] | None = None
        self.output: Any = None
        self._grad_in: list[torch.Tensor | None] | None = None
        self._grad_out: list[torch.Tensor | None] | None = None

    @property
    def grad_input(self) -> tuple[torch.Tensor | None, ...] | None:
        return None if self._grad_in is None else tuple(self._grad_in)

    @property
    def grad_output(self) -> tuple[torch.Tensor | None, ...] | None:
        return None if self._grad_out is None else tuple(self._grad_out)

    def _fields(self) -> list[tuple[str, Any]]:
        fields = [("input", self.input), ("kwargs", self.kwargs), ("output", self.output)]
        fields += [("grad_input", self.grad_input), ("grad_output", self.grad_output)]
        return [(k, v) for k, v in fields if v is not None and not (isinstance(v, dict) and not v)]

    def __repr__(self) -> str:
        inner = ", ".join(f"{key}={describe(value)}" for key, value in self._fields())
        return f"Record({self.name!r}, call={self.call}, {inner})"

    def _repr_html_(self) -> str:
        from ._notebook import record_html

        return record_html(self, describe)


def _one_shot(obj: Any) -> bool:
    """A generator, or another iterator that is its own iterator (``map``, ``zip``), at the
    top of a value or one level inside a tuple, list or dict."""
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (tuple, list)) else ()
    return any(isinstance(x, Iterator) and not isinstance(x, torch.Tensor) for x in (obj, *items))
