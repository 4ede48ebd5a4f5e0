"""Finding the optimizers that step a model: torch's global optimizer step hooks.

The Monitor never needs ``optimizer=``: every ``Optimizer.step()`` in the process passes
through the global pre- and post-hooks, and an optimizer is adopted when it steps at least one
parameter of the watched model. That covers optimizers created after the Monitor, several
optimizers on one model, and wrappers such as Accelerate's ``AcceleratedOptimizer`` (whose
``step()`` calls the wrapped optimizer's). Optimizers of other models are ignored.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from ..._hooks import HookSet

__all__ = ["OptimizerWatch", "unwrap"]


def unwrap(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside a wrapper (Accelerate, Lightning), or the optimizer itself."""
    seen = 0
    while not isinstance(optimizer, torch.optim.Optimizer) or not hasattr(
        optimizer, "_optimizer_step_pre_hooks"
    ):
        inner = getattr(optimizer, "optimizer", None)
        if inner is None or seen > 8:
            raise TypeError(
                f"optimizer= expects a torch.optim.Optimizer (or a wrapper with .optimizer), "
                f"got {type(optimizer).__name__}. Or pass nothing: the Monitor finds the "
                "optimizers that step the model's parameters by itself."
            )
        optimizer, seen = inner, seen + 1
    return optimizer


class OptimizerWatch:
    """Calls the Monitor around every step of an adopted optimizer, with ``names``, the
    watched model's parameters it steps:

    - ``grads(opt, names)`` once this step's gradients are final: just before the update, or,
      for a closure optimizer (LBFGS; Lightning runs forward and backward inside
      ``optimizer.step(closure)``), after the closure's first evaluation (``again()`` before
      each later one: the step's statistics are the first's); and, when
      ``ready()`` says a backward pass of this step ran before ``step(closure)`` was called
      (sharpness-aware minimisation moves the weights by those gradients before its closure
      runs), also before ``step()`` does anything;
    - ``evaluated(opt, names)`` after each later evaluation of a closure (its NaN is found
      while the weights are still the ones it ran with);
    - ``check(opt, names) -> bool`` right after it: ``True`` skips this update (the
      gradients are hidden from the optimizer, which then leaves those parameters and their
      state alone, and are given back after);
    - ``before(opt, names)`` and ``after(opt, names)`` around the update itself.
    """

    def __init__(
        self,
        hooks: HookSet,
        owned: Callable[[torch.optim.Optimizer], list[str]],
        *,
        grads: Callable[[torch.optim.Optimizer, list[str]], None],
        check: Callable[[torch.optim.Optimizer, list[str]], bool],
        before: Callable[[torch.optim.Optimizer, list[str]], None],
        after: Callable[[torch.optim.Optimizer, list[str]], None],
        ready: Callable[[], bool] = lambda: False,
        again: Callable[[], None] = lambda: None,
        evaluated: Callable[[torch.optim.Optimizer, list[str]], None] = lambda opt, names: None,
    ) -> None:
        self._owned, self._grads, self._check = owned, grads, check
        self._before, self._after, self._ready = before, after, ready
        self._again, self._evaluated = again, evaluated
        self._cache: dict[int, tuple[weakref.ref, int, list[str]]] = {}
        self._hidden: dict[int, list[tuple[torch.Tensor, torch.Tensor | None]]] = {}
        self._read_early: set[int] = set()  # optimizers whose gradients were read already
        self._read_all = False  # every parameter's gradient was read already
        # Optimizers whose step() is under way: a subclass's step() that calls super().step()
        # runs torch's hooks twice (both methods are wrapped), for one update.
        self._stepping: dict[int, int] = {}
        self.adopted: list[weakref.ref[torch.optim.Optimizer]] = []
        hooks.optimizer_step_pre_global(self._pre)
        hooks.optimizer_step_post_global(self._post)

    def adopt(self, optimizer: Any) -> None:
        self._names(unwrap(optimizer))

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [opt for ref in self.adopted if (opt := ref()) is not None]

    def learning_rates(self) -> dict[str, float]:
        """Each parameter group's learning rate: ``lr`` when there is one group in all,
        ``lr/{optimizer}.{group}`` otherwise."""
        optimizers = self.optimizers
        if len(optimizers) == 1 and len(groups := optimizers[0].param_groups) == 1:
            return {"lr": float(groups[0]["lr"])}  # the common case, every step: no loop
        return {
            f"lr/{i}.{j}": float(group["lr"])
            for i, opt in enumerate(optimizers)
            for j, group in enumerate(opt.param_groups)
        }

    def _names(self, opt: torch.optim.Optimizer) -> list[str]:
        cached = self._cache.get(id(opt))
        if cached is not None and cached[0]() is opt and cached[1] == len(opt.param_groups):
            return cached[2]
        names = self._owned(opt)
        self._cache[id(opt)] = (weakref.ref(opt), len(opt.param_groups), names)
        if names and not any(ref() is opt for ref in self.adopted):
            self.adopted.append(weakref.ref(opt))
        return names

    def _pre(self, opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> Any:
        names = self._names(opt)
        if not names:
            return None
        depth = self._stepping.get(id(opt), 0)
        if depth:  # the same update, one level down
            self._stepping[id(opt)] = depth + 1
            return None
        changed = self._start(opt, names, args, kwargs)
        self._stepping[id(opt)] = 1  # not before: a check that raises ends the step here
        return changed

    def _start(
        self, opt: torch.optim.Optimizer, names: list[str], args: tuple, kwargs: dict
    ) -> Any:
        # torch passes step()'s own arguments, ``self`` first: (self, closure=None).
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if closure is None or self._ready():
            self._final_grads(opt, names)
        self._before(opt, names)
        if closure is None:
            return None
        first = True

        def closure_then_read() -> Any:
            nonlocal first
            if not first:
                self._again()
            loss = closure()
            if first:
                first = False
                self._final_grads(opt, names)
            else:
                self._evaluated(opt, names)
            return loss

        if "closure" in kwargs:
            return args, {**kwargs, "closure": closure_then_read}
        return (args[0], closure_then_read, *args[2:]), kwargs

    def read_now(self, optimizer: Any) -> None:
        """This step's gradients of ``optimizer``'s parameters are final now (a trainer
        calls this before it clips them): read them here, not again before the update.
        ``None``: the caller read every parameter's gradient itself (no optimizer known yet)."""
        if optimizer is None:
            self._read_all = True
            return
        opt = unwrap(optimizer)
        names = self._names(opt)
        if names and id(opt) not in self._read_early and not self._read_all:
            self._grads(opt, names)
            self._read_early.add(id(opt))

    def reset(self) -> None:
        """A new step: gradients read early by the last one (whose update was skipped, say)
        are stale, and so is a step() that raised before its post-hooks."""
        self._read_early.clear()
        self._read_all = False
        self._stepping.clear()

    def _final_grads(self, opt: torch.optim.Optimizer, names: list[str]) -> None:
        if id(opt) in self._read_early:
            self._read_early.discard(id(opt))
        elif not self._read_all:
            self._grads(opt, names)
        if self._check(opt, names) and id(opt) not in self._hidden:  # hidden once a step
            hidden = [(p, p.grad) for group in opt.param_groups for p in group["params"]]
            for p, _ in hidden:
                p.grad = None
            self._hidden[id(opt)] = hidden

    def _post(self, opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        depth = self._stepping.pop(id(opt), 0)
        if depth > 1:
            self._stepping[id(opt)] = depth - 1
            return
        names = self._names(opt)
        hidden = self._hidden.pop(id(opt), None)
        if hidden is not None:
            for p, grad in hidden:
                p.grad = grad
        elif names:
            self._after(opt, names)
