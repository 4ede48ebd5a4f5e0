"""The one place that registers and removes torch hooks.

Every verb (capture, extract, intervene, Monitor, summary) asks a :class:`HookSet` for its
hooks and never calls ``register_*_hook`` itself. A HookSet owns the handles it creates,
removes exactly those (hooks put on the model by the user or other libraries are never
touched), can be removed more than once, and is a context manager whose exit runs also when
the body raised, ``KeyboardInterrupt`` included.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.optim import optimizer as _optimizer
from torch.utils.hooks import RemovableHandle

from ._errors import CompiledModelError

__all__ = [
    "HookSet",
    "check_not_compiled",
    "in_backward_recompute",
    "live_handles",
    "training_mode",
    "unwrap_parallel",
]

# Every HookSet that still holds handles; assert_no_hooks(only_hookscope=True) reads it.
_LIVE: weakref.WeakSet[HookSet] = weakref.WeakSet()

# Tensor hooks die with their tensor; prune dead handles once this many piled up.
_PRUNE_AT = 4096


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
        _LIVE.add(self)

    # -- modules ---------------------------------------------------------------------------
    def forward_pre(
        self, module: nn.Module, fn: Callable[..., Any], *, prepend: bool = False
    ) -> None:
        self._keep(module.register_forward_pre_hook(fn, with_kwargs=True, prepend=prepend))

    def forward(
        self, module: nn.Module, fn: Callable[..., Any], *, always_call: bool = False
    ) -> None:
        self._keep(module.register_forward_hook(fn, with_kwargs=True, always_call=always_call))

    # -- tensors and parameters ------------------------------------------------------------
    def tensor(self, t: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor | None]) -> None:
        """``t.register_hook(fn)``; the caller checks ``t.requires_grad`` first."""
        self._tensor_handles.append(t.register_hook(fn))
        if len(self._tensor_handles) >= _PRUNE_AT:
            self._tensor_handles = [h for h in self._tensor_handles if _alive(h)]

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

    def __len__(self) -> int:
        return len(self._handles) + sum(_alive(h) for h in self._tensor_handles)

    def __enter__(self) -> HookSet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"HookSet(owner={self.owner!r}, {len(self)} hooks)"


def _alive(handle: RemovableHandle) -> bool:
    hooks = handle.hooks_dict_ref()
    return hooks is not None and handle.id in hooks


def live_handles() -> list[RemovableHandle]:
    """Handles of every HookSet that has not been removed yet."""
    return [h for hs in list(_LIVE) for h in hs.handles() if _alive(h)]


def in_backward_recompute() -> bool:
    """True while autograd runs a backward pass, i.e. a checkpoint is re-running a forward."""
    return torch._C._current_graph_task_id() != -1


def check_not_compiled(model: nn.Module, verb: str) -> None:
    """Refuse a model that ``torch.compile`` already wrapped, in whole or in part.

    Hooks added to a compiled module are silently ignored by its compiled graph
    (``torch._dynamo.config.skip_nnmodule_hook_guards``), so nothing would be seen.
    """
    for name, module in model.named_modules():
        wrapped = _is_optimized_module(module)
        if not wrapped and getattr(module, "_compiled_call_impl", None) is None:
            continue
        what = "the model" if not name else f"its submodule {name!r}"
        how = "torch.compile(...)" if wrapped else ".compile()"
        raise CompiledModelError(
            f"{verb}: {what} is already compiled with {how}. Hooks added after compiling are "
            "silently ignored by the compiled graph, so nothing would be seen.\n"
            f"Fix: attach hookscope to the eager model *before* compiling, e.g.\n"
            f"    with hs.{verb}(model, ...):\n"
            f"        compiled = torch.compile(model)\n"
            f"        compiled(x)\n"
            + (
                "or pass the eager module the wrapper holds, `._orig_mod`, to run it uncompiled."
                if wrapped
                else "or run the model uncompiled for this call."
            )
        )


def _is_optimized_module(model: nn.Module) -> bool:
    # Look only in sys.modules: if dynamo was never imported, nothing was compiled, and
    # importing it just to check would cost a second.
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    optimized = getattr(eval_frame, "OptimizedModule", None)
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
