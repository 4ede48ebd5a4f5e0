"""The one place that registers and removes torch hooks.

Every verb (capture, extract, intervene, Monitor, summary) asks a :class:`HookSet` for its
hooks and never calls ``register_*_hook`` itself. A HookSet owns the handles it creates,
removes exactly those (hooks put on the model by the user or other libraries are never
touched), can be removed more than once, and is a context manager whose exit runs also when
the body raised, ``KeyboardInterrupt`` included.

Saving or copying a hooked model (``torch.save(model, f)``, ``pickle.dumps``,
``copy.deepcopy``) leaves hookscope's hooks out: while any HookSet holds module hooks,
``nn.Module.__getstate__`` is wrapped so that a module's pickled state lacks exactly the hook
ids hookscope registered. The copy carries no hookscope hook and nothing that refers to
hookscope (a checkpoint loads where hookscope is not installed), the original stays hooked,
and the user's and other libraries' hooks travel as they always did.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import sys
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.optim import optimizer as _optimizer
from torch.utils.hooks import RemovableHandle

from ._errors import CompiledModelError, HookscopeWarning

__all__ = [
    "HookSet",
    "check_not_compiled",
    "compiled_wrappers",
    "eager_calls",
    "eager_model",
    "eager_only",
    "in_backward_recompute",
    "live_handles",
    "live_objects",
    "training_mode",
    "uncompiled",
    "unwrap_parallel",
]

# Every HookSet that still holds handles; assert_no_hooks(only_hookscope=True) reads it.
_LIVE: weakref.WeakSet[HookSet] = weakref.WeakSet()

# Tensor hooks die with their tensor; prune dead handles once this many piled up, and then
# at twice what survived: registration stays O(1) amortised however many are alive at once
# (an LSTMCell unrolled over 1,000 steps hooks several thousand outputs per backward).
_PRUNE_AT = 4096

# Keys of always-called forward hooks, one per role in a HookSet (HookSet._always_called).
_ROLE_KEYS = itertools.count(-1, -1)

# Ids (``RemovableHandle.id``: unique in the process, or a role key unique to its HookSet) of
# the hooks live HookSets put into the hook dicts of modules: what a module's pickled state
# leaves out.
_MODULE_HOOK_IDS: set[int] = set()


class HookSet:
    """Every torch hook one hookscope object added. Removing the set removes them all.

    Forward hooks are registered ``with_kwargs=True``: pre-hooks are called as
    ``fn(module, args, kwargs)`` and may return ``(args, kwargs)``; forward hooks as
    ``fn(module, args, kwargs, output)`` and may return a new output.
    """

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self._handles: list[RemovableHandle] = []
        self._tensor_handles: list[RemovableHandle] = []
        self._prune_at = _PRUNE_AT
        self._roles: dict[Any, int] = {}  # always-called hooks: their key, by role
        # Ids of the hooks this set put on modules; forgotten also when the set is collected
        # without remove() (its modules went with it).
        self._module_ids: set[int] = set()
        weakref.finalize(self, _forget_module_hooks, self._module_ids)
        _LIVE.add(self)

    # -- modules ---------------------------------------------------------------------------
    def forward_pre(
        self, module: nn.Module, fn: Callable[..., Any], *, prepend: bool = False
    ) -> None:
        handle = module.register_forward_pre_hook(fn, with_kwargs=True, prepend=prepend)
        self._keep_module_hook(handle)

    def forward(
        self, module: nn.Module, fn: Callable[..., Any], *, always_call: bool = False
    ) -> None:
        if always_call:
            handle = self._always_called(module, fn)
        else:
            handle = module.register_forward_hook(fn, with_kwargs=True)
        self._keep_module_hook(handle)

    def _always_called(self, module: nn.Module, fn: Callable[..., Any]) -> RemovableHandle:
        """``register_forward_hook(fn, with_kwargs=True, always_call=True)``, keyed by the
        hook's role in this set (its function's code) rather than by a fresh id.

        ``torch.compile`` guards on the keys of a module's always-called hooks: with a fresh
        id per module, each of N identical blocks compiled one by one would compile again.
        One key for the same hook on every module keeps them one graph. (Keys are negative:
        torch's own ids count up from 0.)
        """
        role = _code_of(fn)
        key = self._roles.get(role) if role is not None else None
        if key is None and role is not None:
            key = self._roles[role] = next(_ROLE_KEYS)
        if key is None or key in module._forward_hooks:  # twice on one module: a fresh id
            return module.register_forward_hook(fn, with_kwargs=True, always_call=True)
        extra = [module._forward_hooks_with_kwargs, module._forward_hooks_always_called]
        handle = RemovableHandle(module._forward_hooks, extra_dict=extra)
        handle.id = key
        module._forward_hooks[key] = fn
        for marks in extra:
            marks[key] = True
        return handle

    def _keep_module_hook(self, handle: RemovableHandle) -> None:
        self._module_ids.add(handle.id)
        _MODULE_HOOK_IDS.add(handle.id)
        _install_getstate()
        self._keep(handle)

    # -- tensors and parameters ------------------------------------------------------------
    def tensor(self, t: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor | None]) -> None:
        """``t.register_hook(fn)``; the caller checks ``t.requires_grad`` first."""
        handles = self._tensor_handles
        handles.append(t.register_hook(fn))
        if len(handles) >= self._prune_at:
            self._tensor_handles = handles = [h for h in handles if _alive(h)]
            self._prune_at = max(_PRUNE_AT, 2 * len(handles))

    # -- optimizers ------------------------------------------------------------------------
    def optimizer_step_pre(self, opt: torch.optim.Optimizer, fn: Callable[..., Any]) -> None:
        self._keep(opt.register_step_pre_hook(fn))

    def optimizer_step_post(self, opt: torch.optim.Optimizer, fn: Callable[..., Any]) -> None:
        self._keep(opt.register_step_post_hook(fn))

    def optimizer_step_pre_global(self, fn: Callable[..., Any]) -> None:
        """A pre-hook on every optimizer's ``step()`` in the process (torch's global hooks)."""
        self._keep(_optimizer.register_optimizer_step_pre_hook(fn))

    def optimizer_step_post_global(self, fn: Callable[..., Any]) -> None:
        """A post-hook on every optimizer's ``step()`` in the process."""
        self._keep(_optimizer.register_optimizer_step_post_hook(fn))

    # -- lifetime --------------------------------------------------------------------------
    def _keep(self, handle: RemovableHandle) -> None:
        self._handles.append(handle)

    def handles(self) -> list[RemovableHandle]:
        return [*self._handles, *self._tensor_handles]

    def remove(self) -> None:
        """Remove every hook this set added. Safe to call more than once."""
        while self._tensor_handles:
            self._tensor_handles.pop().remove()
        while self._handles:
            self._handles.pop().remove()
        self._prune_at = _PRUNE_AT
        _forget_module_hooks(self._module_ids)

    def __len__(self) -> int:
        return len(self._handles) + sum(_alive(h) for h in self._tensor_handles)

    def __enter__(self) -> HookSet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"HookSet(owner={self.owner!r}, {len(self)} hooks)"


def _code_of(fn: Callable[..., Any]) -> Any:
    """The code object behind a hook (through ``functools.partial`` and bound methods)."""
    fn = getattr(fn, "func", fn)
    return getattr(getattr(fn, "__func__", fn), "__code__", None)


def _alive(handle: RemovableHandle) -> bool:
    hooks = handle.hooks_dict_ref()
    return hooks is not None and handle.id in hooks


# -- pickling and copying: hooked modules travel without hookscope's hooks ---------------------

# nn.Module's own __getstate__, while ours stands in for it; None while it is not installed.
_original_getstate: Callable[[nn.Module], dict[str, Any]] | None = None
_module_getstate = nn.Module.__getstate__  # torch's, for ours left in another wrapper's chain


def _forget_module_hooks(ids: set[int]) -> None:
    """The hooks ``ids`` are gone: stop leaving them out, and give torch's
    ``__getstate__`` back once no HookSet holds module hooks."""
    _MODULE_HOOK_IDS.difference_update(ids)
    ids.clear()
    if not _MODULE_HOOK_IDS:
        _uninstall_getstate()


def _install_getstate() -> None:
    """Put :func:`_getstate_without_hooks` in place of ``nn.Module.__getstate__`` (once)."""
    global _original_getstate
    if _original_getstate is None:
        _original_getstate = nn.Module.__getstate__
        nn.Module.__getstate__ = _getstate_without_hooks  # type: ignore[method-assign]


def _uninstall_getstate() -> None:
    """Give ``nn.Module.__getstate__`` back, unless someone wrapped ours since: then ours
    stays in their chain, a pass-through while no HookSet holds module hooks."""
    global _original_getstate
    if _original_getstate is not None and nn.Module.__getstate__ is _getstate_without_hooks:
        nn.Module.__getstate__ = _original_getstate  # type: ignore[method-assign]
        _original_getstate = None


def _getstate_without_hooks(self: nn.Module) -> dict[str, Any]:
    """``nn.Module.__getstate__``, less the hooks live HookSets registered on this module.

    The state is a shallow copy of ``__dict__``: a hook dict that holds one of ours is
    replaced in the copy by a filtered one (the module itself keeps its hooks); every other
    entry, and the state of a module we never hooked, is what torch returns.
    """
    state = (_original_getstate or _module_getstate)(self)
    ours = _MODULE_HOOK_IDS
    if ours:
        for key, value in list(state.items()):
            if "hooks" in key and isinstance(value, dict) and not ours.isdisjoint(value):
                state[key] = type(value)((k, v) for k, v in value.items() if k not in ours)
    return state


def live_handles() -> list[RemovableHandle]:
    """Handles of every HookSet that has not been removed yet."""
    return [h for handles in live_handle_sets() for h in handles]


def live_handle_sets() -> list[list[RemovableHandle]]:
    """The live handles of each HookSet that has not been removed yet, one list per set."""
    return [[h for h in hs.handles() if _alive(h)] for hs in list(_LIVE)]


def in_backward_recompute() -> bool:
    """True while autograd runs a backward pass, i.e. a checkpoint is re-running a forward.

    Always False while ``torch.compile`` traces: the graph task id is not a tensor, so
    reading it there would break the graph at every hook (and a checkpoint inside a
    compiled graph is recomputed by the graph itself, where no hook runs).
    """
    if torch.compiler.is_compiling():
        return False
    return torch._C._current_graph_task_id() != -1


def eager_only(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` as a hook that runs outside compiled graphs only.

    Traced into a graph (a child's hook, inside the compiled forward of its parent) it does
    nothing, with no graph break: ``fullgraph=True`` still compiles. Called eagerly, as the
    hooks of the module that ``torch.compile`` wraps are (they run before its graph), it runs
    ``fn`` as ``torch.compiler.disable`` would: Dynamo compiles nothing inside it. Its own
    frame is marked for Dynamo to skip, not to compile as a graph of its own (with
    ``fullgraph=True`` that graph would be the traced no-op).
    """
    disabled: list[Callable[..., Any]] = []

    def hook(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return None
        if "torch._dynamo" not in sys.modules:  # nothing can be compiling
            return fn(*args, **kwargs)
        if not disabled:
            disabled.append(torch.compiler.disable(fn))
        return disabled[0](*args, **kwargs)

    _skip_frame(hook.__code__)
    return hook


def _skip_frame(code: Any) -> None:
    """Have Dynamo run frames of ``code`` eagerly (and look at the frames they call) rather
    than compile them: ``torch._dynamo.eval_frame.skip_code``, without importing Dynamo."""
    try:
        from torch._C._dynamo import eval_frame
    except ImportError:  # a build without Dynamo: nothing is compiled
        return
    action = eval_frame._FrameAction
    eval_frame.set_code_exec_strategy(
        code, eval_frame._FrameExecStrategy(action.SKIP, action.DEFAULT)
    )


def check_not_compiled(model: nn.Module, verb: str) -> None:
    """Refuse a model that ``torch.compile`` already wrapped, in whole or in part.

    For the verbs that run the model themselves (``summary``, ``extract_dataset``); the
    others attach through :func:`eager_model`, which watches a compiled model instead.
    """
    for name, module in model.named_modules():
        wrapped = _is_optimized_module(module)
        if not wrapped and getattr(module, "_compiled_call_impl", None) is None:
            continue
        what = "the model" if not name else f"its submodule {name!r}"
        how = "torch.compile(...)" if wrapped else ".compile()"
        raise CompiledModelError(
            f"{verb}: {what} is already compiled with {how}, and {verb} runs the model "
            "itself.\n"
            + (
                "Fix: pass the eager module the wrapper holds, `._orig_mod`."
                if wrapped
                else "Fix: pass an uncompiled copy of the model."
            )
        )


def eager_model(model: nn.Module, verb: str) -> nn.Module:
    """The module to put hooks on, for a model that may be compiled already.

    ``torch.compile(model)`` returns a wrapper whose eager module, ``._orig_mod``, is the
    one whose module names the user knows: hooks go there, and Dynamo traces them into the
    graph when it compiles. A graph compiled *before* the hooks were added does not see
    them: Dynamo does not guard on module hooks (``skip_nnmodule_hook_guards``), so it runs
    that graph without them and records nothing, silently. That is the case when Dynamo
    holds compiled code for any of the model's modules (this model compiled and run, in
    whole, in place, or block by block, or another instance of one of its classes): then
    every compiled function is dropped, once, with a warning, and the model is traced again
    with the hooks at its next call.
    """
    model = uncompiled(model)
    compiled = _compiled_classes(model)
    if compiled:
        import torch._dynamo

        warnings.warn(
            f"hookscope: torch._dynamo.reset() so that the compiled model is traced again "
            f"with hookscope's hooks (one recompile). {verb} attached after torch.compile "
            f"had already compiled {', '.join(compiled)}; that graph would run without "
            "the hooks and record nothing. The reset drops every compiled function of this "
            "process: each compiles again at its next call. To avoid it, attach hookscope "
            "before the first compiled call.",
            HookscopeWarning,
            stacklevel=3,
        )
        torch._dynamo.reset()
    return model


def uncompiled(model: nn.Module) -> nn.Module:
    """The eager model inside ``torch.compile``'s wrapper and ``DistributedDataParallel``
    (in any order), or ``model`` itself: the one whose module names the user knows."""
    model = unwrap_parallel(model)
    while _is_optimized_module(model):
        model = unwrap_parallel(model._orig_mod)
    return model


def compiled_wrappers(model: nn.Module) -> list[nn.Module]:
    """The ``torch.compile`` wrappers (``OptimizedModule``) of ``model`` alive now.

    Hooks of a ``torch.nn`` container compiled whole (``torch.compile(nn.Sequential(...))``)
    are traced into its graph, so no hook of its own runs eagerly; its wrapper's hooks do.
    One walk over the objects the garbage collector tracks (a fraction of a second, once)."""
    optimized = _optimized_module_class()
    if optimized is None:
        return []
    return [o for o in live_objects(optimized) if o._orig_mod is model]


def live_objects(*kinds: type) -> list[Any]:
    """The objects of ``kinds`` the garbage collector tracks now (one walk over them).

    By ``type()``, never ``isinstance()``: torch's deprecated proxies warn on ``__class__``
    and a dead weak proxy raises on it."""
    return [o for o in gc.get_objects() if issubclass(type(o), kinds)]


def eager_calls() -> contextlib.AbstractContextManager[None]:
    """For a pass hookscope runs itself: every compiled function runs eagerly, with the
    hooks and without compiling anything (``torch.compiler.set_stance("force_eager")``)."""
    if "torch._dynamo" not in sys.modules:  # nothing was ever compiled
        return contextlib.nullcontext()
    return torch.compiler.set_stance("force_eager")


def _compiled_classes(model: nn.Module) -> list[str]:
    """Classes of ``model``'s modules whose ``forward`` code Dynamo holds compiled code for.

    Dynamo keeps its compiled graphs in a cache on each code object it compiled: the
    ``forward`` of the module ``torch.compile`` wrapped, of a module compiled in place, or
    of a block compiled on its own, shared by every instance of the class.
    """
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # dynamo never imported: nothing
    entries = getattr(eval_frame, "_debug_get_cache_entry_list", None)  # was compiled
    if entries is None:
        return []
    found: dict[str, None] = {}
    for kind in dict.fromkeys(type(m) for m in model.modules()):
        if any(entries(code) for code in _forward_codes(kind)):
            found[kind.__name__] = None
    if _wrapped_inline(model) and entries(_wrap_inline_code()):
        found[type(model).__name__] = None
    return list(found)


def _wrapped_inline(model: nn.Module) -> bool:
    """Whether ``torch.compile(model)`` compiles a wrapper around ``model`` instead of its
    ``forward``: the case for torch's own modules (``nn.Sequential``), whose code Dynamo
    inlines rather than compiles."""
    trace_rules = sys.modules.get("torch._dynamo.trace_rules")
    return trace_rules is not None and bool(trace_rules.check(model.forward))


def _wrap_inline_code() -> Any:
    """The code of the wrapper that ``torch.compile`` puts around torch's own modules, one
    code object for all of them: compiled code there may be for this model."""
    from torch._dynamo import external_utils

    return external_utils.wrap_inline(nn.Identity()).__code__


def _forward_codes(kind: type) -> list[Any]:
    """The code objects of ``kind.forward`` and of the functions its decorators wrap."""
    codes, fn, seen = [], getattr(kind, "forward", None), 0
    while fn is not None and seen < 8:  # a decorator's wrapper is the frame Dynamo compiles
        code = getattr(fn, "__code__", None)
        if code is not None:
            codes.append(code)
        fn, seen = getattr(fn, "__wrapped__", None), seen + 1
    return codes


def _optimized_module_class() -> type | None:
    """``torch.compile``'s wrapper class, or ``None`` when Dynamo was never imported (then
    nothing was compiled, and importing it just to look would cost a second)."""
    return getattr(sys.modules.get("torch._dynamo.eval_frame"), "OptimizedModule", None)


def _is_optimized_module(model: nn.Module) -> bool:
    optimized = _optimized_module_class()
    return optimized is not None and isinstance(model, optimized)


def unwrap_parallel(model: nn.Module) -> nn.Module:
    """The model inside ``DistributedDataParallel`` / ``DataParallel`` (the one whose module
    names a user knows), or ``model`` itself."""
    while isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        model = model.module
    return model


@contextlib.contextmanager
def training_mode(model: nn.Module, mode: bool) -> Iterator[None]:
    """Set ``model.train(mode)`` for the block, then restore every submodule's own flag."""
    before = [(module, module.training) for module in model.modules()]
    model.train(mode)
    try:
        yield
    finally:
        for module, flag in before:
            module.training = flag
