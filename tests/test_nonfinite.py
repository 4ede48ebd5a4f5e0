"""Non-finite values: caught before the optimizer writes them into the weights."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import hookscope as hs
from hookscope.testing import assert_no_hooks


class Risky(nn.Module):
    """log(|x| + eps): finite while eps > 0; a NaN source when eps < 0."""

    def __init__(self) -> None:
        super().__init__()
        self.eps = 1.0

    def forward(self, x):
        return torch.log(x.abs() + self.eps)


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), Risky(), nn.Linear(16, 4))


def states(model, opt):
    return copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())


def assert_same(a, b):
    (ma, oa), (mb, ob) = a, b
    assert all(torch.equal(ma[k], mb[k]) for k in ma)
    for p, state in oa["state"].items():
        for key, value in state.items():
            other = ob["state"][p][key]
            assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other


def train_until_poisoned(model, opt, mon, bad_step=2, steps=4, record=None):
    x, y = torch.randn(32, 8), torch.randint(0, 4, (32,))
    for step in range(steps):
        model[2].eps = -1.0 if step == bad_step else 1.0
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        if record is not None and step == bad_step:
            record.append(states(model, opt))
        opt.step()
        if record is not None and step == bad_step:
            record.append(states(model, opt))
        mon.step(loss=loss)


@pytest.mark.parametrize("make", [torch.optim.SGD, torch.optim.Adam])
def test_raise_comes_from_optimizer_step_before_the_update(make) -> None:
    model = net()
    opt = make(model.parameters(), lr=1e-2)
    x, y = torch.randn(32, 8), torch.randint(0, 4, (32,))
    with hs.Monitor(model, every=1, on_nonfinite="raise") as mon:
        for step in range(2):
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            mon.step()
        model[2].eps = -1.0
        nn.functional.cross_entropy(model(x), y).backward()
        before = states(model, opt)
        with pytest.raises(hs.NonFiniteError) as info:
            opt.step()
        assert_same(before, states(model, opt))
    assert (info.value.module, info.value.step, info.value.phase) == ("2", 2, "forward")
    assert [(f.kind, f.module, f.step) for f in mon.findings] == [("nonfinite", "2", 2)]
    assert mon.records[-1]["type"] == "finding"
    assert_no_hooks(model)


@pytest.mark.parametrize("make", [torch.optim.SGD, torch.optim.AdamW])
def test_skip_leaves_weights_and_optimizer_state_alone_and_training_goes_on(make) -> None:
    model = net()
    opt = make(model.parameters(), lr=1e-2)
    around = []
    with hs.Monitor(model, every=1, on_nonfinite="skip") as mon:
        train_until_poisoned(model, opt, mon, bad_step=2, steps=5, record=around)
    assert_same(around[0], around[1])
    events = [r for r in mon.records if r["type"] == "event"]
    assert [(e["kind"], e["step"]) for e in events] == [("skipped_step", 2)]
    assert "'2'" in events[0]["message"]
    assert all(torch.isfinite(p).all() for p in model.parameters())
    steps = [r for r in mon.records if r["type"] == "step"]
    assert steps[3]["param"]["0.weight"]["update_ratio"] > 0  # training went on
    assert [(f.kind, f.step) for f in mon.findings] == [("nonfinite", 2)]


def test_log_lets_the_nan_reach_the_weights_and_says_so_next_step() -> None:
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with hs.Monitor(model, every=1) as mon:
        train_until_poisoned(model, opt, mon, bad_step=2, steps=4)
    assert [(f.module, f.step) for f in mon.findings] == [("2", 2), ("0", 3)]


def test_skip_with_a_closure_optimizer() -> None:
    model = net()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=3)
    x, y = torch.randn(32, 8), torch.randint(0, 4, (32,))

    def closure():
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        return loss

    with hs.Monitor(model, every=1, on_nonfinite="skip") as mon:
        opt.step(closure)
        mon.step()
        model[2].eps = -1.0
        before = copy.deepcopy(model.state_dict())
        opt.step(closure)
        mon.step()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert [(f.kind, f.step) for f in mon.findings] == [("nonfinite", 1)]
