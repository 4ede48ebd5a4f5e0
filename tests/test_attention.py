"""The largest pre-softmax attention logit (``attn`` group) and ``attention_logit_growth``,
checked against the logits computed by hand from the model's own projections."""

from __future__ import annotations

import math

import pytest
import torch
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


def test_unsampled_steps_eval_and_multihead_attention_log_nothing() -> None:
    model = _gpt2("eager")
    mha = nn.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(2, 4, 8)
    with hs.Monitor(model, every=2) as mon, hs.Monitor(mha, every=1) as other:
        for _ in range(2):
            model(token_ids()).logits.sum().backward()
            mon.step(loss=1.0)
        model.eval()
        model(token_ids())
        mon.step(loss=1.0)
        mha(x, x, x)[0].sum().backward()
        other.step(loss=1.0)
    steps = [r for r in mon.records if r["type"] == "step"]
    assert steps[0]["attn"] and "attn" not in steps[1] and steps[2]["attn"] == {}
    assert other.records[1]["attn"] == {}


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
