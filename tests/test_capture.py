import dataclasses
import warnings

import pytest
import torch
import torch.nn as nn

import hookscope as hs
from hookscope.testing import assert_no_hooks
from models import Twice


class ThreeInputs(nn.Module):
    def forward(self, x, y, z):
        return 2 * x + 3 * y - 5 * z


class Seed(nn.Module):
    """The seed example: one module with three inputs, used after a linear layer."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.mix = ThreeInputs()

    def forward(self, x):
        h = self.fc(x)
        return self.mix(h, h * h, x)


def test_multi_input_module_gets_one_gradient_per_input() -> None:
    model = Seed()
    x = torch.randn(4, 3, requires_grad=True)
    with hs.capture(model, "mix", what=("grad_input", "grad_output")) as cap:
        model(x).sum().backward()
    g = cap["mix"].grad_output[0]
    assert torch.equal(g, torch.ones(4, 3))
    gx, gy, gz = cap["mix"].grad_input
    assert torch.equal(gx, 2 * g) and torch.equal(gy, 3 * g) and torch.equal(gz, -5 * g)


def test_gradient_through_module_only_not_other_uses_of_the_input() -> None:
    # h feeds mix twice (as x and inside y = h*h); each slot gets only its own gradient.
    model = Seed()
    with hs.capture(model, "mix", what="grad_input") as cap:
        model(torch.randn(2, 3)).sum().backward()
    assert torch.equal(cap["mix"].grad_input[0], torch.full((2, 3), 2.0))


def test_inplace_relu_after_module_keeps_pre_relu_value_and_gradient() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(inplace=True), nn.Linear(8, 1))
    x = torch.randn(16, 4)
    with hs.capture(model, "0", what=("output", "grad_output")) as cap:
        model(x).sum().backward()
    pre = model[0](x)
    assert torch.equal(cap["0"].output, pre.detach())
    assert (cap["0"].output < 0).any()
    expected = model[2].weight.expand(16, 8) * (pre > 0)
    assert torch.allclose(cap["0"].grad_output[0], expected)
    assert_no_hooks(model)


def test_clone_false_refuses_a_value_changed_in_place() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(inplace=True))
    with hs.capture(model, "0", clone=False) as cap:
        model(torch.randn(2, 4))
    with pytest.raises(hs.HookscopeError, match="changed in place"):
        cap["0"]


@dataclasses.dataclass
class Out:
    a: torch.Tensor
    b: torch.Tensor


class Structured(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.kind = kind

    def forward(self, x):
        h = self.fc(x)
        if self.kind == "dict":
            return {"a": h, "b": h * 2, "n": 3}
        if self.kind == "dataclass":
            return Out(h, h * 2)
        return [h, (h * 2, None)]


class UsesStructured(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.inner = Structured(kind)

    def forward(self, x):
        out = self.inner(x)
        a, b = (
            (out["a"], out["b"])
            if isinstance(out, dict)
            else ((out.a, out.b) if isinstance(out, Out) else (out[0], out[1][0]))
        )
        return (a * 3 + b).sum()


@pytest.mark.parametrize("kind", ["dict", "dataclass", "list"])
def test_structured_outputs_get_one_gradient_per_tensor(kind: str) -> None:
    model = UsesStructured(kind)
    with hs.capture(model, "inner", what=("output", "grad_output")) as cap:
        model(torch.randn(2, 3)).backward()
    ga, gb = cap["inner"].grad_output
    assert torch.equal(ga, torch.full((2, 3), 3.0)) and torch.equal(gb, torch.ones(2, 3))
    assert type(cap["inner"].output).__name__ in {"dict", "Out", "list"}


def test_kwargs_are_captured() -> None:
    class KW(nn.Module):
        def forward(self, x, *, scale):
            return x * scale

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.kw = KW()

        def forward(self, x):
            return self.kw(x, scale=torch.tensor(2.0))

    model = Outer()
    with hs.capture(model, "kw", what=("input", "output")) as cap:
        model(torch.ones(2))
    assert torch.equal(cap["kw"].kwargs["scale"], torch.tensor(2.0))
    assert torch.equal(cap["kw"].input[0], torch.ones(2))


def test_keep_last_and_all_with_a_module_called_twice_per_pass() -> None:
    model = Twice()
    with hs.capture(model, "fc", keep="last") as last, hs.capture(model, "fc", keep="all") as every:
        model(torch.ones(1, 2))
        model(torch.zeros(1, 2))
    assert [r.call for r in last.all("fc")] == [0, 1]
    assert torch.equal(last.all("fc")[0].output, model.fc(torch.zeros(1, 2)).detach())
    assert [r.call for r in every.all("fc")] == [0, 1, 0, 1]


def test_no_grad_captures_outputs_and_warns_about_gradients() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    with pytest.warns(hs.NoGradWarning, match="no_grad"):
        with hs.capture(model, "0", what=("output", "grad_output")) as cap, torch.no_grad():
            model(torch.ones(1, 2))
    assert cap["0"].output.shape == (1, 2)
    assert cap["0"].grad_output is None


def test_hooks_removed_when_body_raises_including_keyboard_interrupt() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    for exc in (RuntimeError("boom"), KeyboardInterrupt()):
        with pytest.raises(type(exc)):
            with hs.capture(model, "**", what=("input", "output", "grad_input", "grad_output")):
                model(torch.ones(1, 2, requires_grad=True))
                raise exc
        assert_no_hooks(model)


def test_exception_inside_forward_leaves_bookkeeping_clean() -> None:
    class Flaky(nn.Module):
        fail = True

        def forward(self, x):
            if self.fail:
                raise ValueError("bad input")
            return x + 1

    model = nn.Sequential(nn.Linear(2, 2), Flaky())
    with hs.capture(model, "1", what=("input", "output")) as cap:
        with pytest.raises(ValueError):
            model(torch.ones(1, 2))
        assert cap._open["1"] == []
        model[1].fail = False
        model(torch.ones(1, 2))
    assert cap["1"].call == 0
    assert_no_hooks(model)


def test_module_called_through_forward_is_reported_not_silently_missing() -> None:
    class Parent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.child = nn.Linear(2, 2)

        def forward(self, x):
            return self.child.forward(x)

    model = Parent()
    with pytest.warns(hs.NeverCalledWarning, match=r"\.forward\(\.\.\.\)"):
        with hs.capture(model, "child") as cap:
            model(torch.ones(1, 2))
    assert cap.missing == ["child"]
    with pytest.raises(KeyError, match="never ran"):
        cap["child"]


def test_user_hooks_are_never_touched() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    seen = []
    handle = model[0].register_forward_hook(lambda m, i, o: seen.append(1))
    with hs.capture(model, "0"):
        model(torch.ones(1, 2))
    model(torch.ones(1, 2))
    assert seen == [1, 1]
    assert_no_hooks(model, only_hookscope=True)
    with pytest.raises(AssertionError, match="_forward_hooks"):
        assert_no_hooks(model)
    handle.remove()


def test_captured_values_hold_no_graph_and_do_not_keep_the_model_alive() -> None:
    import gc
    import weakref

    model = nn.Sequential(nn.Linear(2, 2))
    with hs.capture(model, "0", what=("input", "output", "grad_output")) as cap:
        model(torch.ones(1, 2, requires_grad=True)).sum().backward()
    assert cap["0"].output.grad_fn is None and not cap["0"].output.requires_grad
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None
    assert cap["0"].output.shape == (1, 2)


def test_device_and_dtype() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    with hs.capture(model, "0", what=("input", "output"), dtype=torch.float16, device="cpu") as cap:
        model(torch.ones(1, 2))
    assert cap["0"].output.dtype == torch.float16
    with pytest.raises(ValueError, match="floating dtype"):
        hs.capture(model, "0", dtype=torch.int64)
    assert_no_hooks(model)


def test_unknown_point_and_keep_are_clear_errors_that_leave_no_hooks() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="grad_input, grad_output"):
        hs.capture(model, "0", what="gradient")
    with pytest.raises(ValueError, match="keep"):
        hs.capture(model, "0", keep="first")
    assert_no_hooks(model)


def test_repr_names_shapes_and_dtypes() -> None:
    model = nn.Sequential(nn.Linear(2, 3))
    with hs.capture(model, "0", what=("input", "output")) as cap:
        model(torch.ones(4, 2))
    assert "Record('0', call=0, input=(f32[4, 2],), output=f32[4, 3])" in repr(cap)


def test_no_warning_for_globs_whose_modules_did_not_run() -> None:
    model = nn.ModuleDict({"used": nn.Linear(2, 2), "unused": nn.Linear(2, 2)})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with hs.capture(model, "*") as cap:
            model["used"](torch.ones(1, 2))
    assert cap.missing == ["unused"] and list(cap) == ["used"]


def test_backward_after_the_block_warns_that_no_gradient_was_recorded() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    with pytest.warns(hs.NoGradWarning, match="inside the block"):
        with hs.capture(model, "0", what="grad_output") as cap:
            loss = model(torch.ones(1, 2)).sum()
    loss.backward()
    assert cap["0"].grad_output == (None,)


# -- inputs that are non-contiguous views ------------------------------------------------------

ALL = ("input", "output", "grad_input", "grad_output")


class Halves(nn.Module):
    def forward(self, x):
        return x.chunk(2, dim=-1)


class GeGLU(nn.Module):
    """ModernBERT's MLP: the activation runs on one half of a chunk, a non-contiguous view."""

    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.wi = nn.Linear(d, 2 * hidden)
        self.halves = Halves()  # two outputs: capturing their gradients copies both
        self.act = nn.GELU()
        self.wo = nn.Linear(hidden, d)

    def forward(self, x):
        a, g = self.halves(self.wi(x))
        return self.wo(self.act(a) * g)


def _layouts(module: nn.Module) -> tuple[list, object]:
    """Record the layout of what ``module`` really runs on (a hook after hookscope's)."""
    seen: list[tuple] = []
    handle = module.register_forward_pre_hook(
        lambda m, args: seen.append((args[0].stride(), args[0].storage_offset()))
    )
    return seen, handle


@pytest.mark.parametrize("where", ["act", "**"])
@pytest.mark.parametrize("size", [(2, 5, 8, 16), (4, 64, 64, 512)], ids=["small", "vectorized"])
def test_grad_input_of_a_non_contiguous_view_changes_no_bit_of_the_output(
    size: tuple[int, int, int, int], where: str
) -> None:
    batch, length, d, hidden = size
    model = GeGLU(d, hidden)
    x = torch.randn(batch, length, d, requires_grad=True)
    bare = model(x)
    (bare_grad_x,) = torch.autograd.grad(bare.sum(), x)
    a = model.halves(model.wi(x))[0]
    assert not a.is_contiguous()  # the case in question
    with hs.capture(model, where, what=ALL) as cap:
        seen, handle = _layouts(model.act)
        y = model(x)
        y.sum().backward()
    handle.remove()
    assert torch.equal(y, bare)
    assert torch.equal(x.grad, bare_grad_x)
    assert seen == [(a.stride(), a.storage_offset())]  # hookscope's copy is laid out like a
    (expected,) = torch.autograd.grad(
        model.wo(model.act(a) * model.halves(model.wi(x))[1]).sum(), a
    )
    assert torch.equal(cap["act"].grad_input[0], expected)
    assert_no_hooks(model)


# -- models that turn autograd off themselves: Reformer's reversible layers --------------------


def test_reformer_gradients_come_from_the_recompute_in_backward_and_equal_plain_autograd() -> None:
    from models import reformer, reformer_by_hand, token_ids

    model = reformer()
    ids, weight = token_ids(2, 16), torch.randn(2, 16, 64)
    out, parts = reformer_by_hand(model, ids)
    expected = torch.autograd.grad((out * weight).sum(), list(parts.values()))
    model.zero_grad()
    where = ["encoder.layers.*.attention", "encoder.layers.*.feed_forward"]
    grad_modes: list[tuple[bool, bool]] = []
    ff = model.encoder.layers[0].feed_forward
    handle = ff.register_forward_pre_hook(
        lambda m, a: grad_modes.append(
            (torch.is_grad_enabled(), torch._C._current_graph_task_id() != -1)
        )
    )
    with hs.capture(model, where, what=("output", "grad_output")) as cap:
        ((model(ids).last_hidden_state) * weight).sum().backward()
    handle.remove()
    # Forward without autograd, then again with it inside backward: nothing else to hook.
    assert grad_modes == [(False, False), (True, True)]
    for (name, part), grad in zip(parts.items(), expected, strict=True):
        output = cap[name].output
        assert torch.equal(getattr(output, "hidden_states", output), part.detach()), name
        torch.testing.assert_close(cap[name].grad_output[0], grad, rtol=1e-5, atol=1e-4)
    assert_no_hooks(model)


def test_reformer_layers_never_rerun_warn_that_the_model_turned_autograd_off() -> None:
    from models import reformer, token_ids

    model, ids = reformer(), token_ids(2, 16)
    with pytest.warns(hs.NoGradWarning) as caught:
        with hs.capture(model, "encoder.layers.*", what="grad_output") as cap:
            model(ids).last_hidden_state.sum().backward()
    (message,) = [str(w.message) for w in caught]
    assert "the model's own forward ran them with autograd off" in message
    assert "called with autograd on" in message and "feed_forward" in message
    assert cap["encoder.layers.0"].grad_output is None  # nothing recorded, nothing wrong
    # Called under the user's torch.no_grad(), the message says just that.
    with pytest.warns(hs.NoGradWarning, match=r"the forward pass ran under torch\.no_grad"):
        with hs.capture(model, "encoder.layers.0.attention", what="grad_output"):
            with torch.no_grad():
                model(ids)
    assert_no_hooks(model)


def test_reformer_module_shared_by_two_layers_records_no_gradient_rather_than_a_wrong_one() -> None:
    from models import reformer, token_ids

    model, ids = reformer(), token_ids(2, 16)
    layers = model.encoder.layers
    layers[1].feed_forward = layers[0].feed_forward  # called twice per pass, re-run twice
    with pytest.warns(hs.NoGradWarning, match="could not tell which call"):
        with hs.capture(model, "encoder.layers.0.feed_forward", what="grad_output") as cap:
            model(ids).last_hidden_state.sum().backward()
    assert [r.grad_output for r in cap.all("encoder.layers.0.feed_forward")] == [None, None]
