"""The gate: an unsampled step runs no hook on the model's modules but the outermost call's.

On a step where only the model's edges are checked and a replay localises (once an optimizer
is adopted and the eager hooks were seen), the Monitor takes its hooks off every module but
the root, so torch calls each module without any hook dispatch; they come back for sampled
steps, replays, evaluation passes and autocast regions. What the contract promises on such a
step is unchanged: a NaN/Inf found before the update, with its module, op and line.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hookscope as hs
from hookscope.testing import internals
from models import gpt2, token_ids


def cnn() -> nn.Sequential:
    """A small torchvision-style CNN with in-place ReLUs."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False),
        nn.BatchNorm2d(8),
        nn.ReLU(inplace=True),
        nn.Conv2d(8, 8, 3, padding=1, bias=False),
        nn.BatchNorm2d(8),
        nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 4),
    )


def images(step: int) -> torch.Tensor:
    return torch.rand(2, 3, 8, 8, generator=torch.Generator().manual_seed(step)) + 0.1


def hooked(model: nn.Module) -> list[str]:
    """Names of the modules below the root that hold any forward hook or pre-hook."""
    return [
        name
        for name, m in model.named_modules()
        if name and (m._forward_hooks or m._forward_pre_hooks)
    ]


def train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    F.cross_entropy(model(images(step)), torch.tensor([0, 1])).backward()
    opt.step()
    opt.zero_grad()


def test_unsampled_steps_hook_no_module_but_the_root_and_sampled_ones_hook_every_module() -> None:
    torch.manual_seed(0)
    model = cnn()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    seen: list[list[str]] = []
    with hs.Monitor(model, every=3) as mon:
        for step in range(7):
            seen.append(hooked(model))
            train_step(model, opt, step)
            mon.step()
    leaves = [n for n, m in model.named_modules() if n]
    # step 0: every hook (nothing seen yet), then sampled steps 3 and 6 only
    assert [s == leaves for s in seen] == [True, False, False, True, False, False, True]
    assert [s == [] for s in seen] == [False, True, True, False, True, True, False]
    records = [r for r in mon.records if r["type"] == "step"]
    assert [r["step"] for r in records if r.get("act")] == [0, 3, 6]
    assert set(records[6]["act"]) == set(leaves)
    assert hooked(model) == []  # closed: nothing left behind


def test_a_user_hook_keeps_running_and_its_place_among_the_monitors_hooks() -> None:
    torch.manual_seed(0)
    model = cnn()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    calls: list[int] = []
    with hs.Monitor(model, every=2) as mon:
        handle = model[3].register_forward_hook(lambda m, a, o: calls.append(1))
        order = list(model[3]._forward_hooks)  # the Monitor's hooks first, then the user's
        assert order[-1] == handle.id and len(order) >= 4  # the checks' on until it runs
        for step in range(5):
            if step % 2 == 0:  # sampled: the tape's and the probes' back, in their place
                train_step(model, opt, step)
                now = list(model[3]._forward_hooks)
                assert [k for k in order if k in now] == now
                assert len(now) >= 3 and now[-1] == handle.id
            else:
                assert list(model[3]._forward_hooks) == [handle.id]
                train_step(model, opt, step)
            mon.step()
    assert len(calls) == 5
    assert list(model[3]._forward_hooks) == [handle.id]
    handle.remove()
    assert hooked(model) == []


@pytest.mark.parametrize("every", [None, 10])
def test_a_nan_on_a_step_without_module_hooks_is_found_before_the_update_with_op_and_line(
    every: int | None,
) -> None:
    torch.manual_seed(0)
    model = cnn()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with hs.Monitor(model, every=every, on_nonfinite="raise") as mon:
        for step in range(3):
            train_step(model, opt, step)
            mon.step()
        assert hooked(model) == []  # step 3 runs without module hooks
        with torch.no_grad():
            model[3].weight.fill_(1e38)  # its convolution overflows to Inf
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(hs.NonFiniteError) as raised:
            train_step(model, opt, 3)
    error = raised.value
    assert (error.step, error.module, error.phase) == (3, "3", "forward")
    assert error.op == "aten.convolution"
    assert error.source is not None and error.source.startswith(f"{__file__}:")
    # raised before the update: the weights are those from before the step
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before, strict=True))


class AlwaysDropout(nn.Module):
    """Dropout with the mode hard-coded (the bug eval_randomness names)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x, 0.1, training=True)


def test_an_evaluation_pass_between_unsampled_steps_is_checked() -> None:
    torch.manual_seed(0)
    model = gpt2()
    model.transformer.h[1].mlp.dropout = AlwaysDropout()
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with hs.Monitor(model, every=None) as mon:
        for _ in range(3):
            model(token_ids(), labels=token_ids()).loss.backward()
            opt.step()
            opt.zero_grad()
            mon.step()
        assert hooked(model) == []
        model.eval()
        with torch.no_grad():
            model(token_ids())
        assert hooked(model) == []  # the checks' hooks were on for that call only
        mon.step()
    (finding,) = [f for f in mon.findings if f.kind == "eval_randomness"]
    assert (finding.step, finding.module) == (3, "transformer.h.1.mlp.dropout")
    assert [r["step"] for r in mon.records if r["type"] == "eval"] == [3]


class Float32Linear(nn.Linear):
    """A head that turns autocast off for itself (the bug autocast_skipped names)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", enabled=False):
            return super().forward(x.float())


def test_an_autocast_region_on_an_unsampled_step_is_checked() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), Float32Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(4, 8)
    with hs.Monitor(model, every=None) as mon:
        for step in range(3):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=step == 2):
                out = model(x)
            out.float().square().mean().backward()
            opt.step()
            opt.zero_grad()
            mon.step()
    (finding,) = [f for f in mon.findings if f.kind == "autocast_skipped"]
    assert (finding.step, finding.module) == (2, "2")


class TwoParts(nn.Module):
    """A model whose training loop calls its parts one by one (as Lightning's training_step
    may), never the model itself."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.head = nn.Linear(16, 2)


def test_a_loop_that_calls_the_models_parts_keeps_every_hook() -> None:
    torch.manual_seed(0)
    model = TwoParts()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with hs.Monitor(model, every=None) as mon:
        for step in range(4):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
            model.head(model.encoder(x)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            mon.step()
            assert internals(mon).taped_calls == []  # reset at the step's end
        assert hooked(model)  # the parts' own hooks tape each call: never taken off


def test_a_model_copied_or_pickled_on_an_unsampled_step_carries_no_hook() -> None:
    torch.manual_seed(0)
    model = cnn()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with hs.Monitor(model, every=None) as mon:
        for step in range(2):
            train_step(model, opt, step)
            mon.step()
        for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
            assert not any(m._forward_hooks or m._forward_pre_hooks for m in twin.modules())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
