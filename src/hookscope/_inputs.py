"""The model every verb is given: an ``nn.Module`` whose Python hooks run, or a clear error.

A plain function has no modules to hook; a TorchScript module (``torch.jit.script`` or
``torch.jit.trace``) runs compiled TorchScript code that calls no Python hook, so a capture
would record nothing (and torch refuses hooks on scripted ones outright).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from ._errors import UnsupportedModelError

__all__ = ["check_chosen", "check_edit", "check_model"]


def check_model(model: Any, verb: str | None = None) -> None:
    """Refuse what no hook can watch: not an ``nn.Module``, or a TorchScript module.
    ``verb`` begins the message (``"capture"``)."""
    head = f"{verb}: " if verb else ""
    if isinstance(model, torch.jit.ScriptModule):
        raise UnsupportedModelError(f"{head}the model ({type(model).__name__}) is {_SCRIPT}")
    if not isinstance(model, nn.Module):
        what = getattr(model, "__name__", None) or type(model).__name__
        kind = "function" if callable(model) else "object"
        raise UnsupportedModelError(
            f"{head}expected a torch.nn.Module, got the {kind} {what!r} "
            f"({type(model).__module__}.{type(model).__qualname__}).\nFix: pass the model; "
            "to watch a plain function, wrap it in a module whose forward() calls it."
        )


def check_chosen(chosen: dict[str, nn.Module]) -> None:
    """Refuse chosen modules that are TorchScript (a traced backbone inside a Python model)."""
    scripted = [name for name, m in chosen.items() if isinstance(m, torch.jit.ScriptModule)]
    if scripted:
        shown = ", ".join(repr(n) for n in scripted[:4]) + (" ..." if len(scripted) > 4 else "")
        raise UnsupportedModelError(
            f"{shown} {'is' if len(scripted) == 1 else 'are'} {_SCRIPT} Or choose only the "
            "Python modules around it with where=."
        )


_SCRIPT = (
    "a TorchScript module (torch.jit.script or torch.jit.trace): it runs compiled "
    "TorchScript code, which calls no Python hook, so hookscope can see nothing inside it."
    "\nFix: pass the eager model, the nn.Module you scripted or traced (load its state_dict "
    "into the Python class if you only have the TorchScript file); torch.compile(model) "
    "works with hookscope."
)


def check_edit(where: Any, fn: Any) -> None:
    """An ``intervene`` edit must take ``(value, site)``: say so when it was made to take
    something else, before any hook runs it (instead of Python's bare "takes 1 positional
    argument but 2 were given" from inside the model's forward)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without one: it will tell for itself
        return
    try:
        signature.bind(None, None)
    except TypeError:
        name = getattr(fn, "__name__", type(fn).__name__)
        raise TypeError(
            f"intervene: the edit for {where!r}, {name}{signature}, cannot be called as "
            "fn(value, site).\nFix: take two arguments, the value and its Site (e.g. "
            "`lambda out, site: out * 0`), and return None to keep the value or its "
            "replacement."
        ) from None
