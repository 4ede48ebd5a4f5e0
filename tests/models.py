"""Models the tests run hookscope on: real architectures built from small configs (no download)
and a hand-written torchvision-style ResNet.

Everything here is plain PyTorch / transformers code that knows nothing of hookscope, so the
tests can use it as an oracle.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

# -- Hugging Face models from configs (random weights, nothing downloaded) --------------------


def gpt2(n_layer: int = 2, **overrides: object) -> nn.Module:
    """A tiny ``GPT2LMHeadModel`` in eval mode (dropout off)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = dict(
        n_layer=n_layer,
        n_embd=64,
        n_head=2,
        vocab_size=100,
        n_positions=32,
        bos_token_id=0,
        eos_token_id=0,
    )
    config.update(overrides)
    return GPT2LMHeadModel(GPT2Config(**config)).eval()


def bert(**overrides: object) -> nn.Module:
    """A tiny ``BertModel`` in eval mode."""
    from transformers import BertConfig, BertModel

    config = dict(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
    )
    config.update(overrides)
    return BertModel(BertConfig(**config)).eval()


def vit(**overrides: object) -> nn.Module:
    """A tiny ``ViTForImageClassification`` in eval mode: 32x32 images in 8x8 patches (a
    class token, then a 4x4 grid of tokens), 5 classes."""
    from transformers import ViTConfig, ViTForImageClassification

    config = dict(
        image_size=32,
        patch_size=8,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        num_labels=5,
    )
    config.update(overrides)
    return ViTForImageClassification(ViTConfig(**config)).eval()


def reformer() -> nn.Module:
    """A tiny ``ReformerModel`` (local and LSH attention) in training mode, dropout off.

    Its reversible layers run forward under ``torch.no_grad()`` and recompute each layer's
    attention and feed_forward inside backward (which refuses to run in eval mode).
    ``hash_seed`` fixes the LSH hashing, so calling the layers by hand gives the same buckets.
    """
    from transformers import ReformerConfig, ReformerModel

    config = ReformerConfig(
        attn_layers=["local", "lsh", "local", "lsh"],
        hidden_size=32,
        feed_forward_size=64,
        num_attention_heads=2,
        attention_head_size=16,
        axial_pos_embds=False,
        max_position_embeddings=64,
        vocab_size=100,
        local_attn_chunk_length=8,
        lsh_attn_chunk_length=8,
        num_buckets=4,
        is_decoder=False,
        hash_seed=0,
        hidden_dropout_prob=0.0,
        local_attention_probs_dropout_prob=0.0,
        lsh_attention_probs_dropout_prob=0.0,
    )
    return ReformerModel(config).train()


def reformer_by_hand(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Reformer's forward with plain autograd (no reversible trick), from its own modules.

    Returns the encoder's output and, by qualified name, the output of each layer's
    attention and feed_forward, still in the autograd graph.
    """
    h = a = model.embeddings(input_ids=ids)
    parts: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(model.encoder.layers):
        f = layer.attention(hidden_states=h).hidden_states  # Y1 = X1 + f(X2)
        a = a + f
        g = layer.feed_forward(a)  # Y2 = X2 + g(Y1)
        h = h + g
        parts[f"encoder.layers.{i}.attention"] = f
        parts[f"encoder.layers.{i}.feed_forward"] = g
    return model.encoder.layer_norm(torch.cat([a, h], dim=-1)), parts


def token_ids(batch: int = 2, length: int = 8, vocab: int = 100) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length))


# -- torchvision-style ResNet, written by hand ------------------------------------------------


def conv3x3(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)


class BasicBlock(nn.Module):
    """torchvision's BasicBlock: ``ReLU(inplace=True)`` after bn1, ``out += identity``.

    ``inplace=False`` gives the same function without any in-place op, for oracles.
    """

    def __init__(self, cin: int, cout: int, stride: int = 1, inplace: bool = True) -> None:
        super().__init__()
        self.inplace = inplace
        self.conv1 = conv3x3(cin, cout, stride)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=inplace)
        self.conv2 = conv3x3(cout, cout)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample: nn.Module | None = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.conv1(x)
        out = self.bn1(out)
        out = self.relu(out)
        out = self.conv2(out)
        out = self.bn2(out)
        if self.downsample is not None:
            identity = self.downsample(x)
        if self.inplace:
            out += identity
        else:
            out = out + identity
        out = self.relu(out)
        return out


class ResNet(nn.Module):
    """A small torchvision-style ResNet (stem, two stages of BasicBlocks, pool, fc)."""

    def __init__(self, width: int = 8, classes: int = 10, inplace: bool = True) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=inplace)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = nn.Sequential(
            BasicBlock(width, width, inplace=inplace), BasicBlock(width, width, inplace=inplace)
        )
        self.layer2 = nn.Sequential(
            BasicBlock(width, 2 * width, stride=2, inplace=inplace),
            BasicBlock(2 * width, 2 * width, inplace=inplace),
        )
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(2 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv1(x)
        x = self.bn1(x)
        x = self.relu(x)
        x = self.maxpool(x)
        x = self.layer1(x)
        x = self.layer2(x)
        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        return self.fc(x)


def resnet_pair(width: int = 8) -> tuple[ResNet, ResNet]:
    """The same ResNet twice: with torchvision's in-place ops, and without any."""
    model = ResNet(width, inplace=True)
    plain = ResNet(width, inplace=False)
    plain.load_state_dict(model.state_dict())
    return model, plain


def images(batch: int = 4, size: int = 16) -> torch.Tensor:
    return torch.randn(batch, 3, size, size)


# -- checkpointing ----------------------------------------------------------------------------


class SharedAcrossSegments(nn.Module):
    """One block reused at two depths, each use its own checkpoint segment (ALBERT-style)."""

    def __init__(self, reentrant: bool | None) -> None:
        super().__init__()
        self.stem = nn.Linear(4, 4)
        self.block = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for _ in range(2):
            if self.reentrant is None:
                x = self.block(x)
            else:
                x = checkpoint(self.block, x, use_reentrant=self.reentrant)
        return x.pow(2).sum()


class Twice(nn.Module):
    """One Linear(2, 2) called twice per forward: two calls, one module."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.fc(x))


# -- compiling ---------------------------------------------------------------------------------


class Counting:
    """A Dynamo backend that counts the graphs it is given and runs them as they are."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
        self.graphs += 1
        return gm.forward
