"""What capture and intervene share: call counting, recompute detection, input aliasing.

A *site* is one place a value passes: a module's input, output, or the gradient of either.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ._hooks import HookSet, in_backward_recompute

__all__ = ["CallClock", "Site", "alias_grad_inputs", "forward_failed"]

POINTS = ("input", "output", "grad_input", "grad_output")


@dataclass(frozen=True)
class Site:
    """Where an intervention function is being called.

    Attributes:
        name: Qualified name of the module.
        module: The module itself.
        call: Index of this call among the module's calls in the current forward pass.
        at: ``"input"``, ``"output"``, ``"grad_input"`` or ``"grad_output"``.
        index: For gradient sites, which tensor (position in ``grad_input`` / ``grad_output``)
            the gradient belongs to; ``None`` otherwise.
    """

    name: str
    module: nn.Module
    call: int
    at: str
    index: int | None = None

    def __repr__(self) -> str:
        index = "" if self.index is None else f", index={self.index}"
        return f"Site({self.name!r}, at={self.at!r}, call={self.call}{index})"


class CallClock:
    """Counts calls per module within one forward pass of the root model.

    A pass starts when the root module is called (a pre-hook registered first). When the
    root is never called (the user calls submodules directly), calls count from the start.
    Re-runs of forward during backward (activation checkpointing) are counted apart, per
    backward pass, so that they can be matched to the original calls.
    """

    def __init__(self, hooks: HookSet, root: nn.Module) -> None:
        self.pass_ = 0
        self._calls: dict[str, int] = defaultdict(int)
        self._recompute_calls: dict[str, int] = defaultdict(int)
        self._recompute_task = -1
        hooks.forward_pre(root, self._root_called, prepend=True)

    def _root_called(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if not in_backward_recompute():
            self.pass_ += 1
            self._calls.clear()

    def next(self, name: str) -> int:
        call = self._calls[name]
        self._calls[name] = call + 1
        return call

    def next_recompute(self, name: str) -> int:
        task = torch._C._current_graph_task_id()
        if task != self._recompute_task:
            self._recompute_task = task
            self._recompute_calls.clear()
        call = self._recompute_calls[name]
        self._recompute_calls[name] = call + 1
        return call


def alias_grad_inputs(args: tuple[Any, ...]) -> tuple[tuple[Any, ...], list[int]]:
    """Replace each positional tensor that needs a gradient by a fresh alias of itself.

    A hook on the alias sees exactly the gradient that flows back *through this module*,
    not the sum over every other use of the same tensor (a residual stream feeds many).
    Values, strides and storage are unchanged.
    """
    if not torch.is_grad_enabled():
        return args, []
    new, indices = list(args), []
    for i, arg in enumerate(args):
        if isinstance(arg, torch.Tensor) and arg.requires_grad and arg.layout == torch.strided:
            new[i] = arg.view_as(arg)
            indices.append(i)
    return (tuple(new), indices) if indices else (args, [])


def forward_failed(output: Any) -> bool:
    """Inside an ``always_call`` forward hook: did the module's forward raise?"""
    return output is None and sys.exc_info()[0] is not None


__all__ += ["POINTS", "in_backward_recompute"]
