"""hs.Monitor on a CUDA device, in one run: is it right there, does it sync, does it keep CUDA
graphs, and what does it cost against the bare step.

Parts, each printed as it ends and written to ``--out`` (``cuda.json``), so a run cut short
still reports what it measured:

- ``equal``: the same GPT-2 trained 2 steps on the CPU and on the device, each under
  ``Monitor(every=1, sample=None)`` (TF32 off): every activation, output-gradient and parameter
  statistic equal at rtol 1e-3.
- ``nonfinite``: a CNN whose second conv's weight overflows at step 2 (an unsampled step of
  ``every=10``): the finding's module, step, phase, op and line; with
  ``on_nonfinite="raise"``, the error comes before the update (the weights unchanged).
- ``amp``: 20 AdamW steps of GPT-2 under bf16 autocast, and 20 under fp16 autocast with a
  GradScaler (whose first steps skip on overflow): the findings (a healthy run has none but
  what the scaler's skips explain).
- ``syncs``: host synchronisations per step (``torch.cuda.set_sync_debug_mode("warn")``,
  warnings counted by where they come from), on unsampled and sampled steps, eager and
  compiled; the bare step (without its ``loss.item()``) is the baseline.
- ``cudagraphs``: ``torch.compile(mode="reduce-overhead")`` with the Monitor attached before:
  CUDA graphs skipped (Inductor's ``cudagraph_skips`` counter and its reasons) against the
  bare model.
- ``profile``: GPT-2 6x768, eager and compiled, bare, ``every=None`` and ``every=1``: wall
  time against the device's busy time per step, the ops and the Monitor's functions with the
  most host time.
- ``eager`` and ``compiled``: the step time with the Monitor against the bare step, paired and
  interleaved as in ``bench_monitor.py`` (a step ends with ``loss.item()``, which waits for
  the device, so host clocks time the whole step).

    python benchmarks/bench_cuda.py [--device cuda] [--out DIR] [--pairs N] [--only PART,...]

Runs on the CPU too (``--device cpu``: the parts that need CUDA say so), which is how the
script is checked before a device run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import sys
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _models
import bench_monitor as bm
import torch
from torch import nn

import hookscope as hs

RESULTS: dict[str, Any] = {}
OUT: Path | None = None


def save(part: str, value: Any) -> None:
    RESULTS[part] = value
    print(f"== {part}: {json.dumps(value, default=str)[:1500]}", flush=True)
    if OUT is not None:
        (OUT / "cuda.json").write_text(json.dumps(RESULTS, indent=1, default=str))


# -- models on a device ------------------------------------------------------------------------

Built = tuple[nn.Module, Callable[[nn.Module], torch.Tensor], Callable[[nn.Module], Any]]


def gpt2(
    device: str,
    layers: int = 4,
    width: int = 256,
    tokens: int = 128,
    batch: int = 8,
    vocab: int = 5000,
) -> Built:
    torch.manual_seed(0)
    model = (
        _models.gpt2(
            n_layer=layers,
            n_embd=width,
            n_head=max(width // 64, 1),
            vocab_size=vocab,
            n_positions=tokens,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
        .train()
        .to(device)
    )
    ids = torch.randint(0, vocab, (batch, tokens)).to(device)  # the same ids on every device
    return (
        model,
        lambda m: m(ids, labels=ids).loss,
        lambda m: torch.optim.SGD(m.parameters(), lr=1e-4),
    )


def cnn(device: str, batch: int = 16, size: int = 64) -> Built:
    torch.manual_seed(0)
    model, _, make_opt = bm.cnn()
    model = model.to(device)
    x = torch.randn(batch, 3, size, size).to(device)
    y = torch.randint(0, 10, (batch,)).to(device)
    return model, lambda m: nn.functional.cross_entropy(m(x), y), make_opt


def numbers(record: dict[str, Any]) -> dict[tuple[str, str, str], float]:
    found = {}
    for kind in ("act", "grad", "param"):
        for module, stats in record.get(kind, {}).items():
            for stat, value in stats.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    found[kind, module, stat] = float(value)
    return found


def train(
    model: nn.Module, call: Any, loss_of: Callable, make_opt: Callable, mon: Any, steps: int
) -> list[dict]:
    opt = make_opt(model)
    for _ in range(steps):
        loss_of(call).backward()
        opt.step()
        opt.zero_grad()
        if mon is not None:
            mon.step()
    return [r for r in mon.records if r["type"] == "step"] if mon is not None else []


def one_step(call: Any, loss_of: Callable, opt: Any, mon: Any) -> torch.Tensor:
    """A training step of ``call`` (the model, or its compiled wrapper), then ``mon.step``."""
    loss = loss_of(call)
    loss.backward()
    opt.step()
    opt.zero_grad()
    if mon is not None:
        mon.step(loss=loss)
    return loss


# -- parts -------------------------------------------------------------------------------------


def part_equal(device: str) -> dict:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    runs = []
    for where in ("cpu", device):
        model, loss_of, make_opt = gpt2(where, layers=2, width=128, tokens=64, batch=4)
        with hs.Monitor(model, every=1, sample=None) as mon:
            runs.append(train(model, model, loss_of, make_opt, mon, steps=2))
    cpu, dev = runs
    off, total, worst = [], 0, 0.0
    for a, b in zip(cpu, dev, strict=True):
        na, nb = numbers(a), numbers(b)
        missing = sorted(set(na) ^ set(nb))
        for key, value in na.items():
            if key not in nb:
                continue
            total += 1
            rel = abs(nb[key] - value) / max(abs(value), 1e-6)
            worst = max(worst, rel) if math.isfinite(rel) else worst
            if not math.isclose(nb[key], value, rel_tol=1e-3, abs_tol=1e-5):
                off.append((key, value, nb[key]))
    return {
        "values": total,
        "off": len(off),
        "first_off": off[:5],
        "missing": missing[:5],
        "worst_rel": worst,
        "ok": not off and not missing and total > 0,
    }


def part_nonfinite(device: str) -> dict:
    out = {}
    for mode in ("log", "raise"):
        model, loss_of, make_opt = cnn(device)
        opt = make_opt(model)
        conv = model[0][3]
        with hs.Monitor(model, every=10, on_nonfinite=mode) as mon:
            for step in range(4):
                if step == 2:
                    with torch.no_grad():
                        conv.weight.fill_(1e38)
                before = model[4].weight.detach().clone()
                try:
                    loss_of(model).backward()
                    opt.step()
                    opt.zero_grad()
                    mon.step()
                except hs.NonFiniteError as e:
                    out[mode] = {
                        "step": step,
                        "module": e.module,
                        "op": e.op,
                        "source": e.source,
                        "unchanged": bool(torch.equal(before, model[4].weight)),
                    }
                    break
            found = [f for f in mon.findings if f.kind == "nonfinite"]
            if mode == "log":
                out[mode] = [
                    {
                        "step": f.step,
                        "module": f.module,
                        "phase": f.phase,
                        "op": f.op,
                        "source": f.source,
                    }
                    for f in found
                ]
    log = out["log"]
    out["ok"] = (
        bool(log)
        and log[0]["module"] == "0.3"
        and log[0]["step"] == 2
        and bool(log[0]["op"])
        and out.get("raise", {}).get("unchanged") is True
    )
    return out


def part_amp(device: str) -> dict:
    out = {}
    for dtype in (torch.bfloat16, torch.float16):
        model, loss_of, _ = gpt2(device)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
        scaler = torch.amp.GradScaler(device) if dtype == torch.float16 else None
        with hs.Monitor(model, every=5) as mon:
            for _ in range(20):
                with torch.autocast(device, dtype=dtype):
                    loss = loss_of(model)
                if scaler is None:
                    loss.backward()
                    opt.step()
                else:
                    scaler.scale(loss).backward()
                    scaler.step(opt)
                    scaler.update()
                opt.zero_grad()
                mon.step()
        events = [r["kind"] for r in mon.records if r["type"] == "event"]
        out[str(dtype)] = {
            "findings": [(f.kind, f.module, f.step) for f in mon.findings],
            "events": dict(Counter(events)),
        }
    out["ok"] = all(not v["findings"] for v in out.values() if isinstance(v, dict))
    return out


class SyncCounter:
    """Counts the host synchronisations torch reports in sync-debug mode, by Python line."""

    def __init__(self) -> None:
        self.where: Counter[str] = Counter()

    @contextlib.contextmanager
    def __call__(self) -> Any:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield
            finally:
                torch.cuda.set_sync_debug_mode("default")
        for w in caught:
            if "synchroniz" in str(w.message):
                self.where[f"{os.path.relpath(w.filename)}:{w.lineno}"] += 1


def syncs_of(device: str, monitor: dict | None, compiled: bool, steps: int = 12) -> dict:
    """Syncs per step of GPT-2 training: unsampled and sampled steps apart."""
    model, loss_of, make_opt = gpt2(device)
    opt = make_opt(model)
    mon = None if monitor is None else hs.Monitor(model, **monitor)
    every = None if mon is None else mon.every
    call = torch.compile(model) if compiled else model
    per_step, where = [], Counter()
    try:
        for step in range(steps):
            count = SyncCounter()
            with count():
                loss = one_step(call, loss_of, opt, mon)
            loss.item()  # the script's own read, outside the count
            if step >= 3:  # compiled: warm
                sampled = mon is not None and every is not None and step % every == 0
                per_step.append((sampled, sum(count.where.values())))
                where.update(count.where)
    finally:
        if mon is not None:
            mon.close()
    unsampled = [n for s, n in per_step if not s]
    sampled = [n for s, n in per_step if s]
    return {
        "per_unsampled_step": (sum(unsampled) / len(unsampled)) if unsampled else None,
        "per_sampled_step": (sum(sampled) / len(sampled)) if sampled else None,
        "where": dict(where.most_common(8)),
    }


def part_syncs(device: str) -> dict:
    if not device.startswith("cuda"):
        return {"skipped": "needs CUDA"}
    out = {}
    for label, monitor, compiled in (
        ("bare", None, False),
        ("every=None", {"every": None}, False),
        ("every=10", {"every": 10}, False),
        ("every=2, histograms", {"every": 2, "histograms": True}, False),
        ("bare compiled", None, True),
        ("every=10 compiled", {"every": 10}, True),
    ):
        torch._dynamo.reset()
        try:
            out[label] = syncs_of(device, monitor, compiled)
        except Exception as e:
            out[label] = {"error": bm.one_line(e)}
        print(f"   syncs {label}: {out[label]}", flush=True)
    return out


class Messages(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if "cudagraph" in text.lower() or "ecording" in text or "Running " in text:
            self.lines.append(text[:300])

    def kinds(self) -> dict[str, int]:
        """Messages by their first words past the compile id (``Re-recording function``)."""
        return dict(Counter(" ".join(line.split("] ")[-1].split()[:2]) for line in self.lines))


def part_cudagraphs(device: str) -> dict:
    if not device.startswith("cuda"):
        return {"skipped": "needs CUDA"}
    from torch._dynamo.utils import counters

    torch._logging.set_logs(perf_hints=True, cudagraphs=True)
    out = {}
    for label, every in (("bare", 0), ("every=10", 10), ("every=1", 1), ("every=None", None)):
        torch._dynamo.reset()
        counters.clear()
        handler = Messages()
        logging.getLogger("torch").addHandler(handler)
        try:
            model, loss_of, make_opt = gpt2(device)
            opt = make_opt(model)
            mon = None if every == 0 else hs.Monitor(model, every=every)
            call = torch.compile(model, mode="reduce-overhead")
            times = []
            for step in range(14):
                t0 = time.perf_counter()
                one_step(call, loss_of, opt, mon).item()
                if step >= 4:
                    times.append(time.perf_counter() - t0)
            if mon is not None:
                mon.close()
            out[label] = {
                "cudagraph_skips": counters["inductor"].get("cudagraph_skips", 0),
                "graph_breaks": sum(counters["graph_break"].values()),
                "reasons": [x for x in handler.lines if "skipping" in x][:4],
                "log": handler.kinds(),
                "rerecord": [x for x in handler.lines if "Re-recording" in x][:3],
                "median_ms": 1e3 * sorted(times)[len(times) // 2],
                "step_ms": [round(1e3 * t, 1) for t in times],
                "inductor": dict(counters["inductor"]),
                "stats": dict(counters["stats"]),
                "recompiles": dict(counters["recompiles"]) if "recompiles" in counters else {},
            }
        except Exception as e:
            traceback.print_exc(limit=-4)
            out[label] = {"error": bm.one_line(e)}
        finally:
            logging.getLogger("torch").removeHandler(handler)
        print(f"   cudagraphs {label}: {out[label]}", flush=True)
    torch._logging.set_logs()
    return out


ROWS = {
    "no-op forward hook on every leaf": lambda m: bm.Hooks(m, bm.noop_hook),
    "`every=None`": lambda m: bm.Monitor(m, every=None),
    "`every=10`": lambda m: bm.Monitor(m, every=10),
    "`every=1`": lambda m: bm.Monitor(m, every=1),
}

MODELS: dict[str, Callable[[str], Built]] = {
    "GPT-2 4x256, 8x128 tokens (the CPU bench's)": lambda d: gpt2(d),
    "GPT-2 12x768, 8x1024 tokens, vocab 50257 (124M)": lambda d: gpt2(
        d, layers=12, width=768, tokens=1024, vocab=50257
    ),
    "CNN 3 blocks, 64x3x64x64": lambda d: cnn(d, batch=64),
}


def part_eager(
    device: str, pairs: int, rows: dict = ROWS, wrap: Callable = lambda m: m, models: dict = MODELS
) -> dict:
    out = {}
    for label, build in models.items():
        base, loss_of, make_opt = build(device)
        out[label] = {}
        for name, make in rows.items():
            torch._dynamo.reset()
            t0 = time.perf_counter()
            try:
                _, cell = bm.paired(base, loss_of, make_opt, make, pairs, 4, wrap=wrap)
            except Exception as e:
                traceback.print_exc(limit=-4)
                cell = f"error: {bm.one_line(e)}"
            out[label][name] = cell
            print(f"   {label} | {name} | {cell}   [{time.perf_counter() - t0:.0f} s]", flush=True)
        del base
        torch.cuda.empty_cache() if device.startswith("cuda") else None
    return out


COMPILED_MODELS = {
    "GPT-2 6x768, 8x512 tokens, vocab 50257": lambda d: gpt2(
        d, layers=6, width=768, tokens=512, vocab=50257
    ),
    "GPT-2 4x256, 8x128 tokens (the CPU bench's)": lambda d: gpt2(d),
}


def part_compiled(device: str, pairs: int) -> dict:
    import torch._dynamo

    torch._dynamo.config.skip_nnmodule_hook_guards = False  # as in bench_monitor --compiled
    rows = {k: v for k, v in ROWS.items() if k.startswith("`")}
    return part_eager(device, pairs, rows, wrap=torch.compile, models=COMPILED_MODELS)


def part_profile(device: str, steps: int = 3, only: str = "") -> dict:
    """Where a step's time goes: wall time against the device's busy time per step (the gap
    is the device waiting for the host), the ops with the most host time (torch.profiler),
    and the Monitor's own Python functions with the most host time (cProfile)."""
    import cProfile
    import pstats

    import torch._dynamo
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch._dynamo.config.skip_nnmodule_hook_guards = False
    cases = [
        ("GPT-2 6x768 compiled, bare", True, "bare"),
        ("GPT-2 6x768 compiled, every=None", True, None),
        ("GPT-2 6x768 compiled, every=1", True, 1),
        ("GPT-2 6x768 eager, bare", False, "bare"),
        ("GPT-2 6x768 eager, every=None", False, None),
        ("GPT-2 6x768 eager, every=1", False, 1),
    ]
    out = {}
    for label, compiled, every in [c for c in cases if only in c[0]]:
        torch._dynamo.reset()
        model, loss_of, make_opt = gpt2(device, layers=6, width=768, tokens=512, vocab=50257)
        opt = make_opt(model)
        mon = None if every == "bare" else hs.Monitor(model, every=every)
        call = torch.compile(model) if compiled else model
        try:
            for _ in range(4):
                one_step(call, loss_of, opt, mon).item()
            activities = [ProfilerActivity.CPU]
            if device.startswith("cuda"):
                activities.append(ProfilerActivity.CUDA)
            t0 = time.perf_counter()
            with profile(activities=activities) as prof:
                for _ in range(steps):
                    one_step(call, loss_of, opt, mon).item()
            wall = (time.perf_counter() - t0) / steps * 1e3
            events = prof.key_averages()
            device_time = lambda e: getattr(  # noqa: E731
                e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0)
            )
            top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:12]
            # Kernels only, as torch's own table sums them: an op on the host carries its
            # kernels' time too, and a ``record_function`` range (``Optimizer.step#...``) is
            # a span on the device's timeline, idle gaps included, not work.
            kernels = [
                e
                for e in events
                if e.device_type != DeviceType.CPU
                and not getattr(e, "is_user_annotation", False)
                and device_time(e) > 0
            ]
            busy = sum(device_time(e) for e in kernels)
            top_device = sorted(kernels, key=lambda e: -device_time(e))[:15]
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(steps):
                one_step(call, loss_of, opt, mon).item()
            pr.disable()
            stats = pstats.Stats(pr).stats  # type: ignore[attr-defined]
            ours = sorted(
                (
                    (v[2] / steps * 1e3, v[3] / steps * 1e3, f"{Path(k[0]).name}:{k[1]} {k[2]}")
                    for k, v in stats.items()
                    if "hookscope" in k[0]
                ),
                reverse=True,
            )[:15]
            out[label] = {
                "wall_ms": round(wall, 2),
                "device_busy_ms": round(busy / steps / 1e3, 2),
                "top_host_ops_ms": [
                    (e.key[:60], round(e.self_cpu_time_total / steps / 1e3, 3)) for e in top
                ],
                "device_kernels_per_step": round(sum(e.count for e in kernels) / steps),
                "top_device_ops_ms_calls": [
                    (e.key[:60], round(device_time(e) / steps / 1e3, 3), e.count // steps)
                    for e in top_device
                ],
                "hookscope_tottime_cumtime_ms": [(round(a, 3), round(b, 3), n) for a, b, n in ours],
            }
        except Exception as e:
            traceback.print_exc(limit=-4)
            out[label] = {"error": bm.one_line(e)}
        finally:
            if mon is not None:
                mon.close()
        print(f"   profile {label}: {json.dumps(out[label])[:400]}", flush=True)
        del model, call, opt
        torch.cuda.empty_cache() if device.startswith("cuda") else None
    return out


PARTS = {
    "equal": lambda a: part_equal(a.device),
    "nonfinite": lambda a: part_nonfinite(a.device),
    "amp": lambda a: part_amp(a.device),
    "syncs": lambda a: part_syncs(a.device),
    "eager": lambda a: part_eager(a.device, a.pairs),
    "cudagraphs": lambda a: part_cudagraphs(a.device),
    "compiled": lambda a: part_compiled(a.device, a.pairs),
    "profile": lambda a: part_profile(a.device, only=a.profile),
}


def main() -> None:
    global OUT
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default=None)
    parser.add_argument("--pairs", type=int, default=20)
    parser.add_argument("--only", default=",".join(PARTS))
    parser.add_argument("--profile", default="", help="profile only the cases naming this")
    parser.add_argument("--small", action="store_true", help="the first model of each list only")
    args = parser.parse_args()
    if args.small:
        for models in (MODELS, COMPILED_MODELS):
            for key in list(models)[1:]:
                del models[key]
    if args.out:
        OUT = Path(args.out)
        OUT.mkdir(parents=True, exist_ok=True)
    warnings.filterwarnings("ignore", category=FutureWarning)
    env = {"torch": torch.__version__, "python": sys.version.split()[0], "hookscope": hs.__file__}
    if args.device.startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name()
    save("env", env)
    for part in args.only.split(","):
        t0 = time.perf_counter()
        try:
            result = PARTS[part](args)
        except Exception as e:
            traceback.print_exc(limit=-6)
            result = {"error": bm.one_line(e)}
        result = {"seconds": round(time.perf_counter() - t0, 1), **result}
        save(part, result)


if __name__ == "__main__":
    main()
