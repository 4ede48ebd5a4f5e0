"""Non-finite values: caught before the optimizer writes them into the weights."""

from __future__ import annotations

import copy
import itertools
import math
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import hookscope as hs
from hookscope.testing import assert_no_hooks


class Risky(nn.Module):
    """log(|x| + eps): finite while eps > 0; a NaN source when eps < 0."""

    def __init__(self) -> None:
        super().__init__()
        self.eps = 1.0

    def forward(self, x):
        return torch.log(x.abs() + self.eps)


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), Risky(), nn.Linear(16, 4))


def states(model, opt):
    return copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())


def assert_same(a, b):
    (ma, oa), (mb, ob) = a, b
    assert all(torch.equal(ma[k], mb[k]) for k in ma)
    for p, state in oa["state"].items():
        for key, value in state.items():
            other = ob["state"][p][key]
            assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other


def train_until_poisoned(model, opt, mon, bad_step=2, steps=4, record=None):
    x, y = torch.randn(32, 8), torch.randint(0, 4, (32,))
    for step in range(steps):
        model[2].eps = -1.0 if step == bad_step else 1.0
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        if record is not None and step == bad_step:
            record.append(states(model, opt))
        opt.step()
        if record is not None and step == bad_step:
            record.append(states(model, opt))
        mon.step(loss=loss)


@pytest.mark.parametrize("make", [torch.optim.SGD, torch.optim.Adam])
def test_raise_comes_from_optimizer_step_before_the_update(make) -> None:
    model = net()
    opt = make(model.parameters(), lr=1e-2)
    x, y = torch.randn(32, 8), torch.randint(0, 4, (32,))
    with hs.Monitor(model, every=1, on_nonfinite="raise") as mon:
        for _step in range(2):
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            mon.step()
        model[2].eps = -1.0
        nn.functional.cross_entropy(model(x), y).backward()
        before = states(model, opt)
        with pytest.raises(hs.NonFiniteError) as info:
            opt.step()
        assert_same(before, states(model, opt))
    assert (info.value.module, info.value.step, info.value.phase) == ("2", 2, "forward")
    assert [(f.kind, f.module, f.step) for f in mon.findings] == [("nonfinite", "2", 2)]
    assert mon.records[-1]["type"] == "finding"
    assert_no_hooks(model)


@pytest.mark.parametrize("make", [torch.optim.SGD, torch.optim.AdamW])
def test_skip_leaves_weights_and_optimizer_state_alone_and_training_goes_on(make) -> None:
    model = net()
    opt = make(model.parameters(), lr=1e-2)
    around = []
    with hs.Monitor(model, every=1, on_nonfinite="skip") as mon:
        train_until_poisoned(model, opt, mon, bad_step=2, steps=5, record=around)
    assert_same(around[0], around[1])
    events = [r for r in mon.records if r["type"] == "event"]
    assert [(e["kind"], e["step"]) for e in events] == [("skipped_step", 2)]
    assert "'2'" in events[0]["message"]
    assert all(torch.isfinite(p).all() for p in model.parameters())
    steps = [r for r in mon.records if r["type"] == "step"]
    assert steps[3]["param"]["0.weight"]["update_ratio"] > 0  # training went on
    assert [(f.kind, f.step) for f in mon.findings] == [("nonfinite", 2)]


def test_skip_also_undoes_the_failing_forward_on_batchnorm_running_stats() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), Risky(), nn.BatchNorm1d(16), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    x = torch.randn(32, 8)
    with hs.Monitor(model, on_nonfinite="skip") as mon:
        for step in range(3):
            model[1].eps = -1.0 if step == 1 else 1.0
            if step == 1:
                before = copy.deepcopy(model[2].state_dict())
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            if step == 1:
                after = model[2].state_dict()
                assert all(torch.equal(before[k], after[k]) for k in before)
            mon.step()
    assert all(torch.isfinite(b).all() for b in model[2].buffers())


def test_log_lets_the_nan_reach_the_weights_and_says_so_once() -> None:
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with hs.Monitor(model, every=1) as mon:
        train_until_poisoned(model, opt, mon, bad_step=2, steps=5)
    assert all(not torch.isfinite(p).all() for p in model.parameters())
    found = [(f.module, f.step, f.phase) for f in mon.findings if f.kind == "nonfinite"]
    assert found == [("2", 2, "forward"), ("0", 2, "update")]
    assert "became non-finite in step 2's update" in mon.findings[-1].message


def test_skip_with_a_closure_optimizer() -> None:
    model = net()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=3)
    x, y = torch.randn(32, 8), torch.randint(0, 4, (32,))

    def closure():
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        return loss

    with hs.Monitor(model, every=1, on_nonfinite="skip") as mon:
        opt.step(closure)
        mon.step()
        model[2].eps = -1.0
        before = copy.deepcopy(model.state_dict())
        opt.step(closure)
        mon.step()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert [(f.kind, f.step) for f in mon.findings] == [("nonfinite", 1)]


# -- traced to the op and the source line ------------------------------------------------------


def line_of(marker: str) -> str:
    """``"<this file>:<line>"`` of the line holding ``marker``."""
    lines = Path(__file__).read_text().splitlines()
    number = next(i + 1 for i, line in enumerate(lines) if line.rstrip().endswith(marker))
    return f"{__file__}:{number}"


class Log(nn.Module):
    def forward(self, x):
        return torch.log(x - 1.5)  # <- log


class SqrtAtZero(nn.Module):
    """Finite forward, infinite backward: d/dx sqrt(x - x.detach()) at 0 is inf."""

    def forward(self, x):
        return x + torch.sqrt(x - x.detach())  # <- sqrt


class Normalise(nn.Module):
    def forward(self, x):
        zero = x * 0
        return x / zero.norm(dim=1, keepdim=True)  # <- div


class Exp(nn.Module):
    def forward(self, x):
        return torch.exp(x * 200)  # <- exp


class Outer(nn.Module):
    """Nested: the op runs two levels down, in a module called twice per forward."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(8, 8), inner)

    def forward(self, x):
        return self.block(torch.tanh(self.block(x)))


def traced(model, x, steps=1, loss=lambda out: out.square().mean(), every=1, call=None, **kw):
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with hs.Monitor(model, every=every, **kw) as mon:
        for _ in range(steps):
            opt.zero_grad()
            loss((call or model)(x)).backward()
            opt.step()
            mon.step()
    return next(f for f in mon.findings if f.kind == "nonfinite")


@pytest.mark.parametrize(
    ("inner", "op", "phase", "marker"),
    [
        (Log(), "aten.log", "forward", "# <- log"),
        (SqrtAtZero(), "aten.sqrt", "backward", "# <- sqrt"),
        (Normalise(), "aten.div", "forward", "# <- div"),
        (Exp(), "aten.exp", "forward", "# <- exp"),
    ],
    ids=["log", "sqrt-backward", "div-by-zero-norm", "exp-overflow"],
)
def test_the_op_module_phase_and_line_are_named(inner, op, phase, marker) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.1), nn.BatchNorm1d(8), Outer(inner))
    finding = traced(model, torch.randn(16, 8) + 2)
    assert (finding.op, finding.phase, finding.source) == (op, phase, line_of(marker))
    assert finding.module == "3.block.1"
    assert line_of(marker) in finding.message and op in finding.message


def test_a_nan_already_in_the_batch_is_blamed_on_the_data_not_an_op() -> None:
    model = net()
    x = torch.randn(16, 8)
    x[3, 2] = float("nan")
    finding = traced(model, x)
    assert (finding.module, finding.phase, finding.op) == ("0", "forward", None)
    assert "already NaN/Inf" in finding.message


@pytest.mark.parametrize("reentrant", [False, True])
def test_traced_under_activation_checkpointing(reentrant) -> None:
    from torch.utils.checkpoint import checkpoint

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.risky = nn.Linear(8, 8), SqrtAtZero()

        def forward(self, x):
            return checkpoint(lambda h: self.risky(self.fc(h)), x, use_reentrant=reentrant)

    finding = traced(Net(), torch.randn(4, 8, requires_grad=True))
    assert (finding.op, finding.phase, finding.source) == (
        "aten.sqrt",
        "backward",
        line_of("# <- sqrt"),
    )


def test_the_replay_leaves_no_trace() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.BatchNorm1d(8), Log())
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(16, 8) + 2
    with hs.Monitor(model, every=1, on_nonfinite="raise"):
        model(x).square().mean().backward()
        saved = (
            copy.deepcopy(model.state_dict()),
            [(p.grad, p.grad.clone()) for p in model.parameters()],
            torch.get_rng_state(),
        )
        with pytest.raises(hs.NonFiniteError) as info:
            opt.step()
        assert all(torch.equal(saved[0][k], v) for k, v in model.state_dict().items())
        for (grad, values), p in zip(saved[1], model.parameters(), strict=True):
            assert p.grad is grad and torch.equal(grad.nan_to_num(), values.nan_to_num())
        assert torch.equal(saved[2], torch.get_rng_state())
    assert (info.value.op, info.value.phase, info.value.source) == (
        "aten.log",
        "forward",
        line_of("# <- log"),
    )


def test_an_overflowing_attention_score_in_gpt2_is_traced_into_transformers() -> None:
    from models import gpt2, token_ids

    model = gpt2(attn_implementation="eager").train()
    with torch.no_grad():
        model.transformer.h[1].attn.c_attn.weight.mul_(1e20)  # q.k overflows to inf
    finding = traced(model, token_ids(), loss=lambda out: out.logits.square().mean())
    assert finding.phase == "forward" and finding.op in ("aten.bmm", "aten.matmul")
    assert finding.module == "transformer.h.1.attn"
    assert "modeling_gpt2.py" in finding.source


@pytest.mark.parametrize(
    "inner", [Log(), SqrtAtZero(), Exp(), Normalise()], ids=["log", "sqrt", "exp", "div"]
)
def test_unsampled_steps_name_the_same_module_as_sampled_ones(inner) -> None:
    """On unsampled steps, ReLU/max-pool/dropout/flatten outputs are flagged by their
    inputs' flags and their gradients not at all (they cannot make a NaN/Inf): the finding
    must not move."""
    found = {}
    for every, taped in itertools.product((1, None), (True, False)):
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Dropout(0.2),
            nn.Flatten(),
            nn.Linear(8 * 4 * 4, 8),
            copy.deepcopy(inner),
            nn.ReLU(),
            nn.Dropout(0.1),
            nn.Linear(8, 4),
        )
        # Called through .forward(), the root's hooks do not run: nothing is taped, so no
        # replay refines the finding, and the flags alone must name the module.
        call = model if taped else model.forward
        finding = traced(model, torch.randn(16, 1, 8, 8) + 2, every=every, call=call)
        found[every, taped] = (finding.module, finding.phase, finding.op is not None)
        assert_no_hooks(model)
    assert found[None, True] == found[1, True] == (*found[1, False][:2], True)
    assert found[None, False] == found[1, False]
    assert found[None, False][0] == "7"


# -- weights made non-finite by an update: one finding, not a new origin every step ------------


def poisoned_run(model, x, loss, bad_step=1, steps=5, update=None, fault=None, every=1):
    """Train with the NaN-making op switched on at ``bad_step`` only; the findings new at
    each step."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    per_step = []
    with hs.Monitor(model, every=every) as mon:
        for step in range(steps):
            fault(step == bad_step)
            opt.zero_grad()
            loss(model(x)).backward()
            if update is None:
                opt.step()
            else:
                update(model)
            per_step.append([(f.module, f.phase) for f in mon.step() if f.kind == "nonfinite"])
    assert_no_hooks(model)
    return mon, per_step


def gpt2_with_a_log_in_block_1():
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    from models import gpt2

    class LogAfterBlock(GPT2Block):
        faulty = False

        def forward(self, hidden_states, *args, **kwargs):
            out = super().forward(hidden_states, *args, **kwargs)
            return torch.log(out) if self.faulty else out

    torch.manual_seed(0)
    model = gpt2().train()
    model.transformer.h[1].__class__ = LogAfterBlock
    return model, lambda on: setattr(model.transformer.h[1], "faulty", on)


def cnn_with_a_log_in_its_forward():
    from models import ResNet

    class LogResNet(ResNet):
        faulty = False

        def forward(self, x):
            out = super().forward(x)
            return torch.log(out) if self.faulty else out

    torch.manual_seed(0)
    model = LogResNet()
    return model, lambda on: setattr(model, "faulty", on)


def test_gpt2_weights_poisoned_by_an_update_are_one_finding() -> None:
    from models import token_ids

    model, fault = gpt2_with_a_log_in_block_1()
    mon, per_step = poisoned_run(
        model, token_ids(), lambda out: out.logits.square().mean(), fault=fault
    )
    assert per_step == [
        [],
        [("transformer.h.1", "forward"), ("transformer.wte", "update")],
        [],
        [],
        [],
    ]
    weights = mon.findings[-1]
    assert weights.step == 1 and "became non-finite in step 1's update" in weights.message
    assert "'transformer.h.1'" in weights.message  # the cause it applied
    assert not torch.isfinite(model.transformer.wte.weight).all()


@pytest.mark.parametrize("every", [1, None])
def test_cnn_weights_poisoned_by_a_manual_update_are_one_finding(every: int | None) -> None:
    """No torch.optim: the update runs before mon.step(), which finds the weights it wrote."""
    from models import images

    def sgd(model):
        with torch.no_grad():
            for p in model.parameters():
                p -= 1e-3 * p.grad

    model, fault = cnn_with_a_log_in_its_forward()
    mon, per_step = poisoned_run(
        model, images(), lambda out: out.square().mean(), update=sgd, fault=fault, every=every
    )
    # The update ran before mon.step(): the replay of step 1 meets NaN weights everywhere and
    # names no op, so the first finding is the flags' own (the loss's gradient at 'fc').
    assert per_step == [[], [("fc", "backward"), ("conv1", "update")], [], [], []]
    assert "became non-finite in step 1's update" in mon.findings[-1].message


def test_weights_poisoned_before_the_monitor_came_are_named_as_such() -> None:
    """An update the Monitor never saw (it was attached after): the first NaN it meets is
    the weights', said once."""
    from models import images

    model, fault = cnn_with_a_log_in_its_forward()
    x = images()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    fault(True)
    model(x).square().mean().backward()
    opt.step()  # unwatched: the weights are NaN now
    fault(False)
    with hs.Monitor(model, every=1) as mon:
        for _ in range(3):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
            mon.step()
    assert [(f.module, f.step, f.phase) for f in mon.findings] == [("conv1", 0, "update")]
    assert "did not check" in mon.findings[0].message


def test_repaired_weights_are_watched_again() -> None:
    """A checkpoint loaded after the poisoning: the next NaN the weights take is new."""
    from models import images

    model, fault = cnn_with_a_log_in_its_forward()
    good = copy.deepcopy(model.state_dict())
    x = images()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    found = []
    with hs.Monitor(model, every=1) as mon:
        for step in range(6):
            if step == 3:
                model.load_state_dict(good)
                opt = torch.optim.SGD(model.parameters(), lr=1e-3)
            fault(step in (1, 4))
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
            found += [(f.module, f.step, f.phase) for f in mon.step()]
    assert found == [("", 1, "forward"), ("conv1", 1, "update"), ("conv1", 4, "update")]


def test_a_finite_float16_model_whose_sums_pass_65504_is_not_a_nan() -> None:
    """Every value finite and below float16's largest (65504), but their sums and the
    gradients' norms far above it: the checks accumulate in float32."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 8)).half()
    with torch.no_grad():
        model[0].weight.fill_(0.5)
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    x = torch.ones(32, 64, dtype=torch.float16)
    with hs.Monitor(model, every=None) as mon:
        with torch.no_grad():  # plain torch: the first Linear's output
            hidden = nn.functional.linear(x, model[0].weight, model[0].bias)
        assert torch.isfinite(hidden).all() and torch.isinf(hidden.sum())  # fp16's own sum
        (model(x).float().sum() * 4).backward()
        assert model[0].weight.grad.float().abs().sum() > 65504  # its fp16 L1 norm is inf
        opt.step()
        mon.step()
    assert [f for f in mon.findings if f.kind == "nonfinite"] == []


@pytest.fixture
def fresh_dynamo():
    """Nothing compiled before the test, nor left compiled after it (a later Monitor would
    find the model compiled already)."""
    import torch._dynamo

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("every", [None, 1])
@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_a_finite_float32_model_whose_sums_overflow_is_not_a_nan(
    phase: str, every: int | None, compiled: bool
) -> None:
    """Every value finite, the sum of the hidden layer's output (forward: ~6e34 each) or of
    the gradient reaching it (backward: ~8e34 each) past float32's largest, 3.4e38: no
    NaN/Inf is claimed, eager or compiled, with only the model's edges checked or every
    module."""
    model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 8))
    with torch.no_grad():
        model[0].weight.fill_(1e33 if phase == "forward" else 1e-30)
        model[2].weight.fill_(1e-3 if phase == "forward" else 1e34)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    x = torch.ones(32, 64)
    call = torch.compile(model, backend="aot_eager") if compiled else model
    with hs.Monitor(model, every=every, optimizer=opt) as mon:
        out = call(x)
        out.sum().backward()
        with torch.no_grad():  # plain torch: the first Linear's output, and its gradient
            hidden = model[0](x)
        big = hidden if phase == "forward" else model[0].weight.grad
        assert torch.isfinite(big).all() and torch.isinf(big.sum())
        assert torch.isfinite(out).all()
        opt.step()
        mon.step()
    assert [f for f in mon.findings if f.kind == "nonfinite"] == []


@pytest.mark.parametrize("on_nonfinite", ["log", "raise"])
def test_a_finite_gradient_whose_l2_norm_overflows_is_not_a_nan(on_nonfinite: str) -> None:
    """A gradient's flag is its L2 norm, whose float32 sum of squares overflows once an
    element passes 1.8e19: every element here is finite (1e20), the norm is not, and the
    Monitor asks the gradient itself before it calls that a NaN/Inf."""
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-30)
    with hs.Monitor(model, every=1, on_nonfinite=on_nonfinite) as mon:
        model(torch.full((1, 4), 1e20)).sum().backward()
        grad = model.weight.grad
        assert torch.isfinite(grad).all() and torch.isinf(torch.linalg.vector_norm(grad))
        opt.step()  # "raise" would raise here, before the update
        mon.step()
    assert [f for f in mon.findings if f.kind == "nonfinite"] == []
    (record,) = [r for r in mon.records if r["type"] == "step"]
    assert math.isinf(record["param"]["weight"]["grad_norm"])  # measured as it is


def test_a_nan_gradient_whose_l2_norm_is_infinite_is_still_found() -> None:
    """The re-check reads the gradient: an infinite element stays a finding."""
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with hs.Monitor(model, every=None, on_nonfinite="raise"):
        model(torch.ones(1, 4)).sum().backward()
        model.weight.grad[0, 1] = math.inf  # a weight's gradient alone, after the backward
        with pytest.raises(hs.NonFiniteError, match="'weight'"):
            opt.step()


def test_a_backward_nan_seen_only_on_parameters_is_blamed_on_the_last_one_it_reached() -> None:
    """Only parameter gradients flagged (the edges were finite): a NaN made in the backward
    reaches every parameter before its origin, so the last bad one is nearest to it."""
    from hookscope._monitor._step._buffer import StepBuffer
    from hookscope._monitor._step._trail import NonFiniteTrail

    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2))
    params = dict(model.named_parameters())
    for name, p in params.items():
        p.grad = torch.full_like(p, math.nan if name[0] in "01" else 1.0)
    trail, buf = NonFiniteTrail(), StepBuffer()
    trail.parameters(buf, params, list(params))
    finding = trail.localise(buf.to_host(), step=3)
    assert (finding.module, finding.phase) == ("1", "backward")
    assert "'1.bias'" in finding.message
