"""A Monitor's hooks and the parts they feed, built and connected once (``_monitor/_wiring/_build.py``):
the parts share the step's state (the listener hears the script's backward and clip, the
optimizer hooks read and check the gradients into it), ``close()`` takes every hook and the
listener away, and a build that fails half-way leaves nothing behind."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from hookscope import SelectionError
from hookscope._diagnose import Diagnosis, Finding, Thresholds
from hookscope._monitor._output import Output
from hookscope._monitor._probes._set import ProbeSet
from hookscope._monitor._step._state import StepState
from hookscope._monitor._warnings import Warnings
from hookscope._monitor._wiring import _calls
from hookscope._monitor._wiring._build import Wiring
from hookscope.testing import assert_no_hooks
from models import ResNet, images

LISTENED = (torch.autograd, "backward")  # one of the functions the listener wraps


def wire(model: nn.Module, *, frozen: str | None = None) -> Wiring:
    modules = {n: m for n, m in model.named_modules() if next(m.children(), None) is None}
    thresholds = Thresholds()
    probes = ProbeSet(model, modules, thresholds, sample=256, bins=None, precision=(), world=1)
    diagnosis = Diagnosis(thresholds, probes.shapes, {})
    out = Output(
        [], diagnosis, rank=None, coll=None, record_dir=None, record_on=(), bundle=no_bundle
    )
    return Wiring(
        model,
        modules,
        probes,
        diagnosis,
        out,
        coll=None,
        world=1,
        warnings=Warnings(),
        on_nonfinite="log",
        keep_outputs=False,
        step=lambda: 0,
        frozen=frozen,
        replicated=None,
    )


def no_bundle(finding: Finding, before_update: bool) -> Path:
    raise AssertionError("no finding kind records a bundle here")


def listeners() -> list[object]:
    return [ref() for ref in _calls._listeners]


def test_the_parts_share_the_steps_state_the_listener_and_optimizer_hooks_write() -> None:
    model = ResNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    wiring = wire(model)
    try:
        state = wiring.module_hooks.now = StepState(sampled=True, light=False)
        loss = nn.functional.cross_entropy(model(images()), torch.arange(4))
        loss.backward()
        assert state.heard.loss.item() == loss.item() and state.backward_ran and state.hooks_ran
        norm = nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        assert state.heard.clip_norms[0][0] == norm  # heard, and the gradients read before
        read = {f.param for f in state.trail.flags if f.phase == "param"}
        assert read == {n for n, _ in model.named_parameters()}
        opt.step()
        assert state.updates == 1 and [r() for r in wiring.updates.optim.adopted] == [opt]
        assert len({f.param for f in state.trail.flags if f.phase == "param"}) == len(read)
        host = wiring.transfer.to_host(state)
        assert ("act", "conv1") in host and ("grad", "fc") in host
    finally:
        wiring.close()


def test_close_takes_every_hook_and_the_listener_away() -> None:
    model = ResNet()
    original = getattr(*LISTENED)
    wiring = wire(model, frozen="conv1")  # a check with hooks of its own too
    assert wiring._listener in listeners() and getattr(*LISTENED) is not original
    wiring.close()
    assert_no_hooks(model)
    assert wiring._listener not in listeners()
    assert getattr(*LISTENED) is original
    wiring.close()  # twice is fine


def test_a_build_that_fails_half_way_leaves_nothing_behind() -> None:
    model = ResNet()
    before = listeners()
    with pytest.raises(SelectionError):
        wire(model, frozen="no_such_module")  # after the module and optimizer hooks went on
    assert_no_hooks(model)
    assert listeners() == before
