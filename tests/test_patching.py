"""hs.patching: exact and attribution sweeps on nine Hugging Face architectures, equal to
plain-torch hook oracles; the model left as it was; no silent no-op."""

from __future__ import annotations

import functools

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
