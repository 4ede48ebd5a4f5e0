"""Monitor on real training loops: healthy runs give no findings, injected faults are named."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import hookscope as hs
from hookscope._demo import DigitsCNN
from hookscope.testing import assert_no_hooks


class Risky(nn.Module):
    """log(|x| + eps): finite while eps > 0; a NaN source when a bad step sets eps < 0."""

    def __init__(self) -> None:
        super().__init__()
        self.eps = 1.0

    def forward(self, x):
        return torch.log(x.abs() + self.eps)


class MLP(nn.Module):
    def __init__(self, act: type[nn.Module] = nn.ReLU) -> None:
        super().__init__()
        self.fc1, self.act, self.risky = nn.Linear(8, 32), act(), Risky()
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(self.risky(self.act(self.fc1(x))))


def train(
    model,
    steps=20,
    *,
    lr=1e-2,
    before_step=None,
    mon_kwargs=None,
    batch=None,
    optim=torch.optim.SGD,
):
    torch.manual_seed(1)
    opt = optim(model.parameters(), lr=lr)
    x, y = batch or (torch.randn(64, 8), torch.randint(0, 4, (64,)))
    with hs.Monitor(model, every=2, optimizer=opt, **(mon_kwargs or {})) as mon:
        for step in range(steps):
            if before_step:
                before_step(step, model)
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            mon.step(loss=loss)
    assert_no_hooks(model)
    return mon


def test_healthy_mlp_has_no_findings_and_logs_every_statistic() -> None:
    mon = train(MLP())
    assert mon.findings == []
    sampled = [r for r in mon.records if r["type"] == "step" and r["sampled"]]
    assert len(sampled) == 10
    first = sampled[0]
    assert set(first["act"]) == {"fc1", "act", "risky", "fc2"}
    assert first["act"]["act"]["zero_frac"] > 0.2 and first["act"]["fc1"]["nan"] == 0
    assert set(first["grad"]) == {"fc1", "act", "risky", "fc2"}
    assert first["grad_order"][0] == "fc2"
    assert 0 < first["param"]["fc1.weight"]["update_ratio"] < 0.1
    assert first["scalars"]["lr"] == 1e-2 and first["training"] is True


def test_nan_origin_is_the_module_whose_output_turned_nonfinite() -> None:
    def poison(step: int, model: MLP) -> None:
        model.risky.eps = -1.0 if step == 7 else 1.0

    mon = train(MLP(), before_step=poison)
    nonfinite = [f for f in mon.findings if f.kind == "nonfinite"]
    assert (nonfinite[0].module, nonfinite[0].step) == ("risky", 7)
    assert "aten.log in 'risky' made NaN from finite inputs" in nonfinite[0].message
    # the NaN gradients then poison fc1's weights in step 7's update: said once, as such
    assert [(f.module, f.step, f.phase) for f in nonfinite[1:]] == [("fc1", 7, "update")]


def test_nan_can_raise_with_module_and_step() -> None:
    def poison(step: int, model: MLP) -> None:
        model.risky.eps = -1.0 if step == 3 else 1.0

    with pytest.raises(hs.NonFiniteError, match="risky") as info:
        train(MLP(), before_step=poison, mon_kwargs={"on_nonfinite": "raise"})
    assert (info.value.module, info.value.step, info.value.phase) == ("risky", 3, "forward")


class SqrtZero(nn.Module):
    """Finite forward, infinite backward: d/dx sqrt(x - x.detach()) at 0 is inf."""

    def forward(self, x):
        return x + torch.sqrt(x - x.detach())


def test_backward_nonfinite_names_the_module_whose_backward_broke() -> None:
    model = nn.Sequential(nn.Linear(8, 8), SqrtZero(), nn.Linear(8, 4))
    mon = train(model, steps=2)
    assert [(f.kind, f.module, f.step) for f in mon.findings[:1]] == [("nonfinite", "1", 0)]
    assert "backward" in mon.findings[0].message


def test_dead_relu_units_are_found_on_the_relu() -> None:
    model = MLP()
    with torch.no_grad():
        model.fc1.bias.fill_(-100.0)
    mon = train(model, steps=4)
    dead = [f for f in mon.findings if f.kind == "dead_units"]
    assert [(f.module, f.step) for f in dead] == [("act", 0)]
    assert "100%" in dead[0].message


def test_saturated_tanh_is_found() -> None:
    model = MLP(act=nn.Tanh)
    with torch.no_grad():
        model.fc1.weight.mul_(200.0)
    mon = train(model, steps=4)
    assert ("saturated_units", "act") in {(f.kind, f.module) for f in mon.findings}


def deep(act: type[nn.Module], scale: float, depth: int = 8) -> nn.Sequential:
    layers = []
    for _ in range(depth):
        linear = nn.Linear(8, 8)
        with torch.no_grad():
            linear.weight.mul_(scale)
        layers += [linear, act()]
    return nn.Sequential(*layers[:-1], nn.Linear(8, 4))


def test_exploding_gradients_in_a_deep_linear_stack() -> None:
    mon = train(deep(nn.Identity, 6.0), steps=2, lr=0.0)
    kinds = {f.kind for f in mon.findings}
    assert "exploding_gradient" in kinds and "vanishing_gradient" not in kinds


def test_vanishing_gradients_in_a_deep_sigmoid_stack() -> None:
    mon = train(deep(nn.Sigmoid, 0.05, depth=10), steps=2, lr=0.0)
    vanish = [f for f in mon.findings if f.kind == "vanishing_gradient"]
    assert len(vanish) == 1 and vanish[0].step == 0


def test_healthy_digits_cnn_with_batchnorm_and_inplace_relu() -> None:
    from hookscope._demo import load_digits

    x, y, _, _ = load_digits()
    model = DigitsCNN()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    with hs.Monitor(model, every=5, optimizer=opt) as mon:
        for i in range(0, 32 * 30, 32):
            loss = nn.functional.cross_entropy(model(x[i : i + 32]), y[i : i + 32])
            opt.zero_grad()
            loss.backward()
            opt.step()
            mon.step(loss=loss)
    assert mon.findings == []
    bn = [r["bn"]["features.1"] for r in mon.records if r.get("type") == "step" and r["sampled"]]
    assert bn[1]["mean_drift"] > 0 and bn[0]["running_var"] > 0


def test_healthy_gpt2_has_no_findings_and_counts_tied_weights_once() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=2,
        n_embd=64,
        n_head=2,
        vocab_size=100,
        n_positions=32,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(config)
    ids = torch.randint(0, 100, (4, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with hs.Monitor(model, every=3, optimizer=opt) as mon:
        for _ in range(9):
            loss = model(ids, labels=ids).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            mon.step(loss=loss)
    assert mon.findings == []
    header = mon.records[0]
    assert "transformer.wte.weight" in header["params"] and "lm_head.weight" not in header["params"]
    assert "transformer.h.0.attn.c_attn" in mon.records[1]["act"]
    assert_no_hooks(model, only_hookscope=True)


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpoint_recompute_is_not_counted_twice(reentrant: bool) -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
            self.head = nn.Linear(8, 1)

        def forward(self, x):
            return self.head(checkpoint(self.block, x, use_reentrant=reentrant))

    model = Net()
    with hs.Monitor(model, every=1) as mon:
        model(torch.randn(5, 8, requires_grad=True)).sum().backward()
        mon.step()
    assert mon.records[1]["act"]["block.0"]["numel"] == 5 * 8
    assert mon.records[1]["grad"]["block.0"]["norm"] > 0  # reentrant: hooked in the re-run
    assert mon.findings == []


def test_grad_scaler_skipped_step_is_an_event() -> None:
    model = nn.Sequential(nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    with hs.Monitor(model, every=1, optimizer=opt) as mon:
        loss = model(torch.randn(4, 8)).sum()
        scaler.scale(loss).backward()
        model[0].weight.grad[0, 0] = float("inf")
        scaler.step(opt)
        scaler.update()
        mon.step(loss=loss)
    events = [r for r in mon.records if r["type"] == "event"]
    assert [e["kind"] for e in events] == ["skipped_step"]


def test_eval_phase_is_recorded_and_only_checked_for_nonfinite() -> None:
    model = MLP()
    with hs.Monitor(model, every=1) as mon:
        model.eval()
        with torch.no_grad():
            model(torch.randn(3, 8))
        mon.step()
    record = mon.records[1]
    assert record["training"] is False and record["act"] == {}


def test_custom_sink_and_bad_arguments() -> None:
    class Count:
        def __init__(self) -> None:
            self.n = 0

        def write(self, record):
            self.n += 1

        def close(self):
            pass

    sink = Count()
    model = MLP()
    with hs.Monitor(model, sinks=[sink]) as mon:
        mon.step(loss=1.0)  # a step with no forward pass, given its loss (no idle warning)
    assert sink.n == 2 and isinstance(sink, hs.Sink)
    with pytest.raises(ValueError, match="every"):
        hs.Monitor(model, every=0)
    with pytest.raises(TypeError, match="did you mean 'log_dir'"):
        hs.Monitor(model, log_dri="x")
    with pytest.raises(TypeError, match="did you mean 'explode_ratio'"):
        hs.Monitor(model, explode_ration=10.0)
    with pytest.raises(ValueError, match="sample"):
        hs.Monitor(model, sample=0)
    with pytest.raises(hs.SelectionError):
        hs.Monitor(model, where="nope")
    assert_no_hooks(model)


@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor:UserWarning")
def test_monitor_attached_before_compile_sees_the_compiled_steps() -> None:
    import torch._dynamo

    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    torch._dynamo.reset()
    try:
        with hs.Monitor(model, every=1, optimizer=opt) as mon:
            compiled = torch.compile(model, backend="eager")
            for _ in range(2):
                compiled(torch.randn(4, 8)).sum().backward()
                opt.step()
                opt.zero_grad()
                mon.step()
        steps = [r for r in mon.records if r["type"] == "step"]
        assert [sorted(r["act"]) for r in steps] == [["act", "fc1", "fc2", "risky"]] * 2
        assert steps[1]["grad"]["fc1"]["norm"] > 0
        assert_no_hooks(model)  # (attached after compiling: tests/test_compile.py)
    finally:
        torch._dynamo.reset()


def test_threshold_fields_can_be_overridden_by_keyword() -> None:
    with hs.Monitor(MLP(), explode_ratio=10.0) as mon:
        assert mon.thresholds.explode_ratio == 10.0
        assert mon.records[0]["settings"]["thresholds"]["explode_ratio"] == 10.0


def test_every_none_checks_nonfinite_only() -> None:
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with hs.Monitor(model, every=None) as mon:
        for _ in range(3):
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
            mon.step(loss=1.0)
        model.risky.eps = -1.0
        model(torch.randn(4, 8)).sum().backward()
        mon.step()
    steps = [r for r in mon.records if r["type"] == "step"]
    assert not any(r["sampled"] for r in steps) and "act" not in steps[0]
    assert steps[0]["scalars"] == {"loss": 1.0, "lr": 0.1}
    assert [(f.kind, f.module, f.step) for f in mon.findings] == [("nonfinite", "risky", 3)]


def test_a_model_without_children_is_watched_itself() -> None:
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with hs.Monitor(model, every=1) as mon:
        model(torch.randn(8, 4)).pow(2).mean().backward()
        opt.step()
        mon.step()
    step = mon.records[1]
    assert list(mon.modules) == [""] and step["act"][""]["numel"] == 16
    assert step["param"]["weight"]["update_ratio"] > 0
    assert_no_hooks(model)
