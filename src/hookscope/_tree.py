"""Walk the values modules take and return: tensors inside tuples, lists, dicts, dataclasses.

Hugging Face ``ModelOutput`` is both a dict and a dataclass; it is walked as a dict (its
``None`` fields are not items) and rebuilt with its own class. Anything else is a leaf.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = ["describe", "map_tensors", "same_structure", "tensors"]


def tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor inside ``obj``, in a fixed depth-first order."""
    out: list[torch.Tensor] = []
    _collect(obj, out)
    return out


def _collect(obj: Any, out: list[torch.Tensor]) -> None:
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif obj is None or isinstance(obj, (bool, int, float, str)):
        return  # a leaf (see map_tensors)
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            _collect(item, out)
    elif isinstance(obj, Mapping):
        for item in obj.values():
            _collect(item, out)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            _collect(getattr(obj, field.name), out)


def map_tensors(fn: Callable[[torch.Tensor], Any], obj: Any) -> Any:
    """``obj`` with every tensor replaced by ``fn(tensor)``; containers are rebuilt."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj  # a leaf; first: torch 2.9's Dynamo cannot ask None if it is a dataclass
    if isinstance(obj, tuple):
        items = [map_tensors(fn, item) for item in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if isinstance(obj, list):
        return [map_tensors(fn, item) for item in obj]
    if isinstance(obj, Mapping):
        items = {key: map_tensors(fn, value) for key, value in obj.items()}
        if dataclasses.is_dataclass(obj):  # transformers' ModelOutput
            return type(obj)(**items)
        try:
            return type(obj)(items)
        except TypeError:
            return items
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {
            f.name: map_tensors(fn, getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init
        }
        return dataclasses.replace(obj, **changes)
    return obj


def describe(obj: Any) -> str:
    """A short structural description: ``f32[2, 8]``, ``(f32[2, 8], None)``, ``{logits: ...}``."""
    if isinstance(obj, torch.Tensor):
        return tensor_summary(obj)
    if (isinstance(obj, tuple) and not hasattr(obj, "_fields")) or isinstance(obj, list):
        inner = ", ".join(describe(item) for item in obj)
        return (
            f"({inner},)"
            if isinstance(obj, tuple) and len(obj) == 1
            else (f"({inner})" if isinstance(obj, tuple) else f"[{inner}]")
        )
    if isinstance(obj, Mapping):
        inner = ", ".join(f"{key}: {describe(value)}" for key, value in obj.items())
        return f"{type(obj).__name__}({inner})" if type(obj) is not dict else f"{{{inner}}}"
    if (dataclasses.is_dataclass(obj) and not isinstance(obj, type)) or hasattr(obj, "_fields"):
        names = (
            [f.name for f in dataclasses.fields(obj)]
            if dataclasses.is_dataclass(obj)
            else list(obj._fields)
        )
        inner = ", ".join(f"{name}={describe(getattr(obj, name))}" for name in names)
        return f"{type(obj).__name__}({inner})"
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return repr(obj)
    return type(obj).__name__


_DTYPE_SHORT = {
    torch.float32: "f32",
    torch.float64: "f64",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "bool",
    torch.complex64: "c64",
    torch.complex128: "c128",
}


def tensor_summary(t: torch.Tensor) -> str:
    """``f32[2, 8]``, with the device when it is not the CPU (``f16[4] cuda:0``)."""
    dtype = _DTYPE_SHORT.get(t.dtype, str(t.dtype).removeprefix("torch."))
    text = f"{dtype}[{', '.join(str(s) for s in t.shape)}]"
    return text if t.device.type == "cpu" else f"{text} {t.device}"


def same_structure(old: Any, new: Any) -> str | None:
    """``None`` when ``new`` can stand in for ``old`` (same containers, same tensor shapes).

    Otherwise a sentence saying what differs.
    """
    old_t, new_t = tensors(old), tensors(new)
    if type(old) is not type(new) and not (
        isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor)
    ):
        return f"expected {describe(old)}, got {describe(new)}"
    if len(old_t) != len(new_t):
        return (
            f"expected {len(old_t)} tensors ({describe(old)}), got {len(new_t)} ({describe(new)})"
        )
    for i, (a, b) in enumerate(zip(old_t, new_t, strict=True)):
        if a.shape != b.shape:
            where = "" if len(old_t) == 1 else f" (tensor {i})"
            return f"shape{where} expected {tensor_summary(a)}, got {tensor_summary(b)}"
    return None
