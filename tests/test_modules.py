"""The Monitor's hooks on the model's modules (``_monitor/_wiring/_modules.py``): what one step's
module calls write into the step's state, which calls count towards the statistics, and the
state a replay's hooks write into instead."""

from __future__ import annotations

import pytest
import torch

import hookscope as hs
from hookscope.testing import internals, step_state
from models import ResNet, gpt2, images, token_ids


def test_a_sampled_gpt2_step_records_each_output_that_needs_a_gradient_and_gets_it() -> None:
    model = gpt2().train()
    with hs.Monitor(model, every=1) as mon:
        hooks = internals(mon).module_hooks
        model(token_ids(), labels=token_ids()).loss.backward()
        state = step_state(mon)
        assert state.sampled and state.hooks_ran and state.backward_ran
        # Embeddings, norms, projections, dropouts: every watched module made an output
        # needing a gradient, but the attention dropouts, which SDPA attention never calls.
        uncalled = {n for n in mon.modules if n.endswith("attn.attn_dropout")}
        assert len(uncalled) == 2 and set(state.made) == set(mon.modules) - uncalled
        assert state.got_grad == set(state.made)  # the loss reached every one of them
        assert hooks.grad_calls >= len(state.made)
        names = [f.module for f in state.trail.flags if f.phase == "forward"]
        assert names[:3] == ["transformer.wte", "transformer.wpe", "transformer.drop"]
        assert names.index("transformer.h.0.ln_1") < names.index("transformer.h.1.ln_1")


def test_an_unsampled_step_flags_only_the_models_edges_and_counts_their_gradient() -> None:
    model = ResNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # adopted: its check replays the step
    with hs.Monitor(model, every=None, optimizer=opt) as mon:
        hooks = internals(mon).module_hooks
        model(images()).square().mean().backward()
        state = step_state(mon)
        assert hooks.grad_calls == 1  # the one gradient that reached the model's output
        # that gradient is flagged with the parameters' before the update, in the same
        # fused norm (no hook of its own on the output)
        assert [f.phase for f in state.trail.flags] == ["input", "forward"]
        opt.step()
    assert state.light and not state.made and not state.got_grad
    phases = [(f.module, f.phase) for f in state.trail.flags]
    assert phases[:2] == [("", "input"), ("", "forward")] and phases[-1] == ("", "backward")
    assert state.trail.flags[-1].edge and {p for _, p in phases[2:-1]} == {"param"}


def test_a_sampled_step_after_an_optimizer_is_adopted_reads_only_samples_of_modules() -> None:
    # Once an optimizer is adopted, its pre-update check localises by a replay of the step:
    # module outputs and gradients are placed in the trail (who fed whom) but not reduced
    # whole; the model's edges and the parameters' gradients are. Before, every one is.
    model = ResNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with hs.Monitor(model, every=1) as mon:
        checked = []
        for _ in range(2):
            model(images()).square().mean().backward()
            state = step_state(mon)
            opt.step()  # (the gradient at the model's output is flagged before it)
            flags = [f for f in state.trail.flags if f.phase not in ("param", "input")]
            checked.append({(f.module, f.phase) for f in flags if f.checked})
            opt.zero_grad()
            mon.step()
    before, after = checked
    assert {(n, "forward") for n in ("conv1", "layer1.0.conv1", "fc")} <= before
    assert after == {("", "forward"), ("", "backward")}
    assert state.light and state.sampled
    assert ("conv1", "bn1") in state.graph().edges  # who fed whom: still known
    assert [f.module for f in state.trail.flags if f.phase == "forward"][:2] == ["conv1", "bn1"]
    assert mon.records[-1]["act"]["conv1"]  # and the statistics of every module


def test_a_call_counts_towards_the_statistics_on_sampled_training_steps_only() -> None:
    model = ResNet()
    with hs.Monitor(model, every=2) as mon:
        hooks = internals(mon).module_hooks
        assert hooks.measures(model.conv1)
        with internals(mon).replaying():  # a replay of ours
            assert not hooks.measures(model.conv1)
        model.eval()
        assert not hooks.measures(model.conv1)
        model.train()
        mon.step(loss=0.0)  # step 1: not sampled (a step with no pass: its loss given)
        assert not hooks.measures(model.conv1)


def test_a_flagged_replay_writes_into_its_own_state_and_hands_the_steps_back() -> None:
    model = ResNet()
    with hs.Monitor(model, every=None) as mon:
        hooks = internals(mon).module_hooks
        state = step_state(mon)
        with pytest.raises(RuntimeError, match="mid-replay"):
            with hooks.flagging() as replay:
                assert step_state(mon) is replay and replay.flagging and not replay.light
                with internals(mon).replaying(), torch.no_grad():  # as under the op tracer:
                    model(images())  # the hooks still write
                raise RuntimeError("mid-replay")
        assert step_state(mon) is state and not state.trail.flags
    modules = [f.module for f in replay.trail.flags if f.phase == "forward"]  # every one
    assert modules[:2] == ["conv1", "bn1"] and set(modules) <= set(mon.modules)
    assert len(set(modules)) > 10
