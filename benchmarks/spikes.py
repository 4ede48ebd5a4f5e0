"""Injected loss spikes on small transformers: does ``loss_spike`` find them, name the layer,
and stay silent on healthy runs?

Every run trains a small GPT-2 (``tests/models.py``: 3 layers x 64, random weights, dropout 0)
on a synthetic language (sequences of a fixed random first-order Markov chain over 100 tokens,
so the loss falls from ~4.6 towards the chain's entropy) with AdamW, a linear warm-up and a
cosine decay, under ``hs.Monitor(every=None)`` (the non-finite check and the rolling window
only). At step ``AT`` one fault is injected:

- ``bad_batch``: that step's batch is uniform random tokens (off the training distribution);
- ``lr_jump``: the learning rate is multiplied by 30 from that step on;
- ``layer_scale``: the weights of block ``transformer.h.1``'s MLP input projection are
  multiplied by 8 before that step's forward;
- ``grad_scale``: the gradients of block ``transformer.h.1`` are multiplied by 1e4 before that
  step's update (SGD with momentum for this case, which applies them as they are).

Each case is proved with plain torch: the loss in the step after the fault is compared with
the run's loss just before it (the printed ``jump``). Healthy runs: the same training with
no fault, several seeds and schedules. Printed: per case, whether a ``loss_spike`` was found
at or after ``AT`` (within 3 steps), the group it names and its lead; then the detection
rate, the right-layer rate (for the layer cases: ``transformer.h.1``), the median lead and
the false alarms (findings on healthy runs, or before ``AT``). The rolling window's own cost
is timed as the share of a step spent in ``SpikeWatch.observe``.

    python benchmarks/spikes.py [--quick]
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
import hookscope as hs
import models
from hookscope._monitor import _signals

VOCAB, LENGTH, BATCH = 100, 32, 16
STEPS, AT, WARMUP = 160, 110, 20
LAYER = "transformer.h.1"
LR_JUMP, SCALE = 100, 10
CASES = ("bad_batch", "lr_jump", "layer_scale", "grad_scale")


def chain(seed: int) -> torch.Tensor:
    """Transition matrix of a random Markov chain: each token has a few likely successors."""
    g = torch.Generator().manual_seed(1000 + seed)
    logits = torch.randn(VOCAB, VOCAB, generator=g) * 3
    return logits.softmax(-1)


def batch(p: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    ids = torch.empty(BATCH, LENGTH, dtype=torch.long)
    ids[:, 0] = torch.randint(0, VOCAB, (BATCH,), generator=g)
    for t in range(1, LENGTH):
        ids[:, t] = torch.multinomial(p[ids[:, t - 1]], 1, generator=g).squeeze(1)
    return ids


def lr_at(step: int, base: float, schedule: str) -> float:
    if step < WARMUP:
        return base * (step + 1) / WARMUP
    if schedule == "constant":
        return base
    return base * 0.5 * (1 + math.cos(math.pi * (step - WARMUP) / (STEPS - WARMUP)))


def run(case: str | None, seed: int, schedule: str = "cosine") -> dict:
    """Train one run; return its findings, losses and the time spent in the window."""
    torch.manual_seed(seed)
    model = models.gpt2(n_layer=3).train()
    p, g = chain(seed), torch.Generator().manual_seed(seed)
    sgd = case == "grad_scale"
    base = 0.05 if sgd else 3e-3
    opt = (
        torch.optim.SGD(model.parameters(), lr=base, momentum=0.9)
        if sgd
        else torch.optim.AdamW(model.parameters(), lr=base, weight_decay=0.01)
    )
    spent = [0.0]
    observe = _signals.SpikeWatch.observe

    def timed(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return observe(self, *args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - t0

    losses, t0 = [], time.perf_counter()
    _signals.SpikeWatch.observe = timed
    try:
        with hs.Monitor(model, every=None) as mon:
            for step in range(STEPS):
                lr = lr_at(step, base, schedule) * (
                    LR_JUMP if case == "lr_jump" and step >= AT else 1
                )
                for group in opt.param_groups:
                    group["lr"] = lr
                ids = batch(p, g)
                if step == AT and case == "bad_batch":
                    ids = torch.randint(0, VOCAB, ids.shape, generator=g)
                if step == AT and case == "layer_scale":
                    with torch.no_grad():
                        for param in model.transformer.h[1].parameters():
                            if param.dim() == 2:
                                param.mul_(SCALE)
                loss = model(ids, labels=ids).loss
                loss.backward()
                if step == AT and case == "grad_scale":
                    for name, param in model.named_parameters():
                        if name.startswith(LAYER + ".") and param.grad is not None:
                            param.grad.mul_(1e4)
                opt.step()
                opt.zero_grad()
                mon.step()
                losses.append(loss.item())
            findings = [f for f in mon.findings if f.kind == "loss_spike"]
    finally:
        _signals.SpikeWatch.observe = observe
    return {
        "findings": findings,
        "losses": losses,
        "share": spent[0] / (time.perf_counter() - t0),
    }


def judge(case: str, result: dict) -> dict:
    losses = result["losses"]
    before = statistics.median(losses[AT - 10 : AT])
    jump = max(losses[AT : AT + 3]) / before
    false = [f for f in result["findings"] if f.step < AT]
    hit = next((f for f in result["findings"] if AT <= f.step <= AT + 3), None)
    lead = None
    if hit is not None and hit.module:
        before = re.search(r"(\d+) steps? before the loss", hit.message)
        lead = int(before.group(1)) if before else 0
    return {"jump": jump, "hit": hit, "false": false, "lead": lead}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one seed per case")
    args = parser.parse_args()
    seeds = [0] if args.quick else [0, 1, 2]
    torch.set_num_threads(1)
    detected = right = layer_cases = cases = false_alarms = 0
    leads, shares = [], []
    print("| case | seed | loss jump (plain torch) | found at | group | lead |")
    print("|---|---|---|---|---|---|")
    for case in CASES:
        for seed in seeds:
            r = run(case, seed)
            j = judge(case, r)
            cases += 1
            detected += j["hit"] is not None
            false_alarms += len(j["false"])
            shares.append(r["share"])
            if case in ("layer_scale", "grad_scale"):
                layer_cases += 1
                right += j["hit"] is not None and j["hit"].module == LAYER
            if j["lead"] is not None:
                leads.append(j["lead"])
            hit = j["hit"]
            print(
                f"| {case} | {seed} | {j['jump']:.2f}x | {hit.step if hit else '-'} | "
                f"{hit.module if hit else '-'} | {j['lead'] if j['lead'] is not None else '-'} |",
                flush=True,
            )
    healthy = [
        (s, sched)
        for s in (range(2) if args.quick else range(4))
        for sched in ("cosine", "constant")
    ]
    for seed, schedule in healthy:
        r = run(None, 10 + seed, schedule)
        false_alarms += len(r["findings"])
        shares.append(r["share"])
        names = ", ".join(f"step {f.step}" for f in r["findings"]) or "silent"
        print(f"| healthy ({schedule}) | {10 + seed} | - | {names} | - | - |", flush=True)
    print()
    print(f"detection: {detected}/{cases} = {detected / cases:.2f}")
    print(f"right layer ({LAYER}): {right}/{layer_cases} = {right / max(layer_cases, 1):.2f}")
    print(f"median lead: {statistics.median(leads) if leads else '-'} steps")
    print(f"false alarms: {false_alarms} (healthy runs: {len(healthy)})")
    print(f"rolling window's share of the step: {statistics.median(shares):.4f}x (median)")


if __name__ == "__main__":
    main()
