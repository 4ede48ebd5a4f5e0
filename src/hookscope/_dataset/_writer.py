"""The writer thread: commits shards to disk while the model computes the next batches.

A :class:`Shard` gathers whole batches; :class:`Writer` writes each one (temporary file,
fsync, rename) and only then appends its ledger line, so a shard the ledger does not list
does not exist. Memory is bounded: the main thread reserves each batch's bytes and waits while
the shards not yet written would exceed the budget.
"""

from __future__ import annotations

import collections
import json
import os
import threading
from pathlib import Path
from typing import Any

import torch

from ._format import FORMAT, files, replace, shard_name, write_safetensors

__all__ = ["Shard", "Writer"]


class Shard:
    """Whole batches of features on their way to one shard file."""

    __slots__ = ("batches", "events", "first", "index", "nbytes", "rows", "sites")

    def __init__(self, first: int, n_sites: int) -> None:
        self.first, self.batches, self.rows, self.nbytes = first, 0, 0, 0
        self.index: list[torch.Tensor] = []
        self.sites: list[list[torch.Tensor]] = [[] for _ in range(n_sites)]
        self.events: list[Any] = []

    def add(
        self, index: torch.Tensor, feats: list[torch.Tensor], nbytes: int, cuda: list[bool]
    ) -> None:
        self.batches += 1
        self.rows += len(index)
        self.nbytes += nbytes
        self.index.append(index)
        for column, f in zip(self.sites, feats, strict=True):
            column.append(f)
        if any(cuda):  # the copies to pinned memory run asynchronously: wait for them
            event = torch.cuda.Event()
            event.record()
            self.events.append(event)


class Writer:
    """Writes and commits shards in a thread, holding at most ``limit`` bytes of features.

    The main thread calls :meth:`reserve` for each computed batch (it waits while the shards
    waiting to be written would exceed the budget) and :meth:`put` for each full shard.
    """

    def __init__(self, out: Path, rank: int, keys: list[str], limit: int, next_shard: int) -> None:
        self.out, self.rank, self.keys, self.limit = out, rank, keys, limit
        self.next = next_shard
        self.pending = 0  # bytes reserved and not yet written
        self._queued = 0  # bytes handed to the thread
        self._todo: collections.deque[Any] = collections.deque()
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._ledger = open(out / files(rank)["ledger"], "ab")  # noqa: SIM115 - closed in _run
        self._thread = threading.Thread(target=self._run, name="hookscope-writer", daemon=True)
        self._thread.start()

    def reserve(self, nbytes: int) -> None:
        with self._cond:
            while self.pending + nbytes > self.limit and self._queued and self._error is None:
                self._cond.wait()
            self._check()
            self.pending += nbytes

    def put(self, item: Any) -> None:
        with self._cond:
            self._check()
            self._todo.append(item)
            self._queued += getattr(item, "nbytes", 0)
            self._cond.notify_all()

    def close(self, done: dict[str, Any] | None) -> None:
        """Write what is queued (and the "done" line if given), then stop the thread."""
        self.put(done or {})
        self._thread.join()
        self._check()

    def _check(self) -> None:
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._todo:
                        self._cond.wait()
                    item = self._todo.popleft()
                if not isinstance(item, Shard):
                    if item:
                        self._append(item)
                    return
                self._commit(item)
                nbytes = item.nbytes
                del item  # let the features go before saying so
                with self._cond:
                    self.pending -= nbytes
                    self._queued -= nbytes
                    self._cond.notify_all()
        except BaseException as exc:
            with self._cond:
                self._error = exc
                self._cond.notify_all()
        finally:
            self._ledger.close()

    def _commit(self, shard: Shard) -> None:
        for event in shard.events:
            event.synchronize()  # the device-to-host copies of that batch have landed
        name = shard_name(self.rank, self.next)
        final = self.out / name
        tmp = final.with_name("." + name + ".tmp")
        items = [("index", shard.index), *zip(self.keys, shard.sites, strict=True)]
        write_safetensors(tmp, items, {"format": FORMAT})
        replace(tmp, final)
        self._append(
            {
                "shard": self.next,
                "file": name,
                "batches": [shard.first, shard.first + shard.batches],
                "rows": shard.rows,
                "bytes": final.stat().st_size,
            }
        )
        self.next += 1

    def _append(self, entry: dict[str, Any]) -> None:
        self._ledger.write((json.dumps(entry, sort_keys=True) + "\n").encode())
        self._ledger.flush()
        os.fsync(self._ledger.fileno())
