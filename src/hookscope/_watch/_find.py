"""Which models a training script trains: one scan of the garbage collector's objects.

``hookscope watch`` knows nothing of the script: when an optimizer is created (or at the
first ``backward()`` of a model trained by hand), the top-level modules that own the
parameters concerned are the models to watch, looked through wrappers (DDP,
``torch.compile``) and containers without a forward of their own. ``type(o)``, never
``isinstance``: torch's deprecated proxies warn on ``__class__``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .._hooks import live_objects, uncompiled

__all__ = ["owns", "scan", "trained_by_hand"]

_CONTAINERS = (nn.ModuleDict, nn.ModuleList)  # no forward of their own: look inside


def owns(opt: torch.optim.Optimizer, params: set[int]) -> bool:
    return any(id(p) in params for group in opt.param_groups for p in group["params"])


def scan(opt: torch.optim.Optimizer) -> tuple[list[nn.Module], list[Any]]:
    """The models owning ``opt``'s parameters (top-level modules; wrappers and containers
    looked through), and every optimizer."""
    stepped = {id(p) for group in opt.param_groups for p in group["params"]}
    modules, optimizers = _objects()
    return _models(modules, stepped), optimizers


def trained_by_hand() -> list[nn.Module]:
    """The models whose parameters hold gradients and that no optimizer owns, not even in
    part (one made before the start-up hook is found at its first step)."""
    modules, optimizers = _objects()
    owned = {id(p) for opt in optimizers for group in opt.param_groups for p in group["params"]}
    grads = {
        id(p)
        for m in modules
        for p in vars(m).get("_parameters", {}).values()
        if p is not None and p.grad is not None and id(p) not in owned
    }
    return [m for m in _models(modules, grads) if not _params(m) & owned]


def _objects() -> tuple[list[nn.Module], list[Any]]:
    """Every module and every optimizer of the process (one scan of the collector's)."""
    found = live_objects(nn.Module, torch.optim.Optimizer)
    modules = [o for o in found if issubclass(type(o), nn.Module)]
    return modules, [o for o in found if issubclass(type(o), torch.optim.Optimizer)]


def _models(modules: list[nn.Module], params: set[int]) -> list[nn.Module]:
    """The top-level models holding any of ``params``."""
    children = {id(c) for m in modules for c in _children(m)}
    tops = [m for m in modules if id(m) not in children]
    models: list[nn.Module] = []
    for top in tops:
        for model in _models_in(top, params):
            if all(model is not m for m in models):
                models.append(model)
    return models


def _children(module: nn.Module) -> list[nn.Module]:
    found = vars(module).get("_modules")  # missing in a module whose __init__ is still running
    return [c for c in found.values() if c is not None] if isinstance(found, dict) else []


def _params(module: nn.Module) -> set[int]:
    try:
        return {id(p) for p in module.parameters()}
    except AttributeError:  # not initialised yet
        return set()


def _models_in(module: nn.Module, stepped: set[int]) -> list[nn.Module]:
    if not _params(module) & stepped:
        return []
    inner = uncompiled(module)  # DDP, torch.compile's wrapper: the model inside
    if inner is not module:
        return _models_in(inner, stepped)
    if issubclass(type(module), _CONTAINERS):
        return [m for child in _children(module) for m in _models_in(child, stepped)]
    return [module]
