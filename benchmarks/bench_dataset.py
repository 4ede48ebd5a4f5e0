"""What extract_dataset costs: rows/s against the bare forward pass over the same loader.

Method: paired, interleaved timing (as in bench_capture.py). Each pair runs the bare pass,
``model(x)`` under ``torch.no_grad()`` in eval mode for every batch of the loader, and one
whole ``hs.extract_dataset`` into a fresh directory (hooks, copies, the writer thread, every
shard written, fsynced and recorded in the ledger, the manifest, the final store opened),
alternating which goes first; the ratio is the median over pairs of extract rows/s divided by
bare rows/s (>= 1 where stopping the forward early saves more than writing costs). The output
directory is deleted after each run, outside the timed region.

Models: a ResNet-style CNN (stem + 4 BasicBlocks with ``ReLU(inplace=True)``, 16 channels,
32x32 inputs, batch 32, 512 rows) and the GPT-2 of bench_capture.py (n_layer=4, n_embd=256,
batch 8x128, 64 rows); data sets held in memory, ``DataLoader(num_workers=0)``.

    python benchmarks/bench_dataset.py            # 15 pairs per condition
    python benchmarks/bench_dataset.py --quick    # 5 pairs, for a smoke test
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import _models
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import hookscope as hs


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += x
        return self.relu(out)


def cnn(width: int = 16) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, width, 3, padding=1, bias=False),
        nn.BatchNorm2d(width),
        nn.ReLU(inplace=True),
        *[Block(width) for _ in range(4)],
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(width, 10),
    )


def gpt2() -> nn.Module:
    return _models.gpt2()


def bare_pass(model: nn.Module, loader: DataLoader) -> Callable[[], int]:
    def run() -> int:
        rows = 0
        with torch.no_grad():
            for batch in loader:
                x = batch[0] if isinstance(batch, (tuple, list)) else batch
                model(x)
                rows += len(x)
        return rows

    return run


def extract_pass(model: nn.Module, loader: DataLoader, where: str) -> Callable[[], int]:
    def run() -> int:
        out = tempfile.mkdtemp(prefix="bench-dataset-")
        try:
            store = hs.extract_dataset(model, loader, where, out, progress=False)
            return len(store)
        finally:
            run.bytes = sum(e.stat().st_size for e in os.scandir(out))  # type: ignore[attr-defined]
            shutil.rmtree(out)

    return run


def paired(
    bare: Callable[[], int], cond: Callable[[], int], *, pairs: int, warmup: int
) -> tuple[float, float, float]:
    """Median of per-pair ratios of rows/s (cond / bare), and each side's median rows/s."""

    def timed(fn: Callable[[], int]) -> float:
        t0 = time.perf_counter()
        rows = fn()
        return rows / (time.perf_counter() - t0)

    ratios, rb, rc = [], [], []
    for i in range(warmup + pairs):
        if i % 2 == 0:
            b, c = timed(bare), timed(cond)
        else:
            c, b = timed(cond), timed(bare)
        if i >= warmup:
            ratios.append(c / b)
            rb.append(b)
            rc.append(c)
    return statistics.median(ratios), statistics.median(rb), statistics.median(rc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="5 pairs per condition")
    parser.add_argument("--pairs", type=int, default=None)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    pairs = args.pairs or (5 if args.quick else 15)
    warmup = 1
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    net = cnn().eval()
    images = TensorDataset(torch.randn(512, 3, 32, 32), torch.randint(0, 10, (512,)))
    image_loader = DataLoader(images, batch_size=32)
    lm = gpt2().eval()
    ids = DataLoader(torch.randint(0, 5000, (64, 128)), batch_size=8)

    conditions = [
        ("CNN", net, image_loader, "9", "`fc` (the logits: a whole forward)"),
        ("CNN", net, image_loader, "7", "`avgpool` (16 floats/row)"),
        ("CNN", net, image_loader, "3", "first block (16x32x32 floats/row)"),
        ("GPT-2", lm, ids, "lm_head", "`lm_head` (the logits: a whole forward)"),
        ("GPT-2", lm, ids, "transformer.h.3", "last block (128x256 floats/row)"),
    ]
    rows = []
    for model_name, model, loader, where, label in conditions:
        cond = extract_pass(model, loader, where)
        ratio, bare_rate, rate = paired(bare_pass(model, loader), cond, pairs=pairs, warmup=warmup)
        mib = cond.bytes / 2**20  # type: ignore[attr-defined]
        rows.append((model_name, label, ratio, bare_rate, rate, mib))
        print(f"  {model_name} {label:<44} {ratio:.2f}x ({bare_rate:.0f} vs {rate:.0f} rows/s)")

    print()
    print(
        f"torch {torch.__version__}, {platform.machine()}, {args.threads} threads, "
        f"{pairs} pairs per condition, median of per-pair ratios"
    )
    print()
    print("| model | `where` | extract / bare rows/s | bare rows/s | extract rows/s | written |")
    print("|---|---|---:|---:|---:|---:|")
    for model_name, label, ratio, bare_rate, rate, mib in rows:
        print(
            f"| {model_name} | {label} | {ratio:.2f}x | {bare_rate:.0f} | {rate:.0f} "
            f"| {mib:.0f} MiB |"
        )


if __name__ == "__main__":
    main()
