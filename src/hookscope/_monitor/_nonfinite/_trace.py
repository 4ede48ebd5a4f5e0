"""Replaying a step under an op-level tracer, to name the op and the line that made a NaN/Inf.

On healthy steps the Monitor only keeps a :class:`Tape` of the step, by reference: the inputs
of each outermost call into the model (the model itself, or a child that the training code
calls directly: Lightning's ``training_step`` runs ``self.decoder(self.encoder(x))``, never the
module's own forward), the RNG state before each call, and the gradient that reached the
call's outputs from outside it (so the backward pass replays without the user's loss
function). When
a flag fires, :func:`trace` replays the tape under a ``TorchDispatchMode`` that follows every
non-finite value back to the op that made it from finite inputs, and leaves weights, buffers,
gradients and RNG state exactly as they were.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import weakref
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..._diagnose import Finding
from ..._hooks import (
    HookSet,
    compiled_wrappers,
    eager_only,
    in_backward_recompute,
    replaying,
    same_layout_copy,
)
from ..._tree import map_tensors, tensors
from ._pystate import MISSING, PythonState, own_state, restore_state

__all__ = ["OUTPUT_TAG", "Call", "Origin", "Tape", "replay", "top_modules", "trace"]

# The key of the mark on the autograd node of each output copy the tape hands the caller:
# (the call's index in the tape, the output's position)
OUTPUT_TAG = "hookscope_output"

_TORCH_DIR = os.path.dirname(torch.__file__)
# Ops whose output is uninitialised memory: garbage there is no NaN made by the model.
_UNINITIALISED = frozenset(
    {
        "aten.empty",
        "aten.empty_like",
        "aten.empty_strided",
        "aten.new_empty",
        "aten.new_empty_strided",
        "aten.resize_",
        "aten.set_",
    }
)
_HOOKSCOPE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Call:
    """One outermost call into the model: its inputs, the RNG state before it, and the
    gradients that reached its outputs from outside (by position in ``tensors(output)``).
    ``module``: the module called, when it is not the model itself (a child of it)."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    rng: dict[str, Any]
    grads: dict[int, torch.Tensor] = field(default_factory=dict)
    outputs: list[torch.Tensor] | None = None  # detached outputs, kept for a flight recorder
    # each output's version counter when it was kept (None: not tracked, an inference tensor)
    versions: list[int | None] | None = None
    done: bool = False
    module: nn.Module | None = None
    # The step's first call only: the Python attributes of the modules with their own state
    # (a count of their calls), as they were before it, so that a replay starts from them
    state: list[tuple[nn.Module, dict[str, Any]]] | None = None


class Tape:
    """The current step's outermost calls into the model, kept by reference (nothing is
    copied).

    An outermost call is a call of the root module, or of one of its top modules (its direct
    children, looked into through ``ModuleList``/``ModuleDict``) while nothing of the model
    runs: a training loop that calls the model's parts one by one is replayed call by call,
    in order. ``on_top_call(name, module, args, kwargs, output)`` is called as each outermost
    call returns (kept or not), with the output its caller gets."""

    # Beyond this many calls in one step (micro-batches), later ones are not kept: the
    # tape holds each call's inputs and output gradients until step() ends, and a replay
    # that finds nothing in the kept calls leaves the module-level finding as it is.
    MAX_CALLS = 16

    def __init__(
        self,
        hooks: HookSet,
        root: nn.Module,
        *,
        keep_outputs: bool = False,
        on_first_call: Any = None,
        on_top_call: Any = None,
        on_outer: Any = None,
    ) -> None:
        self.keep_outputs = keep_outputs
        self.on_first_call = on_first_call  # called before the step's first outermost call
        self.on_top_call = on_top_call
        # on_outer(True, kept) as an outermost call starts (kept: the tape keeps it), and
        # on_outer(False, kept) once it returned (or raised)
        self.on_outer = on_outer
        # An outermost call of a child of the root (the loop calls the model's parts): the
        # children's hooks ("tape" group of the HookSet) must then stay on
        self.children_called = False
        self.calls: list[Call] = []
        # gradients that reached a kept call's outputs from outside, ever (did a backward
        # pass reach the model?)
        self.grads_heard = 0
        # The kept call whose outputs the caller got as aliases, as ``on_top_call`` hears of
        # it (``None``: that call was not kept, or handed its outputs as they are)
        self.aliased: Call | None = None
        self.paused = False
        self.grad_enabled: bool | None = None  # autograd's mode when the model was called
        # True while an outermost call that the tape keeps runs: a replay of the step can
        # then re-run whatever happens inside it.
        self.recording = False
        self._depth = 0
        # The model may run compiled: the hooks of the module torch.compile wraps run
        # eagerly, before its graph, and tape it; traced into a graph, they do nothing.
        self._hooks = hooks
        self._eager = eager_only(self._before), eager_only(self._after)
        self._wrappers_taped = False
        # Modules with their own state: each module's Python attributes are read before the
        # first two steps' first calls; those that changed between them are read again before
        # every step's first call (none, for most models: nothing per step)
        self._modules = list(root.modules())
        self._seen: list[tuple[nn.Module, dict[str, Any]]] | None = None
        self._stateful: list[tuple[nn.Module, tuple[str, ...]]] = []
        self._outer = False  # the outermost call under way was announced to on_outer
        tops = top_modules(root)
        self._tape(*tops[0])
        # The children's hooks only count calls while the root runs: a HookSet group, off on
        # steps where the loop is known to call the root only (``ModuleHooks``)
        with hooks.grouped("tape"):
            for name, module in tops[1:]:
                self._tape(name, module)

    def _tape(self, name: str, module: nn.Module) -> None:
        before, after = self._eager
        self._hooks.forward_pre(module, functools.partial(before, name), prepend=True)
        self._hooks.forward(module, functools.partial(after, name), always_call=True)

    def tape_wrappers(self, root: nn.Module) -> None:
        """A compiled graph ran and the tape kept no call: the root's hooks were traced into
        the graph (a ``torch.nn`` container compiled whole). Tape the calls of its
        ``torch.compile`` wrappers instead, whose hooks run eagerly, once: from the next step
        the step can be replayed (a NaN's op and line) and unsampled steps flag only the
        model's edges (one recompile). Both taping one call: the outer one keeps it."""
        if self._wrappers_taped or self.calls:
            return
        self._wrappers_taped = True
        for wrapper in compiled_wrappers(root):
            self._tape("", wrapper)

    def _before(self, name: str, module: nn.Module, args: Any, kwargs: Any) -> None:
        if torch.compiler.is_compiling():  # a compiled graph is replayed eagerly, not taped
            return
        self._depth += 1
        if self.paused or self._depth > 1 or in_backward_recompute():
            return
        self.grad_enabled = torch.is_grad_enabled()
        if name:
            self.children_called = True
        if not self.calls and self.on_first_call is not None:
            self.on_first_call()
        kept = len(self.calls) < self.MAX_CALLS
        if self.on_outer is not None:
            self._outer = True
            self.on_outer(True, kept)
        if not kept:
            return
        call = Call(args, dict(kwargs), rng_state(), module=module if name else None)
        if not self.calls:
            call.state = self._state_before()
        self.calls.append(call)
        self.recording = True

    def _state_before(self) -> list[tuple[nn.Module, dict[str, Any]]] | None:
        """The Python state the step starts from, of the modules known to change theirs."""
        if self._modules:  # the first two steps: every module's, to find which change
            now = own_state(self._modules)
            if self._seen is None:
                self._seen = now
                return now
            for (module, before), (_, after) in zip(self._seen, now, strict=True):
                changed = tuple(k for k, v in after.items() if before.get(k, MISSING) is not v)
                if changed:
                    self._stateful.append((module, changed))
            self._modules, self._seen = [], None
            return now
        if not self._stateful:
            return None
        return [(m, {k: vars(m)[k] for k in keys if k in vars(m)}) for m, keys in self._stateful]

    def _after(self, name: str, module: nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
        if torch.compiler.is_compiling():
            return None
        self._depth -= 1
        if self._depth > 0:
            return None
        self.grad_enabled = None
        kept, self.recording = self.recording, False
        if self._outer:
            self._outer = False
            self.on_outer(False, kept)
        if self.paused or in_backward_recompute():
            return None
        self.aliased = None
        aliased = self._end(output) if kept else None
        if self.on_top_call is not None:
            self.on_top_call(name, module, args, kwargs, output if aliased is None else aliased)
        return aliased

    def _end(self, output: Any) -> Any:
        """The kept call that just returned ``output``: what its caller gets instead (aliases
        that hear the gradient coming from outside), or ``None`` for ``output`` itself."""
        call = self.calls[-1]
        if call.done:
            return None
        call.done = True
        if output is None:
            return None
        if not torch.is_grad_enabled():
            self._keep(call, tensors(output))
            return None
        # Hand the caller a fresh alias of each output, whose hook sees only the gradient
        # flowing in from outside the call (not, say, from a loss the model computes itself).
        # A copy (the hook layer's one aliasing rule), not a view: a hook on a view is dropped
        # when the caller changes it in place (``logits.div_(T)``), and the step's loss with it.
        count, index = [0], len(self.calls) - 1

        def alias(t: torch.Tensor) -> torch.Tensor:
            i = count[0]
            count[0] += 1
            if not (t.requires_grad and t.is_floating_point()):
                return t
            out = same_layout_copy(t)
            self._hooks.tensor(out, lambda g, i=i: self._grad(call, i, g))
            # where the training code's graph enters the model (``_nonfinite/_loss.py``)
            out.grad_fn.metadata[OUTPUT_TAG] = (index, i)
            return out

        # The model's own outputs are kept, not the copies: the caller may change its copy in
        # place (``F.relu(out, inplace=True)``, a head whose first ReLU is in place).
        originals = tensors(output)
        output = map_tensors(alias, output)
        self._keep(call, originals)
        self.aliased = call
        return output

    def _keep(self, call: Call, outs: list[torch.Tensor]) -> None:
        if self.keep_outputs:
            call.outputs = [t.detach() for t in outs]
            call.versions = [None if t.is_inference() else t._version for t in outs]

    def _grad(self, call: Call, i: int, grad: torch.Tensor) -> None:
        self.grads_heard += 1
        call.grads[i] = grad if i not in call.grads else call.grads[i] + grad

    def reset(self) -> None:
        self.calls = []


def top_modules(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """The root and the modules a training loop may call directly instead of it: its
    children, and the children of a ``ModuleList``/``ModuleDict`` child (no forward of
    their own), by qualified name."""
    found: list[tuple[str, nn.Module]] = [("", root)]
    todo = [(name, child) for name, child in root.named_children()]
    while todo:
        name, module = todo.pop(0)
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            todo += [(f"{name}.{n}", c) for n, c in module.named_children()]
        elif all(module is not m for _, m in found):  # a module shared by two names: once
            found.append((name, module))
    return found


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


@dataclass(frozen=True)
class Origin:
    """The op that made a NaN/Inf from finite inputs."""

    op: str  # the forward op, e.g. "aten.log" (in backward: the op whose gradient broke)
    phase: str  # "forward" or "backward"
    # The innermost module of the model whose own code called the op ("" the model itself,
    # None: not known); ``own``: that module has children, and the op ran between them.
    module: str | None
    source: str | None  # "file.py:42", the user's line that called the forward op
    produced: str  # "NaN" or "Inf"
    own: bool = False

    def refine(self, finding: Finding, *, cheap_check: bool = True) -> Finding:
        """``finding`` (a ``nonfinite`` one) with this op, phase, module and line; its old
        message is kept after the new one with ``cheap_check``. The module is the one whose
        own code called the op: a container, not the child that ran before or after it."""
        module = finding.module if self.module is None else self.module
        where = f" at {self.source}" if self.source else ""
        formula = (
            " (in the backward pass: its gradient formula)" if self.phase == "backward" else ""
        )
        message = (
            f"{self.phase}: {self.op} in {_place(module, self.own)} made {self.produced} from "
            f"finite inputs{where}{formula}, at step {finding.step}"
        )
        return dataclasses.replace(
            finding,
            module=module,
            phase=self.phase,
            op=self.op,
            source=self.source,
            message=f"{message}. Cheap check: {finding.message}" if cheap_check else message,
        )


def _place(module: str, own: bool) -> str:
    """Where an op ran, for a message: a container's own code is said to be so, since the
    cheap check can only name the child that ran next to it."""
    if module == "":
        return "the model's own code (module '')"
    return f"{module!r} (its own code, outside its children)" if own else repr(module)


def trace(
    model: nn.Module,
    calls: list[Call],
    suspect: str | None = None,
    *,
    keep_outputs: bool = False,
    changed: list[tuple[str, list[str]]] | None = None,
) -> Any:
    """Replay ``calls`` on ``model`` under the tracer; the origin of the first NaN/Inf.

    ``suspect`` is the module whose output the cheap flags found non-finite first; in the
    forward pass the origin of the value that reached that output is reported (a mask
    filled with -inf that a softmax absorbs is not a culprit). Weights, buffers, ``.grad``,
    RNG state are left exactly as they were. With ``keep_outputs``, returns
    ``(origin, outputs)``, the outputs of the calls replayed. ``changed``: see :func:`replay`.
    """
    origin, outputs = None, []
    runs_ = replay(model, calls, changed=changed)
    with closing(runs_) as runs, _Tracer(model, suspect) as tracer:
        for output, backward in runs:
            outputs.append(output)
            origin = tracer.forward_done(output)
            if origin is not None:
                break
            backward()
            origin = tracer.backward_origin
            if origin is not None:
                break
    return (origin, outputs) if keep_outputs else origin


def replay(
    model: nn.Module, calls: list[Call], *, changed: list[tuple[str, list[str]]] | None = None
) -> Iterator[tuple[Any, Callable[[], None]]]:
    """Re-run ``calls`` on ``model``: yields each call's output and a function that runs its
    backward pass from the gradients recorded at its outputs. Weights, buffers, ``.grad``, the
    RNG state and the modules' own Python attributes are left exactly as they were once the
    generator is closed (use it in ``contextlib.closing``: a caller may stop early). The
    replay starts from the Python state the tape read before the step (modules that count
    their calls). ``changed`` gets the modules whose own attributes the replay changed (by
    qualified name, with the attributes' names): state the step cannot be re-run without."""
    with _preserved(model, changed), replaying():
        if calls and calls[0].state is not None:
            restore_state(calls[0].state)  # the modules' own state before the step
        for call in calls:
            module = model if call.module is None else call.module
            args, kwargs = map_tensors(_cut, (call.args, call.kwargs))
            set_rng_state(call.rng)
            with torch.enable_grad():
                output = module(*args, **kwargs)

            def backward(call: Call = call, output: Any = output) -> None:
                outs = tensors(output)
                pairs = [(outs[i], g) for i, g in call.grads.items() if i < len(outs)]
                pairs = [(o, g) for o, g in pairs if o.requires_grad]
                if pairs:
                    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])

            yield output, backward


def _cut(t: torch.Tensor) -> torch.Tensor:
    """An input made by an earlier part of the step (the encoder's output, fed to the
    decoder): the same values, without the graph behind it, whose saved tensors the step's
    own backward has freed. The replayed backward pass then ends at the call's inputs. A
    copy, not a leaf: the model may change its input in place (``ReLU(inplace=True)``)."""
    if t.grad_fn is None:
        return t
    return t.detach().requires_grad_().clone()


@contextmanager
def _preserved(model: nn.Module, changed: list[tuple[str, list[str]]] | None) -> Iterator[None]:
    """Restore buffers, ``.grad``, the RNG state and the modules' own Python attributes (a
    count of calls the replay advanced, a list it appended to) after the block."""
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    attrs = PythonState(model)
    grads = [(p, p.grad) for p in model.parameters()]
    rng = rng_state()
    for p, _ in grads:
        p.grad = None
    try:
        yield
    finally:
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
        for p, grad in grads:
            p.grad = grad
        set_rng_state(rng)
        moved = attrs.restore()
        if changed is not None:
            changed.extend(moved)


class _Tracer(TorchDispatchMode):
    """Follows each non-finite tensor back to the op that first made it from finite inputs."""

    def __init__(self, model: nn.Module, suspect: str | None) -> None:
        super().__init__()
        named = list(model.named_modules())
        self.names = {id(m): n for n, m in named}
        self.containers = {n for n, m in named if next(iter(m.children()), None)}
        self.suspect = suspect
        self._modules = [m for _, m in named]
        # The modules running now, innermost last; None for one that is not the model's (made
        # on the fly in a forward): its ops belong to the model's module that called it.
        self.stack: list[str | None] = []
        self.backward_origin: Origin | None = None
        self.suspect_origin: Origin | None = None
        self.suspect_bad = False  # whether the suspect's output held a NaN/Inf
        self.first_forward: Origin | None = None
        self._origin: dict[int, tuple[weakref.ref, Origin]] = {}
        self._pending: list[tuple[weakref.ref, Origin]] = []
        self._handles: list[Any] = []
        self._hooks = HookSet("nonfinite trace")

    def __enter__(self) -> _Tracer:
        mm = torch.nn.modules.module
        self._handles = [
            mm.register_module_forward_pre_hook(self._enter_module),
            mm.register_module_forward_hook(self._exit_made, always_call=True),
        ]
        # A model's module is left after its own forward hooks (global hooks run before
        # them): what an edit of its output makes there (an intervention, a hook of the
        # user's) is made in that module, not in its parent
        with self._hooks.attaching():
            for module in self._modules:
                self._hooks.forward(module, self._exit_module, always_call=True)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._hooks.remove()
        super().__exit__(*exc)

    def _enter_module(self, module: nn.Module, args: Any) -> None:
        self.stack.append(self.names.get(id(module)))

    def _exit_made(self, module: nn.Module, args: Any, output: Any) -> None:
        """A module made on the fly in a forward (no hook of its own) is left here."""
        if id(module) not in self.names and self.stack:
            self.stack.pop()

    def _exit_module(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if not self.stack:
            return
        name = self.stack.pop()
        if in_backward_recompute():
            return
        if name == self.suspect and self.suspect_origin is None:
            self.suspect_origin = self._origin_of(output)
            self.suspect_bad = self.suspect_bad or _any_nonfinite(output)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        self._label_nodes()
        flat_in = [t for t in tree_flatten((args, kwargs))[0] if _float_tensor(t)]
        bad_in = [t for t in flat_in if not _finite(t)]
        out = func(*args, **kwargs)
        if str(func.overloadpacket) in _UNINITIALISED:
            return out
        flat_out = [t for t in tree_flatten(out)[0] if _float_tensor(t)]
        origin = self._forward_origin(func)
        # Label what autograd makes of it, also when a checkpoint re-runs forward in backward.
        self._pending.extend((weakref.ref(t), origin) for t in flat_out)
        if torch._C._current_graph_task_id() == -1:
            for t in flat_out:
                if _finite(t):
                    continue
                # Made here from finite inputs, or carried from where a non-finite input was
                # made (nowhere we saw, when it came in with the data or the weights: that is
                # carried too, so that no op is blamed for it)
                made = (self._origin_of(bad_in) or _OUTSIDE) if bad_in else _with(origin, t)
                self._origin[id(t)] = (weakref.ref(t), made)
                if not bad_in and self.first_forward is None:
                    self.first_forward = made
        elif self.backward_origin is None and not bad_in:
            broken = [t for t in flat_out if not _finite(t)]
            if broken:
                self.backward_origin = self._backward_origin(func, broken[0])
        return out

    def _forward_origin(self, func: Any) -> Origin:
        module = next((n for n in reversed(self.stack) if n is not None), None)
        return Origin(
            op=str(func.overloadpacket),
            phase="forward",
            module=module,
            source=_user_line(),
            produced="NaN",
            own=module in self.containers,
        )

    def _backward_origin(self, func: Any, t: torch.Tensor) -> Origin:
        node = torch._C._current_autograd_node()
        info = node.metadata.get("hookscope") if node is not None else None
        if info is None:
            name = node.name() if node is not None else str(func.overloadpacket)
            return Origin(name, "backward", None, None, _kind(t))
        return dataclasses.replace(info, phase="backward", produced=_kind(t))

    def _label_nodes(self) -> None:
        """Autograd sets an op's ``grad_fn`` after the op returns: label it now, so that a
        backward op can name the forward op, module and line its node came from."""
        pending, self._pending = self._pending, []
        for ref, origin in pending:
            t = ref()
            node = getattr(t, "grad_fn", None) if t is not None else None
            if node is not None and "hookscope" not in node.metadata:
                node.metadata["hookscope"] = origin

    def _origin_of(self, value: Any) -> Origin | None:
        """Where the first non-finite tensor of ``value`` was made; ``_OUTSIDE`` only where
        every one came in from outside (the data, the weights)."""
        outside = None
        for t in tensors(value):
            entry = self._origin.get(id(t))
            if entry is not None and entry[0]() is t:
                if entry[1] is not _OUTSIDE:
                    return entry[1]
                outside = _OUTSIDE
        return outside

    def forward_done(self, output: Any) -> Origin | None:
        """After a replayed forward: the origin of the NaN/Inf that reached the suspect (or
        the model's output), if the forward pass made one. The first NaN/Inf made anywhere
        only when one reached them untracked: a -inf mask absorbed on the way (a causal mask
        before a softmax) is no culprit of a NaN that the backward pass makes."""
        self._label_nodes()
        origin = self.suspect_origin or self._origin_of(output)
        if origin is _OUTSIDE:  # it came in with the data or the weights: no op made it
            return None
        if origin is None and (self.suspect_bad or _any_nonfinite(output)):
            origin = self.first_forward
        return origin


# The origin of a non-finite value that no op of the replay made (the data, the weights)
_OUTSIDE = Origin("", "forward", None, None, "NaN")


def _with(origin: Origin, t: torch.Tensor) -> Origin:
    return dataclasses.replace(origin, produced=_kind(t))


def _kind(t: torch.Tensor) -> str:
    return "NaN" if bool(torch.isnan(t).any()) else "Inf"


def _float_tensor(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())


def _any_nonfinite(value: Any) -> bool:
    """Checked outside autograd: under activation checkpointing, an op that saves a tensor
    for backward in the first pass and not in the recomputation breaks the backward."""
    with torch.no_grad():
        return any(not _finite(t.detach()) for t in tensors(value) if _float_tensor(t))


def _finite(t: torch.Tensor) -> bool:
    return t.numel() == 0 or bool(torch.isfinite(t).all())


def _user_line() -> str | None:
    """The innermost frame outside torch and hookscope: the line that called the op."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        internal = path.startswith(_HOOKSCOPE_DIR) and not path.endswith("_demo.py")
        if not (path.startswith(_TORCH_DIR) or internal):
            return f"{path}:{frame.f_lineno}"
        frame = frame.f_back
    return None
