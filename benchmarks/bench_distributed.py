"""The cost of the Monitor's one collective per step under DDP, against the bare DDP step.

Two gloo ranks on the CPU (one thread each), each training its own DDP copies of the
benchmarks' GPT-2 (``_models.gpt2``, dropout 0, 4x128 tokens per rank, SGD). Paired,
interleaved timing as in ``bench_monitor.py``: per condition, N pairs of (bare DDP step,
watched DDP step) back to back, alternating which goes first, after warm-up pairs; the ratio
is that of the summed step times. A step is zero_grad, forward, backward (DDP's own
all-reduce of the gradients), SGD step, ``mon.step(loss=loss)``, ``loss.item()``.

Conditions: the Monitor with ``sync=False`` (rank-local statistics, no collective) and with
the default sync (global statistics from one all_reduce per step), at ``every=1``,
``every=10`` and ``every=None``; the difference between a synced row and its ``sync=False``
row is the collective's own cost. The size of the collective's vector is printed too.

    python benchmarks/bench_distributed.py [--pairs N]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import hookscope as hs

WORLD = 2
CONDITIONS = [
    ("`Monitor(every=1, sync=False)` (rank-local, no collective)", dict(every=1, sync=False)),
    ("`Monitor(every=1)` (global, one all_reduce per step)", dict(every=1)),
    ("`Monitor(every=10, sync=False)`", dict(every=10, sync=False)),
    ("`Monitor(every=10)`", dict(every=10)),
    ("`Monitor(every=None, sync=False)` (non-finite only)", dict(every=None, sync=False)),
    ("`Monitor(every=None)`", dict(every=None)),
]


def worker(rank: int, store: str, pairs: int, out: str) -> None:
    import _models

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    torch.manual_seed(0)
    base = _models.gpt2(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    ids = torch.randint(0, base.config.vocab_size, (4, 128))
    rows = [measure(label, kwargs, base, ids, pairs) for label, kwargs in CONDITIONS]
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def measure(label: str, kwargs: dict, base: nn.Module, ids: torch.Tensor, pairs: int) -> dict:
    bare = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    watched = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    opts = {id(m): torch.optim.SGD(m.parameters(), lr=1e-4) for m in (bare, watched)}
    mon = hs.Monitor(watched, **kwargs)
    sizes = []
    real = dist.all_reduce

    def counting(tensor, *args, **kw):
        sizes.append(tensor.numel())
        return real(tensor, *args, **kw)

    def step(model: nn.Module, watch: bool) -> float:
        opt = opts[id(model)]
        opt.zero_grad()
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        if watch:
            mon.step(loss=loss)
        return loss.item()

    times = {False: 0.0, True: 0.0}
    dist.all_reduce = counting
    try:
        for i in range(3 + pairs):
            for watch in (False, True) if i % 2 == 0 else (True, False):
                dist.barrier()
                start = time.perf_counter()
                step(watched if watch else bare, watch)
                if i >= 3:
                    times[watch] += time.perf_counter() - start
    finally:
        dist.all_reduce = real
        mon.close()
    return {
        "label": label,
        "bare_ms": 1000 * times[False] / pairs,
        "with_ms": 1000 * times[True] / pairs,
        "floats": max(sizes, default=0),
        "collectives_per_step": len(sizes) / (3 + pairs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        mp.spawn(worker, args=(os.path.join(tmp, "store"), args.pairs, out), nprocs=WORLD)
        rows = json.loads(Path(out).read_text())
    print(
        f"DDP on {WORLD} gloo ranks (CPU, 1 thread each), GPT-2 4x256, 4x128 tokens per rank, "
        f"torch {torch.__version__}, {platform.machine()}; {args.pairs} pairs per condition\n"
    )
    print(
        "| condition | ratio vs bare DDP | bare ms | with ms | floats reduced | all_reduce/step |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['label']} | {r['with_ms'] / r['bare_ms']:.2f}x | {r['bare_ms']:.0f} | "
            f"{r['with_ms']:.0f} | {r['floats']} | {r['collectives_per_step']:.2f} |"
        )


if __name__ == "__main__":
    main()
