"""Which data-set rows each batch holds, and the same batches again on a resume.

A ``DataLoader`` over a map-style data set has a batch sampler: it is iterated once up front,
and that order (rows, and where each batch starts) is stored and replayed through a shallow
copy of the loader, so shuffled loaders and ``DistributedSampler`` give real data-set rows and
a resume sees the same batches. Any other iterable gets positions ``0..N-1``.
"""

from __future__ import annotations

import array
import copy
import operator
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["Order", "length", "read_order", "replaying", "why_no_sampler"]

Order = tuple[torch.Tensor, torch.Tensor]  # (data-set rows, batch offsets into them)


class _Batches:
    """A batch sampler that replays a stored order from batch ``start`` to ``stop``."""

    def __init__(self, rows: torch.Tensor, offsets: torch.Tensor, start: int, stop: int) -> None:
        self.rows, self.offsets, self.start, self.stop = rows, offsets, start, stop

    def __iter__(self) -> Iterator[list[int]]:
        for b in range(self.start, self.stop):
            yield self.rows[self.offsets[b] : self.offsets[b + 1]].tolist()

    def __len__(self) -> int:
        return self.stop - self.start


def why_no_sampler(loader: Any) -> str | None:
    """None if ``loader``'s rows can be read from its batch sampler; else why not ("" = silent)."""
    from torch.utils.data import DataLoader, IterableDataset

    if not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset):
        return ""
    if loader.batch_sampler is None:
        return "it has batch_size=None, so each data-set item is a whole batch"
    cls = type(loader)
    if cls.__iter__ is not DataLoader.__iter__ or cls._get_iterator is not DataLoader._get_iterator:
        return f"{cls.__name__} overrides how a DataLoader iterates"
    return None


def read_order(loader: Any) -> Order | str:
    """Iterate the batch sampler once: (rows, batch offsets), or why that failed."""
    from torch.utils.data import BatchSampler, SequentialSampler

    sampler = loader.batch_sampler
    if type(sampler) is BatchSampler and type(sampler.sampler) is SequentialSampler:
        n = len(sampler.sampler)
        ends = (n // sampler.batch_size) * sampler.batch_size if sampler.drop_last else n
        offsets = torch.cat([torch.arange(0, ends, sampler.batch_size), torch.tensor([ends])])
        return torch.arange(ends), offsets.unique()  # unique: one end for ends == 0
    rows, offsets = array.array("q"), array.array("q", [0])
    for batch in sampler:
        for i in batch:
            try:
                rows.append(operator.index(i))
            except TypeError:
                return f"its sampler gives keys that are not integers ({i!r})"
        offsets.append(len(rows))
    return _from_array(rows), _from_array(offsets)


def _from_array(values: array.array) -> torch.Tensor:
    import numpy  # a dependency, and torch imports it anyway; not at hookscope's import

    return torch.from_numpy(numpy.frombuffer(values, dtype=numpy.int64).copy())


def replaying(loader: Any, order: Order, start: int, stop: int) -> Any:
    """A shallow copy of ``loader`` whose batch sampler replays ``order[start:stop]``."""
    clone = copy.copy(loader)
    object.__setattr__(clone, "batch_sampler", _Batches(*order, start, stop))
    object.__setattr__(clone, "persistent_workers", False)
    clone._iterator = None
    if hasattr(clone, "in_order"):
        clone.in_order = True
    return clone


def length(obj: Any) -> int | None:
    """``len(obj)``, or None for an object without a length (a generator, an iterable data set)."""
    try:
        return len(obj)
    except TypeError:
        return None
