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


def test_batchnorm_figures_and_drifts_are_plain_torchs_over_sampled_steps() -> None:
    """Each BatchNorm's running mean and variance (means over channels) and their drift
    since the last sampled step, ``||now - before|| / (||before|| + 1e-12)``: BatchNorm1d
    and 2d of several widths, one without running statistics (left out), every=2."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(inplace=True),
        nn.Conv2d(8, 16, 3, padding=1),
        nn.BatchNorm2d(16, momentum=0.5),
        nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 32),
        nn.BatchNorm1d(32),
        nn.Linear(32, 10),
        nn.BatchNorm1d(10, track_running_stats=False),
    ).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    bns = {n: m for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)}
    seen: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = []
    with hs.Monitor(model, every=2, optimizer=opt) as mon:
        for step in range(6):
            x = torch.randn(16, 3, 8, 8) * (1 + step)
            loss = model(x).logsumexp(-1).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step % 2 == 0:
                seen.append(
                    {
                        n: (m.running_mean.clone(), m.running_var.clone())
                        for n, m in bns.items()
                        if m.running_mean is not None
                    }
                )
            mon.step(loss=loss)
    records = [r for r in mon.records if r.get("type") == "step" and r["sampled"]]
    assert len(records) == len(seen) == 3
    for i, (record, stats) in enumerate(zip(records, seen, strict=True)):
        assert set(record["bn"]) == {"1", "4", "9"}  # "11" keeps no running statistics
        for name, (mean, var) in stats.items():
            bn = record["bn"][name]
            assert bn["running_mean"] == pytest.approx(mean.mean().item(), rel=1e-5, abs=1e-7)
            assert bn["running_var"] == pytest.approx(var.mean().item(), rel=1e-5)
            if i == 0:
                assert bn["mean_drift"] != bn["mean_drift"]  # NaN: nothing before
                continue
            for now, before, key in zip(
                (mean, var), seen[i - 1][name], ("mean", "var"), strict=True
            ):
                drift = ((now - before).norm() / (before.norm() + 1e-12)).item()
                assert bn[f"{key}_drift"] == pytest.approx(drift, rel=1e-5), (name, key)
                assert drift > 0
