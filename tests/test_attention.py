"""The largest pre-softmax attention logit (``attn`` group) and ``attention_logit_growth``,
checked against the logits computed by hand from the model's own projections."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hookscope as hs
from models import bert, gpt2, token_ids

E, HEADS = 64, 2  # tests/models.py's GPT-2 width and heads


def _gpt2(impl: str) -> nn.Module:
    """Training mode (the statistics are training's), dropout off."""
    torch.manual_seed(0)
    return gpt2(attn_implementation=impl, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0).train()


def _heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    b, t, e = x.shape
    return x.view(b, t, heads, e // heads).transpose(1, 2)


def _logit_max(q: torch.Tensor, k: torch.Tensor, causal: bool) -> float:
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        t = scores.shape[-1]
        scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), -math.inf)
    return scores.max().item()


def _one_step(model: nn.Module, out: str, **kw: object) -> dict:
    with hs.Monitor(model, every=1, sample=None, **kw) as mon:
        getattr(model(token_ids()), out).sum().backward()
        mon.step(loss=1.0)
    return mon.records[1]["attn"]


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_gpt2_logit_max_equals_q_k_by_hand(impl: str) -> None:
    model = _gpt2(impl)
    qkv = {}
    for i, block in enumerate(model.transformer.h):
        block.attn.c_attn.register_forward_hook(lambda m, a, o, i=i: qkv.__setitem__(i, o))
    attn = _one_step(model, "logits")
    assert set(attn) == {"transformer.h.0.attn", "transformer.h.1.attn"}
    for i in range(2):
        q, k, _ = qkv[i].detach().split(E, dim=2)
        expected = _logit_max(_heads(q, HEADS), _heads(k, HEADS), causal=True)
        assert attn[f"transformer.h.{i}.attn"]["logit_max"] == pytest.approx(expected, abs=1e-4)


def test_sdpa_sample_reads_a_subset_of_query_rows() -> None:
    model = _gpt2("sdpa")
    full = _one_step(model, "logits")
    with hs.Monitor(model, every=1, sample=2) as mon:  # one query row per head: the last
        model(token_ids()).logits.sum().backward()
        mon.step(loss=1.0)
    for name, s in mon.records[1]["attn"].items():
        assert s["logit_max"] <= full[name]["logit_max"] + 1e-6


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_bert_credits_the_inner_self_attention(impl: str) -> None:
    torch.manual_seed(0)
    model = bert(
        attn_implementation=impl, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0
    ).train()
    qk = {}
    for i, layer in enumerate(model.encoder.layer):
        for part in ("query", "key"):
            getattr(layer.attention.self, part).register_forward_hook(
                lambda m, a, o, key=(i, part): qk.__setitem__(key, o.detach())
            )
    attn = _one_step(model, "last_hidden_state")
    assert set(attn) == {f"encoder.layer.{i}.attention.self" for i in range(2)}
    for i in range(2):
        expected = _logit_max(_heads(qk[i, "query"], 2), _heads(qk[i, "key"], 2), causal=False)
        assert attn[f"encoder.layer.{i}.attention.self"]["logit_max"] == pytest.approx(
            expected, abs=1e-4
        )


def test_unsampled_steps_and_eval_log_nothing() -> None:
    model = _gpt2("eager")
    with hs.Monitor(model, every=2) as mon:
        for _ in range(2):
            model(token_ids()).logits.sum().backward()
            mon.step(loss=1.0)
        model.eval()
        model(token_ids())
        mon.step(loss=1.0)
    steps = [r for r in mon.records if r["type"] == "step"]
    assert steps[0]["attn"] and "attn" not in steps[1] and steps[2]["attn"] == {}


def _softmax_inputs(run) -> float:
    """The largest finite entry torch's own ``multi_head_attention_forward`` gives softmax
    (``need_weights=True`` computes the scores in full), recorded by wrapping softmax."""
    seen = []
    original = F.softmax

    def recording(x, *args, **kwargs):
        seen.append(x[torch.isfinite(x)].max().item())
        return original(x, *args, **kwargs)

    F.softmax = recording
    try:
        with torch.no_grad():
            run()
    finally:
        F.softmax = original
    return max(seen)


@pytest.mark.parametrize("case", ["batch_first", "seq_first", "kdim", "bias_kv"])
def test_multihead_attention_logit_max_equals_torch_own_scores(case: str) -> None:
    torch.manual_seed(0)
    kw = {"kdim": 6, "vdim": 6} if case == "kdim" else {}
    mha = nn.MultiheadAttention(
        8, 2, batch_first=case != "seq_first", add_bias_kv=case == "bias_kv", **kw
    ).train()
    mha.dropout = 0.0
    x = torch.randn(3, 5, 8) * 4
    kv = torch.randn(3, 7, 6) * 4 if case == "kdim" else x
    if case == "seq_first":
        x = kv = x.transpose(0, 1)
    s = kv.shape[1] if mha.batch_first else kv.shape[0]
    causal = torch.ones(5, s, dtype=torch.bool).tril().logical_not() if case != "kdim" else None
    padding = torch.zeros(3, s, dtype=torch.bool)
    padding[0, -2:] = True  # the last two keys of the first sequence are padding
    call = lambda: mha(x, kv, kv, key_padding_mask=padding, attn_mask=causal)  # noqa: E731
    expected = _softmax_inputs(call)
    with hs.Monitor(mha, every=1, sample=None) as mon:
        call()[0].sum().backward()
        mon.step(loss=1.0)
    assert mon.records[1]["attn"][""]["logit_max"] == pytest.approx(expected, rel=1e-5)


def test_a_transformer_encoder_logs_each_layer_self_attention() -> None:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False).train()
    x = torch.randn(2, 6, 16)
    mask = nn.Transformer.generate_square_subsequent_mask(6)  # float, -inf above the diagonal
    expected = []
    for i in range(2):
        inner = model.layers[i]
        h = x if i == 0 else model.layers[0](x, src_mask=mask)
        expected.append(
            _softmax_inputs(lambda inner=inner, h=h: inner.self_attn(h, h, h, attn_mask=mask))
        )
    with hs.Monitor(model, every=1, sample=None) as mon:
        model(x, mask=mask).sum().backward()
        mon.step(loss=1.0)
    attn = mon.records[1]["attn"]
    for i in range(2):
        assert attn[f"layers.{i}.self_attn"]["logit_max"] == pytest.approx(expected[i], rel=1e-5)


def _run(scale: float, steps: int = 14) -> tuple[list[hs.Finding], list[float]]:
    """Query weights multiplied by ``scale`` before every step: the logits grow as much."""
    model = _gpt2("sdpa")
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    logits = []
    with hs.Monitor(model, every=1) as mon:
        for _ in range(steps):
            with torch.no_grad():
                model.transformer.h[1].attn.c_attn.weight[:, :E] *= scale
            opt.zero_grad()
            out = model(token_ids(), labels=token_ids())
            out.loss.backward()
            opt.step()
            mon.step()
            record = [r for r in mon.records if r["type"] == "step"][-1]
            logits.append(record["attn"]["transformer.h.1.attn"]["logit_max"])
    return mon.findings, logits


def test_growing_logits_fire_attention_logit_growth_on_that_module() -> None:
    findings, logits = _run(scale=2.0)
    assert logits[-1] > 50 and logits[-1] > 100 * logits[0]
    growth = [f for f in findings if f.kind == "attention_logit_growth"]
    assert {f.module for f in growth} == {"transformer.h.1.attn"}
    assert growth[0].value >= 50


def test_a_healthy_run_stays_silent() -> None:
    findings, logits = _run(scale=1.0)
    assert all(0 < v < 50 for v in logits)
    assert not [f for f in findings if f.kind == "attention_logit_growth"]


class FailingAttention(nn.Module):
    """A hand-written attention whose forward raises after its softmax."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        (x @ x.transpose(-1, -2)).unsqueeze(1).softmax(-1)
        raise RuntimeError("boom")


def test_torch_own_functions_are_back_when_the_monitor_closes_even_after_a_forward_raised() -> None:
    """The measuring wrappers are installed once while a Monitor with attention modules is
    open (not swapped at every forward), measure only inside its attention modules, and
    are torch's own objects again when it closes; a forward that raised leaves nothing
    running (a later call outside the model is not measured)."""
    originals = (F.scaled_dot_product_attention, torch.softmax)
    model = _gpt2("sdpa")
    with hs.Monitor(model, every=1) as mon:
        model(token_ids()).logits.sum().backward()
        assert F.scaled_dot_product_attention is not originals[0]
        mon.step(loss=1.0)
    assert (F.scaled_dot_product_attention, torch.softmax) == originals
    assert F.scaled_dot_product_attention is originals[0] and torch.softmax is originals[1]
    assert "softmax" not in vars(torch.Tensor)  # inherited from torch._C.TensorBase, as before
    failing = nn.Sequential(FailingAttention())
    with hs.Monitor(failing, every=1) as mon:
        with pytest.raises(RuntimeError, match="boom"):
            failing(torch.randn(2, 3, 4, requires_grad=True))
        (torch.randn(1, 1, 2, 2) * 1e6).softmax(-1)  # outside the model: measured by nobody
        mon.step(loss=1.0)
    logits = [r["attn"]["0"]["logit_max"] for r in mon.records if r.get("attn", {}).get("0")]
    assert logits and max(logits) < 1e5  # the softmax inside the model only
    assert F.scaled_dot_product_attention is originals[0] and torch.softmax is originals[1]
    assert "softmax" not in vars(torch.Tensor)
