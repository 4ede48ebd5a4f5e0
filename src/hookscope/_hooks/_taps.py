"""The tap for compiled graphs: hand values and gradients to Python at run time, no graph break.

Inside a Dynamo trace a hook's Python runs once, while the graph is traced, not at each call:
what it reads there (a capture's pass and call counters) becomes a constant the graph guards
on, and a counter that moves at each pass recompiles the graph at each pass (then, past
Dynamo's recompile limit, runs it eagerly; under ``fullgraph=True`` it dies). So inside a
trace a verb does no bookkeeping: it passes the tensors through :func:`tap`, a custom op that
returns copies of them after handing them to the callbacks of ``slot``, and whose backward
hands their gradients to the slot's gradient callback (``hookscope::tap_grads``, a second op:
the backward formula is traced into the backward graph, so the Python side effect must sit in
an opaque op, on the default Inductor backend as on ``aot_eager``). The callbacks run at run
time, in eager Python, where counting calls costs nothing to the graph.

A tapped value keeps its containers (tuples, dicts, dataclasses such as Hugging Face's
``ModelOutput``): :func:`form` describes them while the graph is traced, as a constant
(:func:`refill` rebuilds them around the tensors at run time). A leaf that is neither a tensor
nor a Python constant (``None``, a bool, int, float or string) comes back as ``None``.

Slots are process-wide and never reused: a compiled graph keeps the slot it was traced with,
and one that runs after its verb closed finds no callback and keeps nothing. The registry
holds a verb's callbacks only between :func:`open_tap` and :func:`close_tap`.

Both ops are tagged ``cudagraph_unsafe`` (torch 2.9+): a CUDA graph replays kernels without
the Python, so Inductor's ``mode="reduce-overhead"`` leaves them out of its CUDA graphs.

Torch releases: custom ops with an autograd formula from 2.4, but the compiled path is the
Monitor's (:data:`~hookscope._compat.MONITOR_FLOOR`, tested on 2.7 and newer); older releases
read in the traced hooks as before (:func:`taps_compile`).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .._compat import MONITOR_FLOOR, TORCH, custom_op
from .._tree import map_tensors, tensors

__all__ = ["close_tap", "form", "open_tap", "refill", "refill_tensors", "tap", "taps_compile"]

Values = Callable[[int, list[torch.Tensor]], None]  # (the form's number, the tensors)
Grads = Callable[[int, torch.Tensor], None]  # (the tensor's index, its gradient)

_CALLBACKS: dict[int, tuple[Values | None, Grads | None]] = {}
_SLOTS = itertools.count()
_FORMS: dict[Any, int] = {}  # a form's description -> its number (what the graph holds)
_FORM_LIST: list[Any] = []
_OPS: list[Any] = []  # the forward op, defined by the first trace (_ready)


def taps_compile() -> bool:
    """Whether this torch release taps inside compiled graphs (else the hooks read there)."""
    return TORCH >= MONITOR_FLOOR


def open_tap(values: Values | None = None, grads: Grads | None = None) -> int:
    """A fresh slot: ``values(form, tensors)`` gets a call's tensors (in :func:`tensors`
    order) as the graph runs, ``grads(index, grad)`` each one's gradient during backward.
    Both get the graph's own buffers, which Inductor may reuse after the op: copy what is
    kept. Defines nothing: the ops are defined by the first trace that uses them
    (:func:`_ready`), so an eager verb never pays for them."""
    slot = next(_SLOTS)
    _CALLBACKS[slot] = (values, grads)
    return slot


def close_tap(slot: int) -> None:
    """Forget ``slot``'s callbacks: a graph that still runs with it keeps nothing."""
    _CALLBACKS.pop(slot, None)


def tap(obj: Any, slot: int) -> Any:
    """``obj`` with its tensors replaced by copies that pass through ``slot``'s callbacks.
    For traced code: the op is opaque, so Inductor runs it (and its backward) at run time."""
    found = tensors(obj)
    if not found:
        return obj
    _ready()
    copies = iter(torch.ops.hookscope.tap(found, slot, _number(form(obj))))
    return refill_tensors(obj, copies)


def form(obj: Any) -> Any:
    """``obj``'s containers and constants, its tensors left out: a hashable description
    that Dynamo folds into a constant while it traces."""
    if isinstance(obj, torch.Tensor):
        return ("t",)
    if obj is None or type(obj) in (bool, int, float, str):  # first: torch 2.9's Dynamo
        return ("v", obj)  # cannot ask a None whether it is a dataclass
    if isinstance(obj, (tuple, list)):
        return ("s", type(obj), tuple(form(item) for item in obj))
    if isinstance(obj, Mapping):
        return ("m", type(obj), tuple(obj.keys()), tuple(form(v) for v in obj.values()))
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        names = tuple(f.name for f in dataclasses.fields(obj) if f.init)
        return ("d", type(obj), names, tuple(form(getattr(obj, n)) for n in names))
    return ("v", None)


def _number(description: Any) -> int:
    """The number of a form (the same for equal forms): the op's argument."""
    number = _FORMS.get(description)
    if number is None:
        number = _FORMS[description] = len(_FORM_LIST)
        _FORM_LIST.append(description)
    return number


# Dynamo calls it while tracing, with no graph break, and keeps the result as a constant
# (what torch.compiler.assume_constant_result marks, without importing Dynamo).
_number._dynamo_marked_constant = True  # type: ignore[attr-defined]


def refill(number: int, found: list[torch.Tensor]) -> Any:
    """The value a form (by number) describes, with ``found`` for its tensors."""
    return _build(_FORM_LIST[number], iter(found))


def _build(description: tuple, found: Any) -> Any:
    kind = description[0]
    if kind == "t":
        return next(found)
    if kind == "v":
        return description[1]
    if kind == "s":
        cls, items = description[1], [_build(item, found) for item in description[2]]
        if cls is list:
            return items
        return cls(*items) if hasattr(cls, "_fields") else cls(items)
    cls, keys, values = description[1:]
    items = {key: _build(value, found) for key, value in zip(keys, values, strict=True)}
    if kind == "d" or dataclasses.is_dataclass(cls):  # a dataclass; transformers' ModelOutput
        return cls(**items)
    try:
        return cls(items)
    except TypeError:
        return items


def refill_tensors(obj: Any, found: Any) -> Any:
    """``obj`` with its tensors, in :func:`tensors` order, taken from the iterator ``found``."""
    return map_tensors(lambda _: next(found), obj)


def _ready() -> bool:
    """Define the ops (once, tens of ms). Called while Dynamo traces :func:`tap`."""
    if not _OPS:
        _OPS.append(_define())
    return True


_ready._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _values(found: list[torch.Tensor], slot: int, number: int) -> None:
    values = _CALLBACKS.get(slot, (None, None))[0]
    if values is not None:
        values(number, [t.detach() for t in found])


def _grads(found: list[torch.Tensor], slot: int, indices: list[int]) -> None:
    grads = _CALLBACKS.get(slot, (None, None))[1]
    if grads is not None:
        for index, grad in zip(indices, found, strict=True):
            grads(index, grad.detach())


def _define() -> Any:
    @custom_op("hookscope::tap", python_side_effects=True)
    def tap_op(xs: list[torch.Tensor], slot: int, number: int) -> list[torch.Tensor]:
        _values(xs, slot, number)
        return [x.clone() for x in xs]  # a custom op may not return an alias of its input

    @tap_op.register_fake
    def _(xs: list[torch.Tensor], slot: int, number: int) -> list[torch.Tensor]:
        return [torch.empty_like(x) for x in xs]

    @custom_op("hookscope::tap_grads", python_side_effects=True)
    def tap_grads(gs: list[torch.Tensor], slot: int, indices: list[int]) -> list[torch.Tensor]:
        _grads(gs, slot, indices)
        return [g.clone() for g in gs]

    @tap_grads.register_fake
    def _(gs: list[torch.Tensor], slot: int, indices: list[int]) -> list[torch.Tensor]:
        return [torch.empty_like(g) for g in gs]

    def setup(ctx: Any, inputs: tuple, output: Any) -> None:
        ctx.slot = inputs[1]
        # A gradient only for what had one before the tap, and none made up for an output
        # that got none (as a tensor hook there would not be called)
        ctx.mark_non_differentiable(
            *(out for x, out in zip(inputs[0], output, strict=True) if not x.requires_grad)
        )
        ctx.set_materialize_grads(False)

    def backward(ctx: Any, gs: list[torch.Tensor | None]) -> tuple:
        indices = [i for i, g in enumerate(gs) if g is not None]
        if not indices or _CALLBACKS.get(ctx.slot, (None, None))[1] is None:
            return list(gs), None, None  # traced once: a slot without gradients, no op
        passed = iter(tap_grads([gs[i] for i in indices], ctx.slot, indices))
        return [None if g is None else next(passed) for g in gs], None, None

    tap_op.register_autograd(backward, setup_context=setup)
    return tap_op
