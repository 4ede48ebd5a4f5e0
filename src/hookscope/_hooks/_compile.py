"""Hooks and compiled models: hooks that stay out of compiled graphs, the eager module
behind ``torch.compile``'s wrapper, and compiled code that must be traced again to see new
hooks (dropped for that model's code only, never the process's other compiled functions).
"""

from __future__ import annotations

import contextlib
import gc
import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .._compat import force_eager, is_compiling, skip_frame
from .._errors import CompiledModelError, HookscopeWarning
from .._inputs import check_model
from ._set import HookSet

__all__ = [
    "break_graph_for",
    "check_not_compiled",
    "compiled_wrappers",
    "eager_calls",
    "eager_model",
    "eager_only",
    "guard_module_hooks",
    "in_backward_recompute",
    "live_objects",
    "uncompiled",
    "unwrap_parallel",
]


def in_backward_recompute() -> bool:
    """True while autograd runs a backward pass, i.e. a checkpoint is re-running a forward.

    Always False while ``torch.compile`` traces: the graph task id is not a tensor, so
    reading it there would break the graph at every hook (and a checkpoint inside a
    compiled graph is recomputed by the graph itself, where no hook runs).
    """
    if is_compiling():
        return False
    return torch._C._current_graph_task_id() != -1


def break_graph_for(what: str, verb: str) -> None:
    """Inside a Dynamo trace: break the graph here, saying why.

    A gradient is read or edited by a tensor hook that calls Python during backward, which
    a graph cannot hold: Dynamo breaks the graph at this module (the model still compiles,
    around it), and under ``fullgraph=True``, where it may not, it refuses with this message
    instead of an internal error pointing into hookscope. (capture's ``grad_output`` needs
    no hook there: it goes through the tap, ``_taps.py``.)"""
    if is_compiling():
        import torch._dynamo

        values = "'input'/'output'" + ("/'grad_output'" if verb == "capture" else "")
        torch._dynamo.graph_break(
            msg=f"hookscope: {what} needs a gradient hook, which cannot be compiled into a "
            "graph. Fix: compile without fullgraph=True (the graph then breaks at this module "
            f"only), or run {verb} on the eager model (`compiled._orig_mod`), or ask only for "
            f"{values}, which compile without a break."
        )


def guard_module_hooks(hooks: HookSet) -> None:
    """While ``hooks`` holds module hooks, have Dynamo guard on every module's hooks, empty
    ones included (``skip_nnmodule_hook_guards = False``; held through ``_patches``).

    By default Dynamo skips the guard on an empty hook dict: with identical blocks compiled
    one by one (``block.compile()``), the graph traced for ``blocks.0`` (no hook) would run
    ``blocks.1`` as well, without the hook hookscope put on its child, silently. With the
    guard, a block whose hooks differ compiles once more and runs its hooks. Only once Dynamo
    is imported (importing it costs seconds; nothing compiles before): a verb calls this
    when attaching and at each outermost call of the model.
    """
    if is_compiling():  # traced into a root's graph: the guard is set by then
        return
    config = sys.modules.get("torch._dynamo.config")
    if config is not None:
        hooks.patch(config, "skip_nnmodule_hook_guards", lambda skip: False)


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
        if is_compiling():
            return None
        if "torch._dynamo" not in sys.modules:  # nothing can be compiling
            return fn(*args, **kwargs)
        if not disabled:
            disabled.append(torch.compiler.disable(fn))
        return disabled[0](*args, **kwargs)

    skip_frame(hook.__code__)
    return hook


def check_not_compiled(model: nn.Module, verb: str) -> None:
    """Refuse a model that ``torch.compile`` already wrapped, in whole or in part.

    For the verbs that run the model themselves (``summary``, ``extract_dataset``); the
    others attach through :func:`eager_model`, which watches a compiled model instead.
    """
    check_model(model, verb)  # a function or TorchScript: no hook would run
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
    the compiled code of those ``forward`` functions is dropped (``reset_code``; every
    other compiled function of the process keeps its graphs), with a warning, and the model
    is traced again with the hooks at its next call.
    """
    check_model(model, verb)  # a function or TorchScript: no hook would run
    model = uncompiled(model)
    compiled = _compiled_codes(model)
    if compiled:
        import torch._dynamo

        warnings.warn(
            f"hookscope: {verb} attached after torch.compile had already compiled "
            f"{', '.join(compiled)}; that code would run without hookscope's hooks and "
            "record nothing, so it is dropped and traced again with the hooks at its next "
            "call (one recompile; other compiled functions keep theirs). To avoid it, "
            "attach hookscope before the first compiled call.",
            HookscopeWarning,
            stacklevel=3,
        )
        for codes in compiled.values():
            for code in codes:
                torch._dynamo.reset_code(code)
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
    return force_eager()


def _compiled_codes(model: nn.Module) -> dict[str, list[Any]]:
    """Code objects Dynamo holds compiled code for among ``model``'s ``forward`` functions,
    by the class they belong to.

    Dynamo keeps its compiled graphs in a cache on each code object it compiled: the
    ``forward`` of the module ``torch.compile`` wrapped, of a module compiled in place, or
    of a block compiled on its own, shared by every instance of the class (an eager twin
    compiled later would run the graph traced for another instance, without the hooks).
    """
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # dynamo never imported: nothing
    entries = getattr(eval_frame, "_debug_get_cache_entry_list", None)  # was compiled
    if entries is None:
        return {}
    found: dict[str, list[Any]] = {}
    for kind in dict.fromkeys(type(m) for m in model.modules() if _may_hide_hooks(m, model)):
        codes = [code for code in _forward_codes(kind) if entries(code)]
        if codes:
            found[kind.__name__] = codes
    # torch's own containers share one wrapper's code: only when this model has a wrapper
    inline = _wrap_inline_code() if _wrapped_inline(model) else None
    if inline is not None and entries(inline) and compiled_wrappers(model):
        found.setdefault(type(model).__name__, []).append(inline)
    return found


def _may_hide_hooks(module: nn.Module, model: nn.Module) -> bool:
    """Whether compiled code of ``module``'s ``forward`` could run without hooks hookscope
    adds: the hooks of the children it calls are traced into it, and a module compiled on
    its own (in place, or the model itself) traces its own. A leaf's ``forward`` compiled as
    a frame of its own (after a graph break, say) runs inside torch's module call, which
    still runs the leaf's hooks: its code is left alone, and so are other models' graphs.
    So are torch's own containers (``nn.Sequential``): compiled whole they run through a
    wrapper (``_wrap_inline_code``), and their ``forward`` holds compiled code only as the
    frames a graph break left inside another compiled model, which every model shares."""
    if getattr(module, "_compiled_call_impl", None) is not None:
        return True
    if type(module).__module__.startswith("torch."):
        return False
    return module is model or next(iter(module.children()), None) is not None


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
