"""One forward pass of the model with hooks on the explained modules.

Each call of an explained module gives its output A, copied when the hook runs (so an
in-place op after the module, ``nn.ReLU(inplace=True)`` or torchvision DenseNet's
``F.relu(norm5(x), inplace=True)``, cannot change it), and, for the methods that need a
gradient, the tensor ``src`` that the gradient is taken against:

    src = A.clone()            (never handed to the model: nothing changes it in place)
    the model goes on with src.clone()

``torch.autograd.grad(score, src)`` then differentiates down to the module and no further,
whatever the model does to its own copy afterwards, and makes no parameter gradient. Where
the module's output does not require grad (a frozen model), ``src`` is a fresh leaf that
does: nothing below the module needs a gradient then.

A pass can also *patch* one call of one module: its output replaced by a given value (the
points on the path of integrated gradients).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .._errors import ExplainError
from .._hooks import HookSet
from .._tree import map_tensors, tensors
from ._inputs import Inputs

__all__ = ["Call", "record"]

# One call of an explained module: (src, A). src is None where no gradient is taken.
Call = tuple["torch.Tensor | None", "torch.Tensor"]


class _Recorder:
    def __init__(
        self, names: list[str], keep_src: bool, patch: tuple[str, int, torch.Tensor] | None
    ) -> None:
        self.calls: dict[str, list[Call]] = {name: [] for name in names}
        self.keep_src = keep_src
        self.patch = patch

    def hook(self, name: str, module: nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
        t, put = _first_tensor(name, output)
        calls = self.calls[name]
        if self.patch is not None:
            patched, call, value = self.patch
            calls.append((None, t.detach()))  # counted only
            if name != patched or len(calls) - 1 != call:
                return None
            if value.shape != t.shape:
                raise ExplainError(
                    f"the output of {name!r} has shape {list(t.shape)} when the batch is "
                    f"repeated, not {list(value.shape)}: integrated gradients needs modules "
                    "whose output has the batch first."
                )
            return put(value.clone())
        if self.keep_src and torch.is_grad_enabled():
            src = t.clone() if t.requires_grad else t.detach().clone().requires_grad_()
            calls.append((src, src.detach()))
            return put(src.clone())
        calls.append((None, t.detach().clone()))
        return None


def record(
    model: nn.Module,
    inputs: Inputs,
    modules: dict[str, nn.Module],
    *,
    keep_src: bool,
    patch: tuple[str, int, torch.Tensor] | None = None,
) -> tuple[dict[str, list[Call]], Any]:
    """Run ``model`` on ``inputs`` once: every call of ``modules`` and the model's output.

    The hooks are removed when the pass ends (also when it raised); what autograd recorded
    stays, for ``torch.autograd.grad`` on the calls' ``src``.
    """
    recorder = _Recorder(list(modules), keep_src, patch)
    with HookSet("explain") as hooks:
        for name, module in modules.items():
            hooks.forward(module, functools.partial(recorder.hook, name))
        output = inputs.call(model)
    return recorder.calls, output


def _first_tensor(name: str, output: Any) -> tuple[torch.Tensor, Callable[[Any], Any]]:
    """The tensor explained in a module's output (the output itself, or the first tensor of
    a tuple, dict or ``ModelOutput``) and how to put a replacement for it back."""
    if isinstance(output, torch.Tensor):
        first = output
    else:
        found = tensors(output)
        if not found:
            raise ExplainError(
                f"{name!r} returned {type(output).__name__} with no tensor in it: nothing to "
                "explain. Choose a module that returns a tensor."
            )
        first = found[0]
    if not first.is_floating_point():
        raise ExplainError(
            f"{name!r} returned a {first.dtype} tensor: explain needs floating-point "
            "activations. Choose a module after the embedding (or the embedding's output)."
        )
    if first is output:
        return first, lambda new: new

    def put(new: torch.Tensor) -> Any:
        done: list[bool] = []

        def swap(t: torch.Tensor) -> torch.Tensor:
            if t is first and not done:
                done.append(True)
                return new
            return t

        return map_tensors(swap, output)

    return first, put
