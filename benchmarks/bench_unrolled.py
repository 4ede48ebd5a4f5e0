"""Cost of hs.Monitor per module call when one step calls a module thousands of times.

The model is the LBFGS sequence model of PyTorch's ``time_sequence_prediction`` example, in
small: an ``nn.LSTMCell(1, 51)`` and an ``nn.Linear(51, 1)`` head, unrolled over a sequence of
T steps in ``forward`` (2 module calls per unrolled step), trained with ``torch.optim.LBFGS``,
whose ``step(closure)`` evaluates the closure (zero_grad, forward, MSE loss, backward) up to
``max_iter`` times. One training step thus calls each module ``T x max_iter`` times: 10,000
calls of the cell at T = 1,000. A cost that grows faster than linearly with the calls per
step (a list scanned per call, a registry pruned per registration) shows as a ratio that
grows with T.

Method (as in ``bench_monitor.py``): paired, interleaved timing in one process. Every
condition gets its own deep copy of the model and optimizer and a bare copy that never has
hooks; N pairs of (bare step, watched step) run back to back, alternating which goes first,
after one warm-up pair. The ratio is the ratio of summed step times (the mean cost per step,
fair to ``every=10``, which pays on one step in ten: N is a multiple of 10 for it), the
median of the per-pair ratios in brackets. The watched step is the bare step plus
``mon.step(loss=loss)``; the Monitor finds the optimizer by itself.

    python benchmarks/bench_unrolled.py [--quick] [--lengths 100 300 1000] [--pairs N]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import hookscope as hs

THREADS = 1  # tiny ops: a second thread only adds noise on a shared machine
HIDDEN = 51
BATCH = 16
MAX_ITER = 10  # closure evaluations per LBFGS step (at most; the tolerances never stop it)


class Sequence(nn.Module):
    """An LSTMCell and a Linear head, unrolled over the columns of ``x`` (batch, T)."""

    def __init__(self) -> None:
        super().__init__()
        self.cell = nn.LSTMCell(1, HIDDEN)
        self.head = nn.Linear(HIDDEN, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = c = x.new_zeros(x.shape[0], HIDDEN)
        outputs = []
        for x_t in x.split(1, dim=1):
            h, c = self.cell(x_t, (h, c))
            outputs.append(self.head(h))
        return torch.cat(outputs, dim=1)


def data(length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Noisy sine waves: predict the next value from the current one."""
    t = torch.arange(length + 1, dtype=torch.float32) / 20.0
    phase = torch.rand(BATCH, 1) * 6.28
    wave = torch.sin(t + phase) + 0.01 * torch.randn(BATCH, length + 1)
    return wave[:, :-1], wave[:, 1:]


class Runner:
    """One copy of the model with its LBFGS, and what the watched condition adds."""

    def __init__(self, model: nn.Module, make: Callable[[nn.Module], Any] | None) -> None:
        self.model = model
        self.opt = torch.optim.LBFGS(
            model.parameters(), lr=0.5, max_iter=MAX_ITER, tolerance_grad=0.0, tolerance_change=0.0
        )
        self.mon = make(model) if make is not None else None

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        def closure() -> torch.Tensor:
            self.opt.zero_grad()
            loss = nn.functional.mse_loss(self.model(x), y)
            loss.backward()
            return loss

        start = time.perf_counter()
        loss = self.opt.step(closure)
        if self.mon is not None:
            self.mon.step(loss=loss)
        loss.item()
        return time.perf_counter() - start

    def close(self) -> None:
        if self.mon is not None:
            self.mon.close()


CONDITIONS: dict[str, Callable[[nn.Module], Any]] = {
    "`hs.Monitor(model)` (every=10)": lambda m: hs.Monitor(m),
    "`hs.Monitor(model, every=1)`": lambda m: hs.Monitor(m, every=1),
}


def paired(
    base: nn.Module, length: int, make: Callable[[nn.Module], Any], pairs: int
) -> tuple[float, float, float, float]:
    """(ratio of sums, median ratio, bare ms, watched ms) of one condition at one length."""
    x, y = data(length)
    bare, watched = Runner(copy.deepcopy(base), None), Runner(copy.deepcopy(base), make)
    times: list[tuple[float, float]] = []
    try:
        for i in range(1 + pairs):
            if i % 2 == 0:
                tb, tw = bare.step(x, y), watched.step(x, y)
            else:
                tw, tb = watched.step(x, y), bare.step(x, y)
            if i >= 1:
                times.append((tb, tw))
    finally:
        watched.close()
    total = sum(tw for _, tw in times) / sum(tb for tb, _ in times)
    median = statistics.median(tw / tb for tb, tw in times)
    return (
        total,
        median,
        1e3 * statistics.fmean(tb for tb, _ in times),
        1e3 * statistics.fmean(tw for _, tw in times),
    )


def profile(length: int, make: Callable[[nn.Module], Any], steps: int) -> None:
    """cProfile of ``steps`` watched steps: the functions with the most own time."""
    import cProfile
    import pstats

    torch.manual_seed(0)
    runner = Runner(Sequence(), make)
    x, y = data(length)
    runner.step(x, y)
    with cProfile.Profile() as prof:
        for _ in range(steps):
            runner.step(x, y)
    runner.close()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="10 pairs instead of 20")
    parser.add_argument("--lengths", type=int, nargs="+", default=[100, 300, 1000])
    parser.add_argument("--pairs", type=int, default=None, help="pairs per condition and length")
    parser.add_argument(
        "--profile", type=int, metavar="T", help="profile every=1 at length T instead"
    )
    args = parser.parse_args()
    torch.set_num_threads(THREADS)
    if args.profile:
        profile(args.profile, CONDITIONS["`hs.Monitor(model, every=1)`"], steps=3)
        return
    pairs = args.pairs or (10 if args.quick else 20)
    torch.manual_seed(0)
    base = Sequence()
    start = time.perf_counter()
    rows: dict[str, dict[int, tuple[float, float, float, float]]] = {c: {} for c in CONDITIONS}
    for length in args.lengths:
        for name, make in CONDITIONS.items():
            gc.collect()
            t0 = time.perf_counter()
            rows[name][length] = result = paired(base, length, make, pairs)
            print(
                f"  T={length} {name}: {result[0]:.2f}x ({result[1]:.2f}x), bare "
                f"{result[2]:.0f} ms, watched {result[3]:.0f} ms   [{time.perf_counter() - t0:.0f} s]",
                flush=True,
            )
    print()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{platform.processor() or platform.machine()}, hookscope "
        f"{getattr(hs, '__version__', '?')} ({os.path.dirname(hs.__file__)}); LSTMCell(1, "
        f"{HIDDEN}) + Linear({HIDDEN}, 1), batch {BATCH}, LBFGS max_iter={MAX_ITER}; {pairs} "
        "pairs per cell (1 warm-up); ratio of summed step times (median of per-pair ratios)"
    )
    lengths = args.lengths
    print("\n| condition | " + " | ".join(f"T = {n:,}" for n in lengths) + " |")
    print("|---|" + "---:|" * len(lengths))
    for name, by_length in rows.items():
        cells = [f"{by_length[n][0]:.2f}x ({by_length[n][1]:.2f}x)" for n in lengths]
        print(f"| {name} | " + " | ".join(cells) + " |")
    bare_ms = [f"{statistics.fmean(r[n][2] for r in rows.values()):.0f}" for n in lengths]
    print("| bare step, ms | " + " | ".join(bare_ms) + " |")
    print(f"\ntotal {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
