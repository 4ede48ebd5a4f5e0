"""Training-step cost of hs.Monitor and its alternatives against the bare step, in one process.

Method (research/env-and-baselines.md): paired, interleaved timing. Every condition gets its
own deep copy of the model and a second deep copy that never has hooks (the *bare* copy).
After a few warm-up pairs, N pairs of (bare step, watched step) run back to back, alternating
which goes first. A sampling condition (``every=10``) pays on one step in ten, so the ratio
reported is the ratio of the *summed* step times (the mean cost per step); the median of the
per-pair ratios is shown in brackets. A training step is zero_grad, forward, backward,
optimizer step, ``loss.item()``; the watched step does the same plus what its condition adds.

Conditions: no-op forward hooks on every leaf module; the hand-written six-statistic hook
(mean, std, min, max, zero fraction and norm of every leaf output, one ``.item()`` each, every
step); ``wandb.watch(model, log="all", log_freq=1)`` offline with ``wandb.log`` each step;
``torch.autograd.detect_anomaly(check_nan=True)`` around forward and backward;
``hs.Monitor`` with ``every=None`` (non-finite checks only), ``every=10``, ``every=1`` and
``every=1, sample=None`` (exact statistics). The Monitor is given no optimizer; the script
calls ``mon.step(loss=loss)`` after the optimizer step.

Models: GPT-2 (4 layers x 256, random weights, dropout 0, 8x128 tokens, SGD) and a 3-block CNN
((conv3x3-BN-ReLU(inplace)) x2 + MaxPool2d(2) per block, 3->32->64->128 channels, linear head,
16x3x64x64 inputs, SGD with momentum). Peak memory: one subprocess per condition trains an
8 x Linear(2048, 2048) MLP for 20 steps and reports its peak RSS (VmHWM); three processes per
condition, the median is reported (one with ``--quick``).

With ``--checks``: the cost of the checks of invariants (``_checks/``) alone, each Monitor
row against the same Monitor whose checks are replaced by a no-op (paired and interleaved the
same way; the baseline is then the Monitor without checks, not the bare step). ``--window``:
the same for the rolling window of large-model signals (``_signals.SpikeWatch``: the loss,
per-group gradient and weight norms on every step).

With ``--compiled``: the compiled rows. Both copies run through ``torch.compile(copy)``
(``--backend``, Inductor by default; the Monitor attached before compiling, Dynamo reset
before each row) and the Monitor rows (``every=None``, ``10``, ``1``) are timed against the
compiled bare step, paired and interleaved the same way, after a warm-up that compiles every
graph. Dynamo's ``skip_nnmodule_hook_guards`` is off for these rows: two copies of one class
in one process otherwise share compiled graphs (the bare copy would run the watched copy's
graph, hooks and all, or the reverse).

    python benchmarks/bench_monitor.py [--quick] [--only gpt2|cnn|mem] [--pairs N] [--checks | --window | --compiled] [--backend B]

wandb is a benchmark-only dependency (``pip install -c constraints.txt wandb``); without it
that row is skipped with the reason.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any
from unittest import mock

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ["WANDB_MODE"] = "offline"  # never reach the network
os.environ["WANDB_SILENT"] = "true"

import _models
import torch
from torch import nn

import hookscope as hs

THREADS = 2
LossOf = Callable[[nn.Module], torch.Tensor]


# -- models ------------------------------------------------------------------------------------


def gpt2() -> tuple[nn.Module, LossOf, Callable[[nn.Module], torch.optim.Optimizer]]:
    # transformers builds models in eval mode: train it as a training loop does (a Monitor
    # collects step statistics in training mode, and evaluation passes are logged apart)
    model = _models.gpt2(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0).train()
    ids = torch.randint(0, model.config.vocab_size, (8, 128))
    return (
        model,
        lambda m: m(ids, labels=ids).loss,
        lambda m: torch.optim.SGD(m.parameters(), lr=1e-4),
    )


def cnn() -> tuple[nn.Module, LossOf, Callable[[nn.Module], torch.optim.Optimizer]]:
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
        nn.Sequential(*block(3, 32)),
        nn.Sequential(*block(32, 64)),
        nn.Sequential(*block(64, 128)),
        nn.Flatten(),
        nn.Linear(128 * 8 * 8, 10),
    )
    x, y = torch.randn(16, 3, 64, 64), torch.randint(0, 10, (16,))
    return (
        model,
        lambda m: nn.functional.cross_entropy(m(x), y),
        lambda m: torch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9),
    )


MODELS = {"gpt2": ("GPT-2 4x256, 8x128 tokens", gpt2), "cnn": ("CNN 3 blocks, 16x64x64", cnn)}


def leaves(model: nn.Module) -> list[nn.Module]:
    return [m for n, m in model.named_modules() if n and not list(m.children())]


# -- conditions --------------------------------------------------------------------------------


class Condition:
    """What a watched step adds: a context around forward+backward and work after the step."""

    note = ""

    def around(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def after(self, loss: torch.Tensor) -> None:
        pass

    def close(self) -> None:
        pass


class Hooks(Condition):
    def __init__(self, model: nn.Module, hook: Callable[..., None]) -> None:
        self.handles = [m.register_forward_hook(hook) for m in leaves(model)]

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def noop_hook(module: nn.Module, args: object, out: object) -> None:
    pass


STATS: dict[int, list[float]] = {}


def six_stats_hook(module: nn.Module, args: object, out: object) -> None:
    """The blog-post monitor: six statistics of the output, each read with ``.item()``."""
    if isinstance(out, tuple):
        out = out[0]
    if isinstance(out, torch.Tensor) and out.is_floating_point():
        t = out.detach()
        STATS[id(module)] = [
            t.mean().item(),
            t.std().item(),
            t.min().item(),
            t.max().item(),
            (t == 0).float().mean().item(),
            t.norm().item(),
        ]


class Anomaly(Condition):
    def __init__(self) -> None:
        warnings.filterwarnings("ignore", message="Anomaly Detection has been enabled")

    def around(self) -> contextlib.AbstractContextManager[Any]:
        return torch.autograd.detect_anomaly(check_nan=True)


class Wandb(Condition):
    def __init__(self, model: nn.Module) -> None:
        import wandb

        self.wandb, self.model = wandb, model
        self.tmp = tempfile.TemporaryDirectory(prefix="bench-wandb-")
        for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
            os.environ[var] = self.tmp.name  # leave nothing behind in ~/.cache or ~/.config
        try:
            settings = wandb.Settings(console="off", silent=True)
        except Exception:  # older or newer Settings without these fields
            settings = None
        self.run = wandb.init(
            project="hookscope-bench", dir=self.tmp.name, mode="offline", settings=settings
        )
        wandb.watch(model, log="all", log_freq=1)

    def after(self, loss: torch.Tensor) -> None:
        self.wandb.log({"loss": loss.item()})

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.wandb.unwatch(self.model)
        with contextlib.suppress(Exception):
            self.run.finish()
        with contextlib.suppress(Exception):
            self.wandb.teardown()  # stops the wandb-core service process
        self.tmp.cleanup()


def make_monitor(model: nn.Module, **kwargs: Any) -> tuple[hs.Monitor, str]:
    """hs.Monitor(model, **kwargs), falling back where the current Monitor rejects a kwarg."""
    try:
        return hs.Monitor(model, **kwargs), ""
    except (TypeError, ValueError) as e:
        if kwargs.get("every", 1) is None:
            fallback = {**kwargs, "every": 10**9}
            note = f"every=None rejected ({type(e).__name__}), ran every=10**9"
        elif "sample" in kwargs:
            fallback = {k: v for k, v in kwargs.items() if k != "sample"}
            note = f"sample= rejected ({type(e).__name__}), ran without it"
        else:
            raise
    return hs.Monitor(model, **fallback), note


class Monitor(Condition):
    def __init__(self, model: nn.Module, **kwargs: Any) -> None:
        self.mon, self.note = make_monitor(model, **kwargs)

    def after(self, loss: torch.Tensor) -> None:
        self.mon.step(loss=loss)

    def close(self) -> None:
        self.mon.close()


CONDITIONS: dict[str, Callable[[nn.Module], Condition]] = {
    "no-op forward hook on every leaf module": lambda m: Hooks(m, noop_hook),
    "hand-written hook, 6 stats, `.item()` each, every leaf, every step": lambda m: Hooks(
        m, six_stats_hook
    ),
    '`wandb.watch(model, log="all", log_freq=1)`, offline, + `wandb.log` each step': Wandb,
    "`torch.autograd.detect_anomaly(check_nan=True)` around forward+backward": lambda m: Anomaly(),
    "`hs.Monitor(model, every=None)` (non-finite checks only)": lambda m: Monitor(m, every=None),
    "`hs.Monitor(model, every=10)`": lambda m: Monitor(m, every=10),
    "`hs.Monitor(model, every=1)`": lambda m: Monitor(m, every=1),
    "`hs.Monitor(model, every=1, sample=None)` (exact statistics)": lambda m: Monitor(
        m, every=1, sample=None
    ),
}


# -- timing ------------------------------------------------------------------------------------


def timed_step(
    model: nn.Module, opt: torch.optim.Optimizer, loss_of: LossOf, cond: Condition
) -> float:
    start = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    with cond.around():
        loss = loss_of(model)
        loss.backward()
    opt.step()
    cond.after(loss)
    loss.item()
    return time.perf_counter() - start


def one_line(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".replace("\n", " ").replace("|", "/")
    return text if len(text) <= 160 else text[:157] + "..."


def paired(
    base: nn.Module,
    loss_of: LossOf,
    make_opt: Callable[[nn.Module], torch.optim.Optimizer],
    make: Callable[[nn.Module], Condition],
    pairs: int,
    warmup: int,
    baseline: Callable[[nn.Module], Condition] = lambda m: Condition(),
    wrap: Callable[[nn.Module], nn.Module] = lambda m: m,
) -> tuple[str, str]:
    """One condition on its own copy of the model against a copy under ``baseline`` (by
    default the bare step): (note, result cells). Both copies are called through ``wrap``
    (``torch.compile``, say), applied once the conditions are attached."""
    bare, model = copy.deepcopy(base), copy.deepcopy(base)
    bare_opt, opt = make_opt(bare), make_opt(model)
    bare_cond = baseline(bare)
    try:
        cond = make(model)
    except ImportError as e:
        return "", f"skipped: not installed ({one_line(e)}) | | "
    bare_call, call = wrap(bare), wrap(model)
    try:
        times: list[tuple[float, float]] = []
        for i in range(warmup + pairs):
            if i % 2 == 0:
                tb = timed_step(bare_call, bare_opt, loss_of, bare_cond)
                tw = timed_step(call, opt, loss_of, cond)
            else:
                tw = timed_step(call, opt, loss_of, cond)
                tb = timed_step(bare_call, bare_opt, loss_of, bare_cond)
            if i >= warmup:
                times.append((tb, tw))
    finally:
        for c in (cond, bare_cond):
            with contextlib.suppress(Exception):
                c.close()
    total = sum(tw for _, tw in times) / sum(tb for tb, _ in times)
    median = statistics.median(tw / tb for tb, tw in times)
    mean_b = 1e3 * statistics.fmean(tb for tb, _ in times)
    mean_w = 1e3 * statistics.fmean(tw for _, tw in times)
    return cond.note, f"{total:.2f}x ({median:.2f}x) | {mean_b:.0f} | {mean_w:.0f}"


def built(key: str) -> tuple[str, nn.Module, LossOf, Callable[[nn.Module], torch.optim.Optimizer]]:
    """``MODELS[key]`` built from seed 0, in training mode: its label, the model, its loss
    and its optimizer factory."""
    label, build = MODELS[key]
    torch.manual_seed(0)
    base, loss_of, make_opt = build()
    return label, base.train(), loss_of, make_opt


def measure(key: str, pairs: int, warmup: int) -> list[tuple[str, str]]:
    """Rows of (condition, result cells) for one model, printed as they come."""
    label, base, loss_of, make_opt = built(key)
    n_params = sum(p.numel() for p in base.parameters()) / 1e6
    print(f"{label}: {n_params:.2f} M params, {len(leaves(base))} leaf modules", flush=True)
    rows: list[tuple[str, str]] = []
    for name, make in CONDITIONS.items():
        gc.collect()
        t0 = time.perf_counter()
        try:
            note, cell = paired(base, loss_of, make_opt, make, pairs, warmup)
            rows.append((name + (f" ({note})" if note else ""), cell))
        except Exception as e:  # one failing condition must not stop the others
            traceback.print_exc(limit=-3)
            rows.append((name, f"error: {one_line(e)} | | "))
        print(f"  {rows[-1][0]}: {rows[-1][1]}   [{time.perf_counter() - t0:.0f} s]", flush=True)
    return rows


class _NoChecks:
    """The Monitor's checks of invariants (``_checks.Checks``), replaced by a no-op."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def before_backward(self) -> None:
        pass

    def backward_missed(self) -> None:
        pass

    def begin(self, buf: Any) -> None:
        pass

    def collect(self, buf: Any, sampled: bool) -> None:
        pass

    def layout(self, rank: int) -> list:
        return []

    def read(self, host: Any, record: Any) -> list:
        return []

    def close(self) -> None:
        pass


def without_checks(model: nn.Module, **kwargs: Any) -> Monitor:
    with mock.patch("hookscope._monitor._wiring._build.Checks", _NoChecks):
        return Monitor(model, **kwargs)


class _NoWindow:
    """The rolling window of large-model signals (``_signals.SpikeWatch``), a no-op."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def flags(self, *args: Any) -> None:
        pass

    def weights(self, buf: Any) -> None:
        pass

    def observe(self, *args: Any) -> None:
        return None


def without_window(model: nn.Module, **kwargs: Any) -> Monitor:
    with mock.patch("hookscope._monitor._wiring._probeset.SpikeWatch", _NoWindow):
        return Monitor(model, **kwargs)


PARTS = {"checks": without_checks, "window": without_window}


COMPILED_ROWS = {
    "`hs.Monitor(model, every=None)`, compiled": {"every": None},
    "`hs.Monitor(model, every=10)`, compiled": {"every": 10},
    "`hs.Monitor(model, every=1)`, compiled": {"every": 1},
}


def measure_compiled(key: str, pairs: int, warmup: int, backend: str) -> list[tuple[str, str]]:
    """Rows of (Monitor, result cells): the compiled step with the Monitor against the
    compiled bare step."""
    import torch._dynamo

    label, base, loss_of, make_opt = built(key)
    print(f"{label}: compiled ({backend}) with the Monitor vs compiled bare", flush=True)
    rows = []
    for name, kw in COMPILED_ROWS.items():
        gc.collect()
        torch._dynamo.reset()
        t0 = time.perf_counter()
        try:
            _, cell = paired(
                base,
                loss_of,
                make_opt,
                lambda m: Monitor(m, **kw),  # noqa: B023
                pairs,
                warmup,
                wrap=lambda m: torch.compile(m, backend=backend),
            )
        except Exception as e:  # one failing row must not stop the others
            traceback.print_exc(limit=-3)
            cell = f"error: {one_line(e)} | | "
        rows.append((name, cell))
        print(f"  {name}: {cell}   [{time.perf_counter() - t0:.0f} s]", flush=True)
    return rows


def main_compiled(only: str | None, pairs: int, warmup: int, backend: str) -> None:
    """``--compiled``: each Monitor row through torch.compile against the compiled bare step."""
    import torch._dynamo

    torch._dynamo.config.skip_nnmodule_hook_guards = False  # see the module docstring
    start = time.perf_counter()
    results = {
        key: measure_compiled(key, pairs, warmup, backend) for key in MODELS if only in (None, key)
    }
    print(
        f"\ntorch {torch.__version__}, {torch.get_num_threads()} threads, backend {backend!r}; "
        f"{pairs} pairs per row ({warmup} warm-up, compiling included); ratio of summed step "
        "times to the compiled bare step (median of per-pair ratios); ms = mean step time"
    )
    tables(results, "{model}, compiled train step", "condition", "compiled bare ms")
    print(f"\ntotal {time.perf_counter() - start:.0f} s")


CHECK_ROWS = {
    "`hs.Monitor(model, every=None)`": {"every": None},
    "`hs.Monitor(model, every=10)`": {"every": 10},
    "`hs.Monitor(model, every=1)`": {"every": 1},
    "`hs.Monitor(model, every=1, sample=None)`": {"every": 1, "sample": None},
}


def measure_checks(
    key: str, pairs: int, warmup: int, part: str = "checks"
) -> list[tuple[str, str]]:
    """Rows of (Monitor, result cells): with its checks (or its rolling window) against
    without them."""
    label, base, loss_of, make_opt = built(key)
    without = PARTS[part]
    print(f"{label}: {part} on vs off", flush=True)
    rows = []
    for name, kw in CHECK_ROWS.items():
        gc.collect()
        _, cell = paired(
            base,
            loss_of,
            make_opt,
            lambda m: Monitor(m, **kw),  # noqa: B023
            pairs,
            warmup,
            baseline=lambda m: without(m, **kw),  # noqa: B023
        )
        rows.append((name, cell))
        print(f"  {name}: {cell}", flush=True)
    return rows


# -- peak memory -------------------------------------------------------------------------------

MEM_CONDITIONS = {
    "bare": {},
    "`hs.Monitor(model, every=1)`": {"every": 1},
    "`hs.Monitor(model, every=10)`": {"every": 10},
}


def mem_child(which: str) -> None:
    """Run in a fresh process: 20 training steps of the MLP; print peak RSS as JSON."""
    torch.set_num_threads(THREADS)
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(8):
        layers += [nn.Linear(2048, 2048), nn.ReLU()]
    model = nn.Sequential(*layers)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x, y = torch.randn(64, 2048), torch.randn(64, 2048)
    kwargs = MEM_CONDITIONS[which]
    cond: Condition = Monitor(model, **kwargs) if kwargs else Condition()
    for _ in range(20):
        timed_step(model, opt, lambda m: nn.functional.mse_loss(m(x), y), cond)
    cond.close()
    print(json.dumps({"peak_mb": peak_rss_mb(), "note": getattr(cond, "note", "")}))


def peak_rss_mb() -> float:
    """This process's peak RSS: VmHWM, else ``ru_maxrss``.

    On Linux ``getrusage(RUSAGE_SELF).ru_maxrss`` keeps the high-water mark of the process that
    forked it across ``exec`` (the benchmark parent holds about 900 MB after the timing runs),
    so a child's own peak is read from ``/proc/self/status`` where it exists.
    """
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def mem_run(which: str) -> tuple[float, str]:
    """Peak RSS (MB) and note of one fresh child process."""
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--mem-child", which],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
        raise RuntimeError(tail[0])
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return result["peak_mb"], result["note"]


def measure_memory(repeats: int) -> list[tuple[str, str]]:
    """Each condition in ``repeats`` fresh processes, interleaved; the median peak is reported."""
    print(
        f"MLP 8 x Linear(2048, 2048) + ReLU, batch 64, SGD, 20 steps, {repeats} processes each",
        flush=True,
    )
    peaks: dict[str, list[float]] = {which: [] for which in MEM_CONDITIONS}
    notes: dict[str, str] = {}
    errors: dict[str, str] = {}
    for _ in range(repeats):
        for which in MEM_CONDITIONS:
            if which in errors:
                continue
            try:
                peak, notes[which] = mem_run(which)
                peaks[which].append(peak)
            except Exception as e:  # one failing condition must not stop the others
                errors[which] = one_line(e)
    rows: list[tuple[str, str]] = []
    bare = statistics.median(peaks["bare"]) if peaks["bare"] else None
    for which, runs in peaks.items():
        if which in errors:
            rows.append((which, f"error: {errors[which]} | | "))
        else:
            peak = statistics.median(runs)
            spread = f"{min(runs):.0f}-{max(runs):.0f}"
            extra = f"{peak - bare:+.0f}" if bare else "n/a"
            ratio = f"{peak / bare:.2f}x" if bare else "n/a"
            note = f" ({notes[which]})" if notes.get(which) else ""
            rows.append((which + note, f"{peak:.0f} ({spread}) | {extra} | {ratio}"))
        print(f"  {rows[-1][0]}: {rows[-1][1]}", flush=True)
    return rows


# -- main --------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="10 pairs instead of 30, one memory run instead of 3"
    )
    parser.add_argument(
        "--only", choices=["gpt2", "cnn", "mem"], help="one model only, or only the memory part"
    )
    parser.add_argument("--pairs", type=int, default=None, help="pairs per condition")
    parser.add_argument(
        "--window",
        action="store_true",
        help="the rolling window of large-model signals on vs off, per Monitor",
    )
    parser.add_argument(
        "--checks", action="store_true", help="the checks of invariants on vs off, per Monitor"
    )
    parser.add_argument(
        "--compiled",
        action="store_true",
        help="the Monitor rows through torch.compile, against the compiled bare step",
    )
    parser.add_argument("--backend", default="inductor", help="torch.compile backend")
    parser.add_argument("--mem-child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mem_child:
        mem_child(args.mem_child)
        return
    torch.set_num_threads(THREADS)
    pairs = args.pairs or (10 if args.quick else 30)
    warmup = 3
    if args.checks or args.window:
        main_checks(args.only, pairs, warmup, "window" if args.window else "checks")
        return
    if args.compiled:
        main_compiled(args.only, pairs, max(warmup, 4), args.backend)
        return
    start = time.perf_counter()
    results = {}
    for key in MODELS:
        if args.only in (None, key):
            results[key] = measure(key, pairs, warmup)
    memory = measure_memory(1 if args.quick else 3) if args.only in (None, "mem") else None

    print()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{platform.processor() or platform.machine()}, hookscope "
        f"{getattr(hs, '__version__', '?')} ({os.path.dirname(hs.__file__)}); {pairs} pairs per condition ({warmup} warm-up); "
        "ratio of summed step times (median of per-pair ratios); ms = mean step time"
    )
    tables(results, "{model} train step", "condition", "bare ms")
    if memory is not None:
        print(
            "\n**Peak RSS** (VmHWM), MLP 8 x Linear(2048, 2048), batch 64, SGD, 20 steps, "
            f"{1 if args.quick else 3} fresh process(es) per condition\n"
        )
        print("| condition | peak RSS MB, median (range) | extra MB | ratio to bare |")
        print("|---|---:|---:|---:|")
        for name, cell in memory:
            print(f"| {name} | {cell} |")
    print(f"\ntotal {time.perf_counter() - start:.0f} s")


def tables(
    results: dict[str, list[tuple[str, str]]], title: str, first: str, baseline: str
) -> None:
    """One Markdown table per model: ``title`` with ``{model}`` for the model's label in
    bold, ``first`` the first column's head, ``baseline`` the baseline's time column."""
    for key, rows in results.items():
        print("\n" + title.format(model=f"**{MODELS[key][0]}**") + "\n")
        print(f"| {first} | ratio (median) | {baseline} | with ms |")
        print("|---|---:|---:|---:|")
        for name, cell in rows:
            print(f"| {name} | {cell} |")


def main_checks(only: str | None, pairs: int, warmup: int, part: str) -> None:
    """``--checks`` / ``--window``: each Monitor with that part against the same Monitor
    without it."""
    results = {
        key: measure_checks(key, pairs, warmup, part) for key in MODELS if only in (None, key)
    }
    print(
        f"\ntorch {torch.__version__}, {torch.get_num_threads()} threads; {pairs} pairs per row "
        f"({warmup} warm-up); ratio of summed step times with the {part} to without (median of "
        "per-pair ratios); ms = mean step time"
    )
    tables(results, f"{{model}}: {part} on vs off", "Monitor", f"without {part} ms")


if __name__ == "__main__":
    main()
