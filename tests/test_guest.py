"""hookscope as a guest in other people's processes: whatever it replaces in torch is torch's
own object again once its last user closed (in any order, from any thread); attaching to a
compiled model leaves other models' compiled code alone; another model's backward pass, an
in-place change of the output, a Tap, and the order of `with` items change nothing that is
seen."""

from __future__ import annotations

import copy
import io
import itertools
import sys
import threading
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
import torch.nn.utils
import torch.nn.utils.clip_grad
from torch import nn
from torch.amp import grad_scaler

import hookscope as hs
from hookscope.testing import assert_no_hooks, assert_torch_untouched
from models import ResNet, SharedAcrossSegments, gpt2, images, token_ids

# What torch had before any test of this file ran: compared with `is` after each scenario.
ORIGINALS = {
    (torch.autograd, "backward"): torch.autograd.backward,
    (torch.nn.utils, "clip_grad_norm_"): torch.nn.utils.clip_grad_norm_,
    (torch.nn.utils.clip_grad, "clip_grad_norm_"): torch.nn.utils.clip_grad.clip_grad_norm_,
    (torch.nn.utils, "clip_grad_value_"): torch.nn.utils.clip_grad_value_,
    (torch.nn.utils.clip_grad, "clip_grad_value_"): torch.nn.utils.clip_grad.clip_grad_value_,
    (grad_scaler.GradScaler, "scale"): grad_scaler.GradScaler.scale,
    (grad_scaler.GradScaler, "step"): grad_scaler.GradScaler.step,
    (F, "scaled_dot_product_attention"): F.scaled_dot_product_attention,
    (torch, "softmax"): torch.softmax,
    (nn.Module, "__getstate__"): nn.Module.__getstate__,
    (nn.RNNBase, "__getstate__"): nn.RNNBase.__getstate__,
}


def assert_torch_is_torchs() -> None:
    for (owner, name), original in ORIGINALS.items():
        assert getattr(owner, name) is original, f"{owner.__name__}.{name} is still replaced"
    assert "softmax" not in vars(torch.Tensor)  # inherited from torch._C.TensorBase again
    config = sys.modules.get("torch._dynamo.config")
    assert config is None or config.skip_nnmodule_hook_guards is True  # Dynamo's default
    assert_torch_untouched()


class SelfAttention(nn.Module):
    """A hand-written causal attention block over SDPA (nanoGPT's shape)."""

    def __init__(self, d: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.qkv, self.proj, self.heads = nn.Linear(d, 3 * d), nn.Linear(d, d), heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


def attention_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), SelfAttention(), nn.GELU(), nn.Linear(16, 4))


def train(model: nn.Module, steps: int = 2, mon: hs.Monitor | None = None) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(steps):
        loss = model(torch.randn(2, 5, 8)).square().mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        if mon is not None:
            mon.step()


class Tapped(nn.Module):
    """A Tap between two layers."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.tap_mid, self.out = nn.Linear(4, 4), hs.Tap(), nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.tap_mid(self.fc(x) * 2).relu())


def opener(kind: str, model: nn.Module):
    if kind == "monitor":
        return hs.Monitor(model, every=1)
    if kind == "capture":
        return hs.capture(model, "1", what=("output", "grad_output"))
    return hs.intervene(model, {"2": lambda out, site: out * 1.0})


@pytest.mark.parametrize("order", list(itertools.permutations(["monitor", "capture", "monitor2"])))
@pytest.mark.parametrize("close", ["fifo", "lifo"])
def test_everything_replaced_is_torchs_own_again_after_any_order_of_users(
    order: tuple[str, ...], close: str
) -> None:
    model = attention_model()
    opened = [opener(kind.rstrip("2"), model) for kind in order]
    for user in opened:
        user.__enter__()
    # the second Monitor replaced (closed) the first: one open Monitor per model
    train(model, mon=next(u for u in reversed(opened) if isinstance(u, hs.Monitor)))
    for user in opened if close == "fifo" else reversed(opened):
        user.__exit__(None, None, None)
    assert_torch_is_torchs()
    assert_no_hooks(model)


def test_two_monitors_measure_attention_and_leave_sdpa_torchs_own() -> None:
    """The leak of the third round: A saved torch's SDPA, B saved A's wrapper, A restored
    torch's, B restored A's: torch's functions stayed hookscope's for good."""
    models = [attention_model(), attention_model()]  # one open Monitor per model
    first, second = hs.Monitor(models[0], every=1), hs.Monitor(models[1], every=1)
    with first:
        with second:
            for model, mon in zip(models, (first, second), strict=True):
                opt = torch.optim.SGD(model.parameters(), lr=0.01)
                for _ in range(2):
                    model(torch.randn(2, 5, 8)).square().mean().backward()
                    opt.step()
                    opt.zero_grad()
                    mon.step()
        assert F.scaled_dot_product_attention is not ORIGINALS[F, "scaled_dot_product_attention"]
    assert_torch_is_torchs()
    for mon in (first, second):
        logits = [r["attn"]["1"]["logit_max"] for r in mon.records if r.get("attn")]
        assert len(logits) == 2 and all(v > 0 for v in logits)


def test_monitors_in_two_threads_each_see_their_own_attention_and_leave_torch_as_it_was() -> None:
    models = [attention_model(), attention_model()]
    with torch.no_grad():  # the second model's logits are 100x the first's
        models[1][1].qkv.weight.mul_(10.0)
    monitors = [hs.Monitor(m, every=1) for m in models]
    barrier, errors = threading.Barrier(2), []

    def run(i: int) -> None:
        try:
            with monitors[i]:
                barrier.wait()
                train(models[i], steps=3, mon=monitors[i])
                barrier.wait()
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert_torch_is_torchs()
    small, large = (
        max(r["attn"]["1"]["logit_max"] for r in mon.records if r.get("attn")) for mon in monitors
    )
    assert large > 20 * small  # neither thread's calls were credited to the other's module


def test_an_unwatched_sdpa_call_outside_any_attention_module_is_not_measured() -> None:
    model = attention_model()
    mon = hs.Monitor(model, every=1)
    with mon:
        q = torch.randn(1, 2, 4, 8) * 1000
        F.scaled_dot_product_attention(q, q, q)  # not the model's: credited to nobody
        train(model, steps=1, mon=mon)
    (record,) = [r for r in mon.records if r.get("attn")]
    assert record["attn"]["1"]["logit_max"] < 1000


# -- other models' compiled code -----------------------------------------------------------------


class Teacher(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).tanh()


def test_attaching_to_a_compiled_model_keeps_every_other_models_compiled_code() -> None:
    compiles: list[str] = []

    def counting(name: str):
        def backend(gm: torch.fx.GraphModule, inputs: list) -> object:
            compiles.append(name)
            return gm.forward

        return backend

    torch.manual_seed(0)
    ours = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    teacher = Teacher()  # another class: its forward's compiled code is its own
    ours_c = torch.compile(ours, backend=counting("ours"))
    teacher_c = torch.compile(teacher, backend=counting("teacher"))
    x = torch.randn(3, 4)
    ours_c(x), teacher_c(x)
    assert sorted(compiles) == ["ours", "teacher"]
    with pytest.warns(hs.HookscopeWarning, match="other compiled functions keep theirs"):
        cap = hs.capture(ours_c, "1")
    with cap:
        ours_c(x)
        teacher_c(x)
    assert torch.equal(cap["1"].output, torch.relu(ours[0](x)))  # traced again, with the hook
    assert compiles.count("teacher") == 1  # the teacher's graph was never dropped
    assert compiles.count("ours") == 2


# -- what the Monitor hears ----------------------------------------------------------------------


def test_another_models_backward_before_an_lbfgs_step_is_not_this_steps_pass() -> None:
    """An oracle twin's backward() before `opt.step(closure)` was taken for the watched
    model's pass: its gradients were read before the closure ran, all None."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    teacher = nn.Linear(4, 1)
    opt = torch.optim.LBFGS(model.parameters(), max_iter=3)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    mon = hs.Monitor(model, every=1)
    with mon:
        for _ in range(3):
            teacher(x).sum().backward()

            def closure() -> torch.Tensor:
                opt.zero_grad()
                loss = F.mse_loss(model(x), y)
                loss.backward()
                return loss

            opt.step(closure)
            mon.step()
    steps = [r for r in mon.records if r["type"] == "step"]
    assert len(steps) == 3
    for r in steps:
        assert r["scalars"]["loss"] > 0
        assert all(p["grad_norm"] is not None and p["grad_norm"] > 0 for p in r["param"].values())
    assert not [f for f in mon.findings if f.kind == "stale_gradients"]


def nan_at_step_2(model: nn.Module, edit: Callable[[int], bool] = lambda step: False) -> hs.Monitor:
    """Four SGD steps under a Monitor; step 2's input holds a NaN unless ``edit(step)``
    (called at each step's start) says it makes one instead."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(0)
    with hs.Monitor(model, every=None, on_nonfinite="log") as mon:
        for step in range(4):
            made = edit(step)
            x = torch.randn(3, 4, generator=gen)
            if step == 2 and not made:
                x[0, 0] = float("nan")
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
            mon.step()
    return mon


def test_a_capture_keeps_none_of_the_passes_the_monitor_replays() -> None:
    """The Monitor re-runs a step with a NaN to find the op that made it: those forwards are
    hookscope's, not the user's, and a capture open meanwhile recorded them as passes."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    outputs: list[torch.Tensor] = []
    model[2].register_forward_hook(lambda m, a, out: outputs.append(out.detach().clone()))
    with hs.capture(model, "2", keep="all") as cap:
        mon = nan_at_step_2(model)
    assert any(f.kind == "nonfinite" and f.step == 2 for f in mon.findings)
    assert len(outputs) > 4  # the replay ran the model (the user's own hook heard it)
    kept = cap.all("2")
    assert len(kept) == 4
    for record, out in zip(kept, outputs[:3] + outputs[-1:], strict=True):
        torch.testing.assert_close(record.output, out, equal_nan=True)


def test_an_intervention_edits_the_monitors_replay_as_it_edited_the_step() -> None:
    """...while an intervention's edits run in the replay: it must make what the step made
    (here the NaN itself), or the replay cannot say where it came from; and what an edit of
    a module's output makes is made in that module."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    poison = [False]

    def edit(value: torch.Tensor, site: hs.Site) -> torch.Tensor:
        return value.index_fill(1, torch.tensor([3]), float("nan")) if poison[0] else value

    def at_step(step: int) -> bool:
        poison[0] = step == 2
        return poison[0]

    with hs.intervene(model, {"0": edit}):
        mon = nan_at_step_2(model, at_step)
    found = [f for f in mon.findings if f.kind == "nonfinite" and f.step == 2]
    # made by the edit of '0''s output, in '0' (not in its parent: the edit runs after the
    # global module hooks, where the replay's tracer used to leave '0')
    assert found[0].module == "0"
    assert "aten.index_fill in '0' made NaN from finite inputs" in str(found[0])


@pytest.mark.parametrize("every", [1, 10])
def test_the_loss_is_heard_when_the_loop_changes_the_output_in_place(every: int) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    losses = []
    mon = hs.Monitor(model, every=every)
    with mon:
        for _ in range(4):
            logits = model(x)
            logits.div_(2.0)  # a temperature, applied in place (logits.div_(T))
            loss = F.cross_entropy(logits, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            mon.step()
    logged = [r["scalars"].get("loss") for r in mon.records if r["type"] == "step"]
    assert logged == pytest.approx(losses)


def test_a_tap_is_a_site_of_the_monitor_as_of_capture() -> None:
    torch.manual_seed(0)
    model, x = Tapped(), torch.randn(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = hs.Monitor(model, every=1)
    with mon, hs.capture(model, "tap_mid", what=("output", "grad_output")) as cap:
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
        mon.step()
    (record,) = [r for r in mon.records if r["type"] == "step"]
    assert {"fc", "tap_mid", "out"} <= set(record["act"]) and "tap_mid" in record["grad"]
    value, grad = cap["tap_mid"].output, cap["tap_mid"].grad_output[0]
    assert record["act"]["tap_mid"]["mean"] == pytest.approx(value.mean().item(), rel=1e-5)
    assert record["grad"]["tap_mid"]["norm"] == pytest.approx(grad.norm().item(), rel=1e-4)


@pytest.mark.parametrize("at", ["output", "input", "grad_output"])
@pytest.mark.parametrize("capture_first", [True, False])
def test_a_capture_sees_the_edited_value_whatever_the_order_of_the_with_items(
    at: str, capture_first: bool
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2))
    x = torch.randn(3, 4)
    point = {"output": "output", "input": "input", "grad_output": "grad_output"}[at]
    edit = (lambda v, site: tuple(t * 0 for t in v)) if at == "input" else (lambda v, s: v * 0)
    opened = [hs.capture(model, "1", what=(point,)), hs.intervene(model, "1", edit, at=at)]
    users = opened if capture_first else opened[::-1]
    with users[0], users[1]:
        model(x).sum().backward()
    cap = opened[0]
    seen = getattr(cap["1"], point)
    seen = seen[0] if isinstance(seen, tuple) else seen
    assert torch.count_nonzero(seen) == 0


@pytest.mark.parametrize("at", ["output", "input", "grad_output", "grad_input"])
@pytest.mark.parametrize("capture_first", [True, False])
def test_a_capture_sees_the_edit_whatever_order_the_hooks_went_on_in(
    at: str, capture_first: bool
) -> None:
    """As above, with the hooks attached in both orders: each verb attaches when it is made,
    so the items are made inside the ``with`` statement, as a script writes them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2))
    x = torch.randn(3, 4)
    edit = (lambda v, site: tuple(t * 0 for t in v)) if at == "input" else (lambda v, s: v * 0)
    if capture_first:
        with hs.capture(model, "1", what=at) as cap, hs.intervene(model, "1", edit, at=at):
            model(x).sum().backward()
    else:
        with hs.intervene(model, "1", edit, at=at), hs.capture(model, "1", what=at) as cap:
            model(x).sum().backward()
    seen = getattr(cap["1"], at)
    seen = seen[0] if isinstance(seen, tuple) else seen
    assert torch.count_nonzero(seen) == 0
    assert_no_hooks(model)


def grad_input_case(kind: str) -> tuple[nn.Module, str, Callable[[nn.Module], torch.Tensor]]:
    """A model, the module whose gradient input is edited and captured, and its loss. CNN:
    the second block's first conv, whose input is also the block's identity, added in
    place, and came out of an in-place ReLU. GPT-2: a whole block on the residual stream."""
    torch.manual_seed(0)
    if kind == "cnn":
        x = images()
        return ResNet().train(), "layer1.1.conv1", lambda m: m(x).square().mean()
    ids = token_ids()
    return gpt2(), "transformer.h.1", lambda m: m(ids, labels=ids).loss


def edited_grad_oracle(
    model: nn.Module, name: str, loss: Callable[[nn.Module], torch.Tensor], scale: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Plain torch: the gradient that reaches ``name``'s input through ``name`` only,
    multiplied by ``scale``, and the parameters' gradients under that edit."""
    twin = copy.deepcopy(model)
    seen: list[torch.Tensor] = []

    def edit(grad: torch.Tensor) -> torch.Tensor:
        seen.append(grad * scale)
        return seen[-1]

    def through_this_module_only(module: nn.Module, args: tuple) -> tuple:
        x = args[0].clone()  # a tensor of its own: only this module's gradient reaches it
        x.register_hook(edit)
        return (x, *args[1:])

    twin.get_submodule(name).register_forward_pre_hook(through_this_module_only)
    loss(twin).backward()
    (grad,) = seen
    return grad, {n: p.grad for n, p in twin.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", ["cnn", "gpt2"])
@pytest.mark.parametrize("capture_first", [True, False])
def test_a_grad_input_edit_is_what_a_capture_sees_whatever_the_order_of_the_with_items(
    kind: str, capture_first: bool
) -> None:
    model, name, loss = grad_input_case(kind)
    scale = 3.0
    grad, grads = edited_grad_oracle(model, name, loss, scale)

    def capture() -> hs.Capture:
        return hs.capture(model, name, what="grad_input")

    def edit() -> hs.Intervention:
        return hs.intervene(model, name, lambda g, site: g * scale, at="grad_input")

    if capture_first:
        with capture() as cap, edit():  # the hooks go on as each item is entered
            loss(model).backward()
    else:
        with edit(), capture() as cap:
            loss(model).backward()
    torch.testing.assert_close(cap[name].grad_input[0], grad)
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == grads.keys()
    for n, g in grads.items():
        torch.testing.assert_close(got[n], g, msg=lambda m, n=n: f"{n}: {m}")
    assert_no_hooks(model)
    assert_torch_is_torchs()


def test_a_capture_between_two_grad_input_edits_sees_both() -> None:
    model, name, loss = grad_input_case("cnn")
    grad, _ = edited_grad_oracle(model, name, loss, 6.0)
    double = hs.intervene(model, name, lambda g, site: g * 2, at="grad_input")
    cap = hs.capture(model, name, what="grad_input")
    triple = hs.intervene(model, name, lambda g, site: g * 3, at="grad_input")
    with double, cap, triple:
        loss(model).backward()
    torch.testing.assert_close(cap[name].grad_input[0], grad)
    assert_no_hooks(model)


def test_a_block_and_its_first_conv_each_capture_the_gradient_through_themselves() -> None:
    model, conv, loss = grad_input_case("cnn")  # the conv's input: copied for the block's call
    block = conv.removesuffix(".conv1")
    want = {name: edited_grad_oracle(model, name, loss, 1.0)[0] for name in (block, conv)}
    with hs.capture(model, [block, conv], what="grad_input") as cap:
        loss(model).backward()
    assert not torch.allclose(want[block], want[conv])  # the identity's gradient: the block's
    for name, grad in want.items():
        torch.testing.assert_close(cap[name].grad_input[0], grad)
    assert_no_hooks(model)


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("capture_first", [True, False])
def test_a_grad_input_edit_and_its_capture_agree_through_a_checkpoints_re_run(
    reentrant: bool, capture_first: bool
) -> None:
    """A block reused at two depths, each use a checkpoint segment: the re-run during
    backward is matched to its first-pass call whichever verb copied the input first."""
    torch.manual_seed(0)
    model = SharedAcrossSegments(reentrant)
    x = torch.randn(3, 4, requires_grad=reentrant)  # a reentrant checkpoint needs one
    plain = copy.deepcopy(model)
    plain.reentrant = None  # no checkpoint: the oracle
    want: list[torch.Tensor] = []

    def oracle_edit(module: nn.Module, args: tuple) -> tuple:
        x = args[0].clone()
        x.register_hook(lambda g: (want.append(g * 2), want[-1])[1])
        return (x,)

    plain.block[0].register_forward_pre_hook(oracle_edit)
    plain(x).backward()
    calls: list[int] = []

    def double(g: torch.Tensor, site: hs.Site) -> torch.Tensor:
        calls.append(site.call)
        return g * 2

    def capture() -> hs.Capture:
        return hs.capture(model, "block.0", what="grad_input", keep="all")

    def edit() -> hs.Intervention:
        return hs.intervene(model, "block.0", double, at="grad_input")

    if capture_first:
        with capture() as cap, edit():
            model(x).backward()
    else:
        with edit(), capture() as cap:
            model(x).backward()
    got = [r.grad_input[0] for r in cap.all("block.0")]
    assert len(got) == 2 and sorted(calls) == [0, 1]
    for g, w in zip(got, want[::-1], strict=True):  # the oracle's in backward order
        torch.testing.assert_close(g, w)
    for (n, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m, n=n: f"{n}: {m}")
    assert_no_hooks(model)


# -- saving and copying --------------------------------------------------------------------------


class LanguageModel(nn.Module):
    """pytorch/examples' word_language_model shape: embedding, LSTM, decoder."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.encoder = nn.Embedding(20, 8)
        self.rnn = getattr(nn, kind)(8, 8, num_layers=2)
        self.decoder = nn.Linear(8, 20)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.rnn(self.encoder(x))[0])


@pytest.mark.parametrize("kind", ["LSTM", "GRU", "RNN"])
def test_a_watched_recurrent_model_saves_and_copies_without_hookscope(kind: str) -> None:
    torch.manual_seed(0)
    model = LanguageModel(kind)
    x = torch.randint(0, 20, (5, 2))
    mon = hs.Monitor(model, every=1)
    with mon:
        model(x).sum().backward()
        mon.step()
        buffer = io.BytesIO()
        torch.save(model, buffer)
        clone = copy.deepcopy(model)
        assert nn.RNNBase.__getstate__ is not ORIGINALS[nn.RNNBase, "__getstate__"]
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for other in (loaded, clone):
        assert_no_hooks(other)
        assert torch.equal(other(x), model(x))
    assert_torch_is_torchs()


# -- per-block compile ---------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x)) + x


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning")
@pytest.mark.filterwarnings("ignore:hookscope.*traced again:hookscope.HookscopeWarning")
@pytest.mark.parametrize("warm", [False, True], ids=["attached-before-the-first-call", "after"])
def test_identical_blocks_compiled_one_by_one_run_the_hooks_of_each_block(warm: bool) -> None:
    """Dynamo skips the guard on an empty hook dict: the graph traced for blocks.0 (no hook)
    ran blocks.1 and blocks.2 too, and an edit of blocks.2.fc returned the unedited output
    without a word."""
    torch.manual_seed(0)
    net, twin = Blocks(), Blocks()
    twin.load_state_dict(net.state_dict())
    for block in net.blocks:
        block.compile(backend="eager", fullgraph=True)
    x = torch.randn(4, 8)
    if warm:
        net(x)
    for where in ("blocks.0.fc", "blocks.1.fc", "blocks.2.fc", "blocks.1.fc"):
        with hs.intervene(net, where, lambda out, site: out * 0), hs.capture(net, where) as cap:
            edited = net(x)
        with hs.intervene(twin, where, lambda out, site: out * 0):
            expected = twin(x)
        assert torch.allclose(edited, expected), where
        assert torch.count_nonzero(cap[where].output) == 0
    assert torch.allclose(net(x), twin(x))  # hooks gone, the graphs without them run again
    assert_torch_is_torchs()


@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning")
@pytest.mark.filterwarnings("ignore:hookscope.*traced again:hookscope.HookscopeWarning")
@pytest.mark.parametrize("verb", ["capture", "intervene"])
def test_gradients_inside_a_full_graph_are_refused_with_hookscopes_reason(verb: str) -> None:
    """A gradient hook cannot be compiled into a graph: under fullgraph=True the error says
    so and names the fixes (it was a Dynamo internal error pointing into hookscope); without
    fullgraph the graph breaks at that module and the gradient is right."""
    import torch._dynamo

    torch.manual_seed(0)
    net, twin = Blocks(), Blocks()
    twin.load_state_dict(net.state_dict())
    x = torch.randn(4, 8)
    for block in net.blocks:
        block.compile(backend="eager", fullgraph=True)

    def attach(model: nn.Module):
        if verb == "capture":
            # grad_output alone compiles (tests/test_compiled_grads.py); grad_input does not
            return hs.capture(model, "blocks.1.fc", what=("grad_input", "grad_output"))
        return hs.intervene(model, "blocks.1.fc", lambda g, site: g * 2, at="grad_output")

    refused = attach(net)
    with pytest.raises(torch._dynamo.exc.Unsupported, match="hookscope: .* fullgraph=True"):
        with refused:
            net(x).sum().backward()
    assert_no_hooks(net)
    for block in net.blocks:
        block.compile(backend="eager")  # the same, without fullgraph
    with attach(net) as compiled, attach(twin) as eager:
        net(x).sum().backward()
        twin(x).sum().backward()
    if verb == "capture":
        for point in ("grad_input", "grad_output"):
            got, want = (
                getattr(compiled["blocks.1.fc"], point),
                getattr(eager["blocks.1.fc"], point),
            )
            assert torch.allclose(got[0], want[0])
    for p, q in zip(net.parameters(), twin.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad)
    assert_torch_is_torchs()


# -- under hookscope watch -----------------------------------------------------------------------

WATCHED = """
import torch, torch.nn as nn, torch.nn.functional as F
import hookscope as hs
from hookscope._hooks import patched

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
teacher = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))  # frozen: not watch's
opt = torch.optim.SGD(model.parameters(), lr=0.1)
held = None
for step in range(6):
    x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
    if step == 2:  # watch's Monitor is attached by now: what it holds, before ours
        held = sorted((getattr(o, "__name__", "?"), n, u) for o, n, u in patched())
        mine = hs.Monitor(teacher, every=1)
        cap = hs.capture(model, "0")
        edit = hs.intervene(model, "1", lambda out, site: out * 1.0)
        cap.__enter__(), edit.__enter__()
    with torch.no_grad():
        soft = teacher(x).softmax(-1)
    loss = F.cross_entropy(model(x), soft)
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step == 2:
        mine.step(loss=1.0)
        edit.__exit__(None, None, None)
        cap.__exit__(None, None, None)
        mine.close()
        after = sorted((getattr(o, "__name__", "?"), n, u) for o, n, u in patched())
        assert after == held, (held, after)
        assert held, "watch's Monitor holds its wrappers"
print("ok")
"""


def test_a_scripts_own_monitor_and_capture_under_watch_give_back_only_what_they_took(
    tmp_path: pytest.TempPathFactory,
) -> None:
    import json

    from hookscope._cli import main

    script = tmp_path / "train.py"
    script.write_text(WATCHED, encoding="utf-8")
    out = tmp_path / "out"
    assert (
        main(["watch", "--out", str(out), "--every", "1", "--", sys.executable, str(script)]) == 0
    )
    lines = (out / "hookscope.jsonl").read_text(encoding="utf-8").splitlines()
    steps = [r for r in map(json.loads, lines) if r.get("type") == "step"]
    assert len(steps) == 6  # watch's own Monitor saw every step, before and after ours
