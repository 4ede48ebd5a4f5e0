"""What the interpretability verbs share: model inputs, and the one tensor of a module's value.

A module's *value* is its output's first tensor: the hidden states of a Hugging Face block
whether the block returns a tensor or a tuple (GPT-2's blocks return tuples in older
releases of transformers, a tensor in newer ones), laid out ``[N, T, ...]``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from .._hooks import CallClock, HookSet
from .._tree import describe, map_tensors

__all__ = [
    "Inputs",
    "Key",
    "attach",
    "batch_size",
    "first_tensor",
    "inputs",
    "replace_first",
    "run",
    "stack",
    "value_error",
]

Inputs = tuple[tuple[Any, ...], dict[str, Any]]
Key = tuple[str, int]  # (module, call in the forward pass)


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


def value_error(name: str, value: Any, what: str) -> TypeError:
    return TypeError(
        f"{what} {name!r} is {describe(value)}; hookscope needs a tensor, or a tuple whose "
        "first item is a tensor (the hidden states). Choose a module that returns them."
    )


def attach(
    hooks: HookSet,
    model: nn.Module,
    hooked: Mapping[str, bool],
    fn: Callable[[Key, torch.Tensor], torch.Tensor | None],
) -> None:
    """Call ``fn((name, call), value)`` at the value of each module in ``hooked``: its first
    positional input where ``hooked[name]``, else its output's first tensor. A tensor that
    ``fn`` returns replaces the value. Calls are counted per forward pass of ``model`` by
    the hook layer's clock, as capture and intervene count them (``Site.call``)."""
    clock = CallClock(hooks, model)
    modules = dict(model.named_modules())

    def on_value(name: str, value: torch.Tensor) -> torch.Tensor | None:
        return fn((name, clock.next(name)), value)

    for name, at_input in hooked.items():
        if at_input:
            hooks.forward_pre(modules[name], functools.partial(_input_hook, name, on_value))
        else:
            hooks.forward(modules[name], functools.partial(_output_hook, name, on_value))


def _input_hook(name: str, on_value: Callable, module: nn.Module, args: tuple, kwargs: dict) -> Any:
    if not args or not isinstance(args[0], torch.Tensor):
        raise value_error(name, args, "the input of")
    new = on_value(name, args[0])
    return None if new is None else ((new, *args[1:]), kwargs)


def _output_hook(
    name: str, on_value: Callable, module: nn.Module, args: tuple, kwargs: dict, output: Any
) -> Any:
    value = first_tensor(output)
    if value is None:
        raise value_error(name, output, "the output of")
    new = on_value(name, value)
    return None if new is None else replace_first(output, lambda _: new)
