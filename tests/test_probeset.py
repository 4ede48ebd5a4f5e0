"""Every probe of a Monitor as one collection (``_monitor/_wiring/_probeset.py``): hooked onto a real
model, a sampled step's buffer holds what each probe measured, the layout of the step's
collective has an entry of the right size for each of those keys, the record is filled from
the host values (output gradients divided by the loss scale), and the BatchNorm running
statistics are saved at the step's first call for a skipped update to restore."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

from hookscope._diagnose import Thresholds
from hookscope._hooks import HookSet
from hookscope._log import StepRecord
from hookscope._monitor._step._buffer import StepBuffer
from hookscope._monitor._step._state import StepState
from hookscope._monitor._wiring._modules import ModuleHooks
from hookscope._monitor._wiring._probeset import ProbeSet
from hookscope.testing import assert_no_hooks
from models import ResNet, gpt2, images, token_ids

NOT_PROBES = ("flag", "scalar")  # the non-finite trail's and the step's scalars


def leaves(model: nn.Module) -> dict[str, nn.Module]:
    return {n: m for n, m in model.named_modules() if next(m.children(), None) is None}


@pytest.fixture
def hooks() -> Iterator[HookSet]:
    hooks = HookSet("test")
    yield hooks
    hooks.remove()


def attached(
    model: nn.Module, hooks: HookSet, *, skip: bool = False, **options: object
) -> tuple[ProbeSet, ModuleHooks]:
    options = {"sample": 256, "bins": None, "precision": (), "world": 1, **options}
    probes = ProbeSet(model, leaves(model), Thresholds(), **options)  # type: ignore[arg-type]
    module_hooks = probes.attach(hooks, model, keep_outputs=False, skip=skip)
    module_hooks.now = StepState(sampled=True, light=False)
    return probes, module_hooks


def sampled_step(model: nn.Module, hooks: HookSet) -> tuple[ProbeSet, StepState]:
    """One sampled training step of ``model`` (GPT-2), collected and settled."""
    probes, module_hooks = attached(model, hooks, precision=("bf16",))
    model(token_ids(), labels=token_ids()).loss.backward()
    state = module_hooks.now
    probes.collect(state.buf)
    probes.acts.collect(state.buf)  # the transfer settles it first (``_transfer.py``)
    return probes, state


def test_a_sampled_step_has_every_probes_keys_in_the_layout_with_their_sizes(
    hooks: HookSet,
) -> None:
    torch.manual_seed(0)
    model = gpt2().train()
    probes, state = sampled_step(model, hooks)
    keys = state.buf.pending_keys()
    written = {k: state.buf.value(k) for k in keys if k[0] not in NOT_PROBES}
    assert {"act", "act_top", "grad", "param", "attn", "prec"} <= {k[0] for k in written}
    assert probes.attention is not None and probes.attention.modules  # found and hooked
    sizes = {e.key: e.size for e in probes.layout(0)}
    missing = [k for k in written if k not in sizes]
    assert not missing
    assert {k: v.numel() for k, v in written.items()} == {k: sizes[k] for k in written}


def test_read_fills_the_record_and_divides_output_gradients_by_the_loss_scale(
    hooks: HookSet,
) -> None:
    torch.manual_seed(0)
    model = gpt2().train()
    probes, state = sampled_step(model, hooks)
    host = state.buf.to_host()
    plain, scaled = StepRecord(0, 0.0, True, True), StepRecord(0, 0.0, True, True)
    probes.read(host, plain)
    scaled.scalars["grad_scale"] = 4.0
    probes.read(host, scaled)
    assert set(plain.act) == set(plain.grad) and "transformer.h.0.mlp.c_fc" in plain.act
    assert set(plain.param) == set(probes.params.params)
    assert set(plain.attn) == set(probes.attention.modules)
    assert set(plain.precision) and plain.bn == {}
    for name, stats in plain.grad.items():
        assert scaled.grad[name]["norm"] == pytest.approx(stats["norm"] / 4), name


def test_reset_forgets_the_last_steps_updates_and_output_gradients(hooks: HookSet) -> None:
    torch.manual_seed(0)
    model = gpt2().train()
    probes, _ = attached(model, hooks)
    names = list(probes.params.params)
    model(token_ids(), labels=token_ids()).loss.backward()
    probes.params.before_update(names)
    probes.params.after_update(StepBuffer(), names)  # every weight norm read after its update

    def norms_collected() -> set[str]:
        buf = StepBuffer()
        probes.collect(buf)
        return {k[1] for k in buf.pending_keys() if k[0] == "param" and k[2] == "norm"}

    assert norms_collected() == set()  # read around the update already: not again
    assert probes.grads.order
    probes.grads.unscale(2.0)
    probes.reset()
    assert norms_collected() == set(names)
    assert not probes.grads.order and probes.grads.loss_scale == 1


def test_a_skipped_update_can_restore_the_running_statistics_of_its_forward(
    hooks: HookSet,
) -> None:
    torch.manual_seed(0)
    model = ResNet().train()
    probes, _ = attached(model, hooks, skip=True)
    before = {n: b.clone() for n, b in model.named_buffers()}
    model(images())
    bn = dict(model.named_buffers())
    assert any(not torch.equal(before[n], bn[n]) for n in before)  # the forward moved them
    probes.bns.restore_running()
    assert all(torch.equal(before[n], bn[n]) for n in before)


def test_without_skip_nothing_is_saved_for_a_restore(hooks: HookSet) -> None:
    model = ResNet().train()
    probes, _ = attached(model, hooks, skip=False)
    model(images())
    moved = {n: b.clone() for n, b in model.named_buffers()}
    probes.bns.restore_running()
    assert all(torch.equal(moved[n], b) for n, b in model.named_buffers())


def test_shapes_and_sharding_of_a_plain_model_and_hooks_that_go_with_their_set() -> None:
    model = ResNet()
    hooks = HookSet("test")
    probes, _ = attached(model, hooks)
    trainable = {n: list(p.shape) for n, p in model.named_parameters()}
    assert probes.shapes == trainable and probes.sharded is False
    hooks.remove()
    assert_no_hooks(model)
