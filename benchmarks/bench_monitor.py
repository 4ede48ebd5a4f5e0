"""Training-step cost of hs.Monitor against the bare step, side by side in one process.

Paired, interleaved timing (research/env-and-baselines.md): each condition runs N pairs of
(bare step, monitored step), alternating which goes first. Sampling conditions (every=10)
only pay on one step in ten, so the ratio reported is the ratio of the *summed* times over
all pairs (the mean cost per step); the median of per-pair ratios is shown beside it.

    python benchmarks/bench_monitor.py [--quick] [--only gpt2|cnn]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

import hookscope as hs


def gpt2() -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=4,
        n_embd=256,
        n_head=4,
        vocab_size=5000,
        n_positions=128,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    ids = torch.randint(0, 5000, (8, 128))
    return GPT2LMHeadModel(config), lambda m: m(ids, labels=ids).loss


class Block(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += x
        return self.relu(out)


def cnn() -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]:
    model = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(inplace=True),
        *[Block(32) for _ in range(4)],
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, 10),
    )
    x, y = torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,))
    return model, lambda m: nn.functional.cross_entropy(m(x), y)


class NaiveItemHooks:
    """The hand-written monitor: six stats per module output, each read with .item()."""

    def __init__(self, model: nn.Module) -> None:
        self.handles = [
            m.register_forward_hook(self.hook)
            for n, m in model.named_modules()
            if n and not list(m.children())
        ]
        self.rows: list[list[float]] = []

    @staticmethod
    def hook(module: nn.Module, args: object, out: object) -> None:
        if isinstance(out, tuple):
            out = out[0]
        if isinstance(out, torch.Tensor) and out.is_floating_point():
            t = out.detach()
            [
                t.mean().item(),
                t.std().item(),
                t.min().item(),
                t.max().item(),
                (t == 0).float().mean().item(),
                (~torch.isfinite(t)).sum().item(),
            ]

    def step(self, **_: object) -> None:
        pass

    def close(self) -> None:
        for h in self.handles:
            h.remove()


class Anomaly:
    def __init__(self, model: nn.Module) -> None:
        import warnings

        warnings.filterwarnings("ignore", message="Anomaly Detection has been enabled")
        self.ctx = torch.autograd.detect_anomaly(check_nan=True)

    def step(self, **_: object) -> None:
        pass

    def close(self) -> None:
        pass


def measure(name: str, build, pairs: int) -> list[tuple[str, float, float]]:
    torch.manual_seed(0)
    model, loss_of = build()
    model.train()
    # The bare step runs on an identical copy: the watched model keeps its hooks (and the
    # Monitor its step counter) across pairs, and the bare one never has any.
    plain = copy.deepcopy(model)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=1e-4)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)

    def bare() -> float:
        start = time.perf_counter()
        plain_opt.zero_grad(set_to_none=True)
        loss = loss_of(plain)
        loss.backward()
        plain_opt.step()
        loss.item()
        return time.perf_counter() - start

    conditions = {
        "Monitor every step": lambda: hs.Monitor(model, every=1, optimizer=opt),
        "Monitor every 10 steps": lambda: hs.Monitor(model, every=10, optimizer=opt),
        "Monitor non-finite checks only": lambda: hs.Monitor(model, every=10**9, optimizer=opt),
        "naive .item() hooks (6 stats, every module)": lambda: NaiveItemHooks(model),
        "torch.autograd.detect_anomaly": lambda: Anomaly(model),
    }
    rows = []
    for label, make in conditions.items():
        watcher = make()
        anomaly = watcher.ctx if isinstance(watcher, Anomaly) else contextlib.nullcontext()

        def watched(watcher=watcher, anomaly=anomaly) -> float:
            start = time.perf_counter()
            with anomaly:
                opt.zero_grad(set_to_none=True)
                loss = loss_of(model)
                loss.backward()
                opt.step()
                watcher.step(loss=loss)
                loss.item()
            return time.perf_counter() - start

        for _ in range(3):  # warm-up; also takes a non-finite-only Monitor past its step 0
            bare(), watched()
        times = []
        for i in range(pairs):
            pair = (bare(), watched()) if i % 2 == 0 else tuple(reversed((watched(), bare())))
            times.append(pair)
        watcher.close()
        total = sum(w for _, w in times) / sum(b for b, _ in times)
        median = statistics.median(w / b for b, w in times)
        rows.append((label, total, median))
        print(f"{name:5s} {label:45s} {total:5.2f}x (median pair {median:.2f}x)", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="10 pairs instead of 30")
    parser.add_argument("--only", choices=["gpt2", "cnn"])
    args = parser.parse_args()
    torch.set_num_threads(2)
    pairs = 10 if args.quick else 30
    results = {}
    for name, build in (("gpt2", gpt2), ("cnn", cnn)):
        if args.only in (None, name):
            results[name] = measure(name, build, pairs)
    print(
        f"\n{pairs} pairs per condition; ratio of summed step times (median of per-pair ratios)\n"
    )
    names = list(results)
    print("| condition | " + " | ".join(f"{n} train step" for n in names) + " |")
    print("|---|" + "---:|" * len(names))
    for i, (label, _, _) in enumerate(next(iter(results.values()))):
        cells = [f"{results[n][i][1]:.2f}x ({results[n][i][2]:.2f}x)" for n in names]
        print(f"| {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
