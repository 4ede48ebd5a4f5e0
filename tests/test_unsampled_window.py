"""The rolling window on unsampled steps: each step keeps the numbers its one transfer
brought, and a spike's window sums them per group as plain torch does, for every step of it
(one optimizer: one reading of the gradients; two: a reading each)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import hookscope as hs
from hookscope._monitor._probes._signals import WEIGHT_SAMPLE

AT = 40  # the step whose targets are made 30x larger


def model() -> nn.Sequential:
    torch.manual_seed(0)
    # 5,120 weights in the first layer: its weight sample is every other one
    return nn.Sequential(
        nn.Linear(80, 64), nn.Tanh(), nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 1)
    )


def sample_l1(p: torch.Tensor) -> float:
    w = p.detach().reshape(-1)
    return w[:: max(1, math.ceil(w.numel() / WEIGHT_SAMPLE))].abs().sum().item()


def run(optimizers: int) -> tuple[hs.Monitor, list[dict[str, float]], list[dict[str, float]]]:
    """SGD on a fixed linear target, targets 30x larger at ``AT``; per step, the groups' L2
    gradient norms and weight-sample L1 norms measured by hand before the update."""
    net = model()
    params = list(net.parameters())
    halves = [params[:2], params[2:]] if optimizers == 2 else [params]
    opts = [torch.optim.SGD(h, lr=0.02) for h in halves]
    g = torch.Generator().manual_seed(1)
    w = torch.randn(80, 1, generator=g)
    grads, weights = [], []
    with hs.Monitor(net, every=None) as mon:
        for step in range(AT + 1):
            x = torch.randn(64, 80, generator=g)
            y = x @ w / 10 + 0.1 * torch.randn(64, 1, generator=g)
            if step == AT:
                y = y * 30
            loss = (net(x) - y).pow(2).mean()
            loss.backward()
            squares: dict[str, float] = {}
            l1: dict[str, float] = {}
            for name, p in net.named_parameters():
                group = name.split(".")[0]
                squares[group] = squares.get(group, 0.0) + p.grad.double().square().sum().item()
                l1[group] = l1.get(group, 0.0) + sample_l1(p)
            grads.append({k: math.sqrt(v) for k, v in squares.items()})
            weights.append(l1)
            for opt in opts:
                opt.step()
                opt.zero_grad()
            mon.step()
    return mon, grads, weights


@pytest.mark.parametrize("optimizers", [1, 2])
def test_every_row_of_a_spikes_window_holds_the_groups_norms_of_its_step(optimizers) -> None:
    mon, grads, weights = run(optimizers)
    (spike,) = [f for f in mon.findings if f.kind == "loss_spike"]
    assert spike.step == AT
    (window,) = [r for r in mon.records if r["type"] == "window"]
    assert window["steps"][-1] == AT and len(window["steps"]) > 1
    assert set(window["groups"]) == set(window["weights"]) == {"0", "2", "4"}
    for group in ("0", "2", "4"):
        for i, step in enumerate(window["steps"]):
            assert window["groups"][group][i] == pytest.approx(grads[step][group], rel=1e-5)
            assert window["weights"][group][i] == pytest.approx(weights[step][group], rel=1e-5)


def test_an_unsampled_steps_record_holds_its_scalars_only() -> None:
    mon, _, _ = run(1)
    steps = [r for r in mon.records if r["type"] == "step"]
    assert [r["step"] for r in steps] == list(range(AT + 1))
    for record in steps:
        assert list(record) == ["step", "time", "sampled", "training", "scalars", "type"]
        assert record["sampled"] is False and record["training"] is True
        assert set(record["scalars"]) == {"loss", "lr"} and record["scalars"]["lr"] == 0.02
