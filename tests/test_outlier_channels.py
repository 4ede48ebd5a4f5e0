"""Outlier channels (issue 31): on a sampled step each channel's largest magnitude is read over
every position of the module's output, not over the strided sample of its values, so that a
channel made large at a few tokens is found as surely as one large everywhere; whole outlier
channels on the conv and transformer outputs of real models; healthy models stay silent."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import hookscope as hs
from hookscope._diagnose import Thresholds

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
import heldout


def channel_scaled(module: nn.Module, channel: int, scale: float, dim: int, at=None) -> None:
    """A forward hook (registered before the Monitor's, so they see its result) that scales
    one output channel (dim ``dim``), at every position or only at the index ``at``."""

    def hook(mod, args, out):
        out = out.clone()
        index = [slice(None)] * out.dim() if at is None else list(at)
        index[dim] = channel
        out[tuple(index)] *= scale
        return out

    module.register_forward_hook(hook)


# -- the channel maxima of a sampled step are the exact ones ----------------------------------


class ThreeShapes(nn.Module):
    """A projection called twice on ``(batch, sequence, hidden)`` tokens, a conv on images
    ``(N, C, H, W)``, a 1-d conv on signals ``(N, C, L)``."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 32)
        self.conv = nn.Conv2d(3, 16, 3)
        self.conv1d = nn.Conv1d(4, 12, 3)

    def forward(self, tokens, image, signal) -> torch.Tensor:
        a, b = self.proj(tokens), self.proj(2 * tokens)
        return a.mean() + b.mean() + self.conv(image).mean() + self.conv1d(signal).mean()


def test_a_sampled_steps_top_channels_are_the_exact_maxima_over_every_position() -> None:
    torch.manual_seed(0)
    model = ThreeShapes().train()
    # one value x1000 in each output: a channel at a single position, which a sample of
    # 256 values misses (the projection's second call, the conv's pixel, the signal's step)
    channel_scaled(model.proj, 7, 1000.0, 2, at=(1, 5, None))
    channel_scaled(model.conv, 3, 1000.0, 1, at=(0, None, 4, 2))
    channel_scaled(model.conv1d, 9, 1000.0, 1, at=(2, None, 17))
    outs: dict[str, list[torch.Tensor]] = {}
    for name, module in model.named_children():
        module.register_forward_hook(
            lambda m, a, out, name=name: outs.setdefault(name, []).append(out.detach())
        )
    inputs = torch.randn(4, 10, 8), torch.randn(2, 3, 20, 20), torch.randn(3, 4, 40)
    with hs.Monitor(model, every=1, sample=256) as mon:
        model(*inputs).backward()
        mon.step()
    (record,) = (r for r in mon.records if r["type"] == "step")
    for name, dims in (("proj", (0, 1)), ("conv", (0, 2, 3)), ("conv1d", (0, 2))):
        act = record["act"][name]
        assert act["sampled"] < act["numel"], name  # a sample, not the whole output
        exact = torch.stack([t.abs().amax(dim=dims) for t in outs[name]]).amax(0)
        values, index = exact.topk(4)
        assert act["channels"]["index"] == index.tolist(), name
        assert act["channels"]["absmax"] == pytest.approx(values.tolist(), rel=1e-6), name
        median = exact[exact > 0].median().item()  # torch's median: the lower of the middle two
        assert act["channels"]["median_absmax"] == pytest.approx(median, rel=1e-6), name
    assert record["act"]["proj"]["channels"]["index"][0] == 7
    assert record["act"]["conv"]["channels"]["index"][0] == 3
    assert record["act"]["conv1d"]["channels"]["index"][0] == 9  # dim 1 of (N, C, L)


# -- a channel large at a few tokens: GPT-2's MLP ---------------------------------------------


@pytest.mark.parametrize("scale", [100.0, 1000.0])
def test_a_channel_large_at_a_few_tokens_is_massive_activations_on_its_module(scale) -> None:
    # channel 5 of the first block's c_fc x scale at the first 3 of 32 tokens of every
    # sequence (48 of 512 positions), on a tiny GPT-2 learning a permutation under Adam
    module = "transformer.h.0.mlp.c_fc"
    run = dict(kind="gpt2", optimizer="adam", steps=21, every=5)
    faulty = heldout.train(**run, outlier=(module, 5, scale, "few"))
    act = [r["act"][module] for r in faulty.records if r.get("act")][-1]
    assert act["sampled"] < act["numel"]
    assert act["channels"]["index"][0] == 5
    found = [f for f in faulty.findings if f.kind == "massive_activations"]
    assert found and found[0].module == module
    assert f"channel 5 of {module!r}" in found[0].message
    assert "at a few tokens" in found[0].message


def test_gpt2_without_the_outlier_is_silent() -> None:
    twin = heldout.train(kind="gpt2", optimizer="adam", steps=21, every=5)
    assert twin.findings == []


# -- a whole outlier channel on conv outputs --------------------------------------------------


def hf_resnet() -> nn.Module:
    from transformers import ResNetConfig, ResNetForImageClassification

    config = ResNetConfig(
        num_channels=1,
        embedding_size=16,
        hidden_sizes=[16, 32],
        depths=[1, 1],
        layer_type="basic",
        num_labels=10,
    )
    return ResNetForImageClassification(config)


class Signals(nn.Module):
    """A 1-d CNN on ``(N, C, L)`` signals: conv, BatchNorm, in-place ReLU, conv, pooling."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(1, 16, 5, padding=2)
        self.bn = nn.BatchNorm1d(16)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv1d(16, 16, 5, padding=2)
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv2(self.relu(self.bn(self.conv1(x.view(-1, 1, 64)))))
        return self.head(x.mean(2))


def train_digits(model: nn.Module, steps: int, images: bool) -> hs.Monitor:
    """``steps`` steps of Adam (1e-3, batch 64) on the digits, as 16x16 images for the
    ResNet or as 64-long signals, under a Monitor sampling every 5 steps."""
    x, y = heldout.digits()
    g = torch.Generator().manual_seed(1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with hs.Monitor(model, every=5) as mon:
        for _ in range(steps):
            i = torch.randint(0, len(x), (64,), generator=g)
            if images:
                pixels = nn.functional.interpolate(x[i].view(-1, 1, 8, 8), size=16)
                logits = model(pixel_values=pixels).logits
            else:
                logits = model(x[i])
            nn.functional.cross_entropy(logits, y[i]).backward()
            opt.step()
            opt.zero_grad()
            mon.step()
    return mon


@pytest.mark.parametrize(
    ("build", "module"),
    [
        ("resnet", "resnet.encoder.stages.0.layers.0.layer.0.convolution"),  # (N, C, H, W)
        ("signals", "conv1"),  # (N, C, L)
    ],
)
def test_a_whole_channel_x100_on_a_conv_output_is_found_and_its_twin_is_silent(
    build, module
) -> None:
    def model() -> nn.Module:
        torch.manual_seed(0)
        return (hf_resnet() if build == "resnet" else Signals()).train()

    images = build == "resnet"
    faulty = model()
    channel_scaled(faulty.get_submodule(module), 5, 100.0, 1)
    mon = train_digits(faulty, 21, images)
    found = [f for f in mon.findings if f.kind == "massive_activations"]
    assert found and found[0].module == module
    assert f"channel 5 of {module!r}" in found[0].message
    assert found[0].value >= Thresholds().massive_channel
    twin = train_digits(model(), 21, images)
    assert [f for f in twin.findings if f.kind == "massive_activations"] == []
