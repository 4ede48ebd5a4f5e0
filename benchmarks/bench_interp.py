"""A residual-stream patching sweep: hs.patching against the same sweep with raw hooks.

The sweep: GPT2LMHeadModel(n_layer=6, n_embd=256, n_head=4, vocab_size=5000), one clean and
one corrupted prompt of 32 tokens (differing at position 10), every block's output patched at
every position: 6 x 32 = 192 patched runs, metric = the logit difference of two tokens at the
last position. fp32 on the CPU.

Conditions, each timed as a whole sweep (clean cache included), paired and interleaved with
the raw sweep it is compared with; the ratio is the median over pairs:

- ``hs.patching(batch_size=32)`` (32 copies of the corrupted prompt per forward, one site
  each) against the same batched sweep written with raw ``register_forward_hook`` calls;
- ``hs.patching(batch_size=1)`` against the raw one-by-one sweep (192 forwards), the form a
  user writes first;
- the default ``hs.patching`` (about 4,096 tokens per forward: 128 copies) against the raw
  one-by-one sweep (what batching buys).

Every result is checked against the raw sweep's (max abs difference printed).

    python benchmarks/bench_interp.py            # 5 pairs per condition
    python benchmarks/bench_interp.py --quick    # 2 pairs
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

import torch
from torch import nn

import hookscope as hs

LAYERS, WIDTH, LENGTH, VOCAB, AT = 6, 256, 32, 5000, 10
PER_FORWARD = 32


def build() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=LAYERS,
        n_embd=WIDTH,
        n_head=4,
        vocab_size=VOCAB,
        n_positions=64,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(config).eval()
    clean = torch.randint(0, VOCAB, (1, LENGTH))
    corrupted = clean.clone()
    corrupted[0, AT] = (clean[0, AT] + 1) % VOCAB
    return model, clean, corrupted


def metric(output: object) -> torch.Tensor:
    logits = output.logits
    return (logits[:, -1, 1] - logits[:, -1, 2]).sum()


def raw_sweep(
    model: nn.Module, clean: torch.Tensor, corrupted: torch.Tensor, per: int
) -> torch.Tensor:
    """The same sweep with raw hooks: the clean cache, then ``per`` sites per forward."""
    blocks = list(model.transformer.h)
    cache: dict[int, torch.Tensor] = {}
    handles = [
        b.register_forward_hook(lambda m, a, o, i=i: cache.__setitem__(i, o.clone()))
        for i, b in enumerate(blocks)
    ]
    with torch.no_grad():
        model(clean)
    for h in handles:
        h.remove()
    sites = [(i, p) for i in range(len(blocks)) for p in range(LENGTH)]
    out = torch.empty(len(sites))
    with torch.no_grad():
        for start in range(0, len(sites), per):
            chunk = sites[start : start + per]
            handles = []
            for i in range(len(blocks)):
                rows = [j for j, (b, _) in enumerate(chunk) if b == i]
                if not rows:
                    continue
                pos = [chunk[j][1] for j in rows]

                def patch(m: nn.Module, a: tuple, o: torch.Tensor, i=i, rows=rows, pos=pos):
                    o = o.clone()
                    o[rows, pos] = cache[i][0, pos]
                    return o

                handles.append(blocks[i].register_forward_hook(patch))
            logits = model(corrupted.repeat(len(chunk), 1)).logits
            for h in handles:
                h.remove()
            diff = logits[:, -1, 1] - logits[:, -1, 2]
            out[start : start + len(chunk)] = diff
    return out.view(len(blocks), LENGTH)


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def paired(
    a: Callable[[], object], b: Callable[[], object], pairs: int
) -> tuple[float, float, float]:
    """Median of a/b over interleaved pairs, and the median times."""
    a(), b()  # warm-up
    ratios, ta, tb = [], [], []
    for k in range(pairs):
        if k % 2:
            x, y = timed(a), timed(b)
        else:
            y, x = timed(b), timed(a)
        ta.append(x)
        tb.append(y)
        ratios.append(x / y)
    return statistics.median(ratios), statistics.median(ta), statistics.median(tb)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    pairs = 2 if args.quick else 5
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    model, clean, corrupted = build()
    where = "transformer.h.*"

    def ours(batch: int | None = None) -> torch.Tensor:
        return hs.patching(
            model, clean, corrupted, where, metric, batch_size=batch, progress=False
        ).as_tensor()

    reference = raw_sweep(model, clean, corrupted, 1)
    for name, result in (
        ("hs default", ours()),
        ("hs batch_size=1", ours(1)),
        ("raw batched", raw_sweep(model, clean, corrupted, PER_FORWARD)),
    ):
        print(
            f"{name:>16}: max |diff| vs raw one-by-one {float((result - reference).abs().max()):.2e}"
        )
    print(
        f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} threads, {pairs} pairs"
    )
    rows = [
        (
            "hs.patching(batch_size=32) / raw batched (32)",
            lambda: ours(PER_FORWARD),
            lambda: raw_sweep(model, clean, corrupted, PER_FORWARD),
        ),
        (
            "hs.patching (default: 128) / raw batched (32)",
            lambda: ours(),
            lambda: raw_sweep(model, clean, corrupted, PER_FORWARD),
        ),
        (
            "hs.patching(batch_size=1) / raw one by one",
            lambda: ours(1),
            lambda: raw_sweep(model, clean, corrupted, 1),
        ),
        (
            "hs.patching (default: 128) / raw one by one",
            lambda: ours(),
            lambda: raw_sweep(model, clean, corrupted, 1),
        ),
    ]
    for label, a, b in rows:
        ratio, ta, tb = paired(a, b, pairs)
        print(f"{label:<45} {ratio:5.2f}x  ({ta * 1e3:7.1f} ms vs {tb * 1e3:7.1f} ms)")


if __name__ == "__main__":
    main()
