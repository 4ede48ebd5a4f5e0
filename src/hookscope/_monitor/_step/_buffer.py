"""One step's device values, each with the rule that combines it, moved to the host at once.

Probes ``add`` small device tensors under a key with a reduce rule (``"sum"``, ``"min"`` or
``"max"``); a key added twice is combined by its rule (two calls of a module, two tensors of
one output). Squares stay squares until the host, so that values from several calls or
ranks still add up. :meth:`StepBuffer.to_host` concatenates everything and makes one
``tolist()``: one device-to-host transfer per step.

Probes may also :meth:`~StepBuffer.keep` small tensors (the samples of a sampled step) until
the step's end, where :meth:`~StepBuffer.settle` hands each probe everything it kept, for
statistics of every module in one stacked pass instead of a few ops per module call. That
pass gives its values as rows, one per module: :meth:`~StepBuffer.add_rows` keeps them as the
one tensor they are, not one tensor per key (no split before the transfer and no gather in
it), while no key of them is asked for alone.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any, Literal

import torch

__all__ = ["Host", "StepBuffer", "combine"]

Reduce = Literal["sum", "min", "max"]

_COMBINE = {"sum": torch.add, "min": torch.minimum, "max": torch.maximum}

Host = dict[Hashable, list[float]]

# Items kept for one ``finish`` before it runs, mid-step: what a step keeps stays bounded (a
# cell unrolled over thousands of calls), and so does each stacked pass.
KEEP_LIMIT = 512


class StepBuffer:
    """Named device tensors of one step, each with its reduce rule."""

    def __init__(self) -> None:
        self._values: dict[Hashable, torch.Tensor] = {}
        self._reduce: dict[Hashable, Reduce] = {}
        self._host: Host = {}
        self._kept: dict[Callable[[StepBuffer, list[Any]], None], list[Any]] = {}
        # Blocks (``set_block``): one 1-D tensor standing for many keys, one element each,
        # under a key of its own in ``_values``; its keys, by that key
        # (its keys' prefix, first number, count)
        self._blocks: dict[Hashable, tuple[str, int, int]] = {}
        # Row blocks (``add_rows``): one tensor whose rows are the values of named keys, under
        # a key of its own in ``_values``: its keys, by that key; and each key's row block
        self._rows: dict[Hashable, tuple[Hashable, ...]] = {}
        self._row_of: dict[Hashable, Hashable] = {}

    def keep(self, finish: Callable[[StepBuffer, list[Any]], None], item: Any) -> None:
        """Keep ``item`` until :meth:`settle`, which calls ``finish(self, items)`` with the
        items kept for ``finish``, in the order kept (``finish`` adds values: it may be
        called more than once a step, every ``KEEP_LIMIT`` items)."""
        kept = self._kept.get(finish)
        if kept is None:
            kept = self._kept[finish] = []
        kept.append(item)
        if len(kept) >= KEEP_LIMIT:
            finish(self, self._kept.pop(finish))

    def settle(self) -> None:
        """Hand what was kept to its ``finish`` (which adds values): before any transfer
        (:meth:`to_host` does it itself; a collective's caller must)."""
        while self._kept:
            finish = next(iter(self._kept))
            finish(self, self._kept.pop(finish))

    def add(self, key: Hashable, value: torch.Tensor, reduce: Reduce = "sum") -> None:
        """Put ``value`` under ``key``, or combine it with what is there by ``reduce``."""
        if (self._blocks or self._rows) and self._in_block(key):
            self._unblock()
        value = value.detach() if value.requires_grad else value
        old = self._values.get(key)
        if old is None:
            self._values[key] = value
            self._reduce[key] = reduce
        else:
            self._values[key] = _COMBINE[reduce](old, value)

    def set(self, key: Hashable, value: torch.Tensor, reduce: Reduce = "sum") -> None:
        """Put ``value`` under ``key``, replacing what is there."""
        if (self._blocks or self._rows) and self._in_block(key):
            self._unblock()
        self._host.pop(key, None)
        self._values[key] = value.detach() if value.requires_grad else value
        self._reduce[key] = reduce

    def set_many(self, keys: list[Hashable], values: list[torch.Tensor]) -> None:
        """:meth:`set` each of ``keys`` to its value in ``values`` (detached, ``"sum"``)."""
        if (self._blocks or self._rows) and any(self._in_block(key) for key in keys):
            self._unblock()
        host, store, reduce = self._host, self._values, self._reduce
        for key, value in zip(keys, values, strict=True):
            if host:
                host.pop(key, None)
            store[key] = value.detach() if value.requires_grad else value
            reduce[key] = "sum"

    def set_block(self, prefix: str, start: int, value: torch.Tensor) -> None:
        """:meth:`set` the keys ``(prefix, start)``, ``(prefix, start + 1)``, ... (new keys:
        none waits in the buffer) each to its element of the 1-D ``value`` (``"sum"``): one
        tensor to move, not one per key (a step's parameter flags). The keys read as any
        others on the host; a block is split into its keys only where one is asked for alone
        (:meth:`value`, :meth:`take`, a collective's :meth:`pending_keys`). A transfer that
        moved the block whole also leaves its numbers on the host as one list, under
        ``("block", prefix, start)``, for readers of every key at once."""
        n = value.numel()
        if not n:
            return
        if self._host:
            for i in range(start, start + n):
                self._host.pop((prefix, i), None)
        block = ("block", prefix, start, len(self._blocks))
        self._blocks[block] = (prefix, start, n)
        self._values[block] = value.detach() if value.requires_grad else value
        self._reduce[block] = "sum"

    def add_rows(
        self, keys: Sequence[Hashable], value: torch.Tensor, reduce: Reduce = "sum"
    ) -> None:
        """:meth:`add` ``value[i]`` under ``keys[i]``, each (one module's row of a stacked
        pass): kept as the one tensor ``value`` is, while none of ``keys`` waits already
        (else added one by one) and none is asked for alone (:meth:`value`, :meth:`take`, a
        collective's :meth:`pending_keys` split it into its keys)."""
        if self._waiting(keys, value):
            for key, row in zip(keys, value.unbind(0), strict=True):
                self.add(key, row, reduce)
            return
        self._keep_rows(tuple(keys), value, reduce)

    def set_rows(
        self, keys: Sequence[Hashable], value: torch.Tensor, reduce: Reduce = "sum"
    ) -> None:
        """:meth:`set` ``value[i]`` under ``keys[i]``, each, kept as one tensor as
        :meth:`add_rows` keeps it."""
        if self._waiting(keys, value):
            self._unblock()
            for key in keys:
                self._values.pop(key, None)
        if self._host:
            for key in keys:
                self._host.pop(key, None)
        self._keep_rows(tuple(keys), value, reduce)

    def _waiting(self, keys: Sequence[Hashable], value: torch.Tensor) -> bool:
        """Whether any of ``keys`` waits already, alone or in a block (``value``: a row for
        each)."""
        if len(keys) != value.shape[0]:
            raise ValueError(f"{len(keys)} keys for {value.shape[0]} rows")
        values = self._values
        return any(key in values or self._in_block(key) for key in keys)

    def _keep_rows(self, keys: tuple[Hashable, ...], value: torch.Tensor, reduce: Reduce) -> None:
        """``value``'s rows under ``keys`` (none of which waits), as one tensor."""
        if not keys:
            return
        block = ("rows", len(self._rows), keys[0])
        self._rows[block] = keys
        for key in keys:
            self._row_of[key] = block
        self._values[block] = value.detach() if value.requires_grad else value
        self._reduce[block] = reduce

    def _in_block(self, key: Hashable) -> bool:
        if key in self._row_of:
            return True
        # a loop, not any(generator): a sampled step asks this of every key it adds
        if not self._blocks or type(key) is not tuple or len(key) != 2:
            return False
        head, at = key
        for prefix, start, n in self._blocks.values():
            if head == prefix and start <= at < start + n:
                return True
        return False

    def _unblock(self) -> None:
        """Every block split into its keys, each in the block's place among the values."""
        if not self._blocks and not self._rows:
            return
        values, reduce, rows = self._values, self._reduce, self._rows
        items = list(values.items())
        values.clear()
        for key, value in items:
            block = self._blocks.get(key)
            keys = rows.get(key) if block is None else None
            if block is None and keys is None:
                values[key] = value
                continue
            rule = reduce.pop(key)
            if keys is not None:
                for row_key, row in zip(keys, value.unbind(0), strict=True):
                    values[row_key] = row
                    reduce[row_key] = rule
                continue
            prefix, start, n = block
            for i in range(n):
                values[prefix, start + i] = value[i]
                reduce[prefix, start + i] = "sum"
        self._blocks.clear()
        rows.clear()
        self._row_of.clear()

    def __contains__(self, key: Hashable) -> bool:
        return key in self._values or key in self._host or self._in_block(key)

    def pending(self) -> int:
        """How many values wait for the next transfer."""
        self._unblock()
        return len(self._values)

    def pending_keys(self) -> list[Hashable]:
        """The keys whose values wait for the next transfer."""
        self._unblock()
        return list(self._values)

    def value(self, key: Hashable) -> torch.Tensor | None:
        """The device value under ``key`` that waits for the next transfer, if any."""
        if (self._blocks or self._rows) and self._in_block(key):
            self._unblock()
        return self._values.get(key)

    def take(self, key: Hashable) -> torch.Tensor | None:
        """Remove and return the waiting device value under ``key`` (for a collective that
        moves it itself; :meth:`absorb` hands the result back)."""
        if (self._blocks or self._rows) and self._in_block(key):
            self._unblock()
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
        what is new). ``only`` moves just the keys it accepts. What was kept is settled
        first.
        """
        self.settle()
        if only is not None:
            self._unblock()
        waiting, host, blocks, rows = self._values, self._host, self._blocks, self._rows
        keys = list(waiting) if only is None else [k for k in waiting if only(k)]
        if keys:
            for key, new in zip(keys, _to_lists([waiting[k] for k in keys]), strict=True):
                row_keys = rows.get(key) if rows else None
                if row_keys is not None:  # a row of ``new`` per key
                    rule, width = self._reduce.pop(key), len(new) // len(row_keys)
                    for i, row_key in enumerate(row_keys):
                        row = new[i * width : (i + 1) * width]
                        old = host.get(row_key)
                        host[row_key] = row if old is None else combine(rule, old, row)
                        self._reduce[row_key] = rule
                    continue
                block = blocks.get(key) if blocks else None
                if block is not None:  # one number per key of the block
                    prefix, first, _ = block
                    fresh = True
                    for i, number in enumerate(new, first):
                        old = host.get((prefix, i))
                        host[prefix, i] = [number] if old is None else [old[0] + number]
                        fresh = fresh and old is None
                    if fresh:  # and the numbers at once: ``("block", prefix, first)``
                        host["block", prefix, first] = new
                    continue
                old = host.get(key)
                host[key] = new if old is None else combine(self._reduce[key], old, new)
            if only is None:
                waiting.clear()
                blocks.clear()
                rows.clear()
                self._row_of.clear()
            else:
                for key in keys:
                    del waiting[key]
        return host


def _to_lists(values: list[torch.Tensor]) -> list[list[float]]:
    """Each value as a list of floats, from one ``tolist()``.

    Scalars (the non-finite flags: one per module call and gradient, tens of thousands in a
    step of an unrolled cell) are stacked in one call, and the other values concatenated
    per dtype, not converted one by one: the cost per value stays a small constant.
    """
    first = values[0]
    if all(v.dtype is first.dtype for v in values):
        # an unsampled step: its flags, scalars and a few short vectors of one dtype, in one
        # cat (no float64 copy; the cat itself refuses values on several devices)
        try:
            flat = torch.cat([v if v.dim() == 1 else v.reshape(-1) for v in values])
        except RuntimeError:
            flat = None
        if flat is not None:
            floats = (flat if flat.is_floating_point() else flat.double()).tolist()
            if len(floats) == len(values):  # one number each
                return [[v] for v in floats]
            out, at = [], 0
            for v in values:
                n = v.numel()
                out.append(floats[at : at + n])
                at += n
            return out
    device = next((v.device for v in values if v.device.type != "cpu"), first.device)
    scalars = [i for i, v in enumerate(values) if v.dim() == 0]
    groups: dict[torch.dtype, list[int]] = {}
    for i, v in enumerate(values):
        if v.dim() != 0:
            groups.setdefault(v.dtype, []).append(i)
    parts = [_stack([values[i] for i in scalars], device)] if scalars else []
    order = list(scalars)
    for indices in groups.values():
        flat = [values[i] if values[i].dim() == 1 else values[i].reshape(-1) for i in indices]
        parts.append(_cat(flat, device))
        order += indices
    floats = torch.cat([p.to(dtype=torch.float64) for p in parts]).tolist()
    out: list[list[float]] = [[] for _ in values]
    at = 0
    for i in order:
        n = values[i].numel()
        out[i] = floats[at : at + n]
        at += n
    return out


def _stack(scalars: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """``scalars`` in one tensor on ``device`` (moved one by one only when on several)."""
    try:
        return torch.stack(scalars).to(device)
    except RuntimeError:  # on several devices
        return torch.stack([v.to(device) for v in scalars])


def _cat(parts: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """1-D ``parts`` of one dtype in one tensor on ``device`` (moved one by one only when
    on several)."""
    try:
        return torch.cat(parts).to(device)
    except RuntimeError:  # on several devices
        return torch.cat([p.to(device) for p in parts])


def combine(reduce: Reduce, old: list[float], new: list[float]) -> list[float]:
    pick = {"sum": lambda a, b: a + b, "min": min, "max": max}[reduce]
    return [pick(a, b) for a, b in zip(old, new, strict=True)]
