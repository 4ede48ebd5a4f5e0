"""What ``Monitor(explain=hs.Probe(...))`` costs a training run, side by side in one process.

Model: the demo's digits CNN (``hookscope._demo.DigitsCNN``: conv-BN-ReLU x2, max-pool, two
linear layers; 8x8 inputs), Adam, batch 32, a Monitor with its defaults (``every=10``); the
probe: 10 test digits explained by Grad-CAM at the last conv (``features.3``) every 100 steps,
as ``hookscope demo`` does. fp32 on the CPU, ``torch.set_num_threads(1)``.

Method: two models train side by side, one watched by a Monitor with the probe and one by a
Monitor without it; blocks of 100 steps (each probed block holds one explanation) alternate
between them, which goes first alternating too; the ratio is the median over pairs of
(block with the probe) / (block without). A second figure divides the probe's own time (the
median of its explanations, timed inside ``mon.step()``) by the median block without it:
the same cost, without the noise of two whole blocks.

    python benchmarks/bench_probe.py            # 12 pairs of 100-step blocks
    python benchmarks/bench_probe.py --quick    # 3 pairs, a smoke test
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

import hookscope as hs
from hookscope._demo import DigitsCNN, load_digits
from hookscope._explain._probe import ProbeRun

EVERY = 100  # the probe's period, and a block's length


def trainer(probe: hs.Probe | None) -> tuple[Callable[[], None], hs.Monitor]:
    """One model, its optimizer and Monitor; the returned function trains one block."""
    x, y, _, _ = load_digits(0)
    torch.manual_seed(0)
    model = DigitsCNN()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    mon = hs.Monitor(model, explain=probe)
    order = torch.randperm(len(x))

    def block() -> None:
        for i in range(EVERY):
            idx = order[(i * 32) % (len(x) - 32) :][:32]
            loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            mon.step(loss=loss.detach())

    return block, mon


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    pairs = 3 if args.quick else 12
    torch.set_num_threads(1)
    _, _, x_test, y_test = load_digits(0)
    digits = torch.stack([x_test[(y_test == c).nonzero()[0, 0]] for c in range(10)])
    probe = hs.Probe(digits, where="features.3", every=EVERY)

    spent: list[float] = []
    records = ProbeRun.records

    def timed(self: ProbeRun, step: int) -> list:
        start = time.perf_counter()
        out = records(self, step)
        spent.append(time.perf_counter() - start)
        return out

    ProbeRun.records = timed  # type: ignore[method-assign]
    bare, bare_mon = trainer(None)
    probed, probed_mon = trainer(probe)
    bare()  # warm-up block each (the probe's first explanation included)
    probed()
    spent.clear()
    ratios, blocks = [], []
    for i in range(pairs):
        times = {}
        for name, fn in (("bare", bare), ("probed", probed))[:: 1 if i % 2 == 0 else -1]:
            start = time.perf_counter()
            fn()
            times[name] = time.perf_counter() - start
        ratios.append(times["probed"] / times["bare"])
        blocks.append(times["bare"])
    bare_mon.close()
    probed_mon.close()
    ProbeRun.records = records  # type: ignore[method-assign]
    assert len(spent) == pairs  # one explanation per probed block
    block = statistics.median(blocks)
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, 1 thread")
    print(f"{EVERY} steps without the probe: {block * 1e3:.1f} ms (median of {pairs})")
    print(f"one explanation of 10 digits: {statistics.median(spent) * 1e3:.2f} ms")
    print(f"with / without, paired blocks: {statistics.median(ratios):.3f}x (aim <= 1.02x)")
    print(f"1 + explanation / block: {1 + statistics.median(spent) / block:.4f}x")


if __name__ == "__main__":
    main()
