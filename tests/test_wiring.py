"""A Monitor's hooks and the parts they feed, built and connected once (``_monitor/_wiring/_build.py``):
the parts share the step's state (the listener hears the script's backward and clip, the
optimizer hooks read and check the gradients into it), ``close()`` takes every hook and the
listener away, and a build that fails half-way leaves nothing behind."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hookscope as hs
from hookscope._monitor._wiring import _calls
from hookscope.testing import assert_no_hooks, internals, step_state
from models import ResNet, images

LISTENED = (torch.autograd, "backward")  # one of the functions the listener wraps


def listeners() -> list[object]:
    return [ref() for ref in _calls._listeners]


def test_the_parts_share_the_steps_state_the_listener_and_optimizer_hooks_write() -> None:
    model = ResNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with hs.Monitor(model, every=1) as mon:  # no optimizer yet: every module is checked
        state = step_state(mon)
        assert state.sampled and not state.light
        loss = nn.functional.cross_entropy(model(images()), torch.arange(4))
        loss.backward()
        assert state.heard.loss.item() == loss.item() and state.backward_ran and state.hooks_ran
        norm = nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        assert state.heard.clip_norms[0][0] == norm  # heard, and the gradients read before
        read = {f.param for f in state.trail.flags if f.phase == "param"}
        assert read == {n for n, _ in model.named_parameters()}
        opt.step()
        assert state.updates == 1 and internals(mon).optimizers == [opt]
        assert len({f.param for f in state.trail.flags if f.phase == "param"}) == len(read)
        host = internals(mon).host_values()
        assert ("act", "conv1") in host and ("grad", "fc") in host
        assert step_state(mon) is state  # one state for every part until the step ends


def test_close_takes_every_hook_and_the_listener_away() -> None:
    model = ResNet()
    original, before = getattr(*LISTENED), listeners()
    mon = hs.Monitor(model, frozen="conv1")  # a check with hooks of its own too
    assert len(listeners()) == len(before) + 1 and getattr(*LISTENED) is not original
    mon.close()
    assert_no_hooks(model)
    assert listeners() == before
    assert getattr(*LISTENED) is original
    mon.close()  # twice is fine


def test_a_build_that_fails_half_way_leaves_nothing_behind() -> None:
    model = ResNet()
    before = listeners()
    with pytest.raises(hs.SelectionError):
        hs.Monitor(model, frozen="no_such_module")  # after the module and optimizer hooks
    assert_no_hooks(model)
    assert listeners() == before
