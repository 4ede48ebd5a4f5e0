"""A residual-stream patching sweep: hs.patching against raw hooks, nnsight and TransformerLens.

The sweep: GPT2LMHeadModel(n_layer=6, n_embd=256, n_head=4, vocab_size=5000), random
weights, one clean and one corrupted prompt of 32 tokens (differing at position 10), every
block's output patched at every position: 6 x 32 = 192 patched runs, metric = the logit
difference of two tokens at the last position. fp32 on the CPU, ``torch.set_num_threads``
fixed (``--threads``, default 1).

Conditions, each timed as a whole sweep (clean cache included), paired and interleaved with
the sweep it is compared with (alternating which goes first, one warm-up pair); the ratio is
the median over pairs, of the process's CPU time (one thread on a shared machine: time the
process was not scheduled does not count) and of wall-clock time:

- ``hs.patching(batch_size=32)`` (32 copies of the corrupted prompt per forward, one site
  each) against the same batched sweep written with raw ``register_forward_hook`` calls:
  the hook cost alone (aim <= 1.1x);
- ``hs.patching(batch_size=1)`` against the raw one-by-one sweep (192 forwards), the form a
  user writes first;
- the default ``hs.patching`` (about 4,096 tokens per forward: 128 copies) against the raw
  batched and one-by-one sweeps (what batching buys).

Peers, when importable (never installed with hookscope; a throwaway venv, see
benchmarks/README.md), on copies of the same weights:

- nnsight: ``NNsight(model).trace(...)`` with ``.output[rows, pos] = clean`` interventions,
  at 32 copies per trace and one by one, against ``hs.patching`` at the same batch;
- TransformerLens 4.x: ``TransformerBridge.boot_transformers(hf_model=..., tokenizer=...)``
  over the local model (no download: a word-level tokenizer built here), ``run_with_cache``
  then ``run_with_hooks`` on ``blocks.{i}.hook_out``. The bridge switches its model to eager
  attention, so hs.patching is timed on an eager copy for these rows.

Every result is checked against the raw one-by-one sweep (max abs difference printed).

    python benchmarks/bench_interp.py                 # 5 pairs per row
    python benchmarks/bench_interp.py --quick         # 2 pairs
    python benchmarks/bench_interp.py --only peers    # the peer rows only
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import time
from collections.abc import Callable
from importlib import metadata

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch
from torch import nn

import hookscope as hs

LAYERS, WIDTH, LENGTH, VOCAB, AT = 6, 256, 32, 5000, 10
PER_FORWARD = 32

Sweep = Callable[[], torch.Tensor]


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


def chunks(per: int) -> list[list[tuple[int, int]]]:
    """The 192 sites (block, position), ``per`` to a forward, in the result's order."""
    sites = [(i, p) for i in range(LAYERS) for p in range(LENGTH)]
    return [sites[k : k + per] for k in range(0, len(sites), per)]


def by_block(chunk: list[tuple[int, int]]) -> dict[int, tuple[list[int], list[int]]]:
    """For each block patched in ``chunk``: the copies (rows) and their positions."""
    found: dict[int, tuple[list[int], list[int]]] = {}
    for row, (block, pos) in enumerate(chunk):
        rows, positions = found.setdefault(block, ([], []))
        rows.append(row)
        positions.append(pos)
    return found


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
    out = []
    with torch.no_grad():
        for chunk in chunks(per):
            handles = []
            for i, (rows, pos) in by_block(chunk).items():

                def patch(m: nn.Module, a: tuple, o: torch.Tensor, i=i, rows=rows, pos=pos):
                    o = o.clone()
                    o[rows, pos] = cache[i][0, pos]
                    return o

                handles.append(blocks[i].register_forward_hook(patch))
            logits = model(corrupted.repeat(len(chunk), 1)).logits
            for h in handles:
                h.remove()
            out.append(logits[:, -1, 1] - logits[:, -1, 2])
    return torch.cat(out).view(LAYERS, LENGTH)


def hs_sweep(
    model: nn.Module, clean: torch.Tensor, corrupted: torch.Tensor, per: int | None
) -> torch.Tensor:
    return hs.patching(
        model, clean, corrupted, "transformer.h.*", metric, batch_size=per, progress=False
    ).as_tensor()


# -- peers -----------------------------------------------------------------------------------
def nnsight_sweep(
    wrapped: object, clean: torch.Tensor, corrupted: torch.Tensor, per: int
) -> torch.Tensor:
    """The sweep as nnsight users write it: a saved clean trace, then patched traces."""
    blocks = wrapped.transformer.h
    with torch.no_grad(), wrapped.trace(clean):
        cache = [blocks[i].output.clone() for i in range(LAYERS)]
        cache.save()
    out = []
    for chunk in chunks(per):
        patches = by_block(chunk)
        with torch.no_grad(), wrapped.trace(corrupted.repeat(len(chunk), 1)):
            for i, (rows, pos) in patches.items():  # in execution order
                blocks[i].output[rows, pos] = cache[i][0, pos]
            logits = wrapped.lm_head.output
            diff = (logits[:, -1, 1] - logits[:, -1, 2]).save()
        out.append(diff)
    return torch.cat(out).view(LAYERS, LENGTH)


def lens_sweep(
    bridge: object, clean: torch.Tensor, corrupted: torch.Tensor, per: int
) -> torch.Tensor:
    """The sweep as TransformerLens users write it: run_with_cache, then run_with_hooks."""
    names = {f"blocks.{i}.hook_out" for i in range(LAYERS)}
    with torch.no_grad():
        _, cache = bridge.run_with_cache(clean, names_filter=lambda name: name in names)
    out = []
    with torch.no_grad():
        for chunk in chunks(per):
            hooks = []
            for i, (rows, pos) in by_block(chunk).items():
                name = f"blocks.{i}.hook_out"

                def patch(value, hook, name=name, rows=rows, pos=pos):
                    value[rows, pos] = cache[name][0, pos]
                    return value

                hooks.append((name, patch))
            logits = bridge.run_with_hooks(corrupted.repeat(len(chunk), 1), fwd_hooks=hooks)
            out.append(logits[:, -1, 1] - logits[:, -1, 2])
    return torch.cat(out).view(LAYERS, LENGTH)


def word_tokenizer() -> object:
    """A tokenizer over the model's vocabulary built here (the bridge wants one; no download)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {str(i): i for i in range(VOCAB)}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="0")),
        bos_token="0",
        eos_token="0",
        pad_token="0",
        unk_token="0",
        name_or_path="local-word-level",
        add_bos_token=True,
    )


def peers(model: nn.Module, clean: torch.Tensor, corrupted: torch.Tensor) -> list[tuple]:
    """(label, ours, theirs, reference) for each peer that imports; notes printed for others."""
    rows: list[tuple] = []
    try:
        from nnsight import NNsight
    except ImportError as error:
        print(f"nnsight: not importable ({error}); its rows are skipped")
    else:
        wrapped = NNsight(copy.deepcopy(model))
        print(f"nnsight {metadata.version('nnsight')}: NNsight(copy of the model).trace")
        reference = hs_sweep(model, clean, corrupted, 1)
        for per in (PER_FORWARD, 1):
            rows.append(
                (
                    f"hs.patching(batch_size={per}) / nnsight ({per} per trace)",
                    lambda per=per: hs_sweep(model, clean, corrupted, per),
                    lambda per=per: nnsight_sweep(wrapped, clean, corrupted, per),
                    reference,
                )
            )
    try:
        from transformer_lens.model_bridge import TransformerBridge
    except ImportError as error:
        print(f"TransformerLens: not importable ({error}); its rows are skipped")
    else:
        bridge = TransformerBridge.boot_transformers(
            "gpt2", hf_model=copy.deepcopy(model), tokenizer=word_tokenizer(), device="cpu"
        )
        bridge.eval()
        eager = copy.deepcopy(model)
        eager.set_attn_implementation("eager")  # what the bridge runs
        print(
            f"TransformerLens {metadata.version('transformer_lens')}: "
            "TransformerBridge.boot_transformers(hf_model=copy, local tokenizer); "
            "hs.patching on an eager-attention copy for these rows"
        )
        reference = hs_sweep(eager, clean, corrupted, 1)
        for per in (PER_FORWARD, 1):
            rows.append(
                (
                    f"hs.patching(batch_size={per}) / TransformerLens ({per} per run)",
                    lambda per=per: hs_sweep(eager, clean, corrupted, per),
                    lambda per=per: lens_sweep(bridge, clean, corrupted, per),
                    reference,
                )
            )
    return rows


# -- timing ----------------------------------------------------------------------------------
def timed(fn: Callable[[], object]) -> tuple[float, float]:
    """Wall-clock and CPU seconds (the process's, all threads) of one call."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def paired(a: Callable[[], object], b: Callable[[], object], pairs: int) -> dict[str, tuple]:
    """For CPU and wall time: the median of a/b over interleaved pairs (alternating which
    runs first), its min and max, and the median times of a and b."""
    a(), b()  # warm-up
    times: list[tuple[tuple[float, float], tuple[float, float]]] = []
    for k in range(pairs):
        if k % 2:
            x, y = timed(a), timed(b)
        else:
            y, x = timed(b), timed(a)
        times.append((x, y))
    found = {}
    for clock, c in (("cpu", 1), ("wall", 0)):
        ratios = [x[c] / y[c] for x, y in times]
        found[clock] = (
            statistics.median(ratios),
            min(ratios),
            max(ratios),
            statistics.median(x[c] for x, _ in times),
            statistics.median(y[c] for _, y in times),
        )
    return found


def report(label: str, a: Sweep, b: Sweep, pairs: int) -> None:
    found = paired(a, b, pairs)
    ratio, low, high, ta, tb = found["cpu"]
    wall = found["wall"]
    print(
        f"{label:<58} cpu {ratio:4.2f}x [{low:.2f}-{high:.2f}] "
        f"({ta * 1e3:5.0f} vs {tb * 1e3:5.0f} ms)  wall {wall[0]:4.2f}x [{wall[1]:.2f}-"
        f"{wall[2]:.2f}] ({wall[3] * 1e3:5.0f} vs {wall[4] * 1e3:5.0f} ms)",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="2 pairs per row")
    parser.add_argument("--pairs", type=int, default=None, help="pairs per row (default 5)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--only", choices=("hs", "peers"), default=None)
    args = parser.parse_args()
    pairs = args.pairs or (2 if args.quick else 5)
    torch.set_num_threads(args.threads)
    model, clean, corrupted = build()
    print(
        f"torch {torch.__version__}, transformers {metadata.version('transformers')}, "
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
        f"{pairs} pairs per row: the median ratio [min-max] of CPU and of wall-clock time, "
        "and the median times",
        flush=True,
    )
    reference = raw_sweep(model, clean, corrupted, 1)

    def check(
        name: str, result: torch.Tensor, against: torch.Tensor = reference, what: str = "raw"
    ) -> None:
        diff = float((result - against).abs().max())
        print(f"{name:>40}: max |diff| vs {what} one by one {diff:.1e}", flush=True)

    if args.only != "peers":
        check("hs.patching default", hs_sweep(model, clean, corrupted, None))
        check("hs.patching(batch_size=32)", hs_sweep(model, clean, corrupted, PER_FORWARD))
        check("hs.patching(batch_size=1)", hs_sweep(model, clean, corrupted, 1))
        check("raw batched (32)", raw_sweep(model, clean, corrupted, PER_FORWARD))
        raw32 = lambda: raw_sweep(model, clean, corrupted, PER_FORWARD)  # noqa: E731
        raw1 = lambda: raw_sweep(model, clean, corrupted, 1)  # noqa: E731
        for label, a, b in (
            ("hs.patching(batch_size=32) / raw hooks batched (32)", PER_FORWARD, raw32),
            ("hs.patching(batch_size=1) / raw hooks one by one", 1, raw1),
            ("hs.patching (default: 128) / raw hooks batched (32)", None, raw32),
            ("hs.patching (default: 128) / raw hooks one by one", None, raw1),
        ):
            report(label, lambda per=a: hs_sweep(model, clean, corrupted, per), b, pairs)
    if args.only != "hs":
        found = peers(model, clean, corrupted)
        for label, _ours, theirs, against in found:
            check(label.split(" / ")[1], theirs(), against, "hs.patching")
        for label, ours, theirs, _ in found:
            report(label, ours, theirs, pairs)


if __name__ == "__main__":
    main()
