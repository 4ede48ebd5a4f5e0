"""The Monitor's fixed cost per step: microseconds it adds to a small, fast training step.

Method: paired, interleaved rounds in one process. Each condition gets a deep copy of the
model with the Monitor and a second deep copy that never has hooks (the *bare* copy), each
with its own optimizer. A round runs ``--steps`` (10) training steps of one copy, then as
many of the other, alternating which goes first; the figure of a round is the difference of
the two blocks' times divided by the steps (10 steps: one sampled step of ``every=10`` in
each block, so its row is the average over the steps). Reported: the median of the per-round
differences, in microseconds per step, and the median of the per-round ratios. Times are the
main thread's CPU time (``time.thread_time``) with ``torch.set_num_threads(1)``: every op of a
CPU step runs on that thread, and time spent waiting for a core that other processes hold is
left out (the machine is shared); the wall-clock median is shown too.

A training step: ``zero_grad(set_to_none=True)``, forward, loss, ``backward()``,
``optimizer.step()``, then ``mon.step()`` on the watched copy and ``loss.item()`` on both.

Models (random weights, training mode):

- *CNN*: 3 blocks of (conv3x3-BN-ReLU(inplace)) x2 + MaxPool2d(2), 3->8->16->32 channels,
  Flatten, Linear: 23 leaf modules; batch 2 x 3 x 32 x 32; SGD with momentum.
- *MLP*: 12 x (Linear, LayerNorm, GELU), 32->64->...->64, and a Linear(64, 10) head: 37 leaf
  modules; batch 16; AdamW.

Compiled rows (``--compiled``): both copies run through ``torch.compile`` (Inductor unless
``--backend``), the Monitor attached before compiling; the warm-up compiles every graph
(sampled and unsampled). Dynamo's ``skip_nnmodule_hook_guards`` is off, as in
``bench_monitor.py``: two copies of one ``nn.Sequential`` otherwise share compiled graphs.

    python benchmarks/bench_fixed.py [--rounds N] [--steps S] [--only cnn|mlp]
        [--every none,10,1] [--compiled] [--eager-too] [--backend B] [--profile COND]
        [--parts COND]

``--profile cnn:none`` runs cProfile over 200 watched steps of that model and condition and
prints the top functions by own time (the Monitor's share of a step, by function).
``--parts cnn:none`` times the Monitor's entry points instead (its hooks on the root, the
output gradients, the optimizers' step hooks, the backward listener, ``step()``): the main
thread's CPU time inside each, per step, median of 7 blocks of 200 steps. No profiler runs,
so the figures are the real ones (cProfile inflates code that calls many small functions);
they leave out what torch itself does for the hooks (dispatch, autograd nodes).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import cProfile
import gc
import platform
import pstats
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch._dynamo
from torch import nn

import hookscope as hs

Step = Callable[[], float]

AIMS = {None: 150.0, 10: 300.0, 1: 1500.0}  # microseconds per step, on this CPU


def tiny_cnn() -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor], Any]:
    def block(c_in: int, c_out: int) -> list[nn.Module]:
        return [
            nn.Conv2d(c_in, c_out, 3, padding=1, bias=False),
            nn.BatchNorm2d(c_out),
            nn.ReLU(inplace=True),
            nn.Conv2d(c_out, c_out, 3, padding=1, bias=False),
            nn.BatchNorm2d(c_out),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
        ]

    model = nn.Sequential(
        *block(3, 8), *block(8, 16), *block(16, 32), nn.Flatten(), nn.Linear(32 * 4 * 4, 10)
    )
    x, y = torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,))
    return (
        model,
        lambda m: nn.functional.cross_entropy(m(x), y),
        lambda m: torch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9),
    )


def tiny_mlp() -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor], Any]:
    layers: list[nn.Module] = []
    for i in range(12):
        layers += [nn.Linear(32 if i == 0 else 64, 64), nn.LayerNorm(64), nn.GELU()]
    model = nn.Sequential(*layers, nn.Linear(64, 10))
    x, y = torch.randn(16, 32), torch.randint(0, 10, (16,))
    return (
        model,
        lambda m: nn.functional.cross_entropy(m(x), y),
        lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3),
    )


MODELS = {"cnn": ("CNN, batch 2", tiny_cnn), "mlp": ("MLP, batch 16", tiny_mlp)}


def leaves(model: nn.Module) -> int:
    return sum(1 for n, m in model.named_modules() if n and not list(m.children()))


def stepper(
    call: Callable[..., Any],
    model: nn.Module,
    opt: torch.optim.Optimizer,
    loss_of: Callable,
    mon: hs.Monitor | None,
) -> Callable[[int], tuple[float, float]]:
    """``run(n)``: n training steps; their (CPU, wall) seconds."""

    def run(n: int) -> tuple[float, float]:
        c0, w0 = time.thread_time(), time.perf_counter()
        for _ in range(n):
            opt.zero_grad(set_to_none=True)
            loss = loss_of(call)
            loss.backward()
            opt.step()
            if mon is not None:
                mon.step()
            loss.item()
        return time.thread_time() - c0, time.perf_counter() - w0

    return run


def condition(
    key: str, every: int | None, compiled: bool, backend: str
) -> tuple[Callable[[int], tuple[float, float]], Callable[[int], tuple[float, float]], Any]:
    """The bare and the watched step runners of one condition, and what to close."""
    torch.manual_seed(0)
    base, loss_of, make_opt = MODELS[key][1]()
    base.train()
    bare, model = copy.deepcopy(base), copy.deepcopy(base)
    mon = hs.Monitor(model, every=every)
    bare_call, call = bare, model
    if compiled:
        bare_call = torch.compile(bare, backend=backend)
        call = torch.compile(model, backend=backend)
    bare_run = stepper(bare_call, bare, make_opt(bare), loss_of, None)
    run = stepper(call, model, make_opt(model), loss_of, mon)
    return bare_run, run, mon


def measure(
    key: str, every: int | None, *, compiled: bool, rounds: int, steps: int, backend: str
) -> dict[str, float]:
    bare_run, run, mon = condition(key, every, compiled, backend)
    try:
        warm = 3 if compiled else 1
        for _ in range(warm):  # compiles every graph: a sampled and an unsampled step
            bare_run(max(steps, 12))
            run(max(steps, 12))
        cpu, wall, ratio, bare_us = [], [], [], []
        gc.collect()
        for i in range(rounds):
            if i % 2 == 0:
                b, w = bare_run(steps), run(steps)
            else:
                w, b = run(steps), bare_run(steps)
            cpu.append(1e6 * (w[0] - b[0]) / steps)
            wall.append(1e6 * (w[1] - b[1]) / steps)
            ratio.append(w[0] / b[0])
            bare_us.append(1e6 * b[0] / steps)
    finally:
        mon.close()
    return {
        "added_us": statistics.median(cpu),
        "added_wall_us": statistics.median(wall),
        "ratio": statistics.median(ratio),
        "bare_us": statistics.median(bare_us),
        "q1": statistics.quantiles(cpu, n=4)[0] if len(cpu) > 1 else cpu[0],
        "q3": statistics.quantiles(cpu, n=4)[2] if len(cpu) > 1 else cpu[0],
    }


def profile(spec: str, compiled: bool, backend: str) -> None:
    key, every_text = spec.split(":")
    every = None if every_text == "none" else int(every_text)
    _, run, mon = condition(key, every, compiled, backend)
    run(20)
    prof = cProfile.Profile()
    prof.enable()
    run(200)
    prof.disable()
    mon.close()
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumulative").print_stats("hookscope|optim", 45)


# The Monitor's entry points: (module, class, method, part of the step)
PARTS = [
    ("_monitor._nonfinite._trace", "Tape", "_before", "root hooks (tape, edge flags)"),
    ("_monitor._nonfinite._trace", "Tape", "_after", "root hooks (tape, edge flags)"),
    ("_monitor._nonfinite._trace", "Tape", "_grad", "output-gradient hooks"),
    ("_monitor._wiring._modules", "ModuleHooks", "_on_edge_grad", "output-gradient hooks"),
    ("_monitor._wiring._optim", "OptimizerWatch", "_pre", "before the update (check)"),
    ("_monitor._wiring._optim", "OptimizerWatch", "_post", "after the update"),
    ("_monitor._checks._updates", "NotUpdated", "_pre", "checks' optimizer hooks"),
    ("_monitor._checks._updates", "NotUpdated", "_post", "checks' optimizer hooks"),
    ("_monitor._checks._grads", "StaleGradients", "_pre", "checks' optimizer hooks"),
    ("_monitor._checks._grads", "StaleGradients", "_post", "checks' optimizer hooks"),
    ("_monitor._step._heard", "Ears", "before_backward", "backward listener"),
    ("_monitor._step._heard", "Ears", "after_backward", "backward listener"),
    ("_monitor", "Monitor", "step", "Monitor.step()"),
]


def parts(spec: str, compiled: bool, backend: str) -> None:
    """Per step, the CPU time inside each of the Monitor's entry points (see ``PARTS``)."""
    import importlib
    from collections import defaultdict

    key, every_text = spec.split(":")
    every = None if every_text == "none" else int(every_text)
    spent: dict[str, int] = defaultdict(int)
    inside = [False]

    def timed(fn: Callable[..., Any], label: str) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if inside[0]:  # nested in another entry point: counted there
                return fn(*args, **kwargs)
            inside[0] = True
            t0 = time.thread_time_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[label] += time.thread_time_ns() - t0
                inside[0] = False

        return wrapper

    for module, cls, name, label in PARTS:  # before the Monitor binds its hooks
        owner = getattr(importlib.import_module(f"hookscope.{module}"), cls)
        raw = owner.__dict__[name]
        if isinstance(raw, staticmethod):
            setattr(owner, name, staticmethod(timed(raw.__func__, label)))
        else:
            setattr(owner, name, timed(raw, label))
    _, run, mon = condition(key, every, compiled, backend)
    run(30)
    blocks: dict[str, list[float]] = defaultdict(list)
    for _ in range(7):
        spent.clear()
        run(200)
        for label, ns in spent.items():
            blocks[label].append(ns / 200 / 1e3)
        blocks["all entry points"].append(sum(spent.values()) / 200 / 1e3)
    mon.close()
    print(f"{spec}: CPU us per step inside the Monitor's entry points (median of 7 x 200 steps)")
    for label in sorted(blocks, key=lambda k: -statistics.median(blocks[k])):
        print(f"  {statistics.median(blocks[label]):8.1f}  {label}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=31)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--only", choices=sorted(MODELS))
    parser.add_argument("--every", default="none,10,1")
    parser.add_argument("--compiled", action="store_true", help="compiled rows only")
    parser.add_argument("--eager-too", action="store_true", help="with --compiled: eager too")
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--profile", metavar="MODEL:EVERY")
    parser.add_argument("--parts", metavar="MODEL:EVERY", help="time the entry points")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    if args.compiled:
        torch._dynamo.config.skip_nnmodule_hook_guards = False
        torch._dynamo.config.cache_size_limit = 64
    if args.profile:
        profile(args.profile, args.compiled, args.backend)
        return
    if args.parts:
        parts(args.parts, args.compiled, args.backend)
        return
    everys = [None if e == "none" else int(e) for e in args.every.split(",")]
    modes = [False, True] if args.compiled and args.eager_too else [args.compiled]
    print(
        f"torch {torch.__version__}, Python {platform.python_version()}, "
        f"{platform.machine()}, 1 thread; {args.rounds} rounds of {args.steps} steps "
        "per side; CPU time of the main thread",
        flush=True,
    )
    print("| model | mode | `every` | bare us/step | added us/step (IQR) | wall | ratio | aim |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for key in [args.only] if args.only else list(MODELS):
        label, build = MODELS[key]
        torch.manual_seed(0)
        label = f"{label}, {leaves(build()[0])} leaves"
        for compiled in modes:
            mode = f"compiled ({args.backend})" if compiled else "eager"
            for every in everys:
                if compiled:
                    torch._dynamo.reset()
                r = measure(
                    key,
                    every,
                    compiled=compiled,
                    rounds=args.rounds,
                    steps=args.steps,
                    backend=args.backend,
                )
                aim = AIMS[every] if every in AIMS else float("nan")
                print(
                    f"| {label} | {mode} | {every} | {r['bare_us']:.0f} | "
                    f"{r['added_us']:.0f} ({r['q1']:.0f}..{r['q3']:.0f}) | "
                    f"{r['added_wall_us']:.0f} | {r['ratio']:.2f}x | {aim:.0f} |",
                    flush=True,
                )


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
    sys.exit(0)
