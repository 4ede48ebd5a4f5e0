"""``Monitor(precision=...)``, GradScaler's scale and skipped steps, on real training steps."""

from __future__ import annotations

import copy
import math
import re
from pathlib import Path

import pytest
import torch
from torch import nn

import hookscope as hs
from hookscope._log import PRECISION_STATS
from hookscope._monitor._probes._precision import DTYPES

DOC = (Path(__file__).parents[1] / "docs" / "log-format.md").read_text()


class Scale(nn.Module):
    """``x * w`` elementwise (``w`` ones): its output is its input, value for value."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


def wide(n: int, seed: int) -> torch.Tensor:
    """Values of both signs with magnitudes from 2^-140 to 2^18, a few zeros, and each
    dtype's tie (half its smallest subnormal: rounds to zero) and the float32 just above it
    (does not)."""
    g = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (n,), generator=g) * 2 - 1
    x = signs * torch.exp2(torch.empty(n).uniform_(-140, 18, generator=g))
    x[:8] = 0.0
    ties = []
    for dtype in DTYPES.values():
        info = torch.finfo(dtype)
        tie = torch.tensor(info.smallest_normal * info.eps / 2)
        ties += [tie, torch.nextafter(tie, torch.tensor(1.0)), -tie]
    x[8 : 8 + len(ties)] = torch.stack(ties)
    return x


def truth(x: torch.Tensor) -> dict:
    """The same statistics in plain torch: a cast to each dtype, and its ``finfo``."""
    a = x.abs()
    nonzero = a[a > 0]
    return {
        "amax": a.max().item(),
        "dynamic_range": math.log2(nonzero.max().item() / nonzero.min().item()),
        "underflow": {
            name: ((x.to(dtype) == 0) & (x != 0)).sum().item() / x.numel()
            for name, dtype in DTYPES.items()
        },
        "overflow": {
            name: (a > torch.finfo(dtype).max).sum().item() / x.numel()
            for name, dtype in DTYPES.items()
        },
    }


def test_fractions_amax_and_range_equal_plain_torch_on_the_same_tensors() -> None:
    n = 4000
    model = nn.Sequential(Scale(n))
    x, g = wide(n, 0), wide(n, 1)
    with hs.Monitor(model, every=1, sample=None, precision=tuple(DTYPES)) as mon:
        (model(x[None]) * g).sum().backward()  # the gradient of the output is g
        mon.step()
    got = mon.records[1]["precision"]["0"]
    for kind, values in (("act", x), ("grad", g)):
        want = truth(values)
        assert got[kind]["amax"] == pytest.approx(want["amax"], rel=1e-6)
        assert got[kind]["dynamic_range"] == pytest.approx(want["dynamic_range"], rel=1e-6)
        for stat in ("underflow", "overflow"):
            assert got[kind][stat] == pytest.approx(want[stat], abs=1e-12), (kind, stat)
    assert 0.01 < got["act"]["underflow"]["bf16"] < got["act"]["underflow"]["fp16"]
    assert got["act"]["overflow"]["bf16"] == 0 < got["act"]["overflow"]["fp16"]
    assert mon.findings == []  # one step: shorter than the findings' span


def test_a_sample_reads_its_part_and_sums_over_calls() -> None:
    """With ``sample``, the figures are those of the sampled elements; two calls add up."""
    n = 4000
    model = nn.Sequential(Scale(n))
    x = wide(n, 2)
    with hs.Monitor(model, every=1, sample=512, precision=("fp16",)) as mon:
        model(x[None]).sum().backward()
        model(x[None]).sum().backward()
        mon.step()
    act = mon.records[1]["precision"]["0"]["act"]
    assert act["underflow"]["fp16"] == pytest.approx(truth(x)["underflow"]["fp16"], abs=0.06)
    assert mon.records[1]["act"]["0"]["sampled"] == 2 * 512


def test_unknown_dtype_names_are_refused_with_the_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"'fp32'.*bf16, fp16, fp8_e4m3, fp8_e5m2"):
        hs.Monitor(nn.Linear(2, 2), precision=("bf16", "fp32"))


def test_the_statistics_are_documented_and_logged() -> None:
    line = next(line for line in DOC.splitlines() if line.startswith("- `precision`:"))
    listed = re.findall(r"`(\w+)`", line.split("—")[0])
    assert [s for s in listed if s in PRECISION_STATS] == list(PRECISION_STATS)
    for name in DTYPES:
        assert f'"{name}"' in line
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    with hs.Monitor(model, every=2, precision=("bf16",)) as mon:
        for _ in range(2):
            model(torch.randn(16, 4)).sum().backward()
            mon.step()
    sampled, unsampled = mon.records[1], mon.records[2]
    assert set(sampled["precision"]) == {"0", "1", "2"} and "precision" not in unsampled
    assert set(sampled["precision"]["1"]["grad"]) == set(PRECISION_STATS)
    assert mon.records[0]["settings"]["precision"] == ["bf16"]


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1)
    )


def train(model: nn.Module, mon: hs.Monitor, steps: int, loss_factor: float = 1.0) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x = torch.randn(32, 8, generator=g)
        loss = model(x).pow(2).mean() * loss_factor
        loss.backward()
        opt.step()
        opt.zero_grad()
        mon.step()


def kinds(mon: hs.Monitor) -> list[tuple[str, str]]:
    return [(f.kind, f.module) for f in mon.findings]


def test_a_healthy_run_is_silent() -> None:
    model = mlp()
    with hs.Monitor(model, every=5, precision=("bf16", "fp16")) as mon:
        train(model, mon, 60)
    assert mon.findings == []


def test_gradients_too_small_for_fp16_are_an_underflow_finding_not_in_bf16() -> None:
    """A loss scaled by 1e-12 (float16 without a loss scale would lose it all): the output
    gradients would round to zero in float16, not in bfloat16 (float32's range)."""
    model = mlp()
    with hs.Monitor(model, every=5, precision=("bf16", "fp16")) as mon:
        train(model, mon, 40, loss_factor=1e-12)
    found = [f for f in mon.findings if f.kind == "precision_underflow"]
    assert found and all("fp16" in f.message and "gradient" in f.message for f in found)
    assert found[0].step == 20  # two observations at least precision_span (20) apart
    assert found[0].value > 0.1
    assert "precision_overflow" not in {k for k, _ in kinds(mon)}


class Huge(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 1e5


def test_activations_beyond_fp16_are_an_overflow_finding_at_that_module() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), Huge(), nn.Tanh(), nn.Linear(32, 1))
    with hs.Monitor(model, every=5, precision=("bf16", "fp16")) as mon:
        train(model, mon, 30)
    overflow = [f for f in mon.findings if f.kind == "precision_overflow"]
    assert [f.module for f in overflow] == ["1"]
    assert "fp16" in overflow[0].message and "output values" in overflow[0].message
    at = next(r for r in mon.records if r["type"] == "step" and r["step"] == overflow[0].step)
    assert overflow[0].value == at["precision"]["1"]["act"]["overflow"]["fp16"] > 0.1


# -- GradScaler ------------------------------------------------------------------------------
def test_grad_scaler_scale_and_unscaled_gradients_are_logged() -> None:
    """``scaler.step`` without ``unscale_`` (no clipping): the gradient norms logged, per
    parameter and of the module outputs, are the loss's own, as a run without the scaler
    computes them; the scale that multiplied each step's loss is ``grad_scale``."""
    model = mlp()
    ref = copy.deepcopy(model)
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(3))
    out = {}
    ref[2].register_forward_hook(lambda m, i, o: out.update(o=o))
    out_ref = ref(x)
    out["o"].retain_grad()
    out_ref.pow(2).mean().backward()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    with hs.Monitor(model, every=1, precision=("fp16",)) as mon:
        loss = model(x).pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        mon.step()
    record = mon.records[1]
    assert record["scalars"]["grad_scale"] == 2.0**16
    for name, p in ref.named_parameters():
        assert record["param"][name]["grad_norm"] == pytest.approx(p.grad.norm().item(), rel=1e-5)
    want = out["o"].grad
    assert record["grad"]["2"]["norm"] == pytest.approx(want.norm().item(), rel=1e-5)
    assert record["grad"]["2"]["absmax"] == pytest.approx(want.abs().max().item(), rel=1e-5)
    # precision judges the gradient as backpropagated: the scaled one
    assert record["precision"]["2"]["grad"]["amax"] == pytest.approx(
        want.abs().max().item() * 2.0**16, rel=1e-5
    )


def test_a_step_grad_scaler_skips_is_one_event_with_its_scale() -> None:
    """The scaler skips the first step (an Inf gradient), before any optimizer has stepped
    the model: one ``skipped_step`` event with the scale, and the next steps log the
    halved scale."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    with hs.Monitor(model, every=1) as mon:
        for step in range(3):
            loss = model(torch.randn(16, 8)).pow(2).mean()
            scaler.scale(loss).backward()
            if step == 0:
                model[0].weight.grad[0, 0] = float("inf")
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            mon.step()
    events = [r for r in mon.records if r["type"] == "event"]
    assert [(e["kind"], e["step"]) for e in events] == [("skipped_step", 0)]
    assert "GradScaler" in events[0]["message"] and "1024" in events[0]["message"]
    scales = [r["scalars"]["grad_scale"] for r in mon.records if r["type"] == "step"]
    assert scales == [1024.0, 512.0, 512.0]


def test_without_a_grad_scaler_there_is_no_grad_scale() -> None:
    model = mlp()
    with hs.Monitor(model, every=1) as mon:
        train(model, mon, 2)
    assert all("grad_scale" not in r["scalars"] for r in mon.records if r["type"] == "step")


def test_a_scale_too_large_skips_every_step_with_one_event_each_and_halves() -> None:
    """A real overflow: ``loss * scale`` is Inf in float32, so every gradient is; the scaler
    skips each step and halves its scale, and each step has one event with its own scale."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**127)
    with hs.Monitor(model, every=1) as mon:
        for _ in range(3):
            loss = model(torch.randn(16, 8)).pow(2).mean() * 100
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            mon.step()
    events = [r for r in mon.records if r["type"] == "event"]
    assert [(e["kind"], e["step"]) for e in events] == [("skipped_step", s) for s in range(3)]
    scales = [r["scalars"]["grad_scale"] for r in mon.records if r["type"] == "step"]
    assert scales == [2.0**127, 2.0**126, 2.0**125]
    assert all(f"{s:g}" in e["message"] for e, s in zip(events, scales, strict=True))
    # the scaler's own business: the overflow is said in the event, and is no finding
    assert mon.findings == []
    assert "First: backward:" in events[0]["message"]


def test_tensorboard_gets_the_precision_and_attention_statistics(tmp_path: Path) -> None:
    """The values TensorBoard shows are the logged ones, under documented tags."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from models import gpt2, token_ids

    model = gpt2(2).train()
    sink = hs.TensorBoardSink(tmp_path)
    with hs.Monitor(model, every=1, precision=("bf16", "fp8_e4m3"), sinks=[sink]) as mon:
        model(token_ids(), labels=token_ids()).loss.backward()
        mon.step()
    record = mon.records[1]
    events = EventAccumulator(str(tmp_path)).Reload()
    tags = set(events.Tags()["scalars"])

    def logged(tag: str) -> float:
        return events.Scalars(tag)[0].value

    name = "transformer.h.1.mlp.c_fc"
    stats = record["precision"][name]
    assert logged(f"precision/{name}/act/amax") == pytest.approx(stats["act"]["amax"], rel=1e-6)
    fraction = stats["grad"]["underflow"]["fp8_e4m3"]
    assert logged(f"precision/{name}/grad/underflow/fp8_e4m3") == pytest.approx(fraction)
    attention = "transformer.h.0.attn"
    assert logged(f"attn/{attention}/logit_max") == pytest.approx(
        record["attn"][attention]["logit_max"], rel=1e-6
    )
    assert {t for t in tags if t.startswith("attn/")} == {
        f"attn/{n}/logit_max" for n in record["attn"]
    }
