"""The Monitor's probes measure what plain torch measures, on a CNN with in-place ReLUs.

With ``sample=None`` every statistic is exact: each probe's numbers in a step record are
compared with the same statistic computed by hand from hooks that use no hookscope
(activations, output gradients), from ``p.grad`` and the update (parameters), and from the
BatchNorm buffers.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hookscope as hs
from hookscope._monitor import _buffer
from models import images, resnet_pair

CHOSEN = ["bn1", "layer1.0.bn2", "layer2.0.conv1", "fc"]


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> torch.Tensor:
    loss = model(x).logsumexp(-1).sum()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def test_every_probe_equals_plain_torch_on_a_cnn_with_in_place_relus() -> None:
    model, plain = resnet_pair()
    model.train(), plain.train()
    x = images()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    _step(model, opt, x), _step(plain, plain_opt, x)  # both past step 0: the same weights
    outs, grads = {}, {}
    for name in CHOSEN:  # the oracle: the plain twin's outputs and their gradients
        module = plain.get_submodule(name)
        module.register_forward_hook(lambda m, a, out, name=name: outs.__setitem__(name, out))
        module.register_full_backward_hook(
            lambda m, gi, go, name=name: grads.__setitem__(name, go[0])
        )
    before = {n: p.detach().clone() for n, p in plain.named_parameters()}
    plain(x).logsumexp(-1).sum().backward()
    param_grads = {n: p.grad.norm().item() for n, p in plain.named_parameters()}
    plain_opt.step()
    with hs.Monitor(model, where=CHOSEN, every=1, sample=None, optimizer=opt) as mon:
        loss = model(x).logsumexp(-1).sum()
        loss.backward()
        opt.step()
        mon.step(loss=loss)
    record = mon.records[-1]
    for name in CHOSEN:
        out, act = outs[name].detach().double(), record["act"][name]
        assert act["numel"] == out.numel() == act["sampled"]
        assert act["mean"] == pytest.approx(out.mean().item(), abs=1e-6), name
        assert act["std"] == pytest.approx(out.std(correction=0).item(), rel=1e-5), name
        assert act["absmax"] == pytest.approx(out.abs().max().item(), rel=1e-6), name
        assert act["zero_frac"] == pytest.approx((out == 0).double().mean().item()), name
        assert record["grad"][name]["norm"] == pytest.approx(grads[name].norm().item(), rel=1e-5)
    for name, p in plain.named_parameters():
        stats = record["param"][name]
        assert stats["grad_norm"] == pytest.approx(param_grads[name], rel=1e-5), name
        if p.dim() < 2:  # update ratios concern weight matrices and kernels only
            assert "update_ratio" not in stats, name
            continue
        ratio = ((p.detach() - before[name]).norm() / before[name].norm()).item()
        assert stats["update_ratio"] == pytest.approx(ratio, rel=1e-4, abs=1e-12), name
    for name, module in plain.named_modules():
        if isinstance(module, nn.BatchNorm2d):
            bn = record["bn"][name]
            assert bn["running_mean"] == pytest.approx(module.running_mean.mean().item(), abs=1e-6)
            assert bn["running_var"] == pytest.approx(module.running_var.mean().item(), rel=1e-5)


def test_gradient_accumulation_reads_the_summed_gradient_once_per_step() -> None:
    model = nn.Sequential(nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    xs = torch.randn(4, 16, 8)
    with hs.Monitor(model, every=1, optimizer=opt) as mon:
        for micro in xs:
            model(micro).pow(2).mean().backward()
        expected = model[0].weight.grad.norm().item()
        opt.step()
        mon.step()
    step = mon.records[1]
    assert step["param"]["0.weight"]["grad_norm"] == pytest.approx(expected, rel=1e-6)
    assert step["act"]["0"]["numel"] == 4 * 16 * 4  # four micro-batches, one record


def test_update_ratio_is_the_real_adam_update() -> None:
    model = nn.Sequential(nn.Linear(8, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with hs.Monitor(model, every=1, optimizer=opt) as mon:
        model(torch.randn(16, 8)).sum().backward()
        before = model[0].weight.detach().clone()
        opt.step()
        mon.step()
    ratio = ((model[0].weight - before).norm() / before.norm()).item()
    assert mon.records[1]["param"]["0.weight"]["update_ratio"] == pytest.approx(ratio, rel=1e-5)


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
