"""hs.patching: exact and attribution sweeps on nine Hugging Face architectures, equal to
plain-torch hook oracles; the model left as it was; no silent no-op."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from torch import nn

import hookscope as hs
from _tiny_lms import ARCHS, attribution, logit_diff, pair, patched_metric
from hookscope.testing import assert_no_hooks


@functools.cache
def model_of(arch: str) -> nn.Module:
    return ARCHS[arch].build()


def blocks(arch: str) -> list[str]:
    return list(hs.select(model_of(arch), ARCHS[arch].blocks))


@pytest.mark.parametrize("arch", list(ARCHS))
def test_exact_modules_by_position_equal_the_oracle(arch: str) -> None:
    spec, model = ARCHS[arch], model_of(arch)
    clean, corrupted = pair()
    result = hs.patching(
        model, clean, corrupted, spec.blocks, logit_diff, forward_kwargs=spec.extra
    )
    names = blocks(arch)
    assert result.sites == tuple(names)
    assert result.dims == ("module", "position")
    assert result.shape == (len(names), clean.shape[1])
    expected = torch.tensor(
        [
            [
                patched_metric(
                    model, name, clean, corrupted, logit_diff, extra=spec.extra, position=p
                )
                for p in range(clean.shape[1])
            ]
            for name in names
        ]
    )
    torch.testing.assert_close(result.as_tensor(), expected, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        assert float(result.clean) == pytest.approx(
            float(logit_diff(model(clean, **spec.extra))), abs=1e-6
        )
        assert float(result.corrupted) == pytest.approx(
            float(logit_diff(model(corrupted, **spec.extra))), abs=1e-6
        )
    if spec.causal:  # positions before the corrupted one are the same in both runs
        torch.testing.assert_close(result[:, :2], result.corrupted.expand(len(names), 2))
    assert_no_hooks(model)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_exact_heads_equal_the_oracle(arch: str) -> None:
    spec, model = ARCHS[arch], model_of(arch)
    clean, corrupted = pair()
    result = hs.patching(
        model, clean, corrupted, spec.attention, logit_diff, heads=True, forward_kwargs=spec.extra
    )
    names = list(hs.select(model, spec.attention))
    assert result.dims == ("module", "position", "head")
    assert result.shape == (len(names), clean.shape[1], spec.heads)
    for i, name in enumerate(names):
        for p in (2, clean.shape[1] - 1):
            for h in range(spec.heads):
                expected = patched_metric(
                    model,
                    f"{name}.{spec.projection}",
                    clean,
                    corrupted,
                    logit_diff,
                    extra=spec.extra,
                    position=p,
                    head=(h, spec.heads),
                )
                assert float(result[i, p, h]) == pytest.approx(expected, abs=1e-5), (name, p, h)
    # without positions: each head's whole value
    whole = hs.patching(
        model,
        clean,
        corrupted,
        spec.attention,
        logit_diff,
        positions=False,
        heads=True,
        forward_kwargs=spec.extra,
    )
    assert whole.shape == (len(names), spec.heads)
    expected = patched_metric(
        model,
        f"{names[0]}.{spec.projection}",
        clean,
        corrupted,
        logit_diff,
        extra=spec.extra,
        head=(1, spec.heads),
    )
    assert float(whole[0, 1]) == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_attribution_equals_the_oracle(arch: str) -> None:
    spec, model = ARCHS[arch], model_of(arch)
    clean, corrupted = pair()
    result = hs.patching(
        model,
        clean,
        corrupted,
        spec.blocks,
        logit_diff,
        method="attribution",
        forward_kwargs=spec.extra,
    )
    assert result.method == "attribution"
    for i, name in enumerate(blocks(arch)):
        expected = attribution(model, name, clean, corrupted, logit_diff, extra=spec.extra)
        torch.testing.assert_close(result[i], expected, rtol=1e-4, atol=1e-6)
    heads = hs.patching(
        model,
        clean,
        corrupted,
        spec.attention,
        logit_diff,
        heads=True,
        method="attribution",
        forward_kwargs=spec.extra,
    )
    for i, name in enumerate(hs.select(model, spec.attention)):
        expected = attribution(
            model,
            f"{name}.{spec.projection}",
            clean,
            corrupted,
            logit_diff,
            extra=spec.extra,
            heads=spec.heads,
        )
        torch.testing.assert_close(heads[i], expected, rtol=1e-4, atol=1e-6)
    assert all(p.grad is None for p in model.parameters())
    assert_no_hooks(model)


# -- options, fallbacks and the model left as it was ------------------------------------------
def test_positions_subset_whole_values_and_batching_agree() -> None:
    model = model_of("gpt2")
    clean, corrupted = pair()
    full = hs.patching(model, clean, corrupted, "transformer.h.*", logit_diff)
    some = hs.patching(model, clean, corrupted, "transformer.h.*", logit_diff, positions=[2, -1])
    assert some.positions == (2, 5)
    torch.testing.assert_close(some.as_tensor(), full[:, [2, 5]])
    one_by_one = hs.patching(model, clean, corrupted, "transformer.h.*", logit_diff, batch_size=1)
    torch.testing.assert_close(one_by_one.as_tensor(), full.as_tensor(), rtol=1e-5, atol=1e-6)
    whole = hs.patching(model, clean, corrupted, "transformer.h.0", logit_diff, positions=False)
    assert whole.shape == (1,)
    # the whole first block's output from the clean run restores the clean metric
    assert float(whole[0]) == pytest.approx(float(whole.clean), abs=1e-5)
    assert float(full.effect()[0, 2]) == pytest.approx(
        (float(full[0, 2]) - float(full.corrupted)) / (float(full.clean) - float(full.corrupted))
    )


class SeqFirst(nn.Module):
    """Sequence first ([T, N, C]), as nn.TransformerEncoder without batch_first."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(20, 16)
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(16, 20)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids: [T, N]
        return self.head(self.encoder(self.embed(ids)))


def test_a_model_whose_batch_is_not_the_first_dimension_runs_one_by_one() -> None:
    model = SeqFirst().eval()
    clean = torch.randint(0, 20, (5, 5), generator=torch.Generator().manual_seed(0))  # T = N
    corrupted = clean.clone()
    corrupted[2] = (clean[2] + 3) % 20
    metric = lambda out: (out[-1, :, 1] - out[-1, :, 2]).sum()  # noqa: E731
    result = hs.patching(model, clean, corrupted, "encoder.layers.*", metric, positions=False)
    for i in range(2):
        name = f"encoder.layers.{i}"
        expected = patched_metric(model, name, clean, corrupted, metric, extra={})
        assert float(result[i]) == pytest.approx(expected, abs=1e-5)


def test_the_model_is_left_as_it_was() -> None:
    model = ARCHS["gpt2"].build().train()
    model.transformer.h[0].eval()
    model.lm_head.weight.grad = torch.ones_like(model.lm_head.weight)
    clean, corrupted = pair()
    for method in ("exact", "attribution"):
        hs.patching(model, clean, corrupted, "transformer.h.*", logit_diff, method=method)
        assert model.training and not model.transformer.h[0].training
        assert model.transformer.h[1].training
        assert torch.equal(model.lm_head.weight.grad, torch.ones_like(model.lm_head.weight))
        others = [p for p in model.parameters() if p is not model.lm_head.weight]
        assert all(p.grad is None for p in others)
        assert_no_hooks(model)


def test_progress_bar(capsys: pytest.CaptureFixture[str]) -> None:
    clean, corrupted = pair()
    hs.patching(
        model_of("gpt2"),
        clean,
        corrupted,
        "transformer.h.*",
        logit_diff,
        batch_size=2,
        progress=True,
    )
    assert "patching" in capsys.readouterr().err


def test_result_is_a_tensor_that_names_its_rows() -> None:
    import pickle

    clean, corrupted = pair()
    result = hs.patching(model_of("gpt2"), clean, corrupted, "transformer.h.*", logit_diff)
    assert isinstance(result, torch.Tensor)
    assert type(result[0]) is torch.Tensor and type(result - result.corrupted) is torch.Tensor
    assert "transformer.h.1" in repr(result)
    back = pickle.loads(pickle.dumps(result))
    assert back.sites == result.sites and float(back.clean) == float(result.clean)
    torch.testing.assert_close(back.as_tensor(), result.as_tensor())


class Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(20, 8)
        self.shared = nn.Linear(8, 8)
        self.unused = nn.Linear(8, 8)
        self.head = nn.Linear(8, 20)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        h = h + torch.tanh(self.shared(h)).cumsum(1)  # mixes positions, as attention does
        h = h + torch.tanh(self.shared(h)).cumsum(1)
        return self.head(h)


def test_a_module_called_twice_gets_a_row_per_call() -> None:
    model = Twice()
    clean, corrupted = torch.tensor([[1, 2, 3]]), torch.tensor([[1, 5, 3]])
    metric = lambda out: out[:, -1, 4].sum()  # noqa: E731
    result = hs.patching(model, clean, corrupted, "shared", metric)
    assert result.sites == ("shared (call 0)", "shared (call 1)")
    calls = {"n": 0}
    kept = []

    def keep(m: nn.Module, a: tuple, o: torch.Tensor) -> None:
        kept.append(o.clone())

    handle = model.shared.register_forward_hook(keep)
    with torch.no_grad():
        model(clean)
    handle.remove()

    def patch(m: nn.Module, a: tuple, o: torch.Tensor) -> torch.Tensor:
        o = o.clone()
        if calls["n"] == 1:
            o[:, 1] = kept[1][:, 1]
        calls["n"] += 1
        return o

    handle = model.shared.register_forward_hook(patch)
    with torch.no_grad():
        expected = float(metric(model(corrupted)))
    handle.remove()
    assert float(result[1, 1]) == pytest.approx(expected, abs=1e-6)


# -- no silent no-op --------------------------------------------------------------------------
def test_a_module_never_reached_is_named_and_its_row_is_nan() -> None:
    model = Twice()
    clean, corrupted = torch.tensor([[1, 2, 3]]), torch.tensor([[1, 5, 3]])
    metric = lambda out: out[:, -1, 4].sum()  # noqa: E731
    with pytest.warns(hs.NeverCalledWarning, match="'unused' never ran"):
        result = hs.patching(model, clean, corrupted, ["shared", "unused"], metric)
    assert bool(result[-1].isnan().all()) and not bool(result[0].isnan().any())
    with pytest.warns(hs.NeverCalledWarning, match="'unused' never ran"):
        hs.patching(model, clean, corrupted, ["shared", "unused"], metric, method="attribution")


def test_a_metric_that_does_not_depend_on_the_patched_value_is_named() -> None:
    model = model_of("gpt2")
    clean, corrupted = pair()
    # reads the logits at position 1, before the corrupted token: nothing to restore
    early = lambda out: out.logits[:, 1, 5].sum()  # noqa: E731
    with pytest.warns(hs.NeverCalledWarning, match="same metric"):
        hs.patching(model, clean, corrupted, "transformer.h.*", early)
    # the embedding of the position ids is the same in both runs; block 1 is not
    lens_metric = lambda out: out.logits[:, -1, 5].sum() * 0 + out.logits[:, 0, 5].sum()  # noqa: E731
    with pytest.warns(hs.NeverCalledWarning):
        hs.patching(model, clean, corrupted, "transformer.h.*", lens_metric)
    # a row whose values differ but never move the metric: the metric reads only position 2,
    # which block 1's later positions cannot reach
    at2 = lambda out: out.logits[:, 2, 5].sum()  # noqa: E731
    with pytest.warns(hs.NeverCalledWarning, match="never moved the metric"):
        hs.patching(model, clean, corrupted, "transformer.h.*", at2, positions=[3, 4, 5])


def test_attribution_names_gradients_that_never_arrived_and_metrics_without_one() -> None:
    model = model_of("gpt2")
    clean, corrupted = pair()
    at2 = lambda out: out.logits[:, 2, 5].sum()  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hs.patching(model, clean, corrupted, "transformer.h.*", at2, method="attribution")
    detached = lambda out: out.logits[:, -1, 5].sum().detach()  # noqa: E731
    with pytest.raises(TypeError, match="does not depend on the model's output"):
        hs.patching(model, clean, corrupted, "transformer.h.*", detached, method="attribution")
    blind = lambda out: out.logits[:, -1, 5].sum() * 0 + model.lm_head.weight.sum()  # noqa: E731
    with pytest.warns(hs.NeverCalledWarning, match="no gradient of the metric reached"):
        result = hs.patching(
            model, clean, corrupted, "transformer.h.*", blind, method="attribution"
        )
    assert bool((result.as_tensor() == 0).all())


def test_bad_input_is_refused_with_the_fix() -> None:
    model = model_of("gpt2")
    clean, corrupted = pair()
    with pytest.raises(hs.SelectionError):
        hs.patching(model, clean, corrupted, "transformer.blocks.*", logit_diff)
    with pytest.raises(ValueError, match="position 9 is out of range"):
        hs.patching(model, clean, corrupted, "transformer.h.*", logit_diff, positions=[9])
    with pytest.raises(ValueError, match="same shape"):
        hs.patching(model, clean, corrupted[:, :4], "transformer.h.*", logit_diff)
    with pytest.raises(TypeError, match="scalar tensor"):
        hs.patching(model, clean, corrupted, "transformer.h.*", lambda out: out.logits)
    with pytest.raises(ValueError, match=r"heads= takes"):
        hs.patching(model, clean, corrupted, "transformer.h.*", logit_diff, heads=True)
    with pytest.raises(ValueError, match=r"heads= takes"):
        hs.patching(model, clean, corrupted, "transformer.h.*.mlp", logit_diff, heads=True)
    with pytest.raises(ValueError, match="method"):
        hs.patching(model, clean, corrupted, "transformer.h.*", logit_diff, method="fast")
    # the projection and the head count can be given
    given = hs.patching(
        model,
        clean,
        corrupted,
        "transformer.h.*.attn",
        logit_diff,
        heads=("c_proj", 4),
        positions=False,
    )
    found = hs.patching(
        model, clean, corrupted, "transformer.h.*.attn", logit_diff, heads=True, positions=False
    )
    torch.testing.assert_close(given.as_tensor(), found.as_tensor())
    assert_no_hooks(model)
