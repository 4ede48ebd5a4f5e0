"""Several processes: 2 gloo ranks on CPU, one spawn for all scenarios (a spawn costs ~10 s).

Oracles: one process (``sync=False``, so nothing is combined) running the same model on the
concatenated batch; the unsharded model for FSDP2; a counting wrapper around
``dist.all_reduce``. Each rank runs every scenario and writes what it saw to a JSON file;
the assertions run here, in the test process.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

import hookscope as hs

WORLD = 2
pytestmark = pytest.mark.slow


class Log(nn.Module):
    def forward(self, x):
        return torch.log(x)


def mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 3)
    )


def batches(steps: int, per_rank: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (
            torch.randn(WORLD * per_rank, 6, generator=g),
            torch.randn(WORLD * per_rank, 3, generator=g),
        )
        for _ in range(steps)
    ]


def steps_of(mon: hs.Monitor) -> list[dict]:
    return [r for r in mon.records if r["type"] == "step"]


def mse(model, x, y):
    return nn.functional.mse_loss(model(x), y)


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def train(model, data, mon, rank=None, loss_of=mse, optimizer=sgd):
    """Train on ``data``; with ``rank``, that rank's half of each batch (DDP averages)."""
    opt = optimizer(model.parameters())
    for x, y in data:
        if rank is not None:
            x, y = x.chunk(WORLD)[rank], y.chunk(WORLD)[rank]
        loss = loss_of(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        mon.step(loss=loss)


def reference(base: nn.Module, data: list, **train_kw) -> list[dict]:
    """The oracle: one process on the whole batch (sync=False: nothing is combined)."""
    model = copy.deepcopy(base)
    with hs.Monitor(model, every=1, sample=None, sync=False) as ref:
        train(model, data, ref, **train_kw)
    return steps_of(ref)


@contextlib.contextmanager
def counting_all_reduce() -> Iterator[list[int]]:
    """Counts the calls of ``dist.all_reduce`` (DDP's own reductions do not go through it)."""
    calls: list[int] = []
    real = dist.all_reduce

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    dist.all_reduce = counting
    try:
        yield calls
    finally:
        dist.all_reduce = real


def scenario_ddp(rank: int, out: dict, tmp: Path) -> None:
    torch.manual_seed(0)
    base = mlp()
    data = batches(3)
    ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    with hs.Monitor(ddp, every=1, sample=None, log_dir=tmp / "ddp") as mon:
        with counting_all_reduce() as calls:
            train(ddp, data, mon, rank=rank)
    out["ddp"] = {
        "steps": steps_of(mon),
        "ref": reference(base, data),
        "collectives": len(calls),
        "modules": sorted(mon.modules),
        "findings": len(mon.findings),
    }


def scenario_gpt2(rank: int, out: dict, tmp: Path) -> None:
    """A real architecture: GPT-2 (tied embeddings, layer norms, attention) under DDP."""
    import models

    torch.manual_seed(0)
    base = models.gpt2(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0).train()
    ids = [
        torch.randint(0, 100, (WORLD * 2, 16), generator=torch.Generator().manual_seed(s))
        for s in range(2)
    ]
    data = [(batch, batch) for batch in ids]
    kw = dict(
        loss_of=lambda model, x, y: model(x, labels=y).loss,
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
    )
    ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    with hs.Monitor(ddp, every=1, sample=None) as mon:
        train(ddp, data, mon, rank=rank, **kw)
    out["gpt2"] = {"steps": steps_of(mon), "ref": reference(base, data, **kw)}


def scenario_nan(rank: int, out: dict, tmp: Path) -> None:
    """A NaN made on rank 1 only (log of a negative number)."""
    for mode in ("log", "raise", "skip"):
        torch.manual_seed(0)
        model = nn.Sequential(Log(), nn.Linear(6, 8), nn.Linear(8, 3))
        ddp = nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        seen = {"mode": mode, "raised_at": None}
        with hs.Monitor(ddp, every=1, on_nonfinite=mode) as mon:
            for step in range(3):
                x = torch.rand(4, 6) + 1
                if step == 1 and rank == 1:
                    x = -x  # rank 1's log turns NaN
                before = model[1].weight.detach().clone()
                try:
                    loss = ddp(x).sum()
                    loss.backward()
                    opt.step()
                    if step == 1:
                        seen["unchanged"] = bool(torch.equal(before, model[1].weight))
                    opt.zero_grad()
                    mon.step(loss=loss)
                except hs.NonFiniteError as e:
                    seen["raised_at"] = step
                    seen["error"] = {"module": e.module, "rank": e.rank, "op": e.op}
                    seen["unchanged"] = bool(torch.equal(before, model[1].weight))
                    break
        seen["findings"] = [
            {"kind": f.kind, "module": f.module, "rank": f.rank, "op": f.op, "step": f.step}
            for f in mon.findings
        ]
        out[f"nan_{mode}"] = seen


def scenario_fsdp(rank: int, out: dict, tmp: Path) -> None:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    base = mlp()
    data = batches(2)
    model = copy.deepcopy(base)
    for layer in model:
        if any(p.requires_grad for p in layer.parameters()):
            fully_shard(layer)
    fully_shard(model)
    with hs.Monitor(model, every=1, sample=None, log_dir=tmp / "fsdp") as mon:
        with counting_all_reduce() as calls:
            train(model, data, mon, rank=rank)
    out["fsdp"] = {
        "steps": steps_of(mon),
        "ref": reference(base, data),
        "collectives": len(calls),
        "sharded": type(next(model.parameters())).__name__,
    }


def scenario_mismatch(rank: int, out: dict, tmp: Path) -> None:
    """Ranks that build different Monitors get an error, not a hang; sync=False keeps one
    log per rank."""
    try:
        hs.Monitor(mlp(), every=1 if rank == 0 else 5).close()
        out["mismatch"] = None
    except hs.HookscopeError as e:
        out["mismatch"] = str(e)
    model = mlp()
    with hs.Monitor(model, every=1, log_dir=tmp / "local", sync=False) as mon:
        model(torch.randn(4, 6) * (rank + 1)).sum().backward()
        mon.step()
    out["local_mean"] = steps_of(mon)[0]["act"]["0"]["mean"]


class SumAcrossRanks(torch.autograd.Function):
    """A row-parallel layer's reduction: summed over the ranks, its gradient passed through."""

    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


class TensorParallel(nn.Module):
    """Column- then row-parallel Linear (each rank its own half, marked
    ``tensor_model_parallel``), then a LayerNorm every rank holds whole."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        torch.manual_seed(10 + rank)
        self.col, self.row = nn.Linear(6, 8), nn.Linear(8, 3, bias=False)
        for p in (*self.col.parameters(), *self.row.parameters()):
            p.tensor_model_parallel = True
        torch.manual_seed(0)
        self.norm = nn.LayerNorm(3)

    def forward(self, x):
        return self.norm(SumAcrossRanks.apply(self.row(torch.relu(self.col(x)))))


def differs_across_ranks(params) -> bool:
    """The oracle: these tensors, gathered from every rank, are not all equal."""
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    gathered = [torch.empty_like(flat) for _ in range(WORLD)]
    dist.all_gather(gathered, flat)
    return any(not torch.equal(gathered[0], g) for g in gathered[1:])


def findings_of(mon: hs.Monitor) -> list[dict]:
    return [
        {"kind": f.kind, "module": f.module, "step": f.step, "message": f.message}
        for f in mon.findings
    ]


def scenario_replicas(rank: int, out: dict, tmp: Path) -> None:
    """Replicas that drift apart, each with its fixed twin: a checkpoint loaded on rank 0
    after DDP's initial broadcast; a replicated LayerNorm clipped by each rank's own norm."""
    data = batches(3)
    for bug in (True, False):
        torch.manual_seed(100)
        checkpoint = mlp().state_dict()
        torch.manual_seed(rank)  # each rank its own initialisation; DDP broadcasts rank 0's
        model = mlp()
        if rank == 0 and not bug:
            model.load_state_dict(checkpoint)
        ddp = nn.parallel.DistributedDataParallel(model)
        if rank == 0 and bug:
            model.load_state_dict(checkpoint)
        with hs.Monitor(ddp, every=2) as mon:
            train(ddp, data, mon, rank=rank)
        out[f"checkpoint_{bug}"] = {
            "differs": differs_across_ranks(model.parameters()),
            "findings": findings_of(mon),
        }
    for bug in (True, False):
        model = TensorParallel(rank)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with hs.Monitor(model, every=2, replicated="norm") as mon:
            for x, y in data:  # every rank sees the whole batch
                mse(model, x, y).backward()
                if bug:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
                else:  # one global norm: the shards' squares summed over the ranks
                    shards = [*model.col.parameters(), *model.row.parameters()]
                    sq = torch.stack([p.grad.pow(2).sum() for p in shards]).sum()
                    dist.all_reduce(sq)
                    sq = sq + sum(p.grad.pow(2).sum() for p in model.norm.parameters())
                    torch.nn.utils.clip_grads_with_norm_(model.parameters(), 0.05, sq.sqrt())
                opt.step()
                opt.zero_grad()
                mon.step()
        out[f"tp_clip_{bug}"] = {
            "differs": differs_across_ranks(model.norm.parameters()),
            "findings": findings_of(mon),
        }


def scenario_clip_on_one_rank(rank: int, out: dict, tmp: Path) -> None:
    """clip_grad_norm_ on rank 0 only: the Monitor's collective says so (it used to abort)."""
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(mlp())
    opt = sgd(ddp.parameters())
    out["clip_on_one_rank"] = None
    with hs.Monitor(ddp, every=1) as mon:
        for x, y in batches(2):
            mse(ddp, x, y).backward()
            if rank == 0:
                torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            try:
                mon.step()
            except hs.HookscopeError as e:
                out["clip_on_one_rank"] = str(e)
                break


def scenario_rank0_only(rank: int, out: dict, tmp: Path) -> None:
    """The mistake that hangs wandb.watch (wandb#7423): a Monitor built on rank 0 only.
    (Last: the timed-out collective stays pending on rank 0.)"""
    from hookscope._monitor._step import _dist

    _dist.HANDSHAKE_TIMEOUT = 3.0
    out["rank0_only"] = None
    if rank == 0:
        try:
            hs.Monitor(mlp()).close()
        except hs.HookscopeError as e:
            out["rank0_only"] = str(e)
    else:
        time.sleep(5)


def scenario_compiled(rank: int, out: dict, tmp: Path) -> None:
    """A model compiled (``aot_eager``) after the Monitor was attached, under 2 ranks: the
    compiled graph's statistics are this rank's own, and the Monitor says so."""
    import warnings

    torch.manual_seed(0)
    model = mlp()
    data = batches(2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with hs.Monitor(model, every=1, sample=None) as mon:
            compiled = torch.compile(model, backend="aot_eager")
            for x, y in data:
                x, y = x[rank * 8 : (rank + 1) * 8], y[rank * 8 : (rank + 1) * 8]
                with torch.no_grad():  # plain torch, no hook: the first Linear's output
                    first = torch.nn.functional.linear(x, model[0].weight, model[0].bias)
                mse(compiled, x, y).backward()
                mon.step()
                out.setdefault("compiled_first", []).append(first.abs().max().item())
    out["compiled"] = {
        "steps": steps_of(mon),
        "warnings": [str(w.message) for w in caught if "compiled" in str(w.message)],
    }


def worker(rank: int, tmp: str) -> None:
    tmp = Path(tmp)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=WORLD)
    out: dict = {}
    try:
        scenarios = (scenario_ddp, scenario_gpt2, scenario_nan, scenario_fsdp, scenario_mismatch)
        scenarios += (scenario_replicas, scenario_clip_on_one_rank, scenario_compiled)
        for scenario in (*scenarios, scenario_rank0_only):
            scenario(rank, out, tmp)
    finally:
        (tmp / f"rank{rank}.json").write_text(json.dumps(out, default=str))
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("dist")
    ctx = mp.start_processes(
        worker, args=(str(tmp),), nprocs=WORLD, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + 240
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("the 2-rank run hung (killed after 240 s)")
    outs = [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(WORLD)]
    for out in outs:
        out["tmp"] = tmp
    return outs


def close(a, b, rel=1e-5):
    if a is None or b is None:
        return a is b
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-7)


def test_ddp_statistics_on_rank_0_equal_one_process_on_the_whole_batch(ranks):
    got, ref = ranks[0]["ddp"]["steps"], ranks[0]["ddp"]["ref"]
    assert len(got) == len(ref) == 3
    for g, r in zip(got, ref, strict=True):
        for name, stats in r["act"].items():
            for stat in ("mean", "std", "min", "max", "zero_frac", "numel", "sampled"):
                assert close(g["act"][name][stat], stats[stat]), (name, stat)
        for name, stats in r["grad"].items():
            for stat in ("norm", "rms", "absmax", "numel"):
                assert close(g["grad"][name][stat], stats[stat]), (name, stat)
        for name, stats in r["param"].items():
            for stat in ("norm", "grad_norm", "update_ratio"):
                assert close(g["param"][name].get(stat), stats.get(stat)), (name, stat)
        assert close(g["scalars"]["loss"], r["scalars"]["loss"])


# The position embedding's output (1, T, C) does not grow with the batch: every rank computes
# the same one, so its element count adds up over the ranks, and the norm of its gradient
# (a sum over the batch, not a concatenation) is not the root-sum-square of the ranks' norms.
# Documented in docs/log-format.md.
BROADCAST = "transformer.wpe"


def test_ddp_gpt2_statistics_equal_one_process_on_the_whole_batch(ranks):
    got, ref = ranks[0]["gpt2"]["steps"], ranks[0]["gpt2"]["ref"]
    assert len(got) == len(ref) == 2 and len(ref[0]["act"]) >= 18
    for g, r in zip(got, ref, strict=True):
        assert g["act"].keys() == r["act"].keys() and g["param"].keys() == r["param"].keys()
        for name, stats in r["act"].items():
            for stat in ("mean", "std", "min", "max", "numel"):
                want = stats[stat]
                if name == BROADCAST and stat == "numel":
                    want *= WORLD
                assert close(g["act"][name][stat], want, rel=1e-4), (name, stat)
        for name, stats in r["grad"].items():
            if name != BROADCAST:
                assert close(g["grad"][name]["norm"], stats["norm"], rel=1e-4), name
        for name, stats in r["param"].items():
            for stat in ("norm", "grad_norm", "update_ratio"):
                assert close(g["param"][name].get(stat), stats.get(stat), rel=1e-4), (name, stat)
        assert close(g["scalars"]["loss"], r["scalars"]["loss"], rel=1e-5)


def test_ddp_names_modules_as_the_wrapped_model_and_every_rank_agrees(ranks):
    assert ranks[0]["ddp"]["modules"] == ["0", "1", "2", "3", "4"]
    # rank 1 holds the same global records, though only rank 0 writes the log
    assert ranks[1]["ddp"]["steps"][2]["param"] == ranks[0]["ddp"]["steps"][2]["param"]
    assert ranks[1]["ddp"]["steps"][2]["act"] == ranks[0]["ddp"]["steps"][2]["act"]


def test_exactly_one_collective_per_step(ranks):
    assert ranks[0]["ddp"]["collectives"] == 3
    assert ranks[0]["fsdp"]["collectives"] == 2


def test_only_rank_0_writes_the_log(ranks):
    logs = sorted((ranks[0]["tmp"] / "ddp").glob("**/hookscope.jsonl"))
    assert len(logs) == 1 and logs[0].parent.name == "ddp"
    records = hs.read_log(logs[0])
    assert records[0]["settings"]["world"] == 2 and records[0]["settings"]["sync"] is True
    assert len([r for r in records if r["type"] == "step"]) == 3


def test_a_nan_on_one_rank_is_found_on_every_rank_and_names_it(ranks):
    for r in range(WORLD):
        # the first one; later steps find the NaN weights the logged step left behind
        findings = [f for f in ranks[r]["nan_log"]["findings"] if f["kind"] == "nonfinite"]
        assert findings[:1] == [
            {"kind": "nonfinite", "module": "0", "rank": 1, "op": "aten.log", "step": 1}
        ], r


def test_raise_stops_every_rank_at_the_same_step_before_the_update(ranks):
    for r in range(WORLD):
        seen = ranks[r]["nan_raise"]
        assert seen["raised_at"] == 1
        assert seen["error"] == {"module": "0", "rank": 1, "op": "aten.log"}
        assert seen["unchanged"] is True


def test_skip_skips_the_update_on_every_rank_and_training_goes_on(ranks):
    for r in range(WORLD):
        seen = ranks[r]["nan_skip"]
        assert seen["raised_at"] is None and seen["unchanged"] is True
        nonfinite = [f for f in seen["findings"] if f["kind"] == "nonfinite"]
        assert nonfinite == [
            {"kind": "nonfinite", "module": "0", "rank": 1, "op": "aten.log", "step": 1}
        ]


def test_fsdp2_parameter_norms_and_update_ratios_equal_the_unsharded_model(ranks):
    fsdp = ranks[0]["fsdp"]
    assert fsdp["sharded"] == "DTensor"
    for g, r in zip(fsdp["steps"], fsdp["ref"], strict=True):
        assert set(g["param"]) == set(r["param"])
        for name, stats in r["param"].items():
            for stat in ("norm", "grad_norm", "update_ratio"):
                assert close(g["param"][name].get(stat), stats.get(stat)), (name, stat)
        for name, stats in r["act"].items():
            assert close(g["act"][name]["mean"], stats["mean"]), name


def test_ranks_that_build_different_monitors_get_an_error_not_a_hang(ranks):
    for r in range(WORLD):
        assert "different model or with other settings" in ranks[r]["mismatch"]


def test_a_monitor_built_on_rank_0_only_fails_with_a_clear_error_not_a_hang(ranks):
    assert "the other ranks did not build a Monitor within 3 s" in ranks[0]["rank0_only"]
    assert "sync=False" in ranks[0]["rank0_only"]


def test_sync_false_keeps_one_log_per_rank_with_local_statistics(ranks):
    tmp = ranks[0]["tmp"]
    assert sorted(p.parent.name for p in (tmp / "local").glob("*/hookscope.jsonl")) == [
        "rank0",
        "rank1",
    ]
    assert hs.read_log(tmp / "local" / "rank1")[0]["settings"]["rank"] == 1
    assert ranks[0]["local_mean"] != ranks[1]["local_mean"]


@pytest.mark.parametrize("case", ["checkpoint", "tp_clip"])
def test_replicas_that_drift_apart_are_found_at_the_first_sampled_step_naming_them(ranks, case):
    for r in range(WORLD):
        bug, fixed = ranks[r][f"{case}_True"], ranks[r][f"{case}_False"]
        assert bug["differs"] and not fixed["differs"]  # the oracle: plain torch
        replica = [f for f in bug["findings"] if f["kind"] == "replica_divergence"]
        assert replica and {f["step"] for f in replica} == {0}, replica
        if case == "tp_clip":  # only the replicated LayerNorm, never the shards
            assert {f["module"] for f in replica} == {"norm"}
            assert {f["message"].split("'")[1] for f in replica} <= {"norm.weight", "norm.bias"}
        else:
            assert {f["module"] for f in replica} == {"0", "2", "4"}
        assert all("ranks [1] hold other values than rank 0" in f["message"] for f in replica)
        assert [f for f in fixed["findings"] if f["kind"] == "replica_divergence"] == []


def test_a_clip_on_one_rank_only_is_a_clear_error_on_every_rank_not_an_abort(ranks):
    for r in range(WORLD):
        error = ranks[r]["clip_on_one_rank"]
        assert error is not None and "clip_grad_norm_ ran on 1 of the 2 ranks" in error
        assert "Clip on every rank" in error


def test_a_compiled_model_under_ranks_logs_its_own_statistics_and_says_so(ranks):
    """Not silent: the compiled graph's activation statistics reach the log (this rank's
    own batch, not combined), with a warning that says so."""
    for rank, out in enumerate(ranks):
        steps = out["compiled"]["steps"]
        assert len(steps) == 2 and all("0" in s["act"] for s in steps), rank
        assert [s["act"]["0"]["absmax"] for s in steps] == pytest.approx(
            out["compiled_first"], rel=1e-5
        )  # this rank's micro-batch, through the step's weights
        (message,) = out["compiled"]["warnings"]
        assert "this rank's own (not combined across ranks" in message
