"""What every check shares: its view of the Monitor, and small helpers."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..._hooks import HookSet
from ..._stats import Sampler

__all__ = ["Context", "common_module", "module_of", "spread"]


@dataclass
class Context:
    """What a check may use of its Monitor."""

    model: nn.Module
    modules: dict[str, nn.Module]  # the watched modules
    params: dict[str, nn.Parameter]  # the model's trainable parameters
    hooks: HookSet
    write: Callable[[dict[str, Any]], None]  # a record to the Monitor's sinks
    paused: Callable[[], bool] = lambda: False  # a replay of the Monitor's own runs
    skipping: Callable[[], bool] = lambda: False  # the Monitor skips this update (NaN)
    sampler: Sampler = field(default_factory=lambda: Sampler(4096))  # the Monitor's
    rank: int | None = None  # under a collective: this rank
    world: int = 1


def common_module(names: Sequence[str]) -> str:
    """The innermost module holding every parameter of ``names`` (``""``: the model)."""
    parts = [n.split(".")[:-1] for n in names]
    if not parts:
        return ""
    prefix = parts[0]
    for p in parts[1:]:
        k = 0
        while k < min(len(prefix), len(p)) and prefix[k] == p[k]:
            k += 1
        prefix = prefix[:k]
    return ".".join(prefix)


def spread(t: torch.Tensor, k: int) -> torch.Tensor:
    """Flat indices of at most ``k`` elements spread over ``t`` (for ``torch.take``)."""
    n = t.numel()
    step = max(1, n // k)
    return torch.arange(0, min(n, step * k), step, device=t.device)


def module_of(param: str) -> str:
    """The qualified name of the module holding parameter ``param``."""
    return param.rsplit(".", 1)[0] if "." in param else ""
