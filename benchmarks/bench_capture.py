"""What capture and extract cost on a GPT-2-style model, measured against the bare model.

Method (see research/env-and-baselines.md): paired, interleaved timing. For each condition,
a few warm-up pairs, then N pairs of (bare step, condition step) timed back to back,
alternating which goes first; the ratio reported is the median over pairs of
condition / bare, which cancels the slow drift of a shared machine. Hooks are attached and
removed outside the timed region except where attaching is part of the verb (``hs.extract``
attaches and removes its hooks on every call, so its time includes them).

Model: ``GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=5000,
n_positions=128))``, input ids 8x128, fp32 on the CPU, ``torch.set_num_threads(2)``.

    python benchmarks/bench_capture.py            # 15 pairs per condition
    python benchmarks/bench_capture.py --quick    # 5 pairs, for a smoke test
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import _models
import torch
from torch import nn

import hookscope as hs

N_LAYER = 4
BLOCKS = "transformer.h.*"
ALL = ("input", "output", "grad_input", "grad_output")


def build() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = _models.gpt2(n_layer=N_LAYER)
    ids = torch.randint(0, model.config.vocab_size, (8, 128))
    return model, ids


# -- steps -------------------------------------------------------------------------------------


def forward_step(model: nn.Module, ids: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        with torch.no_grad():
            model(ids)

    return step


def train_step(model: nn.Module, ids: torch.Tensor) -> Callable[[], None]:
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        loss.item()

    return step


class Scoped:
    """A condition whose hooks are attached before the timed step and removed after it."""

    def __init__(self, enter: Callable[[], object]) -> None:
        self.enter = enter

    def __call__(self) -> Callable[[], None]:
        ctx = self.enter()
        ctx.__enter__()  # type: ignore[attr-defined]

        def finish() -> None:
            ctx.__exit__(None, None, None)  # type: ignore[attr-defined]

        return finish


def naive_dict_hooks(model: nn.Module) -> object:
    """The seed's pattern: a forward hook storing each block's output, by reference, in a dict."""
    feats: dict[str, torch.Tensor] = {}
    handles: list[torch.utils.hooks.RemovableHandle] = []

    class Ctx:
        def __enter__(self) -> Ctx:
            for name, module in hs.select(model, BLOCKS).items():

                def hook(m: nn.Module, args: object, out: torch.Tensor, name: str = name) -> None:
                    feats[name] = out

                handles.append(module.register_forward_hook(hook))
            return self

        def __exit__(self, *exc: object) -> None:
            for handle in handles:
                handle.remove()
            handles.clear()

    return Ctx()


# -- timing ------------------------------------------------------------------------------------


def paired(
    bare: Callable[[], None],
    cond: Callable[[], None],
    *,
    setup: Callable[[], Callable[[], None]] | None = None,
    pairs: int,
    warmup: int,
) -> tuple[float, float, float]:
    """Median of per-pair ratios cond/bare, and the median times (ms) of each."""

    def timed_cond() -> float:
        finish = setup() if setup is not None else None
        t0 = time.perf_counter()
        cond()
        t = time.perf_counter() - t0
        if finish is not None:
            finish()
        return t

    def timed_bare() -> float:
        t0 = time.perf_counter()
        bare()
        return time.perf_counter() - t0

    ratios, tb, tc = [], [], []
    for i in range(warmup + pairs):
        if i % 2 == 0:
            b, c = timed_bare(), timed_cond()
        else:
            c, b = timed_cond(), timed_bare()
        if i >= warmup:
            ratios.append(c / b)
            tb.append(b)
            tc.append(c)
    return statistics.median(ratios), 1e3 * statistics.median(tb), 1e3 * statistics.median(tc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="5 pairs per condition")
    parser.add_argument("--pairs", type=int, default=None)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    pairs = args.pairs or (5 if args.quick else 15)
    warmup = 2 if args.quick else 3
    torch.set_num_threads(args.threads)

    model, ids = build()
    rows: list[tuple[str, str, float, float, float]] = []

    def add(group: str, label: str, *timing: float) -> None:
        rows.append((group, label, *timing))
        print(f"  {label:<58} {timing[0]:.3f}x  ({timing[1]:.1f} ms bare, {timing[2]:.1f} ms)")

    def hooked(step: Callable[[], None], enter: Callable[[], object]) -> tuple[float, ...]:
        return paired(step, step, setup=Scoped(enter), pairs=pairs, warmup=warmup)

    def plain(step: Callable[[], None], other: Callable[[], None]) -> tuple[float, ...]:
        return paired(step, other, pairs=pairs, warmup=warmup)

    # (a) capture of every block's output, forward only
    model.eval()
    fwd = forward_step(model, ids)
    print("forward (eval, no_grad)")
    add(
        "forward",
        f"naive dict hook on `{BLOCKS}`, by reference",
        *hooked(fwd, lambda: naive_dict_hooks(model)),
    )
    add(
        "forward",
        f'`hs.capture(model, "{BLOCKS}")` (output, cloned)',
        *hooked(fwd, lambda: hs.capture(model, BLOCKS)),
    )
    add(
        "forward",
        "`hs.capture(..., clone=False)`",
        *hooked(fwd, lambda: hs.capture(model, BLOCKS, clone=False)),
    )

    # (b) extract: the pass stops after the chosen block
    def extract(where: str) -> Callable[[], None]:
        return lambda: hs.extract(model, ids, where=where)

    middle = f"transformer.h.{N_LAYER // 2 - 1}"  # blocks 0 and 1 of 4 run: half the blocks
    last = f"transformer.h.{N_LAYER - 1}"
    add(
        "forward",
        f'`hs.extract(model, ids, where="{middle}")` (half-way)',
        *plain(fwd, extract(middle)),
    )
    add(
        "forward",
        '`hs.extract(model, ids, where="transformer.h.0")` (first block)',
        *plain(fwd, extract("transformer.h.0")),
    )
    add(
        "forward",
        f'`hs.extract(model, ids, where="{last}")` (last block)',
        *plain(fwd, extract(last)),
    )

    # (a) capture with gradients in a training step
    model.train()
    for m in model.modules():  # the ratio should not depend on dropout masks
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    train = train_step(model, ids)
    print("train step (forward, backward, SGD step)")
    add(
        "train",
        f"naive dict hook on `{BLOCKS}`, by reference",
        *hooked(train, lambda: naive_dict_hooks(model)),
    )
    add(
        "train",
        f'`hs.capture(model, "{BLOCKS}")` (output)',
        *hooked(train, lambda: hs.capture(model, BLOCKS)),
    )
    add(
        "train",
        '... `what=("output", "grad_output")`',
        *hooked(train, lambda: hs.capture(model, BLOCKS, what=("output", "grad_output"))),
    )
    add(
        "train",
        "... `what=` all four points",
        *hooked(train, lambda: hs.capture(model, BLOCKS, what=ALL)),
    )

    print()
    print(
        f"GPT-2 n_layer={N_LAYER}, n_embd=256, batch 8x128, fp32 CPU, {args.threads} threads, "
        f"torch {torch.__version__}, {platform.processor() or platform.machine()}; "
        f"{pairs} pairs per condition, median of per-pair ratios"
    )
    print()
    print("| step | condition | ratio vs bare | bare ms | with ms |")
    print("|---|---|---:|---:|---:|")
    for group, label, ratio, tb, tc in rows:
        print(f"| {group} | {label} | {ratio:.2f}x | {tb:.0f} | {tc:.0f} |")


if __name__ == "__main__":
    main()
