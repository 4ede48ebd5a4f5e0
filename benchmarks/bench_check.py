"""Cost of ``Monitor(check="edges")`` (the default) and ``check="modules"`` against the bare
training step, in one process, paired and interleaved.

Every condition gets its own deep copy of the model and a bare copy that never has hooks;
after warm-up pairs, N pairs of (bare step, watched step) run back to back, alternating which
goes first; the ratio is that of the summed step times (the median per-pair ratio in
brackets). A step: zero_grad, forward, backward, SGD step, ``mon.step()``. Conditions:
``every=None`` (the non-finite check and the rolling window only) and ``every=10``, each
with ``check="edges"`` and ``check="modules"``. Models: GPT-2 (4 layers x 256, random weights,
8x128 tokens) and a 3-block CNN with in-place ReLUs (16x3x64x64 inputs).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
import hookscope as hs
import models


def cnn() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    def block(cin: int, cout: int) -> list[nn.Module]:
        return [
            nn.Conv2d(cin, cout, 3, padding=1),
            nn.BatchNorm2d(cout),
            nn.ReLU(inplace=True),
            nn.Conv2d(cout, cout, 3, padding=1),
            nn.BatchNorm2d(cout),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
        ]

    model = nn.Sequential(
        *block(3, 32), *block(32, 64), *block(64, 128), nn.Flatten(), nn.Linear(128 * 8 * 8, 10)
    )
    return model, (torch.randn(16, 3, 64, 64), torch.randint(0, 10, (16,)))


def gpt2() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    model = models.gpt2(4, n_embd=256, n_head=4, n_positions=128).train()
    ids = torch.randint(0, 100, (8, 128))
    return model, (ids, ids)


def loss_of(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    if hasattr(model, "lm_head"):
        return model(x, labels=y).loss
    return nn.functional.cross_entropy(model(x), y)


def stepper(model: nn.Module, batch, mon: hs.Monitor | None):
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> float:
        start = time.perf_counter()
        opt.zero_grad()
        loss_of(model, batch).backward()
        opt.step()
        if mon is not None:
            mon.step()
        return time.perf_counter() - start

    return step


def measure(build, every: int | None, check: str, pairs: int) -> tuple[float, float]:
    torch.manual_seed(0)
    model, batch = build()
    bare = stepper(copy.deepcopy(model), batch, None)
    watched_model = copy.deepcopy(model)
    with hs.Monitor(watched_model, every=every, check=check) as mon:
        watched = stepper(watched_model, batch, mon)
        for _ in range(5):
            bare(), watched()
        ratios, b_sum, w_sum = [], 0.0, 0.0
        for i in range(pairs):
            if i % 2:
                w, b = watched(), bare()
            else:
                b, w = bare(), watched()
            b_sum, w_sum = b_sum + b, w_sum + w
            ratios.append(w / b)
    return w_sum / b_sum, statistics.median(ratios)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    print("| model | every | check | ratio vs bare (median pair) |")
    print("|---|---|---|---|")
    for name, build in (("GPT-2 4x256", gpt2), ("CNN 3 blocks", cnn)):
        for every in (None, 10):
            for check in ("edges", "modules"):
                total, median = measure(build, every, check, args.pairs)
                print(f"| {name} | {every} | {check} | {total:.3f}x ({median:.3f}x) |", flush=True)


if __name__ == "__main__":
    main()
