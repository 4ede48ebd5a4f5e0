"""extract_dataset() and FeatureStore: the features of a whole data set on disk, resumable.

``out`` holds, for rank ``k`` of a ``torch.distributed`` job (``0`` in one process)::

    rank{k}.manifest.json        what was extracted: signature, sites, shard size (written once)
    rank{k}.order.safetensors    the data-set rows in extraction order (loaders with a sampler)
    rank{k}.ledger.jsonl         one line per committed shard, then a "done" line
    rank{k}-{i:06d}.safetensors  shard i: "index" (data-set rows) and "output:<module>" per site

A shard is whole batches. It is written to a temporary file, fsynced, renamed, and only then
recorded in the ledger (fsynced): the ledger is the truth, and a shard it does not list does not
exist. A resumed call skips the batches the ledger lists without loading or running them (a
loader without a sampler re-reads them, without running the model) and writes the same bytes
an uninterrupted run would have written; it first checks a signature (model, ``where``,
``dtype``, data set) and refuses ``out`` when anything differs.

Rows: with a ``DataLoader`` over a map-style data set, the batch sampler is iterated once up
front and that order is stored and replayed, so ``index`` holds real data-set rows (shuffled
loaders and ``DistributedSampler`` included, seeded or not) and a resume sees the same batches.
Any other iterable (an ``IterableDataset``, a list of batches, a generator) gets positions
``0..N-1``; it must give the same batches again to resume.
"""

from __future__ import annotations

import array
import collections
import contextlib
import copy
import functools
import hashlib
import json
import operator
import os
import re
import struct
import threading
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ._errors import HookscopeError, HookscopeWarning, did_you_mean, missing_extra
from ._extract import _StopForward
from ._format import progress_bar
from ._hooks import HookSet, check_not_compiled, training_mode
from ._select import Where, select
from ._sites import forward_failed
from ._tree import describe, map_tensors, tensors

__all__ = ["FeatureStore", "FeatureStoreError", "extract_dataset"]

FORMAT = "hookscope.features"
VERSION = 1
SHARD_BYTES = 64 << 20  # default shard size: about 64 MiB of features
BUFFER_BYTES = 256 << 20  # features held in memory at most (plus the batch being computed)
_OURS = re.compile(r"^\.?rank\d+[.-]")  # every file extract_dataset writes


class FeatureStoreError(HookscopeError, ValueError):
    """``out`` holds another extraction, or is not a hookscope feature store, or is damaged."""


def _files(rank: int) -> dict[str, str]:
    return {
        "manifest": f"rank{rank}.manifest.json",
        "order": f"rank{rank}.order.safetensors",
        "ledger": f"rank{rank}.ledger.jsonl",
    }


def _shard_name(rank: int, i: int) -> str:
    return f"rank{rank}-{i:06d}.safetensors"


# -- safetensors, written by hand: streamed from per-batch tensors, no concatenation -----------

_CODES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}  # fmt: skip
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2")):
    if hasattr(torch, _name):
        _CODES[getattr(torch, _name)] = _code


def _write_safetensors(
    path: Path, items: list[tuple[str, list[torch.Tensor]]], metadata: dict[str, str]
) -> None:
    """Write ``{key: torch.cat(chunks)}`` as a safetensors file, then fsync it.

    Tensors are laid out by decreasing item size (as safetensors does) so each stays aligned.
    """
    items = sorted(items, key=lambda kv: -kv[1][0].element_size())
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for key, chunks in items:
        first = chunks[0]
        size = sum(c.numel() for c in chunks) * first.element_size()
        shape = [sum(c.shape[0] for c in chunks), *first.shape[1:]]
        header[key] = {
            "dtype": _CODES[first.dtype],
            "shape": shape,
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(len(raw) + 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for _, chunks in items:
            for chunk in chunks:
                if chunk.numel():
                    f.write(chunk.reshape(-1).view(torch.uint8).numpy())
        f.flush()
        os.fsync(f.fileno())


def _replace(tmp: Path, final: Path) -> None:
    """Atomically move ``tmp`` to ``final`` and make the rename durable."""
    os.replace(tmp, final)
    with contextlib.suppress(OSError):  # directories cannot be fsynced on every platform
        fd = os.open(final.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name("." + path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    _replace(tmp, path)


def _read_ledger(path: Path) -> tuple[list[dict[str, Any]], dict[str, Any] | None, int]:
    """Committed shards, the "done" line (or None), and the length of the valid prefix.

    A line cut short by a kill (no newline yet) is not committed.
    """
    data = path.read_bytes() if path.exists() else b""
    end = data.rfind(b"\n") + 1
    entries = [json.loads(line) for line in data[:end].splitlines() if line.strip()]
    done = next((e for e in entries if e.get("done")), None)
    return [e for e in entries if "shard" in e], done, end


# -- signature ---------------------------------------------------------------------------------


def _sample_bytes(t: torch.Tensor, k: int) -> bytes:
    """Up to ``k`` evenly spaced values of ``t``, as bytes (exact, whatever the device)."""
    t = t.detach()
    if t.device.type == "meta" or t.numel() == 0:
        return b""
    flat = t.reshape(-1)
    n = flat.numel()
    if n > k:
        flat = flat[torch.arange(k, device=flat.device) * (n - 1) // (k - 1)]
    return flat.cpu().contiguous().view(torch.uint8).numpy().tobytes()


def _model_signature(model: nn.Module) -> dict[str, str]:
    arch = hashlib.sha256()
    weights = hashlib.sha256()
    for name, module in model.named_modules():
        arch.update(f"{name}:{type(module).__qualname__};".encode())
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        arch.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
        weights.update(_sample_bytes(t, 4096))
    return {"architecture": arch.hexdigest(), "weights": weights.hexdigest()}


def _fingerprint(batch: Any) -> str:
    h = hashlib.sha256(describe(batch).encode())
    for t in tensors(batch):
        h.update(_sample_bytes(t, 1 << 16))
    return h.hexdigest()


def _differences(stored: dict[str, Any], now: dict[str, Any]) -> list[str]:
    out = []
    if stored["model"]["architecture"] != now["model"]["architecture"]:
        out.append("the model differs (class, parameter or buffer names, shapes or dtypes)")
    elif stored["model"]["weights"] != now["model"]["weights"]:
        out.append("the model's weights differ (same architecture)")
    if stored["where"] != now["where"]:
        out.append(f"where: the store has {stored['where']}, this call chose {now['where']}")
    for key in ("dtype", "world_size"):
        if stored[key] != now[key]:
            out.append(f"{key}: the store has {stored[key]}, this call has {now[key]}")
    for key in ("rows", "batches", "dataset_len"):
        a, b = stored["data"].get(key), now["data"].get(key)
        if a is not None and b is not None and a != b:
            out.append(f"the data set differs: {key} {a} in the store, {b} now")
    return out


# -- where the batches come from ---------------------------------------------------------------


class _Batches:
    """A batch sampler that replays a stored order from batch ``start`` to ``stop``."""

    def __init__(self, rows: torch.Tensor, offsets: torch.Tensor, start: int, stop: int) -> None:
        self.rows, self.offsets, self.start, self.stop = rows, offsets, start, stop

    def __iter__(self) -> Iterator[list[int]]:
        for b in range(self.start, self.stop):
            yield self.rows[self.offsets[b] : self.offsets[b + 1]].tolist()

    def __len__(self) -> int:
        return self.stop - self.start


def _why_no_sampler(loader: Any) -> str | None:
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


def _order(loader: Any) -> tuple[torch.Tensor, torch.Tensor] | str:
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


def _replay(loader: Any, order: tuple[torch.Tensor, torch.Tensor], start: int, stop: int) -> Any:
    """A shallow copy of ``loader`` whose batch sampler replays ``order[start:stop]``."""
    clone = copy.copy(loader)
    object.__setattr__(clone, "batch_sampler", _Batches(*order, start, stop))
    object.__setattr__(clone, "persistent_workers", False)
    clone._iterator = None
    if hasattr(clone, "in_order"):
        clone.in_order = True
    return clone


def _len(obj: Any) -> int | None:
    try:
        return len(obj)
    except TypeError:
        return None


# -- the writer thread -------------------------------------------------------------------------


class _Shard:
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


class _Writer:
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
        self._ledger = open(out / _files(rank)["ledger"], "ab")  # noqa: SIM115 - closed in _run
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
                if not isinstance(item, _Shard):
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

    def _commit(self, shard: _Shard) -> None:
        for event in shard.events:
            event.synchronize()  # the device-to-host copies of that batch have landed
        name = _shard_name(self.rank, self.next)
        final = self.out / name
        tmp = final.with_name("." + name + ".tmp")
        items = [("index", shard.index), *zip(self.keys, shard.sites, strict=True)]
        _write_safetensors(tmp, items, {"format": FORMAT})
        _replace(tmp, final)
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


# -- extract_dataset ---------------------------------------------------------------------------


def extract_dataset(
    model: nn.Module,
    loader: Iterable[Any],
    where: Where,
    out: str | os.PathLike[str],
    *,
    dtype: torch.dtype | None = None,
    shard_rows: int | None = None,
    progress: bool = True,
    buffer_bytes: int = BUFFER_BYTES,
) -> FeatureStore:
    """Write the chosen modules' outputs for every batch of ``loader`` to ``out``; resumable.

    One pass without gradients, in eval mode (every submodule's training flag is restored
    after), each forward stopped right after the last chosen module. A batch is a tensor
    (``model(x)``), a tuple or list whose first item is the input (``(x, y)`` loaders), or a
    dict of keyword arguments (``model(**batch)``); tensors are moved to the model's device.
    Features go to a writer thread through a buffer of at most ``buffer_bytes`` (plus one
    batch, and at least one shard), so disk writes overlap compute and memory stays bounded
    whatever the data set's size.

    Each module must return one row per data-set row, batch-first, with the same shape for every
    batch. A module returning a tuple, dict or ``ModelOutput`` gives its first tensor (the hidden
    states, for Hugging Face blocks). Call again after a crash, Ctrl-C or kill: the committed
    batches are skipped, and the files end up identical to those of an uninterrupted run. Under
    ``torch.distributed`` each rank writes its own files (``rank{k}-...``).

    Args:
        model: The model. No hook is left behind.
        loader: A ``DataLoader`` or any iterable of batches. With a ``DataLoader`` over a
            map-style data set, ``store.index`` holds the real data-set rows (shuffled,
            ``DistributedSampler``); otherwise positions ``0..N-1``.
        where: Which modules (name, glob, regex, type, predicate, or a list).
        out: A directory: new, empty, or holding this same extraction (it resumes).
        dtype: Cast floating-point features to this dtype before storing them.
        shard_rows: Rows per shard file at most (whole batches; a bigger batch is one shard).
            Default: about 64 MiB of features per shard.
        progress: Show a progress bar on rank 0 (needs ``tqdm``; silent without it).
        buffer_bytes: Bytes of features held in memory before computing waits for the disk.

    Returns:
        A :class:`FeatureStore` reading ``out``.

    Raises:
        FeatureStoreError: If ``out`` holds another extraction (other model, ``where``,
            ``dtype``, data set or number of ranks) or other files; nothing is changed.
        SelectionError: If ``where`` matches nothing.
        HookscopeError: If a chosen module never ran, or gave no batch-first tensor.

    Example:
        >>> import torch, hookscope as hs, torch.nn as nn, tempfile
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> data = torch.utils.data.TensorDataset(torch.randn(10, 4), torch.arange(10))
        >>> loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)
        >>> store = hs.extract_dataset(model, loader, "1", tempfile.mkdtemp(), progress=False)
        >>> store["1"][:3].shape, sorted(store.index.tolist()) == list(range(10))
        (torch.Size([3, 8]), True)
    """
    try:
        import safetensors  # noqa: F401  (the reader; checked first so nothing half-runs)
    except ImportError:
        raise missing_extra("safetensors", "dataset") from None
    check_not_compiled(model, "extract_dataset")
    if shard_rows is not None and shard_rows < 1:
        raise ValueError(f"shard_rows must be >= 1, got {shard_rows}")
    if buffer_bytes < 1:
        raise ValueError(f"buffer_bytes must be >= 1, got {buffer_bytes}")
    if dtype is not None and not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating dtype (it casts features), got {dtype}")
    run = _Run(model, loader, select(model, where), Path(out), dtype, shard_rows)
    run.prepare()
    if run.done is None:
        run.extract(progress, buffer_bytes)
    return FeatureStore(out)


class _Run:
    """One call of extract_dataset: checks ``out``, then runs the batches not yet committed."""

    def __init__(
        self,
        model: nn.Module,
        loader: Iterable[Any],
        chosen: dict[str, nn.Module],
        out: Path,
        dtype: torch.dtype | None,
        shard_rows: int | None,
    ) -> None:
        self.model, self.loader, self.chosen, self.out = model, loader, chosen, out
        self.dtype, self.shard_rows = dtype, shard_rows
        self.rank, self.world = _rank_and_world()
        self.files = {k: out / v for k, v in _files(self.rank).items()}
        self.order: tuple[torch.Tensor, torch.Tensor] | None = None
        self.manifest: dict[str, Any] | None = None
        self.committed: list[dict[str, Any]] = []
        self.done: dict[str, Any] | None = None
        self.ledger_bytes = 0
        self.signature = {
            "model": _model_signature(model),
            "where": list(chosen),
            "dtype": None if dtype is None else _dtype_name(dtype),
            "world_size": self.world,
        }

    # -- before computing anything: resume, or start afresh ---------------------------------
    def prepare(self) -> None:
        if self.files["manifest"].exists():
            self._resume()
        else:
            self._start()

    def _start(self) -> None:
        if self.out.exists():
            foreign = sorted(p.name for p in self.out.iterdir() if not _OURS.match(p.name))
            if foreign:
                raise FeatureStoreError(
                    f"extract_dataset: {str(self.out)!r} holds files hookscope did not write "
                    f"({', '.join(foreign[:3])}), so it was left untouched.\n"
                    "Fix: pass a new or empty directory as `out`."
                )
        self.out.mkdir(parents=True, exist_ok=True)
        for p in self.out.iterdir():  # a start that died before its manifest: ours to redo
            if re.match(rf"^\.?rank{self.rank}[.-]", p.name):
                p.unlink()
        why = _why_no_sampler(self.loader)
        order = _order(self.loader) if why is None else why
        if isinstance(order, str):
            if order:
                warnings.warn(
                    "extract_dataset: store.index will hold positions 0..N-1, not data-set "
                    f"rows, because {order}.",
                    HookscopeWarning,
                    stacklevel=4,
                )
            return
        self.order = order
        _write_safetensors(self.files["order"], [("rows", [order[0]]), ("offsets", [order[1]])], {})

    def _resume(self) -> None:
        manifest = json.loads(self.files["manifest"].read_text())
        if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
            raise FeatureStoreError(f"{self.files['manifest']} is not a hookscope manifest")
        stored = manifest["signature"]
        problems = _differences(stored, {**self.signature, "data": self._data(None)})
        if self.shard_rows is not None and self.shard_rows != manifest["shard_rows"]:
            problems.append(
                f"shard_rows: the store has {manifest['shard_rows']}, this call {self.shard_rows}"
            )
        self.committed, self.done, self.ledger_bytes = _read_ledger(self.files["ledger"])
        if manifest["index"] == "positions" and self.done is not None and not problems:
            first = next(iter(self.loader), None)  # unfinished: checked as the pass starts
            if first is None or _fingerprint(first) != stored["data"]["first"]:
                problems.append(_DATA_DIFFERS)
        if manifest["index"] == "sampler":
            why = _why_no_sampler(self.loader)
            if why is not None:
                problems.append(
                    "the loader differs: the store was read through a DataLoader's batch "
                    f"sampler, and this loader has none ({why or type(self.loader).__name__})"
                )
            else:
                from safetensors.torch import load_file

                loaded = load_file(self.files["order"])
                self.order = (loaded["rows"], loaded["offsets"])
                if not problems and _fingerprint(self._first_batch()) != stored["data"]["first"]:
                    problems.append(_DATA_DIFFERS)
        if problems:
            raise FeatureStoreError(_refusal(self.out, problems))
        self.manifest = manifest
        for entry in self.committed:
            path = self.out / entry["file"]
            if not path.exists() or path.stat().st_size != entry["bytes"]:
                raise FeatureStoreError(
                    f"extract_dataset: the shard {entry['file']} that the ledger lists is missing "
                    f"or changed, so {str(self.out)!r} is damaged.\n"
                    f"Fix: delete {str(self.out)!r} to start over, or pass a new `out`."
                )

    def _first_batch(self) -> Any:
        """Batch 0 again (loaded, not run), to compare with the stored fingerprint."""
        assert self.order is not None  # sampler stores only
        replay = _replay(self.loader, self.order, 0, 1)
        object.__setattr__(replay, "num_workers", 0)
        return next(iter(replay))

    def _data(self, first: Any) -> dict[str, Any]:
        dataset = getattr(self.loader, "dataset", None)
        data: dict[str, Any] = {
            "dataset_len": None if dataset is None else _len(dataset),
            "batches": _len(self.loader),
        }
        if self.order is not None:
            data["rows"] = len(self.order[0])
        if first is not None:
            data["first"] = _fingerprint(first)
        return data

    # -- the pass ---------------------------------------------------------------------------
    def _batches(self, start: int) -> Iterator[tuple[int, Any, torch.Tensor | None]]:
        if self.order is not None:
            rows, offsets = self.order
            replay = _replay(self.loader, self.order, start, len(offsets) - 1)
            for b, batch in enumerate(replay, start):
                yield b, batch, rows[offsets[b] : offsets[b + 1]]
            return
        for b, batch in enumerate(self.loader):  # no sampler: re-read the committed batches
            stored = None if self.manifest is None else self.manifest["signature"]["data"]
            if b == 0 and stored is not None and _fingerprint(batch) != stored["first"]:
                raise FeatureStoreError(_refusal(self.out, [_DATA_DIFFERS]))
            if b >= start:
                yield b, batch, None

    def _writer(self, keys: list[str], limit: int) -> _Writer:
        """Start the writer; first drop what a kill left behind (checks have passed by now)."""
        with open(self.files["ledger"], "ab") as f:
            f.truncate(self.ledger_bytes)  # a ledger line cut short is not committed
        for p in self.out.glob(f".rank{self.rank}[.-]*.tmp"):
            p.unlink()
        return _Writer(self.out, self.rank, keys, limit, len(self.committed))

    def extract(self, progress: bool, buffer_bytes: int) -> None:
        start = self.committed[-1]["batches"][1] if self.committed else 0
        row = sum(e["rows"] for e in self.committed)
        names = list(self.chosen)
        keys = [f"output:{n}" for n in names]
        device = _device(self.model)
        found: dict[str, torch.Tensor] = {}
        on_cuda: list[bool] = []
        state = {t.untyped_storage().data_ptr() for t in self.model.state_dict().values()}
        held: set[int] = set()

        def keep(name: str, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            if forward_failed(output) or name in found:
                return
            last = len(found) + 1 == len(names)
            found[name] = _to_host(name, output, self.dtype, on_cuda, last, held)
            if len(found) == len(names):
                raise _StopForward

        total = _len(self.loader) if self.order is None else len(self.order[1]) - 1
        bar = progress_bar(
            progress and self.rank == 0,
            total=total,
            initial=start,
            unit="batch",
            desc=f"extract_dataset {self.out.name}",
        )
        writer: _Writer | None = None
        shard: _Shard | None = None
        done: dict[str, Any] | None = None
        try:
            with HookSet("extract_dataset") as hooks, training_mode(self.model, False):
                for name, module in self.chosen.items():
                    hooks.forward(module, functools.partial(keep, name))
                for b, batch, index in self._batches(start):
                    found.clear()
                    on_cuda.clear()
                    args, kwargs = _inputs(batch, device)
                    held = state | {t.untyped_storage().data_ptr() for t in tensors(batch)}
                    held |= {t.untyped_storage().data_ptr() for t in tensors((args, kwargs))}
                    with torch.no_grad(), contextlib.suppress(_StopForward):
                        self.model(*args, **kwargs)
                    feats = self._check(found, names, index)
                    rows = feats[0].shape[0]
                    index = torch.arange(row, row + rows) if index is None else index
                    if self.manifest is None:
                        self._write_manifest(names, keys, feats, batch, buffer_bytes)
                    if writer is None:
                        writer = self._writer(keys, buffer_bytes)
                    if shard is not None and shard.rows + rows > self.manifest["shard_rows"]:
                        writer.put(shard)  # full: hand it over before waiting for room
                        shard = None
                    nbytes = index.nbytes + sum(f.nbytes for f in feats)
                    writer.reserve(nbytes)
                    shard = shard or _Shard(b, len(names))
                    shard.add(index, feats, nbytes, on_cuda)
                    row += rows
                    if bar is not None:
                        bar.update(1)
            if self.manifest is None:
                raise ValueError("extract_dataset: the loader gave no batch")
            done = {"done": True, "rows": row}
        finally:
            if bar is not None:
                bar.close()
            if writer is None and done is not None:  # everything was committed already
                writer = self._writer(keys, buffer_bytes)
            if writer is not None:
                if shard is not None:
                    writer.put(shard)
                writer.close(done)  # a stopped pass keeps what is computed: it is committed

    def _check(
        self, found: dict[str, torch.Tensor], names: list[str], index: torch.Tensor | None
    ) -> list[torch.Tensor]:
        missing = [n for n in names if n not in found]
        if missing:
            from ._capture import _never_ran_message

            raise HookscopeError("extract_dataset: " + _never_ran_message(missing))
        feats = [found[n] for n in names]
        rows = feats[0].shape[0] if index is None else len(index)
        sites = None if self.manifest is None else self.manifest["sites"]
        for i, (name, f) in enumerate(zip(names, feats, strict=True)):
            if f.dim() == 0 or f.shape[0] != rows:
                raise HookscopeError(
                    f"extract_dataset: module {name!r} gave {describe(f)} for a batch of {rows} "
                    "rows; it must return one row per data-set row, batch first."
                )
            if sites is not None and (
                list(f.shape[1:]) != sites[i]["shape"] or _dtype_name(f.dtype) != sites[i]["dtype"]
            ):
                raise HookscopeError(
                    f"extract_dataset: module {name!r} gave {describe(f)}, but earlier batches "
                    f"gave {sites[i]['dtype']} rows of shape {sites[i]['shape']}. Every row must "
                    "have the same shape (pad sequences to one length)."
                )
        return feats

    def _write_manifest(
        self,
        names: list[str],
        keys: list[str],
        feats: list[torch.Tensor],
        first: Any,
        buffer_bytes: int,
    ) -> None:
        import safetensors

        for name, f in zip(names, feats, strict=True):
            if f.dtype not in _CODES:
                raise HookscopeError(
                    f"extract_dataset: module {name!r} gives {f.dtype}, which safetensors "
                    "cannot store; pass dtype=torch.float32 (or another float dtype)."
                )
        row_bytes = 8 + sum(f[0].nbytes for f in feats)
        shard_bytes = min(SHARD_BYTES, buffer_bytes // 4)  # a few shards fit in the buffer
        self.manifest = {
            "format": FORMAT,
            "version": VERSION,
            "rank": self.rank,
            "signature": {**self.signature, "data": self._data(first)},
            "index": "positions" if self.order is None else "sampler",
            "shard_rows": self.shard_rows or max(1, shard_bytes // row_bytes),
            "sites": [
                {"name": n, "key": k, "shape": list(f.shape[1:]), "dtype": _dtype_name(f.dtype)}
                for n, k, f in zip(names, keys, feats, strict=True)
            ],
            "versions": {"torch": torch.__version__, "safetensors": safetensors.__version__},
        }
        _write_json(self.files["manifest"], self.manifest)


_DATA_DIFFERS = (
    "the data set differs: its first batch is not the one extracted before (with random "
    "transforms, make them deterministic to resume)"
)


def _refusal(out: Path, problems: list[str]) -> str:
    return (
        f"extract_dataset: {str(out)!r} holds features of another extraction, so it was left "
        "untouched:\n  - " + "\n  - ".join(problems) + "\n"
        f"Fix: pass a new `out`, or delete {str(out)!r} to start over."
    )


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _rank_and_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _device(model: nn.Module) -> torch.device:
    for t in (*model.parameters(), *model.buffers()):
        return t.device
    return torch.device("cpu")


def _inputs(batch: Any, device: torch.device) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` for the model: a tensor, ``(x, y, ...)``, or a dict of keywords."""
    if isinstance(batch, (tuple, list)):
        if not batch:
            raise ValueError("extract_dataset: the loader gave an empty tuple as a batch")
        batch = batch[0]

    def move(t: torch.Tensor) -> torch.Tensor:
        return t if t.device == device else t.to(device, non_blocking=True)

    if isinstance(batch, Mapping):
        return (), {k: map_tensors(move, v) for k, v in batch.items()}
    return (map_tensors(move, batch),), {}


def _to_host(
    name: str,
    output: Any,
    dtype: torch.dtype | None,
    cuda: list[bool],
    last: bool,
    held: set[int],
) -> torch.Tensor:
    """The first tensor of ``output``, cast, copied to host memory (pinned, from CUDA).

    The output of the ``last`` chosen module is kept as it is, without a copy, when it owns its
    whole storage and that storage is not ``held`` elsewhere (a parameter, a buffer, the batch):
    the forward stops right after it, so nothing can change it.
    """
    t = output if isinstance(output, torch.Tensor) else next(iter(tensors(output)), None)
    if t is None:
        raise HookscopeError(
            f"extract_dataset: module {name!r} returned {describe(output)}, which holds no tensor"
        )
    t = t.detach()
    target = dtype if (dtype is not None and t.is_floating_point()) else t.dtype
    if t.device.type == "cuda":
        cuda.append(True)
        host = torch.empty(t.shape, dtype=target, pin_memory=True)
        return host.copy_(t.to(target), non_blocking=True)
    if t.device.type != "cpu":
        return t.to("cpu", dtype=target).contiguous()
    storage = t.untyped_storage()
    if (
        last
        and target == t.dtype
        and t.is_contiguous()
        and storage.nbytes() == t.nbytes
        and storage.data_ptr() not in held
    ):
        return t
    return torch.empty(t.shape, dtype=target).copy_(t)


# -- reading -----------------------------------------------------------------------------------


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
            shards, done, _ = _read_ledger(self.path / _files(manifest["rank"])["ledger"])
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
        from ._notebook import feature_store_html

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
        return f"FeatureColumn({self.name!r}, {_dtype_name(self.dtype)}{list(self.shape)})"
