"""What capture and intervene share: call counting, recompute detection, input aliasing.

A *site* is one place a value passes: a module's input, output, or the gradient of either.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
import weakref
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .._compat import is_compiling
from .._tree import map_tensors, tensors
from ._compile import guard_module_hooks, in_backward_recompute
from ._set import HookSet
from ._taps import close_tap, open_tap, refill_tensors, tap, taps_compile

__all__ = [
    "CallClock",
    "Site",
    "alias_grad_inputs",
    "alias_grad_outputs",
    "forward_failed",
    "is_replaying",
    "no_grad_in_model_message",
    "replaying",
    "same_layout_copy",
]

POINTS = ("input", "output", "grad_input", "grad_output")


@dataclass(frozen=True)
class Site:
    """Where an intervention function is being called.

    Attributes:
        name: Qualified name of the module.
        module: The module itself.
        call: Index of this call among the module's calls in the current forward pass (a
            ``generate()`` call, or any loop of the model's own methods calling it, is one
            pass: its prompt is call 0 of a block, each new token the next). When activation
            checkpointing re-runs the forward during backward, the index of the first-pass
            call being repeated (``-1`` in the rare case it cannot be told). Inside a
            compiled graph, the index the call had when the graph was traced (the same at
            every run of it); each compiled call of the root is a pass of its own.
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

    A pass starts when the root module is called (a pre-hook registered first), except when
    one of the root's own methods calls it again and again: a decoding loop such as Hugging
    Face's ``generate()`` (its prompt, then each new token) is one pass, whose calls are
    counted across its forwards (``site.call`` 0, 1, 2, ... for a block run once per token).
    When the root is never called (the user calls submodules directly), calls count from
    the start.

    Activation checkpointing re-runs forward during backward, segment by segment and last
    segment first; reversible layers (Reformer) re-run their parts in their
    ``autograd.Function``'s backward, in reverse order and on inputs rebuilt from the
    outputs. :meth:`original` finds which call of the first pass a re-run repeats:

    - a module called once in the pass that made the autograd node now running backward is
      its own match (the node's sequence number tells which calls came after it);
    - else the first module of a checkpoint segment is recognised by its input storage (the
      checkpoint keeps the very tensors of the first pass alive and hands them over; a
      freed tensor's address proves nothing, the allocator hands it out again);
    - and the modules after a match follow the first pass's order from there.

    Inside a compiled graph (the root traced with its hooks) nothing here may read a counter
    that moves between passes: Dynamo would guard on it and compile again at every pass.
    The pass starts at run time instead, through a tap on the root's first tensor argument
    (``_taps.py``), and calls are counted while the graph is traced, in a dict the trace
    itself makes (:meth:`next`): its counts are constants of that graph, the same at each run.
    """

    def __init__(self, hooks: HookSet, root: nn.Module) -> None:
        self.pass_ = 0
        # Grad mode the root's forward was called under while it runs, else None: tells
        # a torch.no_grad() of the user's from one inside the model.
        self.root_grad: bool | None = None
        self._calls: dict[str, int] = {}
        # Calls counted in traced code (next): the trace's own dict where the root's hooks
        # are traced with it, else the eager pass's
        self._traced: dict[str, int] = self._calls
        # (name, pass, call, storage key and weakref of the first tensor argument, autograd
        # sequence number when called)
        self._trail: deque[tuple[str, int, int, tuple | None, int, Any]] = deque(maxlen=1 << 16)
        self._task = -1
        self._at: int | None = None  # position in the trail of the last re-run call
        # The frame of the root's method that is calling it (a decoding loop), held while it
        # may call again (until a call from elsewhere, or the hooks go): a frame's id is
        # reused once it is freed, and two generate() calls in a row are two passes.
        self._loop: Any = None
        hooks.on_remove(self._forget_loop)
        self._hooks = hooks
        # by a weak reference: the registry is the process's, the clock is not
        tick = functools.partial(_tick_at_run_time, weakref.ref(self))
        self._tick = open_tap(tick) if taps_compile() else None
        if self._tick is not None:
            hooks.on_remove(functools.partial(close_tap, self._tick))
        guard_module_hooks(hooks)
        hooks.forward_pre(root, self._root_called, prepend=True)
        hooks.forward(root, self._root_returned, always_call=True)

    def _root_called(self, module: nn.Module, args: Any, kwargs: Any) -> Any:
        if is_compiling():
            self.root_grad = torch.is_grad_enabled()
            self._traced = {}  # made by the trace: no guard on what it holds
            return self._tick_in_graph(args, kwargs)
        guard_module_hooks(self._hooks)  # compiled since it was attached: guard the hooks
        if not in_backward_recompute():
            loop = _calling_method(module)
            if loop is None or loop is not self._loop:
                self._start_pass()
            self._loop = loop
            self.root_grad = torch.is_grad_enabled()
        return None

    def _start_pass(self) -> None:
        self.pass_ += 1
        self._calls = self._traced = {}

    def _tick_in_graph(self, args: Any, kwargs: Any) -> Any:
        """In a trace of the root: start the pass when the graph runs, through a tap on the
        root's first tensor argument (a copy of it, which the root receives instead)."""
        found = tensors((args, kwargs))
        if self._tick is None or not found:  # nothing to tap: the trace counts (and guards)
            self.pass_ += 1
            return None
        ticked = [tap(found[0], self._tick), *found[1:]]
        return refill_tensors((args, kwargs), iter(ticked))

    def _forget_loop(self) -> None:
        self._loop = None

    def _root_returned(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if not in_backward_recompute():
            self.root_grad = None

    def next(self, name: str, args: tuple[Any, ...] = ()) -> int:
        """Index of this call of ``name`` in the current pass (a first-pass call)."""
        if is_compiling():  # counted by the trace (a constant of the graph); no trail
            call = self._traced.get(name, 0)
            self._traced[name] = call + 1
            return call
        call = self._calls.get(name, 0)
        self._calls[name] = call + 1
        # A peek that numbers no node
        seq = torch._C._autograd._get_sequence_nr()
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        ref = None if first is None else weakref.ref(_source(first) if _copies else first)
        self._trail.append((name, self.pass_, call, _storage_key(args), seq, ref))
        return call

    def original(self, name: str, args: tuple[Any, ...] = ()) -> tuple[int, int] | None:
        """During a re-run: ``(pass, call)`` of the first-pass call it repeats, if known."""
        task = torch._C._current_graph_task_id()
        if task != self._task:
            self._task, self._at = task, None
        trail = self._trail
        at = self._at
        if at is not None and at + 1 < len(trail) and trail[at + 1][0] == name:
            self._at = at + 1
        else:
            self._at = self._only_call_since_node(name)
            if self._at is None:
                key = _storage_key(args)
                found = [
                    i
                    for i in range(len(trail) - 1, -1, -1)
                    if key is not None
                    and trail[i][0] == name
                    and trail[i][3] == key
                    and _alive(trail[i][5])
                ]
                if not found:
                    return None
                self._at = found[0]
        entry = trail[self._at]
        return entry[1], entry[2]

    def _only_call_since_node(self, name: str) -> int | None:
        """Trail position of ``name``'s one call in the pass that made the running node.

        Calls after the node was made have a larger sequence number; the first of them
        belongs to the pass whose forward made it. ``None`` when ``name`` was called
        before the node was made or more than once in that pass: no telling which call.
        """
        node = torch._C._current_autograd_node()
        if node is None:
            return None
        made = node._sequence_nr()
        trail = self._trail
        first = len(trail)
        while first > 0 and trail[first - 1][4] > made:
            first -= 1
        if first == len(trail):
            return None
        pass_ = trail[first][1]
        calls = [i for i, e in enumerate(trail) if e[1] == pass_ and e[0] == name]
        return calls[0] if len(calls) == 1 and trail[calls[0]][4] > made else None


def _tick_at_run_time(ref: weakref.ref[CallClock], form: Any, found: list[torch.Tensor]) -> None:
    """A compiled root was called: its pass starts (the tap on its first tensor argument)."""
    clock = ref()
    if clock is not None:
        clock._start_pass()
        clock._loop = None


_replays = threading.local()


@contextlib.contextmanager
def replaying() -> Iterator[None]:
    """While hookscope itself re-runs a step of the model on this thread (the Monitor's
    replay, which finds the op that made a NaN): the verbs' hooks run, so an intervention
    edits as it did in the step and the replay makes what the step made, but what records
    passes keeps none of the replay's (a capture holds only the passes the user's code ran)."""
    depth = getattr(_replays, "depth", 0)
    _replays.depth = depth + 1
    try:
        yield
    finally:
        _replays.depth = depth


def is_replaying() -> bool:
    """Inside :func:`replaying` on this thread (eager: never asked in traced code)."""
    return getattr(_replays, "depth", 0) > 0


# Frames of torch's module-call machinery, between a pre-hook and whoever called the module
_MODULE_FILE = nn.Module.__call__.__code__.co_filename


def _calling_method(module: nn.Module) -> Any:
    """The frame of the outermost running method of ``module`` in the chain of its methods
    that called it (``generate`` -> ``_sample`` -> ``self(...)``); ``None`` when someone
    else called it."""
    if is_compiling():
        return None
    frame = sys._getframe(2)  # above this and the pre-hook
    while frame is not None and frame.f_code.co_filename == _MODULE_FILE:
        frame = frame.f_back
    found = None
    while frame is not None:
        code = frame.f_code
        if not (code.co_argcount and code.co_varnames[0] == "self"):
            break
        if frame.f_locals.get("self") is not module:
            break
        found, frame = frame, frame.f_back
    return found


def _alive(ref: Any) -> bool:
    """Is the first-pass tensor still alive? Only then is its storage not reused by another."""
    return ref is not None and ref() is not None


def _storage_key(args: tuple[Any, ...]) -> tuple | None:
    """The first tensor's storage, shape and dtype; of what it is a copy of, where
    alias_grad_inputs made it (a re-run's verbs copy in another order, or not at all)."""
    for arg in args:
        if isinstance(arg, torch.Tensor):
            arg = _source(arg) if _copies else arg
            return (arg.data_ptr(), tuple(arg.shape), arg.dtype)
    return None


def alias_grad_inputs(
    args: tuple[Any, ...], module: nn.Module, *, read: bool = False
) -> tuple[tuple[Any, ...], dict[int, torch.Tensor]]:
    """Give each positional tensor of ``module``'s call that needs a gradient a copy of its
    own, and say which tensor to hook, by position.

    A hook on the copy sees exactly the gradient that flows back *through this module*, not
    the sum over every other use of the same tensor (a residual stream feeds many). A copy,
    not a view: a hook on a view is dropped when the module changes it in place
    (``nn.ReLU(inplace=True)``, ``x += y``). Values and gradients are unchanged.

    The order rule, edits before readers whatever the order the verbs were attached in: an
    edit (``read=False``) always makes a new copy, which the module receives, so the gradient
    meets the edits from the last attached to the first; a reader (``read=True``) of a tensor
    already copied for this call makes none and hooks the call's outermost copy, after the
    hooks already on it, where every edit of the call has run.
    """
    if not torch.is_grad_enabled():
        return args, {}
    new, hooked, copied = list(args), {}, False
    for i, arg in enumerate(args):
        if not (isinstance(arg, torch.Tensor) and arg.requires_grad):
            continue
        made = _copies.get(id(arg))
        outer = None
        if made is not None and made[0]() is arg and made[1] is module:
            outer = arg if made[2] is None else made[2]  # a copy made for this very call
        if read and outer is not None:
            hooked[i] = outer
            continue
        new[i] = hooked[i] = copy = same_layout_copy(arg)
        copied = True
        if not is_compiling():
            key = id(copy)
            ref = weakref.ref(copy, lambda _, k=key: _copies.pop(k, None))
            _copies[key] = (ref, module, outer, weakref.ref(arg))
    return (tuple(new) if copied else args), hooked


# The copies alias_grad_inputs made, by id, while they live: (the copy, weakly; the module of
# the call; the call's first copy, None where it is this one; what was copied, weakly).
# Nothing is put on the tensors.
_copies: dict[int, tuple[weakref.ref, nn.Module, torch.Tensor | None, weakref.ref]] = {}


def _source(arg: Any) -> Any:
    """What ``arg`` is a copy of, if alias_grad_inputs made it (else ``arg``)."""
    made = _copies.get(id(arg)) if isinstance(arg, torch.Tensor) else None
    if made is None or made[0]() is not arg or (source := made[3]()) is None:
        return arg
    return _source(source)


def same_layout_copy(t: torch.Tensor) -> torch.Tensor:
    """``t.clone()``, laid out in memory exactly like ``t``: sizes, strides, storage offset.

    The module then runs the very kernel it runs without hooks: on a non-contiguous view
    (``a, g = x.chunk(2, -1)``) a kernel may take another code path than on a contiguous
    copy and round differently (``nn.GELU`` does); the same offset keeps the alignment. The
    copy is a fresh autograd node, not a view, so a hook on it survives in-place ops.
    Memory: for a view, the copy spans as much storage as the view reaches into, so at most
    the size of the tensor it views.
    """
    if (
        (t.storage_offset() == 0 and t.is_contiguous())
        or t.numel() == 0
        or not _plain(t)
        or is_compiling()
    ):
        return t.clone()
    return _SameLayoutCopy.apply(t)


def _plain(t: torch.Tensor) -> bool:
    """A dense tensor whose storage holds its values as they read (no subclass, lazy bit)."""
    return (
        type(t) in (torch.Tensor, nn.Parameter)
        and t.layout == torch.strided
        and not (t.is_quantized or t.is_conj() or t.is_neg())
    )


class _SameLayoutCopy(torch.autograd.Function):
    """Copy the stretch of storage ``t`` uses, and view it with ``t``'s sizes and strides.

    The output is made with ``set_``, not as a view, so autograd sees a plain tensor that
    later in-place ops may change. Backward passes the gradient on as it is, like
    ``clone``'s.
    """

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor) -> torch.Tensor:
        offset = t.storage_offset()
        span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
        storage = t.new_empty(offset + span).untyped_storage()
        out = t.new_empty(0).set_(storage, offset, t.shape, t.stride())
        # Copy the whole stretch (gaps included): it also works where elements overlap
        # (stride 0, from expand), which ``out.copy_(t)`` refuses.
        out.as_strided((span,), (1,), offset).copy_(t.as_strided((span,), (1,), offset))
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def alias_grad_outputs(
    output: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Any, list[torch.Tensor | None]]:
    """Tensors to hook for the gradient of each output slot, and the output to return.

    Returns the output to pass on (``output`` itself when nothing changed) and, per tensor of
    the output in :func:`tensors` order, the tensor to hook (``None`` where no gradient).

    The common case, one output tensor that is not one of the inputs, is hooked as it is:
    no copy, and the hook survives later in-place ops. Otherwise each output tensor is
    replaced by a copy, so that its hook sees the gradient of *that slot* only: not the part
    flowing into other outputs computed from it inside the module (attention weights feed
    the attention output), nor other uses of a tensor an identity-like module passed through.
    """
    if not torch.is_grad_enabled():
        return output, []
    outs = tensors(output)
    if len(outs) == 1 and outs[0].requires_grad:
        inputs = {id(t) for t in tensors(args)} | {id(t) for t in tensors(kwargs)}
        if id(outs[0]) not in inputs:
            return output, outs
    hooked: list[torch.Tensor | None] = []

    def copy(t: torch.Tensor) -> torch.Tensor:
        t = same_layout_copy(t) if t.requires_grad else t
        hooked.append(t if t.requires_grad else None)
        return t

    if not any(t.requires_grad for t in outs):
        return output, [None] * len(outs)
    return map_tensors(copy, output), hooked


def no_grad_in_model_message(asked: str, lost: str, instead: str, names: str) -> str:
    """NoGradWarning text for modules the model's own forward ran with autograd off.

    ``asked`` starts the sentence ("capture asked for gradients of"), ``names`` are the
    modules, ``lost`` what that cost ("no gradient was recorded"), ``instead`` the fallback.
    """
    return (
        f"{asked} {names}, but the model's own forward ran them with autograd off (in "
        "torch.no_grad() or an autograd.Function's forward inside the model's code; the model "
        f"itself was called with autograd on), and they did not run again with autograd while "
        f"hooks were attached, so {lost}. Models with reversible layers (Reformer) or "
        "reentrant activation checkpointing do this: they re-run parts of the forward during "
        "backward(), and hookscope does see the modules re-run there (for Reformer: each "
        "layer's attention and feed_forward and their submodules, not the layer holding "
        f"them). Choose those modules and call backward() inside the `with` block, or {instead}."
    )


def forward_failed(output: Any) -> bool:
    """Inside an ``always_call`` forward hook: did the module's forward raise?"""
    return output is None and sys.exc_info()[0] is not None


__all__ += ["POINTS", "in_backward_recompute"]
