"""FeatureStore: the features extract_dataset wrote, read lazily, only the rows asked for.

Only shards the ledger lists are read, so a store can be opened while an extraction runs or
after it stopped. A read touches only the shards its rows span, through at most 32 open
safetensors handles.
"""

from __future__ import annotations

import collections
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from .._errors import FeatureStoreError, did_you_mean
from ._format import dtype_name, files, read_ledger

__all__ = ["FeatureColumn", "FeatureStore"]


class FeatureStore:
    """The features ``extract_dataset`` wrote to ``out``, read lazily.

    ``store[name]`` is a :class:`FeatureColumn`: ``store[name][i:j]`` loads only rows ``i..j-1``
    (as a tensor); ``store.index`` holds the data-set row of each stored row. Rows are in the
    order they were extracted, rank 0's first under ``torch.distributed``. Only committed
    shards are read, so a store can be read while an extraction runs or after it stopped.

    Example:
        >>> import torch, hookscope as hs, torch.nn as nn, tempfile
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> loader = torch.utils.data.DataLoader(torch.randn(10, 4), batch_size=4)
        >>> store = hs.extract_dataset(model, loader, "1", tempfile.mkdtemp(), progress=False)
        >>> len(store), store.names, store["1"][2:5].shape
        (10, ['1'], torch.Size([3, 8]))
    """

    def __init__(self, out: str | os.PathLike[str]) -> None:
        self.path = Path(out)
        paths = sorted(
            self.path.glob("rank*.manifest.json"), key=lambda p: int(p.name[4:].split(".")[0])
        )
        if not paths:
            raise FeatureStoreError(
                f"{str(self.path)!r} is not a hookscope feature store (no rank*.manifest.json); "
                "hs.extract_dataset(model, loader, where, out) writes one."
            )
        manifests = [json.loads(p.read_text()) for p in paths]
        self._sites = {s["name"]: s for s in manifests[0]["sites"]}
        self.shards: list[tuple[Path, int]] = []
        self.complete = len(manifests) == manifests[0]["signature"]["world_size"]
        for manifest in manifests:
            if manifest["sites"] != manifests[0]["sites"]:
                raise FeatureStoreError(f"{str(self.path)!r}: the ranks stored different sites")
            shards, done, _ = read_ledger(self.path / files(manifest["rank"])["ledger"])
            self.shards += [(self.path / e["file"], e["rows"]) for e in shards]
            self.complete &= done is not None
        self.starts = [0]
        for _, rows in self.shards:
            self.starts.append(self.starts[-1] + rows)
        self._handles: collections.OrderedDict[Path, Any] = collections.OrderedDict()
        self._index: torch.Tensor | None = None

    @property
    def names(self) -> list[str]:
        """The modules whose features are stored, in ``named_modules()`` order."""
        return list(self._sites)

    @property
    def index(self) -> torch.Tensor:
        """The data-set row of each stored row (int64; positions for loaders without a sampler)."""
        if self._index is None:
            self._index = self._read("index", 0, len(self), (), torch.int64)
        return self._index

    def __len__(self) -> int:
        return self.starts[-1]

    def __contains__(self, name: object) -> bool:
        return name in self._sites

    def __getitem__(self, name: str) -> FeatureColumn:
        if name not in self._sites:
            raise KeyError(
                f"no features of {name!r} in this store{did_you_mean(name, self._sites)}; "
                f"it holds {self.names}"
            )
        return FeatureColumn(self, name)

    def __repr__(self) -> str:
        sites = ", ".join(f"{n!r}: {s['dtype']}{s['shape']}" for n, s in self._sites.items())
        state = "" if self.complete else ", incomplete"
        return f"FeatureStore({str(self.path)!r}, {len(self)} rows{state}, {{{sites}}})"

    def _repr_html_(self) -> str:
        from .._notebook import feature_store_html

        return feature_store_html(self)

    def _open(self, path: Path) -> Any:
        handle = self._handles.pop(path, None)
        if handle is None:
            from safetensors import safe_open

            handle = safe_open(str(path), framework="pt")
        self._handles[path] = handle
        if len(self._handles) > 32:
            self._handles.popitem(last=False)
        return handle

    def _read(
        self, key: str, start: int, stop: int, shape: Sequence[int], dtype: torch.dtype
    ) -> torch.Tensor:
        """Rows ``start..stop-1`` of ``key``, reading only the shards (and rows) they span."""
        import bisect

        parts = []
        s = bisect.bisect_right(self.starts, start) - 1
        while start < stop:
            path, rows = self.shards[s]
            lo, hi = start - self.starts[s], min(stop - self.starts[s], rows)
            parts.append(self._open(path).get_slice(key)[lo:hi])
            start += hi - lo
            s += 1
        if not parts:
            return torch.empty((0, *shape), dtype=dtype)
        if len(parts) > 1:
            return torch.cat(parts)
        # safetensors >= 0.6 gives a view into a private map of the whole file, read only where
        # touched: copy the rows out so the result owns just them and does not hold the file
        part = parts[0]
        return part.clone() if part.untyped_storage().nbytes() > part.nbytes else part


class FeatureColumn:
    """One module's stored features: index it like a tensor to load rows.

    ``column[i]`` gives one row, ``column[i:j]`` rows ``i..j-1``, ``column[[3, 1, 4]]`` (or an
    integer tensor, or a boolean mask) those rows in that order; only the rows asked for are
    read from disk. ``column[rows, ...]`` indexes the rows read as a tensor would.
    """

    def __init__(self, store: FeatureStore, name: str) -> None:
        site = store._sites[name]
        self.store, self.name, self.key = store, name, site["key"]
        self.dtype: torch.dtype = getattr(torch, site["dtype"])
        self.shape = torch.Size([len(store), *site["shape"]])

    def __len__(self) -> int:
        return self.shape[0]

    def _rows(self, start: int, stop: int) -> torch.Tensor:
        return self.store._read(self.key, start, stop, self.shape[1:], self.dtype)

    def __getitem__(self, key: Any) -> torch.Tensor:
        if isinstance(key, tuple):  # rows first, then the rest as on a tensor
            rows = self[key[0]]
            one = isinstance(key[0], int) or (isinstance(key[0], torch.Tensor) and not key[0].dim())
            return rows[key[1:]] if one else rows[(slice(None), *key[1:])]
        n = len(self)
        if isinstance(key, slice):
            start, stop, step = key.indices(n)
            if step == 1:
                return self._rows(start, max(start, stop))
            key = range(start, stop, step)
        elif isinstance(key, int) or (isinstance(key, torch.Tensor) and key.dim() == 0):
            i = int(key)
            if not -n <= i < n:
                raise IndexError(f"row {i} is out of range for {n} rows")
            i %= n
            return self._rows(i, i + 1)[0]
        if isinstance(key, torch.Tensor) and key.dtype == torch.bool:
            key = key.nonzero().reshape(-1)  # a mask
        wanted = torch.as_tensor(list(key) if isinstance(key, range) else key, dtype=torch.int64)
        if wanted.dim() != 1:
            raise IndexError(f"index rows with an int, a slice or a 1-d list of ints, got {key!r}")
        if len(wanted) and not bool(((wanted >= -n) & (wanted < n)).all()):
            raise IndexError(f"a row in {key!r} is out of range for {n} rows")
        wanted = wanted % max(n, 1)
        unique, inverse = torch.unique(wanted, return_inverse=True)
        parts, run = [], 0
        for k in range(1, len(unique) + 1):  # read consecutive rows in one go
            if k == len(unique) or unique[k] != unique[k - 1] + 1:
                parts.append(self._rows(int(unique[run]), int(unique[k - 1]) + 1))
                run = k
        rows = torch.cat(parts) if parts else torch.empty((0, *self.shape[1:]), dtype=self.dtype)
        return rows[inverse]

    def __repr__(self) -> str:
        return f"FeatureColumn({self.name!r}, {dtype_name(self.dtype)}{list(self.shape)})"
