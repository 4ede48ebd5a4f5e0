"""One step's device values, each with the rule that combines it, moved to the host at once.

Probes ``add`` small device tensors under a key with a reduce rule (``"sum"``, ``"min"`` or
``"max"``); a key added twice is combined by its rule (two calls of a module, two tensors of
one output). Squares stay squares until the host, so that values from several calls or
ranks still add up. :meth:`StepBuffer.to_host` concatenates everything and makes one
``tolist()``: one device-to-host transfer per step.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Literal

import torch

__all__ = ["Host", "StepBuffer", "combine"]

Reduce = Literal["sum", "min", "max"]

_COMBINE = {"sum": torch.add, "min": torch.minimum, "max": torch.maximum}

Host = dict[Hashable, list[float]]


class StepBuffer:
    """Named device tensors of one step, each with its reduce rule."""

    def __init__(self) -> None:
        self._values: dict[Hashable, torch.Tensor] = {}
        self._reduce: dict[Hashable, Reduce] = {}
        self._host: Host = {}

    def add(self, key: Hashable, value: torch.Tensor, reduce: Reduce = "sum") -> None:
        """Put ``value`` under ``key``, or combine it with what is there by ``reduce``."""
        old = self._values.get(key)
        if old is None:
            self._values[key] = value.detach()
            self._reduce[key] = reduce
        else:
            self._values[key] = _COMBINE[reduce](old, value.detach())

    def set(self, key: Hashable, value: torch.Tensor, reduce: Reduce = "sum") -> None:
        """Put ``value`` under ``key``, replacing what is there."""
        self._host.pop(key, None)
        self._values[key] = value.detach()
        self._reduce[key] = reduce

    def __contains__(self, key: Hashable) -> bool:
        return key in self._values or key in self._host

    def pending(self) -> int:
        """How many values wait for the next transfer."""
        return len(self._values)

    def pending_keys(self) -> list[Hashable]:
        """The keys whose values wait for the next transfer."""
        return list(self._values)

    def value(self, key: Hashable) -> torch.Tensor | None:
        """The device value under ``key`` that waits for the next transfer, if any."""
        return self._values.get(key)

    def take(self, key: Hashable) -> torch.Tensor | None:
        """Remove and return the waiting device value under ``key`` (for a collective that
        moves it itself; :meth:`absorb` hands the result back)."""
        return self._values.pop(key, None)

    def absorb(self, host: Host) -> None:
        """Host values moved by someone else (a collective), combined as :meth:`to_host`
        would combine them."""
        for key, new in host.items():
            old = self._host.get(key)
            self._host[key] = new if old is None else combine(self._reduce[key], old, new)

    def to_host(self, only: Callable[[Hashable], bool] | None = None) -> Host:
        """Every value as a list of floats, from one device-to-host transfer.

        Values already moved by an earlier call are not moved again; a key added again
        since is combined with them on the host by its rule (a second transfer only carries
        what is new). ``only`` moves just the keys it accepts.
        """
        keys = [k for k in self._values if only is None or only(k)]
        if keys:
            values = [self._values[k] for k in keys]
            for key, new in zip(keys, _to_lists(values), strict=True):
                old = self._host.get(key)
                self._host[key] = new if old is None else combine(self._reduce[key], old, new)
                del self._values[key]
        return self._host


def _to_lists(values: list[torch.Tensor]) -> list[list[float]]:
    """Each value as a list of floats, from one ``tolist()``.

    Scalars (the non-finite flags: one per module call and gradient, tens of thousands in a
    step of an unrolled cell) are stacked in one call, not reshaped one by one: the cost
    per value stays a small constant.
    """
    device = next((v.device for v in values if v.device.type != "cpu"), values[0].device)
    scalars = [i for i, v in enumerate(values) if v.dim() == 0]
    rest = [i for i, v in enumerate(values) if v.dim() != 0]
    parts = [_stack([values[i] for i in scalars], device)] if scalars else []
    parts += [values[i].reshape(-1).to(device) for i in rest]
    flat = torch.cat([p.to(dtype=torch.float64) for p in parts]).tolist()
    out: list[list[float]] = [[] for _ in values]
    for i, x in zip(scalars, flat, strict=False):
        out[i] = [x]
    at = len(scalars)
    for i in rest:
        n = values[i].numel()
        out[i] = flat[at : at + n]
        at += n
    return out


def _stack(scalars: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """``scalars`` in one tensor on ``device`` (moved one by one only when on several)."""
    try:
        return torch.stack(scalars).to(device)
    except RuntimeError:  # on several devices
        return torch.stack([v.to(device) for v in scalars])


def combine(reduce: Reduce, old: list[float], new: list[float]) -> list[float]:
    pick = {"sum": lambda a, b: a + b, "min": min, "max": max}[reduce]
    return [pick(a, b) for a, b in zip(old, new, strict=True)]
