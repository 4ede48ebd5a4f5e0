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

The package, each module importing only those above it in this list:

- ``_format``: file names, safetensors written by hand, the ledger (writer and reader share it);
- ``_signature``: what a resume compares (model, sites, data);
- ``_order``: the loader's batch order, stored and replayed;
- ``_batch``: a batch into the model, a module's output to host memory;
- ``_features``: what a batch stores (``Features``; ``ModuleOutputs``: extract_dataset's);
- ``_writer``: the thread that commits shards;
- ``_store``: ``FeatureStore``, the reader;
- ``_run``: ``extract_dataset``, and ``write_dataset``, the pass for any ``Features``
  (``hs.explain_dataset`` stores each sample's map through it).
"""

from __future__ import annotations

from .._errors import FeatureStoreError
from ._features import Features
from ._run import extract_dataset, write_dataset
from ._store import FeatureColumn, FeatureStore

__all__ = [
    "FeatureColumn",
    "FeatureStore",
    "FeatureStoreError",
    "Features",
    "extract_dataset",
    "write_dataset",
]
