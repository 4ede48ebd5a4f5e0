"""One forward pass of the model with hooks on the explained modules.

Each call of an explained module gives its output A, copied when the hook runs (so an
in-place op after the module, ``nn.ReLU(inplace=True)`` or torchvision DenseNet's
``F.relu(norm5(x), inplace=True)``, cannot change it), and, for the methods that need a
gradient, what the gradient is taken against:

- where the module made its output (the usual case), the *gradient edge* into the autograd
  node that made it, taken when the hook runs: later in-place ops on the output give it a
  new node but leave that edge where it was, so ``torch.autograd.grad(score, edge)`` is the
  gradient with respect to the value the module returned;
- else (the output is, or shares memory with, one of the module's inputs; it is a view,
  whose in-place change would route the gradient around that node; or it does not require
  grad, in a frozen model) a copy ``src = A.clone()`` (a fresh leaf where it does
  not require grad) that the model never sees: it goes on with ``src.clone()``.

Either way autograd differentiates down to the module and no further, and makes no
parameter gradient.

A pass can also *patch* one call of one module: its output replaced by a given value (the
points on the path of integrated gradients).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge

from .._errors import ExplainError
from .._hooks import HookSet
from .._tree import map_tensors, tensors
from ._inputs import Inputs

__all__ = ["Call", "grad_mode_free", "record"]

# One call of an explained module: (src, A). src (a tensor, or the gradient edge into the node
# that made the output) is None where no gradient is taken.
Call = tuple["torch.Tensor | GradientEdge | None", "torch.Tensor"]


class _Recorder:
    def __init__(
        self,
        names: list[str],
        keep_src: bool,
        patch: tuple[str, int, torch.Tensor] | None,
        switch: bool,
    ) -> None:
        self.calls: dict[str, list[Call]] = {name: [] for name in names}
        self.keep_src = keep_src
        self.patch = patch
        self.switch = switch  # turn autograd on here (the pass started without it)

    def hook(self, name: str, module: nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
        t, put = _first_tensor(name, output)
        calls = self.calls[name]
        if self.switch:
            torch.set_grad_enabled(True)
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
            if t.grad_fn is not None and t._base is None and not _aliases(t, args, kwargs):
                # The module made t: the gradient is taken at the edge into the node that
                # made it, which later in-place ops on t do not move. One copy, A.
                calls.append((get_gradient_edge(t), t.detach().clone()))
                return None
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
    from_module: bool = False,
) -> tuple[dict[str, list[Call]], Any]:
    """Run ``model`` on ``inputs`` once: every call of ``modules`` and the model's output.

    ``from_module``: autograd records nothing until the first explained module has run (its
    hook turns it on): the layers below keep no tensors for a backward that never reaches
    them, and run faster. Grad mode is what it was when the pass ends.

    The hooks are removed when the pass ends (also when it raised); what autograd recorded
    stays, for ``torch.autograd.grad`` on the calls' ``src``.
    """
    recorder = _Recorder(list(modules), keep_src, patch, switch=from_module)
    with HookSet("explain") as hooks:
        for name, module in modules.items():
            hooks.forward(module, functools.partial(recorder.hook, name))
        with torch.no_grad() if from_module else contextlib.nullcontext():
            output = inputs.call(model)
    return recorder.calls, output


# torch modules whose forward takes another path without autograd (the fused "fast path" of
# nn.MultiheadAttention and the Transformer layers): their values would differ, so a model
# holding one records from its first layer.
_GRAD_MODE_PATHS = (
    nn.MultiheadAttention,
    nn.TransformerEncoderLayer,
    nn.TransformerDecoderLayer,
    nn.TransformerEncoder,
)


def grad_mode_free(model: nn.Module) -> bool:
    """Whether ``model``'s values do not depend on grad mode (``from_module`` is safe)."""
    return not any(isinstance(m, _GRAD_MODE_PATHS) for m in model.modules())


def _aliases(t: torch.Tensor, args: Any, kwargs: Any) -> bool:
    """Whether ``t`` shares memory with an input of the module (an in-place module, an
    identity, a view): its node then also carries the input's other uses."""
    storage = t.untyped_storage().data_ptr()
    return any(u is t or u.untyped_storage().data_ptr() == storage for u in tensors((args, kwargs)))


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
