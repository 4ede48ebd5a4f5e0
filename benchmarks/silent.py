"""Silent errors: minimal reproductions of real silent training bugs, each with a fixed twin.

Each case trains a small model with ``hs.Monitor`` attached (defaults, except ``every=1`` where
the bug is only visible on a sampled step, and the ``frozen=`` a user would declare). Each
bug is first *proved with plain torch* (weights that did not move, an evaluation that is not
repeatable, a dtype, a scale), on the bug and on its twin: a case whose proof fails is
reported as such and not counted. Printed per case: the finding kind expected, the step the bug
first acts at (the trigger), the step of the first finding of that kind; and at the end:
detected, detected within 2 steps of the trigger, and false alarms (findings of the silent
kinds on the fixed twins). The multi-process cases run on 2 gloo ranks on the CPU (one spawn
for all of them); each proves its bug by gathering the parameters of both ranks, and the
findings are rank 0's (every rank holds the same). Then the cost of the checks: the same
watched training step with the checks and with them replaced by a no-op, paired and
interleaved, as a ratio.

    python benchmarks/silent.py [--pairs N] [--no-cost] [--no-multi]
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

import hookscope as hs

KINDS = (
    "not_updated",
    "stale_gradients",
    "eval_randomness",
    "eval_mismatch",
    "autocast_skipped",
    "frozen_changed",
    "replica_divergence",
)
STEPS = 5


def mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)
    )


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)


@dataclass
class Outcome:
    proved: bool  # plain torch shows the bug (on the bug), or its absence (on the twin)
    findings: list[hs.Finding]


def train(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    mon: hs.Monitor,
    *,
    steps: int = STEPS,
    zero: Callable[[int], bool] = lambda s: True,
    between: bool = False,
) -> None:
    for s in range(steps):
        x, y = batch(s)
        if zero(s) and not between:
            opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        if between:
            opt.zero_grad()
        opt.step()
        mon.step()


# -- the cases: each returns what plain torch showed and the Monitor's findings ----------------
def missing_zero_grad(bug: bool) -> Outcome:
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with hs.Monitor(model) as mon:
        train(model, opt, mon, zero=(lambda s: s == 0) if bug else (lambda s: True))
    # Proof: with the bug, the last gradient is the sum of all steps' gradients.
    grad = model[0].weight.grad.norm()
    opt.zero_grad()
    F.mse_loss(model(batch(STEPS - 1)[0]), batch(STEPS - 1)[1]).backward()
    return Outcome(bool(grad > 2 * model[0].weight.grad.norm()) is bug, mon.findings)


def zero_grad_before_step(bug: bool) -> Outcome:
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    before = copy.deepcopy(model.state_dict())
    with hs.Monitor(model) as mon:
        train(model, opt, mon, between=bug)
    moved = any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    return Outcome(moved is not bug, mon.findings)


def optimizer_of_frozen_head(bug: bool) -> Outcome:
    torch.manual_seed(0)
    model = mlp()
    head = model[4]
    model[0].requires_grad_(False)  # a frozen backbone (part of it)
    if bug:
        head.requires_grad_(False)  # the head frozen too, by a loop that matched too much
    opt = torch.optim.SGD(head.parameters(), lr=0.1)
    before = head.weight.detach().clone()
    with hs.Monitor(model) as mon:
        train(model, opt, mon) if not bug else _frozen_loop(model, opt, mon)
    return Outcome(torch.equal(before, head.weight) is bug, mon.findings)


def _frozen_loop(model: nn.Module, opt: torch.optim.Optimizer, mon: hs.Monitor) -> None:
    for s in range(STEPS):  # nothing requires a gradient: the loss is computed, not backpropagated
        x, y = batch(s)
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        if loss.requires_grad:
            loss.backward()
        opt.step()
        mon.step(loss=float(loss.detach()))


class RebindingSGD(torch.optim.Optimizer):
    """A hand-written SGD; the bug: ``p = p - lr * g`` only rebinds a local name."""

    def __init__(self, params, lr: float, bug: bool) -> None:
        super().__init__(params, {"lr": lr})
        self.bug = bug

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    if self.bug:
                        p = p - group["lr"] * p.grad
                    else:
                        p.sub_(group["lr"] * p.grad)


def rebinding_optimizer(bug: bool) -> Outcome:
    torch.manual_seed(0)
    model = mlp()
    opt = RebindingSGD(model.parameters(), lr=0.1, bug=bug)
    before = model[2].weight.detach().clone()
    with hs.Monitor(model) as mon:
        train(model, opt, mon)
    return Outcome(torch.equal(before, model[2].weight) is bug, mon.findings)


def optimizer_of_a_copy(bug: bool) -> Outcome:
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if bug:  # the model is re-created (copied) after its optimizer was built
        model = copy.deepcopy(model)
    before = model[2].weight.detach().clone()
    with hs.Monitor(model) as mon:
        train(model, opt, mon)
    return Outcome(torch.equal(before, model[2].weight) is bug, mon.findings)


class Block(nn.Module):
    """A transformer-ish block: attention (nanoGPT's) then an MLP with functional dropout."""

    def __init__(self, width: int, attention_bug: bool, dropout_bug: bool) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc = nn.Linear(width, width)
        self.attention_bug, self.dropout_bug = attention_bug, dropout_bug

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        p = 0.1 if self.training or self.attention_bug else 0.0
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True))
        h = F.dropout(F.gelu(self.fc(x)), 0.1, training=self.training or self.dropout_bug)
        return x + h


def _eval_random(attention_bug: bool, dropout_bug: bool, bug: bool) -> Outcome:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 16), Block(16, attention_bug and bug, dropout_bug and bug), nn.Linear(16, 4)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(4, 6, 8)
    with hs.Monitor(model) as mon:
        for _ in range(2):
            F.mse_loss(model(x), torch.zeros(4, 6, 4)).backward()
            opt.step()
            opt.zero_grad()
            mon.step()
        model.eval()
        with torch.no_grad():
            a, b = model(x), model(x)
        mon.step()
    return Outcome((not torch.equal(a, b)) is bug, mon.findings)


def functional_dropout_in_eval(bug: bool) -> Outcome:
    return _eval_random(False, True, bug)


def attention_dropout_in_eval(bug: bool) -> Outcome:
    return _eval_random(True, False, bug)


class NoAutocastLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", enabled=False):
            return super().forward(x.float())


class DoubleLinear(nn.Linear):
    """A layer kept in float64 (``.double()`` on one layer, e.g. for a 'precise' head)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.double(), self.weight.double(), self.bias.double()).float()


def _autocast(layer: type[nn.Linear] | None) -> Outcome:
    torch.manual_seed(0)
    model = mlp()
    if layer is not None:
        new = layer(32, 32)
        new.load_state_dict(model[2].state_dict())
        model[2] = new
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    dtypes = []
    model[2].register_forward_hook(lambda m, i, o: dtypes.append(o.dtype))
    with hs.Monitor(model) as mon:
        for s in range(3):
            x, y = batch(s)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(x)
            F.mse_loss(out.float(), y).backward()
            opt.step()
            opt.zero_grad()
            mon.step()
    return Outcome((dtypes[0] != torch.bfloat16) is (layer is not None), mon.findings)


def autocast_disabled_layer(bug: bool) -> Outcome:
    return _autocast(NoAutocastLinear if bug else None)


def float64_layer_under_autocast(bug: bool) -> Outcome:
    return _autocast(DoubleLinear if bug else None)


def spectral_norm_eval_first(bug: bool) -> Outcome:
    sn = nn.utils.spectral_norm if bug else nn.utils.parametrizations.spectral_norm
    torch.manual_seed(0)
    model = nn.Sequential(
        sn(nn.Conv2d(3, 32, 3, padding=1)), nn.LeakyReLU(0.1),
        sn(nn.Conv2d(32, 64, 4, 2, 1)), nn.LeakyReLU(0.1),
        sn(nn.Conv2d(64, 64, 4, 2, 1)), nn.LeakyReLU(0.1),
        nn.Flatten(), sn(nn.Linear(64 * 4 * 4, 1)),
    )  # fmt: skip
    x = torch.randn(8, 3, 16, 16)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    with hs.Monitor(model) as mon:
        model.eval()
        with torch.no_grad():
            ev = model(x).pow(2).mean().sqrt()
        model.train()
        for _ in range(3):
            out = model(x)
            out.mean().backward()
            opt.step()
            opt.zero_grad()
            mon.step()
    return Outcome(bool(ev / out.detach().pow(2).mean().sqrt() > 100) is bug, mon.findings)


def unnormalised_eval_inputs(bug: bool) -> Outcome:
    """Training sees images scaled to [0, 1]; the evaluation transform forgets to scale."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 14 * 14, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    pixels = torch.randint(0, 256, (8, 3, 16, 16)).float()
    with hs.Monitor(model) as mon:
        for _ in range(2):
            F.cross_entropy(model(pixels / 255), torch.zeros(8, dtype=torch.long)).backward()
            opt.step()
            opt.zero_grad()
            mon.step()
        model.eval()
        with torch.no_grad():
            ev = model(pixels if bug else pixels / 255)
            tr = model(pixels / 255)
        mon.step()
    return Outcome(bool(ev.abs().mean() / tr.abs().mean() > 30) is bug, mon.findings)


def _frozen_by_name(bug: bool, name: str) -> nn.Module:
    model = nn.Sequential()
    model.add_module("backbone", mlp()[:4])
    model.add_module("head", nn.Linear(32, 4))
    for n, p in model.named_parameters():
        if n.startswith(name):
            p.requires_grad_(False)
    return model


def frozen_by_the_wrong_name(bug: bool) -> Outcome:
    torch.manual_seed(0)
    model = _frozen_by_name(bug, "encoder." if bug else "backbone.")  # the names say backbone
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = model.backbone[0].weight.detach().clone()
    with hs.Monitor(model, frozen="backbone") as mon:
        train(model, opt, mon)
    return Outcome((not torch.equal(before, model.backbone[0].weight)) is bug, mon.findings)


def frozen_batchnorm_in_train_mode(bug: bool) -> Outcome:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))
    model[:2].requires_grad_(False)
    opt = torch.optim.SGD(model[3].parameters(), lr=0.01)
    before = model[1].running_mean.clone()
    with hs.Monitor(model, frozen=["0", "1"]) as mon:
        for s in range(STEPS):
            model.train()
            if not bug:  # the fix: the frozen part stays in eval mode
                model[:2].eval()
            x, y = batch(s)
            F.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            mon.step()
    return Outcome((not torch.equal(before, model[1].running_mean)) is bug, mon.findings)


def frozen_but_momentum_goes_on(bug: bool) -> Outcome:
    """Fine-tuning: the backbone is frozen after a warm-up, but it stays in the optimizer with
    zero_grad(set_to_none=False): momentum keeps moving it."""
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for s in range(3):  # warm-up, everything trains
        opt.zero_grad(set_to_none=False)
        F.mse_loss(model(batch(s)[0]), batch(s)[1]).backward()
        opt.step()
    model[0].requires_grad_(False)
    if not bug:  # the fix: drop the stale gradient (or rebuild the optimizer)
        model[0].weight.grad = model[0].bias.grad = None
    before = model[0].weight.detach().clone()
    with hs.Monitor(model, frozen="0") as mon:
        for s in range(STEPS):
            opt.zero_grad(set_to_none=False)
            F.mse_loss(model(batch(s)[0]), batch(s)[1]).backward()
            opt.step()
            mon.step()
    return Outcome((not torch.equal(before, model[0].weight)) is bug, mon.findings)


@dataclass
class Case:
    name: str
    run: Callable[[bool], Outcome]
    kind: str
    trigger: int  # the step at which the bug first acts


CASES = [
    Case("missing zero_grad()", missing_zero_grad, "stale_gradients", 1),
    Case("zero_grad() between backward and step", zero_grad_before_step, "not_updated", 0),
    Case("optimizer of frozen parameters only", optimizer_of_frozen_head, "not_updated", 0),
    Case("custom optimizer rebinds p (p = p - lr*g)", rebinding_optimizer, "not_updated", 0),
    Case("optimizer built for the model before a copy", optimizer_of_a_copy, "not_updated", 0),
    Case(
        "F.dropout(training=True) in evaluation", functional_dropout_in_eval, "eval_randomness", 2
    ),
    Case("attention dropout_p=p in evaluation", attention_dropout_in_eval, "eval_randomness", 2),
    Case("layer disables autocast for itself", autocast_disabled_layer, "autocast_skipped", 0),
    Case("float64 layer inside autocast", float64_layer_under_autocast, "autocast_skipped", 0),
    Case("spectral norm evaluated before training", spectral_norm_eval_first, "eval_mismatch", 0),
    Case("evaluation inputs not normalised", unnormalised_eval_inputs, "eval_mismatch", 2),
    Case("frozen by the wrong name", frozen_by_the_wrong_name, "frozen_changed", 0),
    Case("frozen BatchNorm in training mode", frozen_batchnorm_in_train_mode, "frozen_changed", 0),
    Case("frozen, momentum goes on", frozen_but_momentum_goes_on, "frozen_changed", 0),
]


# -- several processes: 2 gloo ranks on CPU --------------------------------------------------
WORLD = 2


class SumAcrossRanks(torch.autograd.Function):
    """A row-parallel layer's reduction: partial outputs summed over the ranks; the gradient
    of the sum passes through unchanged (Megatron's ``reduce_from_tensor_model_parallel``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


class TensorParallel(nn.Module):
    """A column-parallel then a row-parallel Linear (each rank holds half of the hidden
    features: marked ``tensor_model_parallel``) and a LayerNorm every rank holds whole."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        torch.manual_seed(10 + rank)  # each rank's own shards
        self.col = nn.Linear(8, 32 // WORLD)
        self.row = nn.Linear(32 // WORLD, 4, bias=False)
        for p in (*self.col.parameters(), *self.row.parameters()):
            p.tensor_model_parallel = True
        torch.manual_seed(0)  # the replicated part: the same on every rank
        self.norm = nn.LayerNorm(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(SumAcrossRanks.apply(self.row(torch.relu(self.col(x)))))


def _differs_across_ranks(params: list[torch.Tensor]) -> bool:
    """Plain torch: whether these tensors differ between the ranks (all-gathered)."""
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    gathered = [torch.empty_like(flat) for _ in range(WORLD)]
    dist.all_gather(gathered, flat)
    return any(not torch.equal(gathered[0], g) for g in gathered[1:])


def _ddp_train(ddp: nn.Module, opt: torch.optim.Optimizer, mon: hs.Monitor, rank: int) -> None:
    for s in range(STEPS):
        x, y = batch(s)  # each rank trains on its half of the batch
        opt.zero_grad()
        F.mse_loss(ddp(x.chunk(WORLD)[rank]), y.chunk(WORLD)[rank]).backward()
        opt.step()
        mon.step()


def head_replaced_after_wrapping(rank: int, bug: bool) -> Outcome:
    """Fine-tuning swaps the classifier head after DistributedDataParallel wrapped the model
    (with find_unused_parameters=True, nothing complains): its gradients are never averaged."""
    DDP = nn.parallel.DistributedDataParallel
    torch.manual_seed(0)
    model = mlp()
    if not bug:
        model[4] = nn.Linear(32, 4)
    ddp = DDP(model, find_unused_parameters=True)
    if bug:
        model[4] = nn.Linear(32, 4)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    with hs.Monitor(ddp) as mon:
        _ddp_train(ddp, opt, mon, rank)
    return Outcome(_differs_across_ranks(list(model[4].parameters())) is bug, mon.findings)


def learning_rate_of_the_rank(rank: int, bug: bool) -> Outcome:
    """The learning rate scaled by a per-rank value (a rank-local batch size, say)."""
    torch.manual_seed(0)
    model = mlp()
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05 * (1 + rank if bug else 1))
    with hs.Monitor(ddp) as mon:
        _ddp_train(ddp, opt, mon, rank)
    return Outcome(_differs_across_ranks(list(model.parameters())) is bug, mon.findings)


def checkpoint_loaded_on_rank_0_after_wrapping(rank: int, bug: bool) -> Outcome:
    """Each rank initialises with its own seed; DDP's initial broadcast makes them equal. The
    checkpoint is loaded on rank 0 only, after that broadcast: the ranks start apart."""
    torch.manual_seed(100)
    checkpoint = mlp().state_dict()
    torch.manual_seed(rank)
    model = mlp()
    if not bug and rank == 0:
        model.load_state_dict(checkpoint)  # before wrapping: the broadcast spreads it
    ddp = nn.parallel.DistributedDataParallel(model)
    if bug and rank == 0:
        model.load_state_dict(checkpoint)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    with hs.Monitor(ddp) as mon:
        _ddp_train(ddp, opt, mon, rank)
    return Outcome(_differs_across_ranks(list(model.parameters())) is bug, mon.findings)


def replicated_norm_clipped_per_rank(rank: int, bug: bool) -> Outcome:
    """Tensor parallelism: clip_grad_norm_ on each rank's own parameters measures a
    rank-local norm, so the replicated LayerNorm is scaled by another factor on each rank.
    The fix: one global norm (the shards' squares summed over the ranks)."""
    model = TensorParallel(rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with hs.Monitor(model, replicated="norm") as mon:
        for s in range(STEPS):
            x, y = batch(s)  # every rank sees the same batch
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            if bug:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            else:
                shards = [p for p in model.parameters() if getattr(p, "tensor_model_parallel", 0)]
                sq = torch.stack([p.grad.pow(2).sum() for p in shards]).sum()
                dist.all_reduce(sq)
                total = (sq + sum(p.grad.pow(2).sum() for p in model.norm.parameters())).sqrt()
                torch.nn.utils.clip_grads_with_norm_(model.parameters(), 0.05, total)
            opt.step()
            mon.step()
    return Outcome(_differs_across_ranks(list(model.norm.parameters())) is bug, mon.findings)


@dataclass
class DistCase:
    name: str
    run: Callable[[int, bool], Outcome]
    kind: str = "replica_divergence"
    trigger: int = 0


DIST_CASES = [
    DistCase("DDP: head replaced after wrapping", head_replaced_after_wrapping),
    DistCase("DDP: learning rate differs per rank", learning_rate_of_the_rank),
    DistCase(
        "DDP: checkpoint loaded on rank 0 after wrap", checkpoint_loaded_on_rank_0_after_wrapping
    ),
    DistCase("TP: replicated norm clipped per rank", replicated_norm_clipped_per_rank),
]


def _dist_worker(rank: int, tmp: str) -> None:
    torch.set_num_threads(1)
    store = f"file://{tmp}/store"
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=WORLD)
    out = []
    try:
        for case in DIST_CASES:
            for bug in (True, False):
                got = case.run(rank, bug)
                findings = [(f.kind, f.module, f.step, f.value, f.message) for f in got.findings]
                out.append({"proved": got.proved, "findings": findings})
    finally:
        Path(tmp, f"rank{rank}.json").write_text(json.dumps(out))
        dist.destroy_process_group()


def run_dist_cases() -> list[tuple[Outcome, Outcome]]:
    """Every multi-process case on 2 gloo ranks (one spawn); rank 0's outcomes, the proof
    holding on both ranks."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_dist_worker, args=(tmp,), nprocs=WORLD, start_method="spawn")
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(WORLD)]
    outcomes = []
    for i in range(0, len(ranks[0]), 2):
        pair = []
        for j in (i, i + 1):
            proved = all(r[j]["proved"] for r in ranks)
            pair.append(Outcome(proved, [hs.Finding(*f) for f in ranks[0][j]["findings"]]))
        outcomes.append(tuple(pair))
    return outcomes


def run_cases(multi: bool = True) -> None:
    rows = [(c.name, c.kind, c.trigger, c.run(True), c.run(False)) for c in CASES]
    if multi:
        for case, (bug, twin) in zip(DIST_CASES, run_dist_cases(), strict=True):
            rows.append((case.name + " (2 ranks)", case.kind, case.trigger, bug, twin))
    detected = timely = alarms = proved = 0
    print(f"{'case':56} {'kind':18} trigger found  twin")
    for name, kind, trigger, bug, twin in rows:
        ok = bug.proved and twin.proved
        proved += ok
        hits = [f.step for f in bug.findings if f.kind == kind]
        false = [f for f in twin.findings if f.kind in KINDS]
        first = min(hits) if hits else None
        detected += ok and first is not None
        timely += ok and first is not None and first - trigger <= 2
        alarms += len(false)
        twin_text = "silent" if not false else ", ".join(f"{f.kind}@{f.module}" for f in false)
        print(
            f"{name:56} {kind:18} {trigger:>7} {first!s:>5}  {twin_text}"
            + ("" if ok else "  (NOT PROVED by plain torch)")
        )
    n = len(rows)
    print(
        f"\n{proved}/{n} proved with plain torch; detected {detected}/{n}, within 2 steps of "
        f"the trigger {timely}/{n}; false alarms on the {n} fixed twins: {alarms}"
    )


# -- cost ---------------------------------------------------------------------------------------
def _timed_step(model: nn.Module, opt: torch.optim.Optimizer, mon: hs.Monitor, ids) -> float:
    t = time.perf_counter()
    opt.zero_grad()
    model(ids, labels=ids).loss.backward()
    opt.step()
    mon.step()
    return time.perf_counter() - t


def cost(pairs: int) -> None:
    """Paired, interleaved: a Monitor with the checks against one without them."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_monitor import without_checks

    from models import gpt2, token_ids

    torch.manual_seed(0)
    for every in (10, 1):
        base = gpt2(n_layer=4, n_embd=128, n_head=4, n_positions=64).train()
        models = {"with": base, "without": copy.deepcopy(base)}
        mons, opts = {}, {}
        for key, model in models.items():
            opts[key] = torch.optim.AdamW(model.parameters(), lr=1e-4)
            if key == "with":
                mons[key] = hs.Monitor(model, every=every)
            else:
                mons[key] = without_checks(model, every=every).mon  # an hs.Monitor inside
        ids = token_ids(8, 64)
        totals = {"with": 0.0, "without": 0.0}

        def step(key: str) -> float:
            return _timed_step(models[key], opts[key], mons[key], ids)  # noqa: B023

        for _ in range(3):
            step("with"), step("without")
        for i in range(pairs * every if every > 1 else pairs):
            order = ("with", "without") if i % 2 else ("without", "with")
            for key in order:
                totals[key] += step(key)
        for mon in mons.values():
            mon.close()
        ratio = totals["with"] / totals["without"]
        print(
            f"GPT-2 4x128, 8x64 tokens, every={every}: checks add {ratio - 1:+.4f}x "
            f"({totals['without'] * 1e3 / (pairs * every if every > 1 else pairs):.1f} ms/step "
            "without)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=30, help="timed pairs for the cost")
    parser.add_argument("--no-cost", action="store_true", help="only the cases")
    parser.add_argument(
        "--no-multi", action="store_true", help="skip the 2-rank cases (one spawn, ~15 s)"
    )
    args = parser.parse_args()
    run_cases(multi=not args.no_multi)
    if not args.no_cost:
        print()
        cost(args.pairs)


if __name__ == "__main__":
    main()
