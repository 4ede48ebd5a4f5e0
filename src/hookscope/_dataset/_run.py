"""extract_dataset(): one pass over a loader, the outputs committed shard by shard.

A call first checks ``out``: new or empty, it starts (and stores the loader's order); holding
this same extraction, it resumes after the last committed batch; anything else is refused
before a file is touched. The pass runs without gradients in eval mode, stops each forward
right after the last chosen module, and hands whole batches to the writer thread.

:func:`write_dataset` is that pass for any :class:`~._features.Features` (what a batch
stores): ``extract_dataset`` gives the modules' outputs, ``hs.explain_dataset`` each sample's
map; both get the same store, resume and refusals.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .._errors import (
    FeatureStoreError,
    HookscopeError,
    HookscopeWarning,
    missing_extra,
    never_ran_message,
)
from .._format import progress_bar
from .._hooks import check_not_compiled
from .._paths import make_dir
from .._select import Where, select
from .._tree import describe, tensors
from ._batch import device_of, inputs
from ._features import Features, ModuleOutputs
from ._format import (
    CODES,
    FORMAT,
    OURS,
    VERSION,
    dtype_name,
    files,
    read_ledger,
    write_json,
    write_safetensors,
)
from ._order import Order, length, read_order, replaying, why_no_sampler
from ._signature import DATA_DIFFERS, differences, fingerprint, model_signature, refusal
from ._store import FeatureStore
from ._writer import Shard, Writer

__all__ = ["extract_dataset", "write_dataset"]

SHARD_BYTES = 64 << 20  # default shard size: about 64 MiB of features
BUFFER_BYTES = 256 << 20  # features held in memory at most (plus the batch being computed)


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
    batches are skipped (those of a shard not yet full when it stopped are computed again), and
    the files end up identical to those of an uninterrupted run. Under
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
    check_not_compiled(model, "extract_dataset")
    if dtype is not None and not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating dtype (it casts features), got {dtype}")
    chosen = select(model, where)
    return write_dataset(
        model,
        loader,
        out,
        ModuleOutputs(model, chosen, dtype),
        verb="extract_dataset",
        signature={"where": list(chosen), "dtype": None if dtype is None else dtype_name(dtype)},
        shard_rows=shard_rows,
        progress=progress,
        buffer_bytes=buffer_bytes,
    )


def write_dataset(
    model: nn.Module,
    loader: Iterable[Any],
    out: str | os.PathLike[str],
    features: Features,
    *,
    verb: str,
    signature: dict[str, Any],
    shard_rows: int | None = None,
    progress: bool = True,
    buffer_bytes: int = BUFFER_BYTES,
) -> FeatureStore:
    """The resumable pass of :func:`extract_dataset` for any ``features``: each batch of
    ``loader`` through ``features`` into ``out``, shard by shard; a :class:`FeatureStore`.

    ``verb`` names the caller in messages; ``signature`` (JSON: ``where``, ``dtype`` and
    whatever else makes the stored values what they are) is stored with the model's and the
    data's, and a call whose signature differs in any key is refused ``out``.
    """
    try:
        import safetensors  # noqa: F401  (the reader; checked first so nothing half-runs)
    except ImportError:
        raise missing_extra("safetensors", "dataset") from None
    if shard_rows is not None and shard_rows < 1:
        raise ValueError(f"shard_rows must be >= 1, got {shard_rows}")
    if buffer_bytes < 1:
        raise ValueError(f"buffer_bytes must be >= 1, got {buffer_bytes}")
    run = _Run(model, loader, features, Path(out), signature, shard_rows, verb)
    run.prepare()
    if run.done is None:
        run.extract(progress, buffer_bytes)
    return FeatureStore(out)


class _Run:
    """One call of write_dataset: checks ``out``, then runs the batches not yet committed."""

    def __init__(
        self,
        model: nn.Module,
        loader: Iterable[Any],
        features: Features,
        out: Path,
        signature: dict[str, Any],
        shard_rows: int | None,
        verb: str,
    ) -> None:
        self.model, self.loader, self.features, self.out = model, loader, features, out
        self.shard_rows, self.verb = shard_rows, verb
        self.rank, self.world = _rank_and_world()
        self.files = {k: out / v for k, v in files(self.rank).items()}
        self.order: Order | None = None
        self.manifest: dict[str, Any] | None = None
        self.committed: list[dict[str, Any]] = []
        self.done: dict[str, Any] | None = None
        self.ledger_bytes = 0
        self.signature = {
            "model": model_signature(model),
            **signature,
            "world_size": self.world,
        }

    # -- before computing anything: resume, or start afresh ---------------------------------
    def prepare(self) -> None:
        if self.out.exists() and not self.out.is_dir():
            make_dir(self.out, "the features", "out=")  # the error for a file in the way
        if self.files["manifest"].exists():
            self._resume()
        else:
            self._start()

    def _start(self) -> None:
        if self.out.exists():
            foreign = sorted(p.name for p in self.out.iterdir() if not OURS.match(p.name))
            if foreign:
                raise FeatureStoreError(
                    f"{self.verb}: {str(self.out)!r} holds files hookscope did not write "
                    f"({', '.join(foreign[:3])}), so it was left untouched.\n"
                    "Fix: pass a new or empty directory as `out`."
                )
        make_dir(self.out, "the features", "out=")
        for p in self.out.iterdir():  # a start that died before its manifest: ours to redo
            if re.match(rf"^\.?rank{self.rank}[.-]", p.name):
                p.unlink()
        why = why_no_sampler(self.loader)
        order = read_order(self.loader) if why is None else why
        if isinstance(order, str):
            if order:
                warnings.warn(
                    f"{self.verb}: store.index will hold positions 0..N-1, not data-set "
                    f"rows, because {order}.",
                    HookscopeWarning,
                    stacklevel=4,
                )
            return
        self.order = order
        write_safetensors(self.files["order"], [("rows", [order[0]]), ("offsets", [order[1]])], {})

    def _resume(self) -> None:
        manifest = json.loads(self.files["manifest"].read_text())
        if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
            raise FeatureStoreError(f"{self.files['manifest']} is not a hookscope manifest")
        stored = manifest["signature"]
        problems = differences(stored, {**self.signature, "data": self._data(None)})
        if self.shard_rows is not None and self.shard_rows != manifest["shard_rows"]:
            problems.append(
                f"shard_rows: the store has {manifest['shard_rows']}, this call {self.shard_rows}"
            )
        self.committed, self.done, self.ledger_bytes = read_ledger(self.files["ledger"])
        if manifest["index"] == "positions" and self.done is not None and not problems:
            first = next(iter(self.loader), None)  # unfinished: checked as the pass starts
            if first is None or fingerprint(first) != stored["data"]["first"]:
                problems.append(DATA_DIFFERS)
        if manifest["index"] == "sampler":
            why = why_no_sampler(self.loader)
            if why is not None:
                problems.append(
                    "the loader differs: the store was read through a DataLoader's batch "
                    f"sampler, and this loader has none ({why or type(self.loader).__name__})"
                )
            else:
                from safetensors.torch import load_file

                loaded = load_file(self.files["order"])
                self.order = (loaded["rows"], loaded["offsets"])
                if not problems and fingerprint(self._first_batch()) != stored["data"]["first"]:
                    problems.append(DATA_DIFFERS)
        if problems:
            raise FeatureStoreError(refusal(self.out, problems, self.verb))
        self.manifest = manifest
        for entry in self.committed:
            path = self.out / entry["file"]
            if not path.exists() or path.stat().st_size != entry["bytes"]:
                raise FeatureStoreError(
                    f"{self.verb}: the shard {entry['file']} that the ledger lists is missing "
                    f"or changed, so {str(self.out)!r} is damaged.\n"
                    f"Fix: delete {str(self.out)!r} to start over, or pass a new `out`."
                )

    def _first_batch(self) -> Any:
        """Batch 0 again (loaded, not run), to compare with the stored fingerprint."""
        assert self.order is not None  # sampler stores only
        replay = replaying(self.loader, self.order, 0, 1)
        object.__setattr__(replay, "num_workers", 0)
        return next(iter(replay))

    def _data(self, first: Any) -> dict[str, Any]:
        dataset = getattr(self.loader, "dataset", None)
        data: dict[str, Any] = {
            "dataset_len": None if dataset is None else length(dataset),
            "batches": length(self.loader),
        }
        if self.order is not None:
            data["rows"] = len(self.order[0])
        if first is not None:
            data["first"] = fingerprint(first)
        return data

    # -- the pass ---------------------------------------------------------------------------
    def _batches(self, start: int) -> Iterator[tuple[int, Any, torch.Tensor | None]]:
        if self.order is not None:
            rows, offsets = self.order
            replay = replaying(self.loader, self.order, start, len(offsets) - 1)
            for b, batch in enumerate(replay, start):
                yield b, batch, rows[offsets[b] : offsets[b + 1]]
            return
        for b, batch in enumerate(self.loader):  # no sampler: re-read the committed batches
            stored = None if self.manifest is None else self.manifest["signature"]["data"]
            if b == 0 and stored is not None and fingerprint(batch) != stored["first"]:
                raise FeatureStoreError(refusal(self.out, [DATA_DIFFERS], self.verb))
            if b >= start:
                yield b, batch, None

    def _writer(self, keys: list[str], limit: int) -> Writer:
        """Start the writer; first drop what a kill left behind (checks have passed by now)."""
        with open(self.files["ledger"], "ab") as f:
            f.truncate(self.ledger_bytes)  # a ledger line cut short is not committed
        for p in self.out.glob(f".rank{self.rank}[.-]*.tmp"):
            p.unlink()
        return Writer(self.out, self.rank, keys, limit, len(self.committed))

    def extract(self, progress: bool, buffer_bytes: int) -> None:
        start = self.committed[-1]["batches"][1] if self.committed else 0
        row = sum(e["rows"] for e in self.committed)
        names, keys = self.features.names, self.features.keys
        device = device_of(self.model)
        total = length(self.loader) if self.order is None else len(self.order[1]) - 1
        bar = progress_bar(
            progress and self.rank == 0,
            total=total,
            initial=start,
            unit="batch",
            desc=f"{self.verb} {self.out.name}",
        )
        writer: Writer | None = None
        shard: Shard | None = None
        done: dict[str, Any] | None = None
        try:
            with self.features.attached():
                for b, batch, index in self._batches(start):
                    args, kwargs = inputs(batch, device)
                    try:
                        found, pending = self.features(batch, args, kwargs)
                    except Exception as exc:
                        if tensors(batch):
                            raise  # the model's own error, on a batch of tensors
                        raise HookscopeError(_no_tensor(self.verb, b, batch, exc)) from exc
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
                    shard = shard or Shard(b, len(names))
                    shard.add(index, feats, nbytes, [pending])
                    row += rows
                    if bar is not None:
                        bar.update(1)
            if self.manifest is None:
                raise ValueError(f"{self.verb}: the loader gave no batch")
            done = {"done": True, "rows": row}
        finally:
            if bar is not None:
                bar.close()
            if writer is None and done is not None:  # everything was committed already
                writer = self._writer(keys, buffer_bytes)
            if writer is not None:
                # A stopped pass keeps its full shards (committed); the batches of a shard
                # that a further batch could still join are computed again on resuming, so
                # that a resumed extraction ends with the same files as an uninterrupted one.
                if shard is not None and (done is not None or self._full(shard)):
                    writer.put(shard)
                writer.close(done)

    def _full(self, shard: Shard) -> bool:
        """No further batch (of at least one row) fits in ``shard``."""
        return self.manifest is not None and shard.rows >= self.manifest["shard_rows"]

    def _check(
        self, found: dict[str, torch.Tensor], names: list[str], index: torch.Tensor | None
    ) -> list[torch.Tensor]:
        missing = [n for n in names if n not in found]
        if missing:
            raise HookscopeError(f"{self.verb}: " + never_ran_message(missing))
        feats = [found[n] for n in names]
        rows = feats[0].shape[0] if index is None else len(index)
        sites = None if self.manifest is None else self.manifest["sites"]
        for i, (name, f) in enumerate(zip(names, feats, strict=True)):
            if f.dim() == 0 or f.shape[0] != rows:
                raise HookscopeError(
                    f"{self.verb}: module {name!r} gave {describe(f)} for a batch of {rows} "
                    "rows; it must return one row per data-set row, batch first."
                )
            if sites is not None and (
                list(f.shape[1:]) != sites[i]["shape"] or dtype_name(f.dtype) != sites[i]["dtype"]
            ):
                raise HookscopeError(
                    f"{self.verb}: module {name!r} gave {describe(f)}, but earlier batches "
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
            if f.dtype not in CODES:
                raise HookscopeError(
                    f"{self.verb}: module {name!r} gives {f.dtype}, which safetensors "
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
                {"name": n, "key": k, "shape": list(f.shape[1:]), "dtype": dtype_name(f.dtype)}
                for n, k, f in zip(names, keys, feats, strict=True)
            ],
            "versions": {"torch": torch.__version__, "safetensors": safetensors.__version__},
        }
        write_json(self.files["manifest"], self.manifest)


def _no_tensor(verb: str, b: int, batch: Any, exc: Exception) -> str:
    """The model failed on a batch that holds no tensor (a list of strings, say)."""
    return (
        f"{verb}: batch {b} of the loader holds no tensor ({describe(batch)}), and "
        f"the model failed on it: {type(exc).__name__}: {exc}.\nFix: give a loader of "
        "tensors: a batch is a tensor (model(x)), a tuple or list whose first item is the "
        "input ((x, y) loaders), or a dict of keyword arguments (model(**batch)); tokenize "
        "text in the data set or in a collate_fn."
    )


def _rank_and_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1
