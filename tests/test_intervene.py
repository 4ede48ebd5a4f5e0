import copy
from typing import Any

import pytest
import torch
import torch.nn as nn

import hookscope as hs
from _oracles import assert_same_grads, lm_loss
from hookscope.testing import assert_no_hooks
from models import SharedAcrossSegments, bert, gpt2, token_ids


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))


def test_output_edit_replaces_the_output_and_is_removed_after() -> None:
    model, x = mlp(), torch.randn(3, 4)
    with hs.intervene(model, {"1": lambda out, site: out * 0}) as edit:
        y = model(x)
    assert torch.equal(y, model[2].bias.expand(3, 2))
    assert "Intervention(at='output'" in repr(edit)
    assert not torch.equal(model(x), y)
    assert_no_hooks(model)


def test_input_edit_returns_a_new_input_bare_or_as_tuple() -> None:
    model, x = mlp(), torch.randn(3, 4)
    with hs.intervene(model, "0", lambda args, site: args[0] * 2, at="input"):
        bare = model(x)
    with hs.intervene(model, "0", lambda args, site: (args[0] * 2,), at="input"):
        tupled = model(x)
    assert torch.equal(bare, model(x * 2)) and torch.equal(tupled, bare)


def test_backward_edit_returns_a_new_grad_input() -> None:
    model = mlp()
    x = torch.randn(3, 4, requires_grad=True)
    with hs.intervene(model, {"0": lambda g, site: torch.zeros_like(g)}, at="grad_input"):
        model(x).sum().backward()
    assert torch.equal(x.grad, torch.zeros_like(x))
    assert model[0].weight.grad.abs().sum() > 0  # only the gradient to the input was changed


def test_grad_output_edit_scales_parameter_gradients() -> None:
    model, x = mlp(), torch.randn(3, 4)
    model(x).sum().backward()
    reference = model[0].weight.grad.clone()
    model.zero_grad()
    with hs.intervene(model, "0", lambda g, site: g * 3, at="grad_output"):
        model(x).sum().backward()
    assert torch.allclose(model[0].weight.grad, reference * 3)


def test_tensor_gradient_edit_on_an_intermediate_value_through_a_tap() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tap_h = hs.Tap()

        def forward(self, x):
            h = self.tap_h(x * 2)
            return (h * h).sum()

    x = torch.randn(5, requires_grad=True)
    with hs.intervene(Net(), "tap_h", lambda g, site: g + 2, at="grad_output"):
        Net()  # a second instance is not affected
    net = Net()
    with hs.intervene(net, "tap_h", lambda g, site: g + 2, at="grad_output"):
        net(x).backward()
    # Oracle: the seed's Tensor.register_hook(lambda grad: grad + 2) on the intermediate.
    x2 = x.detach().clone().requires_grad_()
    h = x2 * 2
    h.register_hook(lambda g: g + 2)
    (h * h).sum().backward()
    assert torch.equal(x.grad, x2.grad)


def test_gradient_edit_works_with_inplace_relu_after_the_module() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 1))
    x = torch.randn(8, 4)
    with hs.intervene(model, "0", lambda g, site: g * 0, at="grad_output"):
        model(x).sum().backward()
    assert torch.equal(model[0].weight.grad, torch.zeros(4, 4))


def test_wrong_shape_is_a_clear_error_naming_the_site_and_both_shapes() -> None:
    model = mlp()
    with pytest.raises(hs.InterventionError, match=r"'1'.*expected f32\[3, 4\], got f32\[3, 5\]"):
        with hs.intervene(model, {"1": lambda out, site: torch.zeros(3, 5)}):
            model(torch.randn(3, 4))
    assert_no_hooks(model)


def test_wrong_structure_is_a_clear_error() -> None:
    model = mlp()
    with pytest.raises(hs.InterventionError, match="expected f32.*got \\("):
        with hs.intervene(model, {"1": lambda out, site: (out, out)}):
            model(torch.randn(3, 4))
    with pytest.raises(hs.InterventionError, match="must return a tensor or None"):
        with hs.intervene(model, "0", lambda g, site: 1.0, at="grad_output"):
            model(torch.randn(3, 4)).sum().backward()
    assert_no_hooks(model)


def test_edit_only_the_second_call_of_a_shared_module() -> None:
    fc = nn.Linear(2, 2)
    model = nn.Sequential(fc, fc)
    x = torch.randn(1, 2)
    with hs.intervene(model, "0", lambda out, site: out * 0 if site.call == 1 else None):
        y = model(x)
    assert torch.equal(y, torch.zeros(1, 2))
    # named_modules() lists the shared module once, under its first name


def test_not_callable_and_unknown_point_fail_before_any_hook() -> None:
    model = mlp()
    with pytest.raises(TypeError, match="callable"):
        hs.intervene(model, {"0": 3})
    with pytest.raises(ValueError, match="grad_output"):
        hs.intervene(model, {"0": lambda v, s: None}, at="weights")
    with pytest.raises(hs.SelectionError):
        hs.intervene(model, {"nope": lambda v, s: None})
    assert_no_hooks(model)


def test_no_grad_gradient_edit_warns() -> None:
    model = mlp()
    with pytest.warns(hs.NoGradWarning):
        with hs.intervene(model, "0", lambda g, s: g, at="grad_output"), torch.no_grad():
            model(torch.randn(1, 4))


def test_identity_grad_input_edit_on_a_non_contiguous_view_changes_no_bit() -> None:
    class GeGLU(nn.Module):  # ModernBERT's MLP: GELU on one half of a chunk, a strided view
        def __init__(self) -> None:
            super().__init__()
            self.wi, self.act, self.wo = nn.Linear(64, 1024), nn.GELU(), nn.Linear(512, 64)

        def forward(self, x):
            a, g = self.wi(x).chunk(2, dim=-1)
            return self.wo(self.act(a) * g)

    model, x = GeGLU(), torch.randn(4, 64, 64)
    bare = model(x)
    bare.sum().backward()
    bare_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with hs.intervene(model, "act", lambda g, site: None, at="grad_input"):
        y = model(x)
        y.sum().backward()
    assert torch.equal(y, bare)
    for p, grad in zip(model.parameters(), bare_grads, strict=True):
        assert torch.equal(p.grad, grad)


def test_gradient_edits_on_reformer_apply_in_the_recompute_and_match_plain_autograd() -> None:
    from models import reformer, reformer_by_hand, token_ids

    model = reformer()
    ids, weight = token_ids(2, 16), torch.randn(2, 16, 64)

    def grads(run) -> list[torch.Tensor]:
        model.zero_grad()
        with (
            hs.intervene(
                model, "encoder.layers.1.feed_forward", lambda g, s: g * 2, at="grad_output"
            ),
            hs.intervene(
                model, "encoder.layers.2.attention.output", lambda g, s: -g, at="grad_input"
            ),
        ):
            (run() * weight).sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    got = grads(lambda: model(ids).last_hidden_state)  # edits in backward's recompute
    want = grads(lambda: reformer_by_hand(model, ids)[0])  # the same edits, plain autograd
    for (name, _), a, b in zip(model.named_parameters(), got, want, strict=True):
        # float32 sums in another order: an entry near zero of a gradient whose largest is
        # ~150 differs by ~3e-5 on some CPUs, so the absolute tolerance scales with it
        atol = 1e-5 + 1e-6 * float(b.abs().max())
        torch.testing.assert_close(a, b, rtol=1e-4, atol=atol, msg=name)
    model.zero_grad()
    (model(ids).last_hidden_state * weight).sum().backward()
    assert not torch.allclose(model.embeddings.word_embeddings.weight.grad, got[0])  # it edited
    assert_no_hooks(model)
    with pytest.warns(hs.NoGradWarning, match="model's own forward ran them with autograd off"):
        with hs.intervene(model, "encoder.layers.0", lambda g, s: g, at="grad_output"):
            model(ids).last_hidden_state.sum().backward()  # the layer itself is never re-run


# -- GPT-2 and BERT: against hand-written models and hooks ----------------------------------


def test_zero_ablating_every_gpt2_attention_equals_a_hand_written_model_without_it() -> None:
    model = gpt2()
    ids = token_ids()
    with torch.no_grad():
        base = model(ids, use_cache=False).logits

        def zero(out: Any, site: hs.Site) -> Any:
            return (torch.zeros_like(out[0]), *out[1:])

        with hs.intervene(model, {"transformer.h.*.attn": zero}):
            ablated = model(ids, use_cache=False).logits

        # Manual reimplementation: a GPT-2 whose blocks are x + mlp(ln_2(x)).
        t = model.transformer
        h = t.wte(ids) + t.wpe(torch.arange(ids.shape[1]))
        for block in t.h:
            h = h + block.mlp(block.ln_2(h))
        manual = model.lm_head(t.ln_f(h))
        after = model(ids, use_cache=False).logits
    torch.testing.assert_close(ablated, manual, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(ablated, base)
    assert torch.equal(after, base)
    assert_no_hooks(model)


def test_zeroing_a_bert_layer_output_equals_a_hand_written_forward_hook() -> None:
    model = bert()
    ids = token_ids()
    name = "encoder.layer.0.attention.self"
    with torch.no_grad():
        base = model(ids).last_hidden_state
        with hs.intervene(
            model,
            {
                name: lambda out, site: (
                    tuple(torch.zeros_like(o) if o is not None else None for o in out)
                    if isinstance(out, tuple)
                    else torch.zeros_like(out)
                )
            },
        ):
            ablated = model(ids).last_hidden_state

        def by_hand(module: nn.Module, args: Any, output: Any) -> Any:
            if isinstance(output, tuple):
                return tuple(torch.zeros_like(o) if o is not None else None for o in output)
            return torch.zeros_like(output)

        handle = model.get_submodule(name).register_forward_hook(by_hand)
        manual = model(ids).last_hidden_state
        handle.remove()
    assert torch.equal(ablated, manual)
    assert not torch.allclose(ablated, base)
    assert_no_hooks(model)


def test_identity_intervention_on_gpt2_changes_nothing_including_gradients() -> None:
    model = gpt2()
    bare = copy.deepcopy(model)
    ids = token_ids()
    seen: list[str] = []

    def watch(value: Any, site: hs.Site) -> None:
        seen.append(site.name)

    with hs.intervene(model, "transformer.h.*", watch, at="grad_output"):
        lm_loss(model, ids).backward()
    lm_loss(bare, ids).backward()
    assert sorted(seen) == ["transformer.h.0", "transformer.h.1"]
    assert_same_grads(model, bare)


# -- under activation checkpointing ---------------------------------------------------------


def _checkpointed_gpt2_pair() -> tuple[nn.Module, nn.Module]:
    model = gpt2()
    plain = copy.deepcopy(model)
    model.activation_checkpointing_enable({"use_reentrant": False})
    for m in [*model.modules(), *plain.modules()]:
        m.train()
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    return model, plain


def test_intervening_on_checkpointed_gpt2_gives_the_gradients_of_the_plain_model() -> None:
    model, plain = _checkpointed_gpt2_pair()
    ids = token_ids()
    edits = {"transformer.h.*.mlp": lambda out, site: out * 0.5}
    grads = {"transformer.h.*.attn": lambda g, site: g * 2.0}
    for m in (model, plain):
        with hs.intervene(m, edits), hs.intervene(m, grads, at="grad_output"):
            lm_loss(m, ids).backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)
    assert_no_hooks(model, only_hookscope=True)


@pytest.mark.parametrize(
    "reentrant",
    [False, True],
    ids=["non_reentrant", "reentrant"],
)
def test_call_dependent_edit_under_checkpointing_gives_the_plain_gradients(reentrant: bool) -> None:
    plain = SharedAcrossSegments(None)
    model = copy.deepcopy(plain)
    model.reentrant = reentrant
    x = torch.randn(3, 4)
    edit = {"block.0": lambda out, site: out * 3 if site.call == 1 else None}
    losses = []
    for m in (model, plain):
        with hs.intervene(m, edit):
            loss = m(x)
            loss.backward()
        losses.append(loss)
    assert torch.equal(losses[0], losses[1])  # the forward pass is right ...
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)  # ... the recompute is not
