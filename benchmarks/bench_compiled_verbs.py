"""capture and intervene on a ``torch.compile``d model: graphs compiled, and the cost per pass.

A small GPT-2 (2 layers, 64 wide, eager attention) and a 6-block MLP (64 wide, in-place ReLUs),
compiled with ``aot_eager`` (the graph Inductor would get, without its C++ build time), trained
``--passes`` forward+backward passes under each verb and bare, in one process:

- ``graphs``: graphs Dynamo compiled over all passes (a verb whose hooks Dynamo guards on
  compiles again at every pass, then falls back to eager past the recompile limit);
- ``first pass s``: the first pass, with its compile;
- ``later passes``: the median of the passes after the first two, over the bare compiled
  model's median, both measured in this run (alternating the bare and the watched model);
- ``eager``: the same ratio for the same verb on the model not compiled (the hooks' own cost
  on a model this small, for comparison).

``python benchmarks/bench_compiled_verbs.py [--passes 20]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch
import torch._dynamo
from torch import nn

import hookscope as hs


class Counting:
    """aot_eager, counting the graphs Dynamo hands it."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
        from torch._dynamo.backends.debugging import aot_eager

        self.graphs += 1
        return aot_eager(gm, example_inputs)


def mlp() -> tuple[nn.Module, Callable[[], tuple]]:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(64, 64), nn.ReLU(inplace=True)) for _ in range(6)]
    return nn.Sequential(*blocks), lambda: (torch.randn(32, 64),)


def gpt2() -> tuple[nn.Module, Callable[[], tuple]]:
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2,
        n_embd=64,
        n_head=4,
        vocab_size=100,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation="eager",
    )
    model = transformers.GPT2LMHeadModel(config)
    return model, lambda: (torch.randint(0, 100, (4, 32)),)


def loss(out: Any) -> torch.Tensor:
    out = out.logits if hasattr(out, "logits") else out
    return out.float().square().mean()


VERBS: dict[str, Callable[[nn.Module, str], Any]] = {
    "capture output": lambda m, where: hs.capture(m, where, "output"),
    "capture output+grad_output": lambda m, where: hs.capture(m, where, ("output", "grad_output")),
    "capture input+output, keep=all": lambda m, where: hs.capture(
        m, where, ("input", "output"), keep="all"
    ),
    "intervene output": lambda m, where: hs.intervene(m, {where: lambda v, site: v}),
}
WHERE = {"mlp": "*.0", "gpt2": "transformer.h.*.mlp"}


def run(kind: str, verb: str, passes: int, compile: bool = True) -> tuple[int, float, float]:
    torch._dynamo.reset()
    build = mlp if kind == "mlp" else gpt2
    model, batch = build()
    bare, bare_batch = build()
    watched_backend, bare_backend = Counting(), Counting()
    compiled = torch.compile(model, backend=watched_backend) if compile else model
    compiled_bare = torch.compile(bare, backend=bare_backend) if compile else bare
    times: list[float] = []
    bare_times: list[float] = []
    with VERBS[verb](model, WHERE[kind]):
        for _ in range(passes):
            for fn, make, into in (
                (compiled_bare, bare_batch, bare_times),
                (compiled, batch, times),
            ):
                args = make()
                start = time.perf_counter()
                loss(fn(*args)).backward()
                into.append(time.perf_counter() - start)
    later = statistics.median(times[2:]) / statistics.median(bare_times[2:])
    return watched_backend.graphs, times[0], later


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--passes", type=int, default=20)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {args.passes} passes, aot_eager")
    head = f"{'model':6} {'verb':32} {'graphs':>6} {'first pass s':>12} {'later passes':>12}"
    print(f"{head} {'eager':>6}")
    for kind in ("mlp", "gpt2"):
        for verb in VERBS:
            graphs, first, later = run(kind, verb, args.passes)
            eager = run(kind, verb, args.passes, compile=False)[2]
            print(f"{kind:6} {verb:32} {graphs:6d} {first:12.2f} {later:11.2f}x {eager:5.2f}x")


if __name__ == "__main__":
    main()
