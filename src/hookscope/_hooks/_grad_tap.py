"""The gradient identity for compiled graphs: read an output's gradient with no graph break.

A tensor hook calls Python during backward, which a graph cannot hold: Dynamo breaks the
graph at the module (and refuses under ``fullgraph=True``). Inside a trace a verb instead
passes the output through :func:`grad_tap`, a custom op that returns a copy of ``x`` and
whose backward hands the gradient on unchanged after giving a copy of it to the callback
registered for ``slot`` (``hookscope::grad_keep``, a second op: the backward formula is
traced into the backward graph, so the Python side effect must sit in an opaque op that runs
at run time, on the default Inductor backend as on ``aot_eager``).

Slots are process-wide and never reused: a compiled graph keeps the slot it was traced with,
and one that runs after its verb closed finds no callback and keeps nothing. The registry
holds a verb's callback only between :func:`open_tap` and :func:`close_tap`.

Torch releases: custom ops with an autograd formula from 2.4, but the compiled path is the
Monitor's (:data:`~hookscope._compat.MONITOR_FLOOR`, tested on 2.7 and newer); older releases
keep the graph break (:func:`taps_compile`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch

from .._compat import MONITOR_FLOOR, TORCH, custom_op

__all__ = ["close_tap", "grad_tap", "open_tap", "taps_compile"]

_CALLBACKS: dict[int, Callable[[int, torch.Tensor], None]] = {}
_SLOTS = itertools.count()
_OPS: list[Any] = []  # the forward op, defined by the first trace (_ready)


def taps_compile() -> bool:
    """Whether this torch release reads gradients inside compiled graphs (else: a break)."""
    return TORCH >= MONITOR_FLOOR


def open_tap(callback: Callable[[int, torch.Tensor], None]) -> int:
    """A fresh slot whose gradients go to ``callback(index, grad)``. ``grad`` lives in a
    compiled graph's buffer, which Inductor may reuse after the op: copy what is kept.
    Defines nothing: the ops are defined by the first trace that uses them (:func:`_ready`),
    so an eager capture never pays for them."""
    slot = next(_SLOTS)
    _CALLBACKS[slot] = callback
    return slot


def close_tap(slot: int) -> None:
    """Forget ``slot``'s callback: a graph that still runs with it keeps nothing."""
    _CALLBACKS.pop(slot, None)


def grad_tap(x: torch.Tensor, slot: int, index: int) -> torch.Tensor:
    """``x`` (a copy) whose gradient goes to ``slot``'s callback as ``index``. For traced
    code: the op is opaque, so Inductor runs it (and its backward) at run time."""
    _ready()
    return torch.ops.hookscope.grad_tap(x, slot, index)


def _ready() -> bool:
    """Define the ops (once, tens of ms). Called while Dynamo traces :func:`grad_tap`."""
    if not _OPS:
        _OPS.append(_define())
    return True


# What torch.compiler.assume_constant_result(_ready) does (Dynamo calls it while tracing, with
# no graph break, and keeps the result), without importing Dynamo at ``import hookscope``.
_ready._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _keep(grad: torch.Tensor, slot: int, index: int) -> None:
    callback = _CALLBACKS.get(slot)
    if callback is not None:
        callback(index, grad.detach())


def _define() -> Any:
    @custom_op("hookscope::grad_tap", mutates_args=())
    def tap(x: torch.Tensor, slot: int, index: int) -> torch.Tensor:
        return x.clone()  # a custom op may not return an alias of its input

    @tap.register_fake
    def _(x: torch.Tensor, slot: int, index: int) -> torch.Tensor:
        return torch.empty_like(x)

    @custom_op("hookscope::grad_keep", mutates_args=())
    def keep(g: torch.Tensor, slot: int, index: int) -> torch.Tensor:
        _keep(g, slot, index)
        return g.clone()

    @keep.register_fake
    def _(g: torch.Tensor, slot: int, index: int) -> torch.Tensor:
        return torch.empty_like(g)

    def setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        ctx.slot, ctx.index = inputs[1], inputs[2]

    def backward(ctx: Any, g: torch.Tensor) -> tuple:
        return keep(g, ctx.slot, ctx.index), None, None

    tap.register_autograd(backward, setup_context=setup)
    return tap
