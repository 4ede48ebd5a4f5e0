"""Large-model training signals: the rolling window and ``loss_spike`` on real training runs."""

from __future__ import annotations

import itertools
import json
import math
import re
import statistics
from dataclasses import fields
from pathlib import Path

import pytest
import torch
from torch import nn

import hookscope as hs
from hookscope._diagnose import Thresholds
from hookscope._log import Window
from hookscope._monitor._probes._signals import (
    MAD_TO_STD,
    WEIGHT_SAMPLE,
    LossTail,
    Rolling,
    WeightNorms,
    group_of,
)
from hookscope._monitor._step._buffer import StepBuffer

DOC = (Path(__file__).parents[1] / "docs" / "log-format.md").read_text()
AT = 40  # the step a fault is injected at


def test_parameters_group_by_block_else_by_module() -> None:
    assert group_of("transformer.h.3.attn.c_attn.weight") == "transformer.h.3"
    assert group_of("encoder.layers.0.mlp.0.weight") == "encoder.layers.0"
    assert group_of("transformer.wte.weight") == "transformer.wte"
    assert group_of("0.bias") == "0"
    assert group_of("cls_token") == ""


def test_the_rolling_range_is_the_median_plus_k_noise_units_in_logs() -> None:
    g = torch.Generator().manual_seed(0)
    history = (torch.linspace(3.0, 2.0, 50) + torch.rand(50, generator=g) * 0.2).tolist()
    logs = [math.log(v) for v in history]
    median = statistics.median(logs)
    changes = [b - a for a, b in itertools.pairwise(logs)]
    mid = statistics.median(changes)
    noise = MAD_TO_STD * statistics.median([abs(c - mid) for c in changes]) / math.sqrt(2)
    rule = Rolling(k=6.0, rel=0.0, min_history=20)
    assert rule.score(history, math.exp(median + 12 * noise)) == pytest.approx(2.0)
    assert rule.score(history, math.exp(median)) == pytest.approx(0.0, abs=1e-9)
    assert rule.score(history[:19], 100.0) is None  # too little history
    # the floor: at least ``rel`` above the median, whatever the noise
    floor = Rolling(k=6.0, rel=1.0, min_history=20)
    assert floor.score(history, 2 * math.exp(median)) == pytest.approx(1.0)
    # a loss that can be negative is judged in plain units
    shifted = [v - 2.5 for v in history]
    assert rule.score(shifted, statistics.median(shifted)) == pytest.approx(0.0, abs=1e-9)


def test_the_loss_trend_follows_a_fast_descent_and_the_largest_rise_halves() -> None:
    tail = LossTail(window=50, halflife=200)
    losses = [4.0 * 0.8**i for i in range(30)]  # falling by a fifth per step
    for loss in losses[:20]:
        level = tail.trend()
        tail.add(loss, None if level is None else loss - level)
    # the median of the last five carried along the descent: the next loss, not 1.6x above it
    assert tail.trend() == pytest.approx(losses[20])
    assert tail.largest() == pytest.approx(0.0, abs=1e-9)
    tail.add(1.0, 1.0)  # one hard batch
    for _ in range(200):
        tail.add(1.0, 0.0)
    assert max(tail.rises) == 0.0  # gone from the window of 50
    assert tail.largest() == pytest.approx(0.5)  # and remembered, halved after 200 steps


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1)
    )


def train(model: nn.Module, mon: hs.Monitor, steps: int, fault=None) -> list[float]:
    """SGD on a fixed linear target with fresh noisy batches; ``fault(step, phase)`` may change
    the batch (``"batch"``) or the gradients before the update (``"grads"``)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    w = torch.randn(8, 1, generator=g)
    losses = []
    for step in range(steps):
        x = torch.randn(64, 8, generator=g)
        y = x @ w + 0.1 * torch.randn(64, 1, generator=g)
        if fault is not None:
            x = fault(step, "batch", x)
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        if fault is not None:
            fault(step, "grads", model)
        opt.step()
        opt.zero_grad()
        mon.step()
        losses.append(loss.item())
    return losses


def spikes(mon: hs.Monitor) -> list[hs.Finding]:
    return [f for f in mon.findings if f.kind == "loss_spike"]


def test_a_healthy_run_raises_no_spike() -> None:
    model = mlp()
    with hs.Monitor(model, every=None) as mon:
        train(model, mon, 150)
    assert spikes(mon) == []
    assert not [r for r in mon.records if r["type"] == "window"]


def test_a_bad_batch_is_a_spike_with_its_window_in_the_log(tmp_path: Path) -> None:
    def bad_batch(step, phase, x):
        return x * 30 if phase == "batch" and step == AT else x

    model = mlp()
    with hs.Monitor(model, every=None, log_dir=tmp_path) as mon:
        losses = train(model, mon, AT + 5, bad_batch)
    assert losses[AT] > 10 * statistics.median(losses[AT - 10 : AT])  # plain torch saw it too
    (spike,) = spikes(mon)
    assert (spike.step, spike.value) == (AT, pytest.approx(losses[AT]))
    records = hs.read_log(tmp_path)
    (window,) = [r for r in records if r["type"] == "window"]
    lead = Thresholds().spike_lead
    assert window["step"] == AT and window["kind"] == "loss_spike"
    assert window["steps"] == list(range(AT - lead, AT + 1))
    assert window["scalars"]["loss"] == pytest.approx(losses[AT - lead : AT + 1])
    assert set(window["groups"]) == {"0", "2", "4"}
    # The group norms are the L2 norms of the gradients the optimizer applied (the last row).
    assert all(len(v) == lead + 1 for v in window["groups"].values())


def test_the_layer_whose_gradient_rose_first_is_named_with_its_lead() -> None:
    def scaled_grads(step, phase, arg):
        if phase == "grads" and step == AT:
            for p in arg[2].parameters():
                p.grad.mul_(300)
        return arg

    model = mlp()
    with hs.Monitor(model, every=None) as mon:
        losses = train(model, mon, AT + 5, scaled_grads)
    assert losses[AT + 1] > 3 * statistics.median(losses[AT - 10 : AT])  # the update broke it
    (spike,) = spikes(mon)
    assert (spike.step, spike.module) == (AT + 1, "2")
    assert "1 step before the loss (at step 40)" in spike.message


@pytest.mark.parametrize("factor", [10.0, 0.05])
def test_the_block_whose_weights_were_scaled_is_named(factor: float) -> None:
    """Weights scaled between two steps (a bad merge, checkpoint surgery): the loss spikes in
    the same forward, and the gradient that grows most is the one of the layer below it."""

    used = []  # the L1 norm of the weights the spiking forward ran with

    def scaled_weights(step, phase, arg):
        if phase == "batch" and step == AT:
            with torch.no_grad():
                model[2].weight.mul_(factor)
            used.append(sum(p.abs().sum().item() for p in model[2].parameters()))
        return arg

    model = mlp()
    with hs.Monitor(model, every=None) as mon:
        losses = train(model, mon, AT + 3, scaled_weights)
    assert losses[AT] > 3 * statistics.median(losses[AT - 10 : AT])  # plain torch saw it too
    (spike,) = spikes(mon)
    assert (spike.step, spike.module) == (AT, "2")
    window = next(r for r in mon.records if r["type"] == "window")
    assert window["weights"]["2"][-1] == pytest.approx(used[0], rel=1e-5)
    assert "the weights of '2' changed out of their own rolling range first, before this " in (
        spike.message
    )
    assert f"(step {AT - 1}) to" in spike.message


def test_weight_norms_read_the_same_strided_sample_of_each_parameter() -> None:
    """At most WEIGHT_SAMPLE weights per parameter, spread over all of it, summed per group."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(300, 200), nn.Linear(200, 8))  # 60,000 and 1,600 weights
    norms = WeightNorms(dict(model.named_parameters()))
    buf = StepBuffer()
    norms.measure(buf)
    got = norms.read(buf.to_host())
    w = model[0].weight.detach().reshape(-1)
    stride = math.ceil(w.numel() / WEIGHT_SAMPLE)
    assert w[::stride].numel() <= WEIGHT_SAMPLE
    expected = w[::stride].abs().sum() + model[0].bias.detach().abs().sum()
    assert got["0"] == pytest.approx(expected.item(), rel=1e-5)
    small = sum(p.detach().abs().sum() for p in model[1].parameters())  # all of them
    assert got["1"] == pytest.approx(small.item(), rel=1e-5)


def test_weight_norms_follow_updates_moved_weights_and_transposed_ones() -> None:
    """The sample views are made once and kept, so each step must still read the weights of
    that step: updated in place, replaced (``p.data = ...``), or not contiguous."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(300, 200), nn.Linear(200, 8))
    model[1].weight = nn.Parameter(torch.randn(8, 200).t().contiguous().t())  # a transpose
    assert not model[1].weight.is_contiguous()
    norms = WeightNorms(dict(model.named_parameters()))

    def measured() -> dict[str, float]:
        buf = StepBuffer()
        norms.measure(buf)
        return norms.read(buf.to_host())

    def expected(layer: nn.Linear) -> float:
        w = layer.weight.detach().reshape(-1)
        return (
            w[:: math.ceil(w.numel() / WEIGHT_SAMPLE)].abs().sum() + layer.bias.abs().sum()
        ).item()

    for change in (
        lambda: None,
        lambda: model[0].weight.data.mul_(3.0),  # an update, in place
        lambda: setattr(model[0].weight, "data", torch.randn(200, 300)),  # replaced
        lambda: model[1].weight.data.mul_(-2.0),  # in place, not contiguous
    ):
        with torch.no_grad():
            change()
        got = measured()
        assert got["0"] == pytest.approx(expected(model[0]), rel=1e-5)
        assert got["1"] == pytest.approx(expected(model[1]), rel=1e-5)


def test_group_norms_are_the_l2_norms_of_the_gradients_before_the_update() -> None:
    model = mlp()
    seen = {}

    def keep(step, phase, arg):
        if phase == "grads" and step == AT:
            seen.update({n: p.grad.square().sum().item() for n, p in arg.named_parameters()})
        if phase == "batch" and step == AT:
            return arg * 30
        return arg

    with hs.Monitor(model, every=None) as mon:
        train(model, mon, AT + 1, keep)
    (window,) = [r for r in mon.records if r["type"] == "window"]
    for group in ("0", "2", "4"):
        expected = math.sqrt(seen[f"{group}.weight"] + seen[f"{group}.bias"])
        assert window["groups"][group][-1] == pytest.approx(expected, rel=1e-5)


def test_record_on_loss_spike_writes_a_replay_bundle(tmp_path: Path) -> None:
    def bad_batch(step, phase, x):
        return x * 30 if phase == "batch" and step == AT else x

    model = mlp()
    with hs.Monitor(model, every=None, record_dir=tmp_path, record_on=("loss_spike",)) as mon:
        train(model, mon, AT + 2, bad_batch)
    recorded = [r for r in mon.records if r["type"] == "event" and r["kind"] == "recorded"]
    assert len(recorded) == 1 and "loss_spike" in recorded[0]["message"]
    assert any(tmp_path.iterdir())


def test_the_skip_list_names_the_spiking_batch_and_a_resumed_run_that_skips_it_is_calm(
    tmp_path: Path,
) -> None:
    """A data set with one corrupt stretch (the large-run recipe: rewind to a checkpoint
    before the spike and skip the batches that spiked)."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(8, 1, generator=g)
    xs = torch.randn(64 * (AT + 5), 8, generator=g)
    ys = xs @ w + 0.1 * torch.randn(len(xs), 1, generator=g)
    xs[64 * AT : 64 * (AT + 1)] *= 30  # the batch of step AT is corrupt
    skip_file = tmp_path / "skip.json"

    def run(skip: set[int]) -> hs.Monitor:
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        with hs.Monitor(model, every=None, skip_list=skip_file) as mon:
            for batch in range(AT + 5):
                if batch in skip:
                    continue
                index = torch.arange(64 * batch, 64 * (batch + 1))
                (model(xs[index]) - ys[index]).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
                mon.step(batch_indices=index)
        return mon

    mon = run(set())
    assert [f.step for f in spikes(mon)] == [AT]
    listed = json.loads(skip_file.read_text())
    assert listed["steps"] == [AT]
    assert listed["samples"] == list(range(64 * AT, 64 * (AT + 1)))
    assert listed["spikes"][0]["loss"] == pytest.approx(spikes(mon)[0].value)
    resumed = run(set(listed["steps"]))
    assert spikes(resumed) == []


def test_batch_indices_that_are_not_indices_are_an_error() -> None:
    model = mlp()
    with hs.Monitor(model, every=None) as mon:
        model(torch.randn(4, 8)).sum().backward()
        with pytest.raises(TypeError, match="batch_indices must be a sequence or tensor of ints"):
            mon.step(batch_indices=3.5)


def test_the_window_record_is_documented() -> None:
    row = next(line for line in DOC.splitlines() if line.startswith("| `window` |"))
    documented = set(re.findall(r"`(\w+)`", row.split("|")[3]))
    assert {f.name for f in fields(Window)} - {"type"} <= documented


def test_kurtosis_and_max_over_rms_equal_plain_torch() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 8))
    x = torch.randn(32, 16)
    with torch.no_grad():
        outs = [model[0](x)]
        outs.append(model[1](outs[0]))
        outs.append(model[2](outs[1]))
    with hs.Monitor(model, every=1, sample=None) as mon:
        model(x).pow(2).mean().backward()
        mon.step()
    for name, out in zip(("0", "1", "2"), outs, strict=True):
        v = out.double().flatten()
        centred = v - v.mean()
        kurtosis = centred.pow(4).mean() / centred.pow(2).mean().square()
        stats = mon.records[1]["act"][name]
        assert stats["kurtosis"] == pytest.approx(kurtosis.item(), rel=1e-4)
        assert stats["absmax_over_rms"] == pytest.approx(
            (v.abs().max() / v.pow(2).mean().sqrt()).item(), rel=1e-5
        )


class OneLoudValue(nn.Module):
    """Adds ``scale`` to channel 5 of the first token of the first sequence: a massive
    activation, as LLMs grow on a start token."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bump = torch.zeros_like(x)
        bump[0, 0, 5] = self.scale
        return x + bump


@pytest.mark.parametrize("scale", [0.0, 3000.0])
def test_massive_activations_are_found_where_the_value_was_made_large(scale: float) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 256), OneLoudValue(scale), nn.Linear(256, 1))
    span = Thresholds().massive_span
    with hs.Monitor(model, every=5, sample=None) as mon:
        for _ in range(span + 6):
            model(torch.randn(2, 64, 8)).pow(2).mean().backward()
            model.zero_grad()
            mon.step()
    found = [f for f in mon.findings if f.kind == "massive_activations"]
    if scale == 0:
        assert found == []
        return
    (finding,) = found
    assert finding.module == "1" and finding.step == span
    assert finding.value >= Thresholds().massive
    assert mon.records[1]["act"]["1"]["kurtosis"] > 1000  # one value: far from a normal's 3
    assert mon.records[1]["act"]["1"]["channels"]["index"][0] == 5
    assert ", in channel 5 (absmax " in finding.message


def test_the_top_channels_are_the_largest_per_channel_magnitudes() -> None:
    """Channels: the hidden dim of a ``(batch, sequence, hidden)`` output, dim 1 of a conv's."""
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(8, 32), nn.GELU())
    conv = nn.Sequential(nn.Conv2d(3, 16, 3), nn.ReLU())
    for model, x, dims in (
        (seq, torch.randn(4, 10, 8), (0, 1)),
        (conv, torch.randn(2, 3, 9, 9), (0, 2, 3)),
    ):
        with torch.no_grad():
            outs = [model[0](x)]
            outs.append(model[1](outs[0]))
        with hs.Monitor(model, every=1, sample=None) as mon:
            model(x).square().mean().backward()
            mon.step()
        for name, out in zip(("0", "1"), outs, strict=True):
            values, index = out.abs().amax(dim=dims).topk(4)
            channels = mon.records[1]["act"][name]["channels"]
            assert channels["index"] == index.tolist()
            assert channels["absmax"] == pytest.approx(values.tolist(), rel=1e-6)
