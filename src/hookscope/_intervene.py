"""intervene(): edit inputs, outputs and gradients of chosen modules (ablate, patch, steer, clip)."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from ._errors import InterventionError, NoGradWarning
from ._hooks import (
    POINTS,
    CallClock,
    HookSet,
    Site,
    alias_grad_inputs,
    alias_grad_outputs,
    break_graph_for,
    eager_model,
    in_backward_recompute,
    no_grad_in_model_message,
)
from ._inputs import check_edit
from ._select import Where, select
from ._tree import describe, same_structure

__all__ = ["Intervention", "intervene"]

EditFn = Callable[[Any, Site], Any]


def intervene(
    model: nn.Module,
    edits: Mapping[Any, EditFn] | Where,
    fn: EditFn | None = None,
    *,
    at: str = "output",
) -> Intervention:
    """Change values at the chosen modules while the block runs.

    ``fn(value, site) -> None | replacement`` is called at each chosen module; ``None`` keeps
    the value, anything else replaces it and must have the same structure and shapes.

    - ``at="output"``: ``value`` is what the module returned (tensor, tuple, dict, ...).
    - ``at="input"``: ``value`` is the tuple of positional arguments; a module with one
      positional argument may also get a bare tensor back.
    - ``at="grad_output"`` / ``"grad_input"``: called once per tensor with its gradient during
      ``backward()``; ``site.index`` says which output (or positional input) it belongs to.
      Gradient edits work with in-place ops after the module and on dict/dataclass outputs.

    Args:
        model: The model to edit. Hooks are removed on exit, also when the body raised.
        edits: ``{where: fn}``, or a single *where* with ``fn`` given next.
        fn: The function, when ``edits`` is a single *where*.
        at: ``"input"``, ``"output"`` (default), ``"grad_input"`` or ``"grad_output"``.

    Raises:
        SelectionError: If a *where* matches nothing.
        InterventionError: During the forward or backward pass, if a function returns a
            replacement of the wrong structure or shape (the message names the site).

    Example:
        >>> import torch, hookscope as hs, torch.nn as nn
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
        >>> with hs.intervene(model, {"1": lambda out, site: out * 0}):
        ...     y = model(torch.randn(3, 4))
        >>> torch.equal(y, model[2].bias.expand(3, 2))
        True
    """
    if at not in POINTS:
        raise ValueError(f"at: unknown point {at!r}; choose from {', '.join(POINTS)}")
    if fn is not None:
        edits = {_hashable(edits): fn}
    elif not isinstance(edits, Mapping):
        raise TypeError(
            "intervene needs {where: fn} or (where, fn), e.g. "
            "hs.intervene(model, {'layer2': lambda out, site: out * 0})"
        )
    return Intervention(model, edits, at)


def _hashable(where: Any) -> Any:
    return tuple(where) if isinstance(where, list) else where


class Intervention:
    """The hooks of one :func:`intervene` call; a context manager. ``close()`` removes them."""

    def __init__(self, model: nn.Module, edits: Mapping[Any, EditFn], at: str) -> None:
        for where, fn in edits.items():
            if not callable(fn):
                raise TypeError(f"intervene: the edit for {where!r} must be callable, got {fn!r}")
            check_edit(where, fn)  # called as fn(value, site)
        model = eager_model(model, "intervene")  # compiled already: traced again, with a warning
        plan: dict[str, list[EditFn]] = {}
        for where, fn in edits.items():
            chosen = select(model, list(where) if isinstance(where, tuple) else where)
            for name in chosen:
                plan.setdefault(name, []).append(fn)
        self.at = at
        self.names = tuple(plan)
        # Calls that ran without autograd: (name, whether the model itself turned it off);
        # and names re-run with autograd during backward (checkpoints, reversible layers).
        self._no_grad: set[tuple[str, bool]] = set()
        self._rerun: set[str] = set()
        self._hooks = HookSet("intervene")
        with self._hooks.attaching():
            modules = dict(model.named_modules())
            for name, fns in plan.items():
                self._attach(name, modules[name], fns)
            # Last, and prepended: the pass starts before any edit of the root runs
            self._clock = CallClock(self._hooks, model)

    def _attach(self, name: str, module: nn.Module, fns: list[EditFn]) -> None:
        """Edits go before the hooks already there (``prepend``): every reader (capture,
        a Monitor, a Tap's watchers) sees the edited value, whatever the order in which
        they were attached. A ``grad_input`` edit goes after them instead: the copy of the
        input it hooks must be made after the input edits; a reader attached later hooks the
        call's first copy, which the gradient reaches after every edit
        (``_hooks/_points.py:alias_grad_inputs``)."""
        hooks = self._hooks
        if self.at == "output":
            hooks.forward(module, functools.partial(self._edit_output, name, fns), prepend=True)
        elif self.at == "input":
            hooks.forward_pre(module, functools.partial(self._edit_input, name, fns), prepend=True)
        elif self.at == "grad_output":
            edit = functools.partial(self._hook_grad_output, name, fns)
            hooks.forward(module, edit, prepend=True)
        else:
            hooks.forward_pre(module, functools.partial(self._hook_grad_input, name, fns))

    def _site(self, name: str, module: nn.Module, args: tuple) -> Site:
        if in_backward_recompute():  # a checkpoint re-run: the same edit as the first pass
            original = self._clock.original(name, args)
            call = original[1] if original is not None else -1
        else:
            call = self._clock.next(name, args)
        return Site(name, module, call, self.at)

    # -- forward edits (applied the same way when a checkpoint re-runs forward) ------------
    def _edit_output(
        self, name: str, fns: list[EditFn], module: nn.Module, args: Any, kwargs: Any, output: Any
    ) -> Any:
        site = self._site(name, module, args)
        value = output
        for fn in fns:
            value = _apply(fn, value, site)
        return None if value is output else value

    def _edit_input(
        self, name: str, fns: list[EditFn], module: nn.Module, args: tuple, kwargs: dict
    ) -> Any:
        site = self._site(name, module, args)
        value = args
        for fn in fns:
            new = fn(value, site)
            if new is None:
                continue
            if isinstance(new, torch.Tensor) and len(value) == 1:
                new = (new,)
            _check(value, new, site)
            value = new
        return None if value is args else (value, kwargs)

    # -- gradient edits: tensor hooks set up during forward ----------------------------------
    def _hook_grad_output(
        self, name: str, fns: list[EditFn], module: nn.Module, args: Any, kwargs: Any, output: Any
    ) -> Any:
        call = self._site(name, module, args).call  # also without autograd: a re-run's match
        if not self._grad_enabled(name):
            return None
        break_graph_for(f"intervene at {self.at!r} of {name!r}", "intervene")
        new, aliases = alias_grad_outputs(output, args, kwargs)
        for i, t in enumerate(aliases):
            if t is not None:
                site = Site(name, module, call, self.at, i)
                self._hooks.tensor(t, functools.partial(_edit_grad, fns, site))
        return None if new is output else new

    def _hook_grad_input(
        self, name: str, fns: list[EditFn], module: nn.Module, args: tuple, kwargs: dict
    ) -> Any:
        call = self._site(name, module, args).call  # also without autograd: a re-run's match
        if not self._grad_enabled(name):
            return None
        break_graph_for(f"intervene at {self.at!r} of {name!r}", "intervene")
        new, hooked = alias_grad_inputs(args, module)  # a copy of its own, innermost
        for i, t in hooked.items():
            site = Site(name, module, call, self.at, i)
            self._hooks.tensor(t, functools.partial(_edit_grad, fns, site))
        return None if new is args else (new, kwargs)

    def _grad_enabled(self, name: str) -> bool:
        """Is there a gradient to edit? Notes the calls that have none, for the warning."""
        if not torch.is_grad_enabled():
            if not in_backward_recompute():
                self._no_grad.add((name, bool(self._clock.root_grad)))
            return False
        if in_backward_recompute():
            self._rerun.add(name)
        return True

    # -- lifetime --------------------------------------------------------------------------
    def close(self) -> None:
        """Remove every hook this intervention added. Safe to call more than once."""
        self._hooks.remove()

    def __enter__(self) -> Intervention:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.close()
        if exc_type is not None:
            return
        user = sorted({name for name, in_model in self._no_grad if not in_model})
        model = sorted({n for n, in_model in self._no_grad if in_model} - self._rerun - set(user))
        if user:
            warnings.warn(
                f"intervene at {self.at!r} on {', '.join(map(repr, user[:5]))}: the forward pass "
                "ran under torch.no_grad() or torch.inference_mode(), so there was no gradient "
                "to edit. Run the forward pass with autograd enabled.",
                NoGradWarning,
                stacklevel=2,
            )
        if model:
            warnings.warn(
                no_grad_in_model_message(
                    f"intervene at {self.at!r} asked to edit the gradients of",
                    "there was no gradient to edit",
                    "edit their outputs (at='output') instead",
                    ", ".join(map(repr, model[:5])),
                ),
                NoGradWarning,
                stacklevel=2,
            )

    def __repr__(self) -> str:
        return (
            f"Intervention(at={self.at!r}, {len(self.names)} modules: {', '.join(self.names[:5])})"
        )


def _apply(fn: EditFn, value: Any, site: Site) -> Any:
    new = fn(value, site)
    if new is None:
        return value
    _check(value, new, site)
    return new


def _edit_grad(fns: list[EditFn], site: Site, grad: torch.Tensor) -> torch.Tensor | None:
    value = grad
    for fn in fns:
        new = fn(value, site)
        if new is None:
            continue
        if not isinstance(new, torch.Tensor):
            raise InterventionError(
                f"intervene at {site.at!r} of {site.name!r} (call {site.call}, tensor "
                f"{site.index}): the function must return a tensor or None, got {describe(new)}"
            )
        _check(value, new, site)
        value = new
    return None if value is grad else value


def _check(old: Any, new: Any, site: Site) -> None:
    problem = same_structure(old, new)
    if problem is not None:
        index = "" if site.index is None else f", tensor {site.index}"
        raise InterventionError(
            f"intervene at {site.at!r} of {site.name!r} (call {site.call}{index}): the replacement "
            f"does not fit: {problem}. Return a value with the same structure and shapes as the "
            "one received, or None to keep it."
        )
