"""Injected loss spikes on small transformers: does ``loss_spike`` find them, name the layer,
and stay silent on healthy runs? And the large-model precursors: attention logits, loss scale.

Every run trains a small GPT-2 (``tests/models.py``: 3 layers x 64, random weights) on a
synthetic language (sequences of a fixed random first-order Markov chain over 100 tokens, so
the loss falls from ~4.6 towards the chain's entropy) with AdamW, a linear warm-up and a
cosine decay, under ``hs.Monitor(every=None)`` (the non-finite check and the rolling window
only) unless a case says otherwise. At step ``AT`` one fault is injected:

- ``bad_batch``: that step's batch is uniform random tokens (off the training distribution);
- ``lr_jump``: the learning rate is multiplied by 100 from that step on;
- ``layer_scale``: every weight matrix of block ``transformer.h.1`` is multiplied by 10
  before that step's forward;
- ``grad_scale``: the gradients of block ``transformer.h.1`` are multiplied by 1e4 before that
  step's update (SGD with momentum for this case, which applies them as they are);
- ``adam_eps``: Adam's epsilon too small for the gradients. The loss is multiplied by 5e-8
  before ``backward()`` (a loss divided by a huge normaliser; per-element gradients of
  ~1e-11, as tiny as a very wide model's, Wortsman et al. 2023, sec. 3.4), so AdamW's
  ``eps=1e-8`` dominates the denominator: each update is ``lr * m / eps``, SGD-like, and the
  learning rate (0.1) is one tuned for that regime. At ``AT`` epsilon is lowered to 1e-16 (the
  large-model advice, applied on a resume): the denominator becomes ``sqrt(v)`` and every
  element's update jumps to about ``lr * sign(g)``, ~30x the learning rate a healthy AdamW run
  of this model uses, for every parameter at once;
- ``attn_logits``: attention-logit growth from a high learning rate without QK normalisation
  (Wortsman et al. 2023, "Small-scale proxies for large-scale Transformer training
  instabilities"): from ``AT`` the learning rate ramps up linearly to 50x over 30 steps (a
  warm-up restarted to a wrong peak). The queries' and keys' weights grow, the largest
  pre-softmax logit grows ~200x, attention saturates, then the loss rises. This case runs
  under ``Monitor(every=5)`` (the attention probe reads sampled steps); a ``loss_spike`` or an
  ``attention_logit_growth`` anywhere after ``AT`` counts, and when both fire the lead of the
  logits over the loss is printed: the precursor;
- ``fp16_overflow``: float16 mixed precision (``torch.autocast("cpu", dtype=torch.float16)``,
  ``torch.amp.GradScaler("cpu")``, the usual ``unscale_`` + ``clip_grad_norm_`` before
  ``scaler.step``). At ``AT`` block ``transformer.h.1``'s MLP hidden activations are made
  1000x larger (its input projection x1000, its output projection /1000: the same function in
  float32, as massive activations are): ``gelu_new`` cubes its input, which overflows float16
  above ~40, and its backward makes NaN (0 x Inf) at every loss scale. GradScaler skips every
  step from then on and its scale halves each time, towards zero: the run stalls silently while
  its loss stays where it was. Found by the Monitor's ``skipped_step`` events; the event names
  where the first non-finite gradient was seen.

Each case is proved with plain torch: the loss in the steps after the fault over the run's
loss just before it (``loss``); for ``attn_logits`` the largest causal logit ``q.k/sqrt(d)``
after the fault over the one before, recomputed from each block's ``c_attn`` output in a
forward hook (``logit``); for ``fp16_overflow`` the steps GradScaler skipped (its scale halved)
and its scale before and at the end. Healthy runs: the same training with no fault, several
seeds and schedules, and one twin of each of the last three cases without its fault (its loss
weight and learning rate, its sampling, its float16). Printed: per case the first signal at or
after ``AT`` (within 3 steps, or to the end for ``attn_logits``), the module it names and its
lead; then, per kind of case, the detection rate, the right-layer rate (for the layer cases:
``transformer.h.1``) and the median lead, and the false alarms (any finding or skipped step on
a healthy run; a signal before ``AT``). The rolling window's own cost is timed as the share of
a step spent in ``SpikeWatch.observe``.

    python benchmarks/spikes.py [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import math
import re
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
import hookscope as hs
import models
from hookscope._monitor._probes import _signals

VOCAB, LENGTH, BATCH = 100, 32, 16
STEPS, AT, WARMUP = 160, 110, 20
LAYER = "transformer.h.1"
LR_JUMP, SCALE = 100, 10
EPS_LOSS, EPS_LR, EPS_AFTER = 5e-8, 0.1, 1e-16  # adam_eps
ATTN_LR, ATTN_RAMP = 50, 30  # attn_logits: the learning rate ramps to 50x over 30 steps
MASSIVE = 1000.0  # fp16_overflow: how much larger h.1's MLP hidden activations are made
CASES = (
    "bad_batch",
    "lr_jump",
    "layer_scale",
    "grad_scale",
    "adam_eps",
    "attn_logits",
    "fp16_overflow",
)
LAYER_CASES = ("layer_scale", "grad_scale", "fp16_overflow")
TWINS = ("adam_eps", "attn_logits", "fp16_overflow")  # with a healthy twin of their own
SIGNALS = ("loss_spike", "attention_logit_growth", "skipped_step")


@dataclass(frozen=True)
class Setup:
    """How a case trains: SGD or AdamW at ``base``, the loss's weight before ``backward()``,
    the Monitor's ``every``, float16 autocast with a GradScaler, and how many steps after the
    fault its signal may come."""

    sgd: bool = False
    base: float = 3e-3
    loss_weight: float = 1.0
    every: int | None = None
    amp: bool = False
    window: int = 3


SETUPS = {
    "grad_scale": Setup(sgd=True, base=0.05),
    "adam_eps": Setup(base=EPS_LR, loss_weight=EPS_LOSS),
    "attn_logits": Setup(every=5, window=STEPS - AT),
    "fp16_overflow": Setup(amp=True),
}


class Signal(NamedTuple):
    """A finding or a ``skipped_step`` event: when, what, and the module it names."""

    step: int
    kind: str
    module: str
    message: str


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


def learning_rate(fault: str | None, step: int, base: float, schedule: str) -> float:
    """The schedule's rate, or the faulty one: x100 from ``AT`` on (``lr_jump``), or a ramp to
    50x its rate at ``AT`` over 30 steps (``attn_logits``)."""
    if fault == "lr_jump" and step >= AT:
        return lr_at(step, base, schedule) * LR_JUMP
    if fault == "attn_logits" and step >= AT:
        return lr_at(AT, base, schedule) * (1 + (ATTN_LR - 1) * min(1, (step - AT) / ATTN_RAMP))
    return lr_at(step, base, schedule)


def inject(
    fault: str | None,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    ids: torch.Tensor,
    g: torch.Generator,
) -> torch.Tensor:
    """The faults applied before the step's forward; the batch to train on."""
    block = model.transformer.h[1]
    with torch.no_grad():
        if fault == "bad_batch":
            ids = torch.randint(0, VOCAB, ids.shape, generator=g)
        elif fault == "layer_scale":
            for param in block.parameters():
                if param.dim() == 2:
                    param.mul_(SCALE)
        elif fault == "adam_eps":
            for group in opt.param_groups:
                group["eps"] = EPS_AFTER
        elif fault == "fp16_overflow":
            block.mlp.c_fc.weight.mul_(MASSIVE)
            block.mlp.c_fc.bias.mul_(MASSIVE)
            block.mlp.c_proj.weight.div_(MASSIVE)
    return ids


def attention_logits(model: torch.nn.Module) -> list[float]:
    """Plain torch: per forward, the largest causal logit ``q.k / sqrt(d)`` over the blocks,
    from each block's ``c_attn`` output (GPT-2's fused query, key and value projection)."""
    config, found = model.config, []
    heads, width = config.n_head, config.n_embd

    def hook(module, args, output) -> None:
        q, k, _ = output.detach().float().split(width, dim=2)
        q, k = (t.unflatten(2, (heads, width // heads)).transpose(1, 2) for t in (q, k))
        scores = q @ k.transpose(-1, -2) / math.sqrt(width // heads)
        n = scores.shape[-1]
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        value = scores.masked_fill(~causal, -math.inf).amax().item()
        if module is model.transformer.h[0].attn.c_attn:
            found.append(value)
        else:
            found[-1] = max(found[-1], value)

    for block in model.transformer.h:
        block.attn.c_attn.register_forward_hook(hook)
    return found


def run(case: str, seed: int, schedule: str = "cosine", faulty: bool = True) -> dict:
    """Train one run (``faulty=False``: the case's setup without its fault); return its
    signals, other findings, losses, plain-torch logits and loss scales, and the time spent
    in the window."""
    setup, fault = SETUPS.get(case, Setup()), case if faulty else None
    torch.manual_seed(seed)
    model = models.gpt2(n_layer=3).train()
    p, g = chain(seed), torch.Generator().manual_seed(seed)
    opt = (
        torch.optim.SGD(model.parameters(), lr=setup.base, momentum=0.9)
        if setup.sgd
        else torch.optim.AdamW(model.parameters(), lr=setup.base, weight_decay=0.01)
    )
    scaler = torch.amp.GradScaler("cpu") if setup.amp else None
    logits = attention_logits(model) if case == "attn_logits" else []
    spent = [0.0]
    observe = _signals.SpikeWatch.observe

    def timed(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return observe(self, *args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - t0

    losses, scales, t0 = [], [], time.perf_counter()
    _signals.SpikeWatch.observe = timed
    try:
        with hs.Monitor(model, every=setup.every) as mon:
            for step in range(STEPS):
                for group in opt.param_groups:
                    group["lr"] = learning_rate(fault, step, setup.base, schedule)
                ids = batch(p, g)
                if step == AT:
                    ids = inject(fault, model, opt, ids, g)
                with torch.autocast("cpu", dtype=torch.float16, enabled=setup.amp):
                    loss = model(ids, labels=ids).loss
                root = loss if setup.loss_weight == 1 else loss * setup.loss_weight
                if scaler is not None:
                    scaler.scale(root).backward()
                    scaler.unscale_(opt)
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    scaler.step(opt)
                    scaler.update()
                    scales.append(scaler.get_scale())
                else:
                    root.backward()
                    if step == AT and fault == "grad_scale":
                        for name, param in model.named_parameters():
                            if name.startswith(LAYER + ".") and param.grad is not None:
                                param.grad.mul_(1e4)
                    opt.step()
                opt.zero_grad()
                mon.step()
                losses.append(loss.item())
            signals, others = _signals_of(mon)
    finally:
        _signals.SpikeWatch.observe = observe
    return {
        "signals": signals,
        "others": others,
        "losses": losses,
        "logits": logits,
        "scales": scales,
        "share": spent[0] / (time.perf_counter() - t0),
    }


def _signals_of(mon: hs.Monitor) -> tuple[list[Signal], list[Signal]]:
    """The run's signals (``loss_spike``, ``attention_logit_growth``, ``skipped_step``
    events: one per skipped step) and its other findings, in step order."""
    signals, others = [], []
    for f in mon.findings:
        (signals if f.kind in SIGNALS else others).append(
            Signal(f.step, f.kind, f.module, f.message)
        )
    for r in mon.records:
        if r.get("type") == "event" and r["kind"] == "skipped_step":
            cause = re.search(r"First: .*?'([\w.]+)'", r["message"])
            signals.append(
                Signal(r["step"], "skipped_step", cause[1] if cause else "", r["message"])
            )
    return sorted(signals), sorted(others)


def proof(case: str, result: dict) -> str:
    """What plain torch shows of the fault."""
    losses, window = result["losses"], SETUPS.get(case, Setup()).window
    jump = max(losses[AT : AT + window + 1]) / statistics.median(losses[AT - 10 : AT])
    shown = f"loss {jump:.2f}x"
    if result["logits"]:
        logits, before = result["logits"], max(result["logits"][AT - 10 : AT])
        tenfold = next((AT + i for i, v in enumerate(logits[AT:]) if v >= 10 * before), None)
        shown = f"logit {max(logits[AT:]) / before:.0f}x (10x at {tenfold}), {shown}"
    if result["scales"]:
        scales = result["scales"]
        skipped = sum(b < a for a, b in itertools.pairwise(scales[AT - 1 :]))
        shown = f"{skipped} skipped, scale {scales[AT - 1]:g} -> {scales[-1]:.2g}, {shown}"
    return shown


def judge(case: str, result: dict) -> dict:
    """The first signal within the case's window after ``AT``, the signals before it, and
    the lead: for ``attn_logits`` of the first ``attention_logit_growth`` over the first
    ``loss_spike`` (when both fire), else the one a ``loss_spike`` finding states."""
    window = SETUPS.get(case, Setup()).window
    signals = result["signals"]
    false = [s for s in signals if s.step < AT]
    found = [s for s in signals if AT <= s.step <= AT + window]
    hit = found[0] if found else None
    lead = None
    if case == "attn_logits":
        first = {k: next((s.step for s in found if s.kind == k), None) for k in SIGNALS}
        if first["loss_spike"] is not None and first["attention_logit_growth"] is not None:
            lead = first["loss_spike"] - first["attention_logit_growth"]
    elif hit is not None and hit.kind == "loss_spike" and hit.module:
        before = re.search(r"(\d+) steps? before the loss", hit.message)
        lead = int(before.group(1)) if before else 0
    also = sorted({s.kind for s in result["others"] if s.step >= AT})
    return {"hit": hit, "found": found, "false": false, "lead": lead, "also": also}


def named(hit: Signal | None) -> bool:
    return hit is not None and (hit.module == LAYER or hit.module.startswith(LAYER + "."))


def row(case: str, seed: int, result: dict, j: dict) -> str:
    hit, lead = j["hit"], j["lead"]
    kinds = ", ".join(dict.fromkeys(s.kind for s in j["found"])) or "-"
    return (
        f"| {case} | {seed} | {proof(case, result)} | {hit.step if hit else '-'} | {kinds} | "
        f"{(hit.module or '(none)') if hit else '-'} | {lead if lead is not None else '-'} | "
        f"{', '.join(j['also']) or '-'} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one seed per case")
    args = parser.parse_args()
    seeds = [0] if args.quick else [0, 1, 2]
    torch.set_num_threads(1)
    tally = {case: {"cases": 0, "detected": 0, "right": 0, "leads": []} for case in CASES}
    false_alarms, shares = 0, []
    print("| case | seed | proof (plain torch) | found at | signals | names | lead | also |")
    print("|---|---|---|---|---|---|---|---|")
    for case in CASES:
        for seed in seeds:
            r = run(case, seed)
            j = judge(case, r)
            t = tally[case]
            t["cases"] += 1
            t["detected"] += j["hit"] is not None
            t["right"] += named(j["hit"])
            if j["lead"] is not None:
                t["leads"].append(j["lead"])
            false_alarms += len(j["false"])
            shares.append(r["share"])
            print(row(case, seed, r, j), flush=True)
    healthy = [
        (case, 10 + s, sched)
        for s in (range(2) if args.quick else range(4))
        for case, sched in (("healthy", "cosine"), ("healthy", "constant"))
    ] + [(case, 10, "cosine") for case in TWINS]
    for case, seed, schedule in healthy:
        r = run(case, seed, schedule, faulty=False)
        alarms = r["signals"] + r["others"]
        false_alarms += len(alarms)
        shares.append(r["share"])
        names = ", ".join(f"{s.kind} at {s.step}" for s in alarms) or "silent"
        label = f"healthy ({schedule})" if case == "healthy" else f"healthy twin of {case}"
        print(f"| {label} | {seed} | - | {names} | - | - | - | - |", flush=True)
    print()
    print("| kind | detected | right layer | median lead (steps; attn_logits: logits first) |")
    print("|---|---|---|---|")
    for case, t in tally.items():
        right = f"{t['right']}/{t['cases']}" if case in LAYER_CASES else "-"
        lead = statistics.median(t["leads"]) if t["leads"] else "-"
        print(f"| {case} | {t['detected']}/{t['cases']} | {right} | {lead} |")
    cases = sum(t["cases"] for t in tally.values())
    detected = sum(t["detected"] for t in tally.values())
    layer_cases = sum(tally[c]["cases"] for c in LAYER_CASES)
    right = sum(tally[c]["right"] for c in LAYER_CASES)
    leads = [lead for c, t in tally.items() if c != "attn_logits" for lead in t["leads"]]
    ahead = tally["attn_logits"]["leads"]
    print()
    print(f"detection: {detected}/{cases} = {detected / cases:.2f}")
    print(f"right layer ({LAYER}): {right}/{layer_cases} = {right / max(layer_cases, 1):.2f}")
    print(f"median lead of the named group: {statistics.median(leads) if leads else '-'} steps")
    print(
        "attention_logit_growth before the loss_spike: "
        f"{', '.join(map(str, ahead)) or '-'} steps (median {statistics.median(ahead) if ahead else '-'})"
    )
    print(f"false alarms: {false_alarms} (healthy runs: {len(healthy)})")
    print(f"rolling window's share of the step: {statistics.median(shares):.4f}x (median)")


if __name__ == "__main__":
    main()
