"""``massive_activations`` on outputs of other shapes than ``heldout.py``'s (issue 31).

Tiny models from configs, random weights, no download: GPT-2 learning a permutation of 100
tokens (16 x 32), BERT (masked LM learning a fixed map of tokens), ViT and a Hugging Face
ResNet on scikit-learn's digits as 16x16 images (batch 64), ``heldout.py``'s CNN (BatchNorm,
in-place ReLUs) and MLP. Adam 1e-3, ``every=5``.

``python benchmarks/outlier_shapes.py healthy``: each model at init (30 steps) and after 300
unwatched steps (60 more): its findings, the largest channel over the median channel and the
largest magnitude over the RMS on any module and sampled step.

``python benchmarks/outlier_shapes.py outlier [gpt2,bert,...]``: a forward hook scales output
channel 5 of a module x100 or x1000, at every position (``all``) or at 3 positions of the first
sequence / image only (``few``), 30 steps; *found* when a finding names that module and
channel; ``min chan``: the weakest sampled step's channel ratio of that module.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
import heldout

import hookscope as hs

X, Y = heldout.digits()


def build(kind: str):
    """The model, a batch maker and its loss."""
    torch.manual_seed(0)
    if kind == "bert":
        from transformers import BertConfig, BertForMaskedLM

        config = BertConfig(
            vocab_size=100,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=128,
            max_position_embeddings=32,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
        perm = torch.randperm(100)

        def tokens(g):
            ids = torch.randint(0, 100, (16, 32), generator=g)
            return ids, perm[ids]

        return BertForMaskedLM(config), tokens, lambda m, x, y: m(input_ids=x, labels=y).loss
    if kind == "gpt2":
        model, perm = heldout.gpt2(), torch.randperm(100)

        def chain(g):
            ids = torch.empty(16, 32, dtype=torch.long)
            ids[:, 0] = torch.randint(0, 100, (16,), generator=g)
            for t in range(1, 32):
                ids[:, t] = perm[ids[:, t - 1]]
            return ids, ids

        return model, chain, lambda m, x, y: m(x, labels=y).loss

    def digits(g):
        i = torch.randint(0, len(X), (64,), generator=g)
        if kind in ("vit", "resnet"):
            return nn.functional.interpolate(X[i].view(-1, 1, 8, 8), size=16), Y[i]
        return X[i], Y[i]

    if kind == "vit":
        from transformers import ViTConfig, ViTForImageClassification

        model = ViTForImageClassification(
            ViTConfig(
                image_size=16,
                patch_size=4,
                num_channels=1,
                hidden_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                intermediate_size=128,
                num_labels=10,
                hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0,
            )
        )
    elif kind == "resnet":
        from transformers import ResNetConfig, ResNetForImageClassification

        model = ResNetForImageClassification(
            ResNetConfig(
                num_channels=1,
                embedding_size=16,
                hidden_sizes=[16, 32],
                depths=[1, 1],
                layer_type="basic",
                num_labels=10,
            )
        )
    else:
        model = heldout.MLP() if kind == "mlp" else heldout.CNN()
        return model, digits, lambda m, x, y: nn.functional.cross_entropy(m(x), y)
    return model, digits, lambda m, x, y: nn.functional.cross_entropy(m(pixel_values=x).logits, y)


TARGETS = {
    "gpt2": ["transformer.h.0.mlp.c_fc"],
    "bert": ["bert.encoder.layer.0.intermediate.dense", "bert.encoder.layer.1.output.LayerNorm"],
    "vit": ["vit.layers.0.mlp.fc1", "vit.embeddings.patch_embeddings.projection"],
    "resnet": [
        "resnet.encoder.stages.0.layers.0.layer.0.convolution",
        "resnet.embedder.embedder.normalization",
    ],
    "cnn": ["conv2"],
    "mlp": ["2"],
}


def scale_channel(module: nn.Module, channel: int, scale: float, where: str) -> None:
    def hook(mod, args, out):
        out = out.clone()
        dim = out.dim() - 1 if out.dim() == 3 else 1
        index: list = [slice(None)] * out.dim()
        index[dim] = channel
        if where == "few":  # 3 positions of the first sequence / image
            index[0] = 0
            other = [d for d in range(1, out.dim()) if d != dim]
            if other:
                index[other[0]] = slice(0, 3)
            else:
                index[0] = slice(0, 3)
        out[tuple(index)] *= scale
        return out

    module.register_forward_hook(hook)


def run(kind: str, steps: int, fault=None, pre: int = 0):
    model, batch, loss = build(kind)
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    for _ in range(pre):  # trained first, unwatched
        loss(model, *batch(g)).backward()
        opt.step()
        opt.zero_grad()
    if fault:
        scale_channel(model.get_submodule(fault[0]), 5, fault[1], fault[2])
    losses = []
    with hs.Monitor(model, every=5) as mon:
        for _ in range(steps):
            value = loss(model, *batch(g))
            value.backward()
            opt.step()
            opt.zero_grad()
            mon.step()
            losses.append(value.item())
    return mon, losses


def ratios(mon: hs.Monitor, only: str | None = None) -> list[tuple[str, float, float]]:
    """(module, largest channel / median channel, largest magnitude / RMS) per sampled step."""
    out = []
    for r in mon.records:
        for name, s in (r.get("act") or {}).items():
            c = s.get("channels")
            if (only and name != only) or not c or len(c["index"]) < 4:
                continue
            if not c["median_absmax"] > 0 or not s["absmax_over_rms"] > 0:
                continue
            rms = s["absmax"] / s["absmax_over_rms"]
            out.append((name, c["absmax"][0] / c["median_absmax"], c["absmax"][0] / rms))
    return out


def main() -> None:
    torch.set_num_threads(1)
    what = sys.argv[1] if len(sys.argv) > 1 else "healthy"
    kinds = sys.argv[2].split(",") if len(sys.argv) > 2 else list(TARGETS)
    for kind in kinds:
        if what == "healthy":
            for pre, steps in ((0, 30), (300, 60)):
                start = time.perf_counter()
                mon, losses = run(kind, steps, pre=pre)
                seen = ratios(mon)
                chan = max(seen, key=lambda t: t[1])
                rms = max(seen, key=lambda t: t[2])
                found = [f"{f.kind}@{f.step}:{f.module}" for f in mon.findings]
                print(
                    f"healthy {kind:6} trained {pre:3} steps, loss {losses[0]:.2f} -> "
                    f"{losses[-1]:.2f}: largest channel {chan[1]:.1f}x ({chan[0]}), "
                    f"absmax/RMS {rms[2]:.1f} ({rms[0]}); findings {found[:4] or 'none'} "
                    f"[{time.perf_counter() - start:.0f}s]",
                    flush=True,
                )
            continue
        for module in TARGETS[kind]:
            for where in ("all", "few"):
                for scale in (100.0, 1000.0):
                    mon, _ = run(kind, 30, fault=(module, scale, where))
                    hits = [f for f in mon.findings if f.kind == "massive_activations"]
                    ok = any(f.module == module and "channel 5 of" in f.message for f in hits)
                    weakest = min(t[1] for t in ratios(mon, module))
                    print(
                        f"outlier {kind:6} {module:52} {where:3} x{scale:<5.0f} "
                        f"{'found' if ok else 'MISSED':6} min chan {weakest:.0f}",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
