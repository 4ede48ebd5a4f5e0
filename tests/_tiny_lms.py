"""Tiny Hugging Face language models of nine architectures, and plain-torch hook oracles.

Each entry says, in the test's own words, where things are in that architecture (the blocks,
the attention modules and their output projection, the final norm): hookscope must find
them with no per-architecture code, and its results must equal these hand-written hooks.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch
from torch import nn

VOCAB = 100
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    max_position_embeddings=64,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


@dataclass
class Arch:
    name: str
    build: Callable[[], nn.Module]
    blocks: str  # glob of the residual blocks
    attention: str  # glob of the attention modules
    projection: str  # the attention output projection, inside an attention module
    heads: int
    norm: str | None = None  # the final norm (causal LMs)
    causal: bool = True
    extra: dict[str, Any] = field(default_factory=dict)  # keyword inputs (T5's decoder ids)


def _build(config_cls: str, model_cls: str, **config: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import transformers

        torch.manual_seed(0)
        model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**config))
        return model.eval()

    return build


_DECODER = {**COMMON, "num_key_value_heads": 2}
ARCHS = {
    "gpt2": Arch(
        "gpt2",
        _build(
            "GPT2Config",
            "GPT2LMHeadModel",
            n_layer=2,
            n_embd=32,
            n_head=4,
            n_positions=64,
            vocab_size=VOCAB,
            bos_token_id=1,
            eos_token_id=2,
        ),
        "transformer.h.*",
        "transformer.h.*.attn",
        "c_proj",
        4,
        "transformer.ln_f",
    ),
    "llama": Arch(
        "llama",
        _build("LlamaConfig", "LlamaForCausalLM", **_DECODER),
        "model.layers.*",
        "model.layers.*.self_attn",
        "o_proj",
        4,
        "model.norm",
    ),
    "mistral": Arch(
        "mistral",
        _build("MistralConfig", "MistralForCausalLM", **_DECODER),
        "model.layers.*",
        "model.layers.*.self_attn",
        "o_proj",
        4,
        "model.norm",
    ),
    "qwen2": Arch(
        "qwen2",
        _build("Qwen2Config", "Qwen2ForCausalLM", **_DECODER),
        "model.layers.*",
        "model.layers.*.self_attn",
        "o_proj",
        4,
        "model.norm",
    ),
    "gemma": Arch(
        "gemma",
        _build("GemmaConfig", "GemmaForCausalLM", **_DECODER, head_dim=8),
        "model.layers.*",
        "model.layers.*.self_attn",
        "o_proj",
        4,
        "model.norm",
    ),
    "phi": Arch(
        "phi",
        _build("PhiConfig", "PhiForCausalLM", **COMMON),
        "model.layers.*",
        "model.layers.*.self_attn",
        "dense",
        4,
        "model.final_layernorm",
    ),
    "neox": Arch(
        "neox",
        _build("GPTNeoXConfig", "GPTNeoXForCausalLM", **COMMON),
        "gpt_neox.layers.*",
        "gpt_neox.layers.*.attention",
        "dense",
        4,
        "gpt_neox.final_layer_norm",
    ),
    "bert": Arch(
        "bert",
        _build("BertConfig", "BertForMaskedLM", **COMMON),
        "bert.encoder.layer.*",
        "bert.encoder.layer.*.attention",
        "output.dense",
        4,
        causal=False,
    ),
    "t5": Arch(
        "t5",
        _build(
            "T5Config",
            "T5ForConditionalGeneration",
            vocab_size=VOCAB,
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_heads=4,
            decoder_start_token_id=0,
            pad_token_id=0,
            eos_token_id=2,
        ),
        "encoder.block.*",
        "encoder.block.*.layer.0.SelfAttention",
        "o",
        4,
        causal=False,
        extra={"decoder_input_ids": torch.tensor([[0, 5, 6], [0, 7, 8]])},
    ),
}


def pair(batch: int = 2, length: int = 6, at: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Clean token ids, and corrupted ones differing at position ``at``."""
    g = torch.Generator().manual_seed(1)
    clean = torch.randint(3, VOCAB, (batch, length), generator=g)
    corrupted = clean.clone()
    corrupted[:, at] = (clean[:, at] + 11) % (VOCAB - 3) + 3
    return clean, corrupted


def logit_diff(output: Any) -> torch.Tensor:
    """The metric: logit of token 5 minus token 7 at the last position, summed over the batch."""
    logits = output.logits if hasattr(output, "logits") else output[0]
    return (logits[:, -1, 5] - logits[:, -1, 7]).sum()


# -- oracles: plain torch hooks, nothing of hookscope -----------------------------------------
def _first(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output


def _with_first(output: Any, value: torch.Tensor) -> Any:
    return (value, *output[1:]) if isinstance(output, tuple) else value


def value_of(
    model: nn.Module, name: str, x: torch.Tensor, extra: dict, at_input: bool
) -> torch.Tensor:
    """The module's output (first tensor), or its first positional input, on ``x``."""
    module = model.get_submodule(name)
    kept = {}

    def keep(value: torch.Tensor) -> None:
        kept["v"] = value.clone()

    if at_input:
        handle = module.register_forward_pre_hook(lambda m, a: keep(a[0]))
    else:
        handle = module.register_forward_hook(lambda m, a, o: keep(_first(o)))
    try:
        with torch.no_grad():
            model(x, **extra)
    finally:
        handle.remove()
    return kept["v"]


def patched_metric(
    model: nn.Module,
    name: str,
    clean: torch.Tensor,
    corrupted: torch.Tensor,
    metric: Callable[[Any], torch.Tensor],
    *,
    extra: dict,
    position: int | None = None,
    head: tuple[int, int] | None = None,  # (head, number of heads): patch the input of `name`
) -> float:
    """Run ``corrupted`` with ``name``'s value at ``position`` (and head) from ``clean``."""
    source = value_of(model, name, clean, extra, at_input=head is not None)
    module = model.get_submodule(name)

    def patch(value: torch.Tensor) -> torch.Tensor:
        value = value.clone()
        if head is None:
            target, src = value, source
        else:
            target = value.view(*value.shape[:-1], head[1], -1)[..., head[0], :]
            src = source.view(*source.shape[:-1], head[1], -1)[..., head[0], :]
        if position is None:
            target[...] = src
        else:
            target[:, position] = src[:, position]
        return value

    if head is None:
        handle = module.register_forward_hook(lambda m, a, o: _with_first(o, patch(_first(o))))
    else:
        handle = module.register_forward_pre_hook(lambda m, a: (patch(a[0]), *a[1:]))
    try:
        with torch.no_grad():
            return float(metric(model(corrupted, **extra)))
    finally:
        handle.remove()


def attribution(
    model: nn.Module,
    name: str,
    clean: torch.Tensor,
    corrupted: torch.Tensor,
    metric: Callable[[Any], torch.Tensor],
    *,
    extra: dict,
    heads: int | None = None,
) -> torch.Tensor:
    """(A_clean - A_corrupted) . d metric / dA per position ([T], or [T, H] per head)."""
    a_clean = value_of(model, name, clean, extra, at_input=heads is not None)
    module = model.get_submodule(name)
    kept = {}

    def grab(value: torch.Tensor) -> torch.Tensor:
        leaf = value.detach().requires_grad_()
        kept["a"] = leaf
        return leaf * 1

    if heads is None:
        handle = module.register_forward_hook(lambda m, a, o: _with_first(o, grab(_first(o))))
    else:
        handle = module.register_forward_pre_hook(lambda m, a: (grab(a[0]), *a[1:]))
    try:
        score = metric(model(corrupted, **extra))
    finally:
        handle.remove()
    (grad,) = torch.autograd.grad(score, kept["a"])
    product = (a_clean - kept["a"].detach()) * grad
    if heads is None:
        return product.sum(dim=[d for d in range(product.dim()) if d != 1])
    product = product.view(*product.shape[:-1], heads, -1).sum(-1)
    return product.sum(dim=[d for d in range(product.dim()) if d not in (1, product.dim() - 1)])
