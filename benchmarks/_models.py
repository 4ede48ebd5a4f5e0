"""The GPT-2 the benchmarks measure: 4 x 256, 5000 tokens, random weights, nothing downloaded."""

from __future__ import annotations

import os
from typing import Any

from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def gpt2(**overrides: Any) -> nn.Module:
    """``GPT2LMHeadModel`` from a small config; ``overrides`` change single fields."""
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging

    logging.set_verbosity_error()
    config = dict(
        n_layer=4,
        n_embd=256,
        n_head=4,
        vocab_size=5000,
        n_positions=128,
        bos_token_id=0,
        eos_token_id=0,
        use_cache=False,
        loss_type="ForCausalLM",
    )
    config.update(overrides)
    return GPT2LMHeadModel(GPT2Config(**config))
