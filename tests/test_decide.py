"""The non-finite decision (``_monitor/_nonfinite/_decide.py``), driven with the step state a Monitor's
hooks wrote: a replay with every module flagged where only the model's edges were, that
leaves the step's own state alone; every module flagged from then on where no replay finds
the value; the weights an update made non-finite, once the step's update went ahead."""

from __future__ import annotations

import math

import torch
from torch import nn

import hookscope as hs
from hookscope._diagnose import Finding
from hookscope._monitor._nonfinite._decide import nonfinite_error
from hookscope.testing import internals, step_state
from models import ResNet, images


def passes(model: nn.Module, x: torch.Tensor) -> None:
    nn.functional.cross_entropy(model(x), torch.arange(len(x)) % 10).backward()


def test_a_nan_in_the_batch_is_named_by_a_flagged_replay_that_leaves_the_step_alone() -> None:
    model = ResNet()
    x = images()
    x[1, 0, 3, 3] = math.nan
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # adopted: its check replays the step
    with hs.Monitor(model, every=None, optimizer=opt) as mon:
        passes(model, x)
        state, decision = step_state(mon), internals(mon).decision
        assert state.light  # unsampled: only the model's edges were flagged
        host = state.buf.to_host()  # (the output's gradient is flagged as it moves)
        flags = list(state.trail.flags)
        assert {f.module for f in flags if f.phase != "param"} == {""}
        finding = decision.localised(state, host, 0, [])
        # The replay's hooks wrote into a state of their own.
        assert step_state(mon) is state and state.trail.flags == flags
    # The edges alone say "the model's inputs"; the flagged replay names the first module.
    assert (finding.module, finding.phase, finding.op) == ("conv1", "forward", None)
    assert "inputs of 'conv1' were already NaN/Inf" in finding.message
    assert decision.light  # the replay found it: unsampled steps stay light


def test_a_nan_no_replay_reproduces_makes_every_module_flagged_from_then_on() -> None:
    model = ResNet()
    faults = [0, 1]  # the steps whose forward a NaN hits once, replays of them not

    def spoil(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
        if faults and faults[0] == mon.step_count:
            faults.pop(0)
            return torch.cat([output[:, :1], torch.full_like(output[:, 1:], math.nan)], 1)
        return None

    model.fc.register_forward_hook(spoil)  # before the Monitor's own hooks
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with hs.Monitor(model, every=None, optimizer=opt) as mon:
        named = []
        for _ in range(2):
            model(images())[:, 0].sum().backward()  # the loss never sees the NaN
            light = step_state(mon).light
            opt.zero_grad()  # no update: the check runs at step()
            found = [f for f in mon.step() if f.kind == "nonfinite"]
            named.append((light, found[0].module if found else None))
        assert internals(mon).decision.light is False and step_state(mon).light is False
    # Step 0: only the edges were flagged, and no replay finds the value: the model's output
    # is named. Step 1: every module is flagged, and the module is named.
    assert named == [(True, ""), (False, "fc")]


def test_a_nan_made_at_weights_restored_before_the_update_is_not_blamed_on_the_loss() -> None:
    # Sharpness-aware minimisation: the second pass runs at weights moved in place and put
    # back before optimizer.step(), where the check replays the step: the replay's forward
    # stays finite while the recorded gradient from the loss is NaN. That replay has not seen
    # the step, and must not say "the gradient from the loss was NaN, the forward finite".
    model = ResNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    named = []
    with hs.Monitor(model, every=None, optimizer=opt, on_nonfinite="skip") as mon:
        for _ in range(2):
            model(images()).logsumexp(1).sum().backward()
            saved = model.fc.weight.detach().clone()
            with torch.no_grad():
                model.fc.weight.mul_(math.inf)  # a perturbation that overflowed
            opt.zero_grad()
            model(images()).logsumexp(1).sum().backward()
            with torch.no_grad():
                model.fc.weight.copy_(saved)
            light = step_state(mon).light
            opt.step()  # skipped: the weights stay finite
            found = [f for f in mon.step() if f.kind == "nonfinite"]
            named.append((light, [(f.module, f.phase, f.op) for f in found]))
    assert named[0] == (True, [("", "forward", None)])
    assert "did not reproduce it" in mon.findings[0].message
    assert "gradient reaching" not in mon.findings[0].message
    # from then on every module is flagged, in the step itself: fc's own output went bad
    assert named[1] == (False, [("fc", "forward", None)])


def test_without_an_optimizer_every_module_is_checked() -> None:
    # A hand-written update runs before step(): a replay there would meet the new weights.
    model = ResNet()
    with hs.Monitor(model, every=None) as mon:
        for _ in range(2):
            passes(model, images())
            with torch.no_grad():
                for p in model.parameters():
                    p -= 1e-3 * p.grad
                    p.grad = None
            assert not step_state(mon).light
            assert {"conv1", "fc"} <= {f.module for f in step_state(mon).trail.flags}
            mon.step()


def test_the_weights_an_update_made_non_finite_are_found_after_it() -> None:
    model = ResNet()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with hs.Monitor(model, every=1) as mon:
        passes(model, images())
        model.fc.weight.grad[0, 0] = math.nan
        opt.step()  # found before the update (on_nonfinite="log"), which still runs
        state = step_state(mon)
        assert (state.nonfinite.module, state.nonfinite.phase) == ("fc", "backward")
        assert state.early == [state.nonfinite] == mon.findings
        found, poisoned = internals(mon).decision.at_step(
            state, state.buf.to_host(), None, 0, [], None
        )
    assert found == []  # made before the update, and reported there
    assert (poisoned.module, poisoned.phase, poisoned.step) == ("fc", "update", 0)
    assert "1 of 32 parameters hold NaN/Inf ('fc.weight')" in poisoned.message


def test_the_error_carries_every_field_of_its_finding() -> None:
    finding = Finding(
        "nonfinite",
        "layer1.0.conv2",
        3,
        math.inf,
        "forward: aten.exp in 'layer1.0.conv2' made Inf from finite inputs",
        phase="forward",
        op="aten.exp",
        source="model.py:42",
        rank=1,
    )
    error = nonfinite_error(finding)
    assert isinstance(error, hs.NonFiniteError)
    assert (error.module, error.step, error.phase, error.op, error.source, error.rank) == (
        "layer1.0.conv2",
        3,
        "forward",
        "aten.exp",
        "model.py:42",
        1,
    )
    assert str(error).startswith(finding.message)
