"""What the interpretability verbs share: model inputs, and the one tensor of a module's value.

A module's *value* is its output's first tensor: the hidden states of a Hugging Face block
whether the block returns a tensor or a tuple (GPT-2's blocks return tuples in older
releases of transformers, a tensor in newer ones), laid out ``[N, T, ...]``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from .._tree import describe, map_tensors

__all__ = [
    "Inputs",
    "batch_size",
    "first_tensor",
    "inputs",
    "replace_first",
    "run",
    "stack",
    "value_error",
]

Inputs = tuple[tuple[Any, ...], dict[str, Any]]


def inputs(x: Any, forward_kwargs: Mapping[str, Any] | None, what: str) -> Inputs:
    """``(args, kwargs)`` for ``model(*args, **kwargs)``: ``x`` is a tensor, a tuple of
    positional inputs, or a mapping of keyword inputs (a tokenizer's ``BatchEncoding``)."""
    kwargs = dict(forward_kwargs or {})
    if isinstance(x, Mapping):
        return (), {**dict(x), **kwargs}
    if isinstance(x, torch.Tensor):
        return (x,), kwargs
    if isinstance(x, (tuple, list)):
        return tuple(x), kwargs
    raise TypeError(
        f"{what} must be a tensor, a tuple of positional inputs or a dict of keyword inputs, "
        f"got {describe(x)}"
    )


def run(model: torch.nn.Module, x: Inputs) -> Any:
    return model(*x[0], **x[1])


def batch_size(x: Inputs) -> int | None:
    """The first dimension shared by every input tensor, or None when they disagree."""
    sizes = {t.shape[0] for t in _leaves(x) if t.dim() > 0}
    return sizes.pop() if len(sizes) == 1 else None


def stack(x: Inputs, copies: int) -> Inputs:
    """``copies`` copies of every input tensor, one after the other along the first dim."""

    def repeat(t: torch.Tensor) -> torch.Tensor:
        return t if t.dim() == 0 else t.repeat(copies, *([1] * (t.dim() - 1)))

    args, kwargs = map_tensors(repeat, x[0]), map_tensors(repeat, x[1])
    return tuple(args), dict(kwargs)


def _leaves(x: Inputs) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    map_tensors(found.append, x)
    return found


def first_tensor(value: Any) -> torch.Tensor | None:
    """The tensor itself, or the first item of a tuple or list when it is a tensor."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
        return value[0]
    return None


def replace_first(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``value`` with its first tensor replaced by ``fn(that tensor)``."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    items = list(value)
    items[0] = fn(items[0])
    return type(value)(items) if not hasattr(value, "_fields") else type(value)(*items)


def value_error(name: str, value: Any, verb: str) -> TypeError:
    return TypeError(
        f"{verb}: {name!r} returned {describe(value)}; it needs a tensor, or a tuple whose "
        "first item is a tensor (the hidden states). Choose the module that returns them."
    )
