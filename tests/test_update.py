"""Around each optimizer update (``_monitor/_wiring/_update.py``): the final gradients are read once
(early, before a clip, or just before the update), the non-finite check runs before the
optimizer changes anything (raise: nothing changed; skip: weights, optimizer state and
BatchNorm running statistics as before the step), and the update itself is measured."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import hookscope as hs
from hookscope.testing import internals, step_state
from models import ResNet, images


def backward(model: nn.Module, *, nan: bool = False) -> None:
    nn.functional.cross_entropy(model(images()), torch.arange(4)).backward()
    if nan:
        model.fc.weight.grad[0, 0] = math.nan  # after backward: only the update can see it


def test_gradients_read_before_a_clip_are_not_read_again_before_the_update() -> None:
    model = ResNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with hs.Monitor(model, every=None) as mon:
        for _ in range(2):
            backward(model)
            mon.read_gradients()
            read = len(step_state(mon).trail.flags)
            assert read > 0
            opt.step()  # the pre-update read is skipped: no second set of flags
            assert len(step_state(mon).trail.flags) == read
            opt.zero_grad()
            mon.step()  # a new step reads again


def test_before_any_optimizer_every_parameter_is_read_once() -> None:
    model = ResNet()
    with hs.Monitor(model, every=None) as mon:
        backward(model)
        mon.read_gradients()
        params = {f.param for f in step_state(mon).trail.flags if f.phase == "param"}
        assert params == {n for n, p in model.named_parameters()}
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        read = len(step_state(mon).trail.flags)
        opt.step()  # adopted now, and its gradients were read already
        assert len(step_state(mon).trail.flags) == read
        assert internals(mon).optimizers == [opt]


def test_a_healthy_check_lets_the_update_run_and_carries_the_loss_with_its_transfer() -> None:
    model = ResNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with hs.Monitor(model, every=2) as mon:
        mon.step(loss=0.0)  # step 1: unsampled (an empty step() warns)
        backward(model)
        before = model.fc.weight.detach().clone()
        opt.step()
        state = step_state(mon)
        assert state.nonfinite is None and state.updates == 1 and state.skipped == 0
        assert set(state.carried) == {"loss"}  # moved before the update: not again at step()
        assert not torch.equal(model.fc.weight, before)
        assert mon.step() == []


def test_raise_stops_before_the_update_with_nothing_changed() -> None:
    model = ResNet()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    with hs.Monitor(model, every=None, on_nonfinite="raise") as mon:
        backward(model, nan=True)
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
        with pytest.raises(hs.NonFiniteError) as raised:
            opt.step()
        assert raised.value.module == "fc" and raised.value.step == 0
        assert all(torch.equal(weights[n], p) for n, p in model.named_parameters())
        assert not opt.state  # the optimizer never ran
        assert step_state(mon).early and step_state(mon).early[0].kind == "nonfinite"


def test_skip_leaves_weights_optimizer_state_and_running_statistics_as_before() -> None:
    model = ResNet().train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with hs.Monitor(model, every=1, on_nonfinite="skip") as mon:
        buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
        backward(model, nan=True)
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
        grad = model.fc.weight.grad
        opt.step()
        assert model.fc.weight.grad is grad  # hidden from the optimizer, then given back
        assert all(torch.equal(weights[n], p) for n, p in model.named_parameters())
        assert all(torch.equal(buffers[n], b) for n, b in model.named_buffers())
        assert not opt.state
        state = step_state(mon)
        assert (state.updates, state.skipped) == (1, 1)
        found = mon.step()
    events = [r for r in mon.records if r["type"] == "event" and r["kind"] == "skipped_step"]
    assert len(events) == 1
    assert events[0]["message"].startswith("step 0: skipped the update of SGD")
    assert [f.kind for f in found] == ["nonfinite"]


def test_a_sampled_update_is_measured_and_an_unsampled_one_is_not() -> None:
    model = ResNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with hs.Monitor(model, every=2) as mon:
        for _ in range(2):
            backward(model)
            opt.step()
            opt.zero_grad()
            mon.step()
    sampled, unsampled = [r for r in mon.records if r["type"] == "step"]
    assert sampled["param"]["fc.weight"]["update_ratio"] > 0
    assert "param" not in unsampled and unsampled["sampled"] is False
