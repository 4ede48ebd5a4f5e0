"""What ``hs.report`` costs: the time to write the HTML and its size, by run size.

Method: a log is written once per size (modules x steps, every ``--every`` steps sampled,
act and grad statistics of every module, update ratios of every weight, the loss and the
learning rate every step), by hand in the log format (docs/log-format.md), so no model runs.
Each size is timed ``--repeat`` times in this process, the median taken, and set against a
baseline in the same process: ``hs.read_log`` of the same logs (reading and decoding the
JSON lines), which every reader of a log pays. The report's own share is the difference.

    python benchmarks/bench_report.py [--quick] [--repeat N]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path

import hookscope as hs


def write_log(path: Path, modules: int, steps: int, every: int, seed: int) -> Path:
    """A log of ``modules`` Linear layers: noisy curves, one with a spike, no NaN."""
    rnd = random.Random(seed)
    names = [f"layers.{i}" for i in range(modules)]
    path.mkdir(parents=True, exist_ok=True)
    header = {
        "type": "header",
        "format": "hookscope-log",
        "version": 2,
        "hookscope": hs.__version__,
        "model": "Bench",
        "modules": dict.fromkeys(names, "Linear"),
        "params": {f"{n}.weight": [64, 64] for n in names},
        "settings": {"every": every},
        "time": 0.0,
    }
    with (path / "hookscope.jsonl").open("w") as f:
        f.write(json.dumps(header) + "\n")
        for step in range(steps):
            rec = {
                "type": "step",
                "step": step,
                "time": float(step),
                "sampled": step % every == 0,
                "training": True,
                "scalars": {
                    "loss": 2.3 * math.exp(-step / steps * 3) + 0.05 * rnd.random(),
                    "lr": 3e-4 * 0.5 * (1 + math.cos(math.pi * step / steps)),
                },
            }
            if rec["sampled"]:
                spike = 40.0 if step == steps // 2 else 1.0
                rec["act"] = {
                    n: {
                        "mean": 0.01 * i + 0.1 * rnd.gauss(0, 1),
                        "std": 1.0 + 0.05 * rnd.random(),
                        "min": -3.0,
                        "max": 3.0 * spike,
                        "absmax": 3.0 * spike,
                        "zero_frac": 0.0,
                        "sat_frac": 0.0,
                        "dead_frac": 0.0,
                        "nan": 0,
                        "inf": 0,
                        "numel": 4096,
                        "sampled": 4096,
                    }
                    for i, n in enumerate(names)
                }
                rec["grad"] = {
                    n: {
                        "norm": 10 ** (-1 - i / modules) * (1 + 0.2 * rnd.random()) * spike,
                        "rms": 1e-3,
                        "absmax": 1e-2,
                        "numel": 4096,
                        "sampled": 4096,
                    }
                    for i, n in enumerate(names)
                }
                rec["param"] = {
                    f"{n}.weight": {
                        "norm": 8.0,
                        "grad_norm": 0.1,
                        "update_ratio": 1e-3 * rnd.random(),
                    }
                    for n in names
                }
                rec["grad_order"] = names[::-1]
            f.write(json.dumps(rec) + "\n")
    return path


def _median(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the small size only")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    sizes = [(25, 1_000, 1, 1), (25, 1_000, 10, 1), (100, 10_000, 10, 3)]
    if args.quick:
        sizes = sizes[:1]
    print(f"python {platform.python_version()}, {platform.machine()}, hookscope {hs.__version__}")
    print(
        "| modules x steps (every) x runs | log MB | read_log | report | report's own | HTML MB |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for modules, steps, every, runs in sizes:
            logs = [
                write_log(Path(tmp) / f"m{modules}s{steps}e{every}r{r}", modules, steps, every, r)
                for r in range(runs)
            ]
            target = logs if runs > 1 else logs[0]
            out = Path(tmp) / "report.html"
            base = _median(lambda logs=logs: [hs.read_log(p) for p in logs], args.repeat)
            took = _median(lambda t=target, o=out: hs.report(t, o), args.repeat)
            mb = sum((p / "hookscope.jsonl").stat().st_size for p in logs) / 1e6
            print(
                f"| {modules} x {steps:,} ({every}) x {runs} | {mb:.1f} | {base:.2f} s | "
                f"{took:.2f} s ({took / base:.2f}x) | {took - base:.2f} s | "
                f"{out.stat().st_size / 1e6:.2f} |"
            )


if __name__ == "__main__":
    main()
