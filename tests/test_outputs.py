"""The probes of module outputs and their gradients (``_monitor/_probes/_outputs.py``): the samples of a
sampled step wait for one stacked pass at its end, and each module's statistics come out as
plain torch computes them from the same sample, whatever the calls, sizes and dtypes.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hookscope as hs
from hookscope._monitor._step import _buffer


class TwoSizes(nn.Module):
    """``shared`` and ``act`` run twice per forward, on 3 rows (an output smaller than the
    sample: read whole) and on 700 (sampled); ``wide`` runs in float64. ``act``'s outputs
    are positive: a zero of padding would be its minimum."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(8, 16)
        self.act = nn.Sigmoid()
        self.wide = nn.Linear(16, 64).double()

    def forward(self, small: torch.Tensor, big: torch.Tensor) -> torch.Tensor:
        a = self.act(self.shared(small))
        b = self.act(self.shared(big))
        return a.sum() + self.wide(b.double()).sum()


def _sampled(t: torch.Tensor, k: int) -> torch.Tensor:
    """The elements a Monitor with ``sample=k`` reads: ``t`` whole if it is small, else every
    ``stride``-th element from the first, the stride coprime with the last two dims' size."""
    flat = t.detach().reshape(-1).double()
    if flat.numel() <= k:
        return flat
    period = t.shape[-2] * t.shape[-1]
    stride = flat.numel() // k
    while torch.gcd(torch.tensor(stride), torch.tensor(period)).item() != 1:
        stride += 1
    return flat[::stride][:k]


@pytest.mark.parametrize("keep_limit", [None, 2])
def test_sampled_statistics_keep_modules_calls_and_sample_lengths_apart(
    keep_limit, monkeypatch
) -> None:
    """The samples of a step wait for one stacked pass at its end (``keep_limit``: a pass
    every two samples, as a cell unrolled over many calls has)."""
    if keep_limit is not None:
        monkeypatch.setattr(_buffer, "KEEP_LIMIT", keep_limit)
    torch.manual_seed(0)
    model, k = TwoSizes().train(), 256
    small, big = torch.randn(3, 8), torch.randn(700, 8) * 10
    outs: dict[str, list[torch.Tensor]] = {}
    grads: dict[str, list[torch.Tensor]] = {}

    def keep(name: str, out: torch.Tensor) -> None:  # the oracle: plain hooks
        outs.setdefault(name, []).append(out.detach().clone())
        out.register_hook(lambda g: grads.setdefault(name, []).append(g.detach().clone()))

    for name, module in model.named_children():
        module.register_forward_hook(lambda m, a, out, name=name: keep(name, out))
    with hs.Monitor(model, every=1, sample=k) as mon:
        model(small, big).backward()
        mon.step()
    (record,) = (r for r in mon.records if r["type"] == "step")
    assert [len(outs[n]) for n in ("shared", "act", "wide")] == [2, 2, 1]
    for name, calls in outs.items():
        x = torch.cat([_sampled(t, k) for t in calls])
        act = record["act"][name]
        assert act["numel"] == sum(t.numel() for t in calls), name
        assert act["sampled"] == x.numel() < act["numel"], name
        assert act["mean"] == pytest.approx(x.mean().item(), rel=1e-5, abs=1e-6), name
        assert act["std"] == pytest.approx(x.std(correction=0).item(), rel=1e-5), name
        assert (act["min"], act["max"]) == pytest.approx((x.min().item(), x.max().item()))
        assert act["zero_frac"] == (x == 0).double().mean().item(), name
        sat = ((x <= 1e-3) | (x >= 1 - 1e-3)).double().mean().item()
        assert act["sat_frac"] == (pytest.approx(sat) if name == "act" else 0.0), name
        amax = torch.stack([t.detach().abs().reshape(-1, t.shape[-1]).amax(0) for t in calls])
        if all(t.numel() <= k for t in calls):  # read whole: the true top channels
            assert act["channels"]["index"] == amax.amax(0).topk(4).indices.tolist(), name
        g = torch.cat([_sampled(t, k) for t in grads[name]])
        numel = sum(t.numel() for t in grads[name])
        norm = (g.square().mean() * numel).sqrt().item()  # the estimate from the sample
        assert record["grad"][name]["norm"] == pytest.approx(norm, rel=1e-5), name
        assert record["grad"][name]["sampled"] == g.numel(), name
        assert record["grad"][name]["absmax"] == pytest.approx(g.abs().max().item()), name
    assert record["act"]["act"]["sat_frac"] > 0  # the sigmoid of 10x-scaled inputs saturates


@pytest.mark.parametrize("sample", [None, 1000])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16_bit_outputs_and_gradients_are_measured_in_float32(dtype, sample) -> None:
    """Sums of squares of 16-bit values pass float16's largest value (65504) fast."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64)).to(dtype).train()
    x = torch.randn(128, 64, dtype=dtype) * 30
    outs, grads = [], []

    def keep(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
        outs.append(out.detach().clone())
        out.register_hook(lambda g: grads.append(g.clone()))

    model[0].register_forward_hook(keep)
    with hs.Monitor(model, every=1, sample=sample) as mon:
        model(x).float().square().sum().backward()
        mon.step()
    (record,) = (r for r in mon.records if r["type"] == "step")
    k = sample or outs[0].numel()
    out, grad = _sampled(outs[0], k), _sampled(grads[0], k)
    assert out.square().sum() > 65504 and grad.square().sum() > 65504
    act = record["act"]["0"]
    assert act["std"] == pytest.approx(out.std(correction=0).item(), rel=1e-4)
    assert act["mean"] == pytest.approx(out.mean().item(), rel=1e-4, abs=1e-3)
    norm = (grad.square().mean() * grads[0].numel()).sqrt().item()
    assert record["grad"]["0"]["norm"] == pytest.approx(norm, rel=1e-4)


class DeadChannels(nn.Module):
    """A CNN whose first conv has 3 of its 8 channels dead (bias -100, before an in-place
    ReLU called twice), a frozen head (10 of its 32 units dead, or more) whose ReLU's
    output an in-place subtraction then makes all negative (a sample taken as a view of the
    output would read it after that), and a float64 layer (6 of 24 dead, or more)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.relu = nn.ReLU(inplace=True)
        self.head = nn.Linear(16, 32).requires_grad_(False)
        self.head_relu = nn.ReLU(inplace=True)
        self.wide = nn.Linear(32, 24).double()
        self.wide_relu = nn.ReLU()
        with torch.no_grad():
            self.conv.bias[[1, 4, 6]] = -100.0
            self.head.bias[:10] = -100.0
            self.wide.bias[:6] = -100.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.conv2(self.relu(self.conv(x))))
        h = self.head_relu(self.head(x.mean((2, 3)).detach()))
        out = self.wide_relu(self.wide(h.double()))
        h.sub_(1000.0)  # after the head ReLU's hooks ran
        return out.sum() + h.sum()


@pytest.mark.parametrize("keep_limit", [None, 2])
def test_dead_units_of_every_call_come_from_one_pass_as_plain_torch_counts_them(
    keep_limit, monkeypatch
) -> None:
    """A unit is dead when it is <= 0 on at least ``dead_at`` of its positions; a module's
    figure is the largest over its calls. Each call's units sample waits, a copy, for the
    step's pass (``keep_limit``: a pass every two samples)."""
    if keep_limit is not None:
        monkeypatch.setattr(_buffer, "KEEP_LIMIT", keep_limit)
    torch.manual_seed(0)
    model = DeadChannels().train()
    x = torch.randn(16, 3, 8, 8)
    x[0, :, 0, 0] = float("nan")  # a NaN at one position of every channel of conv's input
    want: dict[str, float] = {}

    def oracle(name: str, out: torch.Tensor) -> None:  # plain torch, over every position
        units = out.detach().movedim(1, -1).reshape(-1, out.shape[1])
        dead = ((units <= 0).double().mean(0) >= 0.9).double().mean().item()
        want[name] = max(want.get(name, 0.0), dead)

    for name in ("relu", "head_relu", "wide_relu"):
        module = model.get_submodule(name)
        module.register_forward_hook(lambda m, a, out, name=name: oracle(name, out))
    with hs.Monitor(model, every=1, thresholds=hs.Thresholds(dead_unit=0.9)) as mon:
        model(x).backward()
        mon.step()
    (record,) = (r for r in mon.records if r["type"] == "step")
    got = {name: record["act"][name]["dead_frac"] for name in want}
    assert want["relu"] == 3 / 8  # as built; the others: at least the units biased -100
    assert want["head_relu"] >= 10 / 32 and want["wide_relu"] >= 6 / 24
    assert got == pytest.approx(want, abs=1e-7)
