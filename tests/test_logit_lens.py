"""hs.logit_lens: the final norm and unembedding found on Hugging Face causal LMs, results
equal to plain-torch hooks; given ones for a masked LM and T5."""

from __future__ import annotations

import functools
import pickle

import pytest
import torch
from torch import nn

import hookscope as hs
from _tiny_lms import ARCHS, pair
from hookscope.testing import assert_no_hooks

CAUSAL = [name for name, spec in ARCHS.items() if spec.norm]


@functools.cache
def model_of(arch: str) -> nn.Module:
    return ARCHS[arch].build()


def block_outputs(model: nn.Module, names: list[str], x: torch.Tensor, extra: dict) -> list:
    kept = []

    def keep(module: nn.Module, args: tuple, output: object) -> None:
        kept.append((output[0] if isinstance(output, tuple) else output).clone())

    handles = [model.get_submodule(n).register_forward_hook(keep) for n in names]
    try:
        with torch.no_grad():
            logits = model(x, **extra).logits
    finally:
        for h in handles:
            h.remove()
    return kept, logits


@pytest.mark.parametrize("arch", CAUSAL)
def test_logit_lens_finds_norm_and_unembedding(arch: str) -> None:
    spec, model = ARCHS[arch], model_of(arch)
    tokens, _ = pair()
    lens = hs.logit_lens(model, tokens, spec.blocks)
    names = list(hs.select(model, spec.blocks))
    assert lens.sites == tuple(names)
    assert lens.shape == (len(names), *tokens.shape, 100)
    hidden, logits = block_outputs(model, names, tokens, {})
    norm, head = model.get_submodule(spec.norm), model.get_submodule("lm_head")
    with torch.no_grad():
        expected = torch.stack([torch.log_softmax(head(norm(h)), -1) for h in hidden])
    torch.testing.assert_close(lens.as_tensor(), expected, rtol=1e-5, atol=1e-5)
    # the last block read through the lens is the model's own prediction
    torch.testing.assert_close(lens[-1], torch.log_softmax(logits, -1), rtol=1e-5, atol=1e-5)
    values, ids = lens.top(3)
    assert ids.shape == (len(names), *tokens.shape, 3)
    torch.testing.assert_close(ids[..., 0], lens.argmax(-1))
    assert bool((values[..., 0] >= values[..., 1]).all())
    assert_no_hooks(model)


def test_masked_lm_and_t5_take_the_norm_given() -> None:
    tokens, _ = pair()
    bert = model_of("bert")
    with pytest.raises(ValueError, match="norm="):
        hs.logit_lens(bert, tokens, "bert.encoder.layer.*")
    lens = hs.logit_lens(bert, tokens, "bert.encoder.layer.*", norm=bert.cls.predictions.transform)
    _, logits = block_outputs(bert, ["bert.encoder.layer.1"], tokens, {})
    torch.testing.assert_close(lens[-1], torch.log_softmax(logits, -1), rtol=1e-5, atol=1e-5)

    t5, extra = model_of("t5"), ARCHS["t5"].extra
    scale = t5.config.d_model**-0.5  # T5 scales the decoder output before its tied lm_head
    lens = hs.logit_lens(
        t5,
        tokens,
        "decoder.block.*",
        norm="decoder.final_layer_norm",
        unembed=lambda h: t5.lm_head(h * scale),
        forward_kwargs=extra,
    )
    _, logits = block_outputs(t5, ["decoder.block.1"], tokens, extra)
    assert lens.shape == (2, 2, 3, 100)
    torch.testing.assert_close(lens[-1], torch.log_softmax(logits, -1), rtol=1e-5, atol=1e-5)


def test_unembedding_not_found_names_unembed() -> None:
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 10))
    with pytest.raises(ValueError, match="norm="):
        hs.logit_lens(model, torch.tensor([[1, 2]]), "1")
    with pytest.raises(ValueError, match="unembed="):
        hs.logit_lens(model, torch.tensor([[1, 2]]), "1", norm="2")
    lens = hs.logit_lens(model, torch.tensor([[1, 2]]), ["0", "1"], norm="2", unembed=model[3])
    with torch.no_grad():
        expected = torch.log_softmax(model(torch.tensor([[1, 2]])), -1)
    torch.testing.assert_close(lens[1], expected)


def test_notebook_view_and_pickle() -> None:
    tokens, _ = pair(batch=1, length=4)
    lens = hs.logit_lens(model_of("gpt2"), tokens, "transformer.h.*")
    page = lens._repr_html_()
    assert "transformer.h.1" in page
    assert page.count("<td") == 2 * 4
    assert str(int(lens[1, 0, 3].argmax())) in page
    back = pickle.loads(pickle.dumps(lens))
    assert back.sites == lens.sites
    torch.testing.assert_close(back.as_tensor(), lens.as_tensor())
    assert "transformer.h.0" in repr(lens)
    assert type(lens + 1) is torch.Tensor  # arithmetic gives plain tensors
