"""A sampled step's statistics are its first training call's: a second training call into the
model in the same step (a micro-batch of an accumulated step, a closure ``LBFGS`` evaluates
again) is checked as an unsampled step's calls are (its modules' hooks off where the edges
are checked), so a step of 20 closure evaluations pays for one read, not 20. A NaN made in a
later call is still found, with its module."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import hookscope as hs
from hookscope.testing import hooks_on, step_state


class RmsNorm2d(nn.Module):
    """Each channel scaled to unit RMS over its positions: 0 x inf = NaN on an all-zero map."""

    def forward(self, x):
        return x * torch.rsqrt(x.square().mean((2, 3), keepdim=True))  # <- rsqrt


def cnn(inner: nn.Module | None = None) -> nn.Sequential:
    """A small torchvision-like CNN with in-place ReLUs; ``inner`` after its second block."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False),
        nn.BatchNorm2d(8),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1, bias=False),
        nn.BatchNorm2d(16),
        nn.ReLU(inplace=True),
        inner or nn.Identity(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 10),
    )


def micro_batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(4, 3, 16, 16, generator=g), torch.randint(0, 10, (4,), generator=g))
        for _ in range(n)
    ]


def test_an_accumulated_sampled_step_reads_its_first_micro_batch() -> None:
    """Four micro-batches per step, every step sampled: the step's activation and output
    gradient statistics are those of a copy that ran the first micro-batch alone (the same
    weights, the same batch), and from the light steps on, the later micro-batches run with
    no Monitor hook on any module but the model's own."""
    torch.manual_seed(0)
    model = cnn()
    batches = micro_batches(4)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    with hs.Monitor(model, every=1, sample=None) as mon:
        for step in range(3):
            alone = copy.deepcopy(model)  # before this step's forward: the same weights
            opt.zero_grad(set_to_none=True)
            for k, (x, y) in enumerate(batches):
                out = model(x)
                state = step_state(mon)
                assert state.sampled and state.reading == (k == 0)
                if step >= 2 and k > 0:  # light (the optimizer adopted, the hooks seen)
                    assert state.light
                    places = {line.split(":")[0] for line in hooks_on(model, only_hookscope=True)}
                    assert places - {"torch.optim.optimizer"} == {"<root>"}
                (nn.functional.cross_entropy(out, y) / len(batches)).backward()
            opt.step()
            mon.step()
            with hs.Monitor(alone, every=1, sample=None) as solo:
                x, y = batches[0]
                (nn.functional.cross_entropy(alone(x), y) / len(batches)).backward()
                solo.step()
            (mine,) = [r for r in mon.records if r["type"] == "step" and r["step"] == step]
            (theirs,) = [r for r in solo.records if r["type"] == "step"]
            for kind in ("act", "grad"):
                assert mine[kind].keys() == theirs[kind].keys()
                for name, stats in theirs[kind].items():
                    for key in ("mean", "std", "norm", "absmax", "numel", "zero_frac"):
                        if key in stats:
                            assert mine[kind][name][key] == pytest.approx(stats[key], rel=1e-5)
    assert [f for f in mon.findings if f.kind == "nonfinite"] == []


@pytest.mark.parametrize("check", ["edges", "modules"])
def test_a_nan_made_in_a_later_micro_batch_of_a_sampled_step_is_named(check: str) -> None:
    """The third micro-batch of a sampled step is all zeros, and the model's first module
    makes a NaN of it (0 x inf): found before the update, in that module (by a replay of
    that call where the edges are checked, by its own flag where every module is), the
    update skipped."""
    torch.manual_seed(0)
    model = nn.Sequential(RmsNorm2d(), cnn())
    batches = micro_batches(4)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with hs.Monitor(model, every=2, on_nonfinite="skip", check=check) as mon:
        for step in range(5):
            opt.zero_grad(set_to_none=True)
            for k, (x, y) in enumerate(batches):
                if step == 4 and k == 2:
                    x = torch.zeros_like(x)
                (nn.functional.cross_entropy(model(x), y) / len(batches)).backward()
            assert step_state(mon).sampled == (step % 2 == 0)
            before = model[1][0].weight.detach().clone()
            opt.step()
            if step == 4:
                assert torch.equal(model[1][0].weight, before)  # skipped
            mon.step()
    (finding,) = [f for f in mon.findings if f.kind == "nonfinite"]
    assert (finding.step, finding.module, finding.phase) == (4, "0", "forward")


def test_an_lbfgs_step_reads_its_first_closure_evaluation() -> None:
    """LBFGS evaluates the closure up to ``max_iter`` times per step: a sampled step's
    output statistics are those of the first evaluation (the weights before the step), and
    the step's update is the optimizer's own (the same weights as a bare copy's)."""

    class Sequence(nn.Module):  # an LSTMCell unrolled, a Linear head (time series)
        def __init__(self) -> None:
            super().__init__()
            self.cell = nn.LSTMCell(1, 16)
            self.head = nn.Linear(16, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = c = x.new_zeros(x.shape[0], 16)
            outs = []
            for x_t in x.split(1, dim=1):
                h, c = self.cell(x_t, (h, c))
                outs.append(self.head(h))
            return torch.cat(outs, dim=1)

    torch.manual_seed(0)
    t = torch.arange(0, 41, dtype=torch.float32)
    wave = torch.sin((t[None, :] + torch.randint(-8, 8, (6, 1))) / 4)
    x, y = wave[:, :-1], wave[:, 1:]
    model, bare = Sequence(), None
    bare = copy.deepcopy(model)
    opts = [torch.optim.LBFGS(m.parameters(), lr=0.5, max_iter=5) for m in (model, bare)]

    def closure_of(m: nn.Module, opt: torch.optim.Optimizer):
        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = nn.functional.mse_loss(m(x), y)
            loss.backward()
            return loss

        return closure

    with hs.Monitor(model, every=1, sample=None) as mon:
        for _ in range(2):
            first = copy.deepcopy(model)
            opts[0].step(closure_of(model, opts[0]))
            opts[1].step(closure_of(bare, opts[1]))
            mon.step()
    for p, q in zip(model.parameters(), bare.parameters(), strict=True):
        assert torch.equal(p, q)
    (last,) = [r for r in mon.records if r["type"] == "step" and r["step"] == 1]
    with torch.no_grad():
        h = c = x.new_zeros(x.shape[0], 16)
        heads = []
        for x_t in x.split(1, dim=1):
            h, c = first.cell(x_t, (h, c))
            heads.append(first.head(h))
        head = torch.cat(heads)
    assert last["act"]["head"]["numel"] == head.numel()  # one evaluation's 40 calls
    assert last["act"]["head"]["mean"] == pytest.approx(head.mean().item(), rel=1e-4)
    assert last["act"]["head"]["absmax"] == pytest.approx(head.abs().max().item(), rel=1e-5)
