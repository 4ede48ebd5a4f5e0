"""An unsampled step where only the model's edges are checked (``check="edges"``, once an
optimizer is adopted): no Monitor hook runs on any module but the model itself, the gradient
reaching the model's output has no hook of its own (the tape's record of it is flagged with
the parameters' gradients, in one fused norm, before the update), and a NaN is still found
before the update, with its module, op and line."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

import hookscope as hs
from hookscope.testing import hooks_on, internals, step_state


class SqrtAtZero(nn.Module):
    """Finite forward, infinite backward: d/dx sqrt(x - x.detach()) at 0 is inf."""

    def forward(self, x):
        return x + torch.sqrt(x - x.detach())  # <- sqrt


def cnn(inner: nn.Module | None = None) -> nn.Sequential:
    """A small torchvision-like CNN, in-place ReLUs; ``inner`` after its second block."""
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


def images() -> torch.Tensor:
    return torch.randn(4, 3, 16, 16)


def line_of(marker: str) -> str:
    lines = Path(__file__).read_text().splitlines()
    number = next(i + 1 for i, line in enumerate(lines) if line.rstrip().endswith(marker))
    return f"{__file__}:{number}"


def test_a_light_unsampled_step_has_no_hook_on_any_module_but_the_model() -> None:
    torch.manual_seed(0)
    model = cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    y = torch.randint(0, 10, (4,))
    with hs.Monitor(model, every=None) as mon:
        for step in range(4):
            opt.zero_grad(set_to_none=True)
            out = model(images())
            state = step_state(mon)
            if step >= 2:  # the optimizer was adopted at step 0, the hooks seen at step 1
                assert state.light and not state.sampled
                # between the forward and the update: only the model's own hooks are on
                # (and torch's global optimizer hooks)
                places = {line.split(":")[0] for line in hooks_on(model, only_hookscope=True)}
                assert places - {"torch.optim.optimizer"} == {"<root>"}
                # the output the caller got has one hook: the tape's (no flag hook of its own)
                assert len(out._backward_hooks) == 1
            nn.functional.cross_entropy(out, y).backward()
            if step >= 2:
                assert not state.got_grad and not state.made  # no module hook ran
                assert [f.phase for f in state.trail.flags] == ["input", "forward"]
            opt.step()
            if step >= 2:  # the edge's gradient flagged before the update, with the params'
                phases = [f.phase for f in state.trail.flags]
                assert phases[:2] == ["input", "forward"] and phases[-1] == "backward"
                assert set(phases[2:-1]) == {"param"}
                assert state.trail.flags[-1].edge
            mon.step()
    assert [f for f in mon.findings if f.kind == "nonfinite"] == []
    losses = [r["scalars"]["loss"] for r in mon.records if r["type"] == "step"]
    assert len(losses) == 4 and all(math.isfinite(v) for v in losses)


def test_a_nan_made_in_a_module_is_named_before_the_update_with_its_op_and_line() -> None:
    torch.manual_seed(0)
    model = cnn(SqrtAtZero())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with hs.Monitor(model, every=None, on_nonfinite="raise") as mon:
        assert internals(mon).module_hooks is not None
        opt.zero_grad()
        model(images()).square().mean().backward()
        with pytest.raises(hs.NonFiniteError) as info:
            opt.step()  # raised before the update: the weights are the step's own
    finding = info.value
    assert (finding.module, finding.op, finding.phase) == ("7", "aten.sqrt", "backward")
    assert finding.source == line_of("# <- sqrt")


@pytest.mark.parametrize("update", [True, False], ids=["before-update", "no-update"])
def test_a_nan_gradient_reaching_the_model_from_the_loss_is_found(update: bool) -> None:
    """The loss is finite, its gradient at the model's output is not: found from the tape's
    record of that gradient, before the update, or, where the step has no update (an
    accumulation step), when ``step()`` moves the buffer."""
    torch.manual_seed(0)
    model = cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    weight = model[0].weight.detach().clone()
    with hs.Monitor(model, every=None, on_nonfinite="skip") as mon:
        for step in range(3):
            opt.zero_grad()
            out = model(images())
            bad = step == 2
            loss = out.square().mean() + (torch.sqrt(out - out.detach()).sum() if bad else 0)
            assert torch.isfinite(loss)
            loss.backward()
            if update or not bad:
                opt.step()
            if bad:
                weight = model[0].weight.detach().clone()
            mon.step()
    (finding,) = [f for f in mon.findings if f.kind == "nonfinite"]
    assert finding.step == 2 and finding.phase == "backward" and finding.module == ""
    assert "from the loss" in finding.message or finding.op == "aten.sqrt"
    assert torch.equal(model[0].weight, weight)  # skipped (or never run): unchanged


def test_a_finite_gradient_at_the_output_whose_l2_norm_overflows_is_not_a_nan() -> None:
    """The output's gradient is flagged by its L2 norm: every element here is finite (1e20),
    its float32 sum of squares is not; the gradient itself is asked before that is a NaN."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with hs.Monitor(model, every=None, on_nonfinite="raise") as mon:
        for _ in range(3):
            opt.zero_grad()
            out = model(torch.ones(1, 4) * 1e-30)
            (out * 1e20).sum().backward()
            opt.step()  # "raise" would raise here, before the update
            mon.step()
        assert step_state(mon).light
    assert [f for f in mon.findings if f.kind == "nonfinite"] == []


class Masked(nn.Module):
    """Scores plus a positional additive mask that holds -inf on purpose, bounded above by a
    positional bound that is +inf where there is none."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x, mask, bound):
        return torch.softmax(torch.minimum(self.proj(x), bound) + mask, dim=-1)


@pytest.mark.parametrize("bad", ["nan", "infinities"])
def test_the_models_inputs_on_a_light_step_are_checked_for_nan_only(bad: str) -> None:
    """The model's positional inputs are flagged for NaN only (an additive mask holds -inf on
    purpose, a bound +inf): a NaN in the batch is the data's, found before the update; the
    infinities are no finding."""
    torch.manual_seed(0)
    model = Masked()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mask = torch.zeros(4, 8)
    mask[:, 5:] = -math.inf
    bound = torch.full((4, 8), math.inf)
    bound[:, 0] = 1.0
    with hs.Monitor(model, every=None, on_nonfinite="skip") as mon:
        for step in range(3):
            x = torch.randn(4, 8)
            if bad == "nan" and step == 2:
                x[1, 3] = math.nan
            opt.zero_grad()
            out = model(x, mask, bound)
            out[:, :5].square().mean().backward()
            opt.step()
            assert step_state(mon).light == (step > 0)
            mon.step()
    found = [f for f in mon.findings if f.kind == "nonfinite"]
    if bad == "infinities":
        assert found == []
    else:
        (finding,) = found
        assert (finding.step, finding.phase, finding.op) == (2, "forward", None)
        assert "NaN/Inf" in finding.message


class HalfBrokenSGD(torch.optim.Optimizer):
    """SGD on its first group; on the others, an update that rebinds a local name."""

    def __init__(self, groups) -> None:
        super().__init__(groups, {"lr": 0.1})

    @torch.no_grad()
    def step(self, closure=None):
        for k, group in enumerate(self.param_groups):
            for p in group["params"]:
                if p.grad is not None:
                    if k == 0:
                        p.sub_(group["lr"] * p.grad)
                    else:
                        p = p - group["lr"] * p.grad
        return None


def test_weights_compared_in_one_batch_per_learning_rate_are_judged_one_by_one() -> None:
    """``not_updated`` compares the elements of an optimizer's largest weights in one vector
    per dtype, device and learning rate: each weight still gets its own verdict."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 32))
    opt = HalfBrokenSGD(
        [
            {"params": model[0].parameters(), "lr": 0.1},
            {"params": model[1].parameters(), "lr": 0.2},
            {"params": model[2].parameters(), "lr": 0.3},
        ]
    )
    with hs.Monitor(model, every=1) as mon:
        for _ in range(2):
            opt.zero_grad()
            model(torch.randn(8, 64)).square().mean().backward()
            opt.step()
            mon.step()
    found = [f for f in mon.findings if f.kind == "not_updated"]
    assert {f.module for f in found} == {"1", "2"} and {f.step for f in found} == {0}
    assert any("at lr 0.2," in f.message for f in found if f.module == "1")
