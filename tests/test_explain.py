"""hs.explain against plain-torch oracles of each formula, on CNNs written here with the
in-place ops of torchvision (ResNet's BasicBlock, DenseNet's ``norm5`` then an in-place
ReLU, VGG), and on transformers built from configs (ViT, Swin, ConvNeXt, ResNet).

Each oracle runs the *not-in-place twin* of the model (same weights, no in-place op) with a
forward hook that keeps the module's output and ``torch.autograd.grad`` written out here,
then the paper's formula in einsum form. explain runs the in-place model: equal maps prove
the formula and the copy at hook time at once.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hookscope as hs
from hookscope.testing import assert_no_hooks
from models import resnet_pair


@pytest.fixture(autouse=True)
def _one_thread():
    """Small tensors: one intra-op thread (two, on a loaded machine, cost 10x per call)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


CAMS = ("gradcam", "gradcam++", "xgradcam", "hirescam", "layercam")
ALL_METHODS = (*CAMS, "scorecam", "eigencam", "grad_x_act", "integrated_gradients")


# -- models -------------------------------------------------------------------------------------


class DenseNetLike(nn.Module):
    """torchvision DenseNet's tail: ``features`` ends in ``norm5`` (BatchNorm), then
    ``F.relu(features, inplace=True)`` in forward, pool, classifier."""

    def __init__(self, inplace: bool = True, classes: int = 6) -> None:
        super().__init__()
        self.inplace = inplace
        self.features = nn.Sequential()
        self.features.add_module("conv0", nn.Conv2d(3, 8, 3, padding=1, bias=False))
        self.features.add_module("norm0", nn.BatchNorm2d(8))
        self.features.add_module("relu0", nn.ReLU(inplace=inplace))
        self.features.add_module("conv1", nn.Conv2d(8, 12, 3, stride=2, padding=1))
        self.features.add_module("norm5", nn.BatchNorm2d(12))
        self.classifier = nn.Linear(12, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = self.features(x)
        out = F.relu(features, inplace=self.inplace)
        out = F.adaptive_avg_pool2d(out, (1, 1)).flatten(1)
        return self.classifier(out)


class VGGLike(nn.Module):
    def __init__(self, inplace: bool = True, classes: int = 5) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.ReLU(inplace=inplace),
            nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1),
            nn.ReLU(inplace=inplace),
            nn.Conv2d(16, 16, 3, padding=1),
            nn.ReLU(inplace=inplace),
        )
        self.avgpool = nn.AdaptiveAvgPool2d((2, 2))
        self.classifier = nn.Sequential(
            nn.Linear(64, 32), nn.ReLU(inplace=inplace), nn.Dropout(0.5), nn.Linear(32, classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.avgpool(self.features(x)).flatten(1))


def _twins(kind: str) -> tuple[nn.Module, nn.Module, str]:
    """(in-place model, not-in-place twin, the module to explain), BatchNorm statistics not
    at their initial values so that eval mode matters."""
    if kind == "resnet":
        model, twin = resnet_pair()
        where = "layer2.1.bn2"  # followed by out += identity and ReLU(inplace=True)
    else:
        make = {"densenet": DenseNetLike, "vgg": VGGLike}[kind]
        model, twin = make(inplace=True), make(inplace=False)
        twin.load_state_dict(model.state_dict())
        where = {"densenet": "features.norm5", "vgg": "features.5"}[kind]
    with torch.no_grad():  # BatchNorm statistics of a trained-looking model
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)
    twin.load_state_dict(model.state_dict())
    return model, twin, where


# -- oracles (no hookscope) ---------------------------------------------------------------------


def plain_a_g(
    model: nn.Module, x: torch.Tensor, name: str, target: torch.Tensor | None = None
) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """Each call's output A and G = d(sum of target logits)/dA, by a forward hook and
    torch.autograd.grad, on a model with no in-place op (so A is intact)."""
    module = dict(model.named_modules())[name]
    outs: list[torch.Tensor] = []
    handle = module.register_forward_hook(lambda m, args, out: outs.append(out))
    model.eval()
    try:
        with torch.enable_grad():
            logits = model(x)
    finally:
        handle.remove()
    target = logits.argmax(1) if target is None else target
    score = logits.gather(1, target[:, None]).sum()
    grads = torch.autograd.grad(score, outs)
    return [o.detach() for o in outs], list(grads), target


def formula(method: str, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The contract's formulas, written in einsum form over [N, K, H, W]."""
    if method == "gradcam":
        w = g.mean((2, 3))
    elif method == "xgradcam":
        w = torch.einsum("nkhw,nkhw->nk", g, a) / (a.sum((2, 3)) + 1e-7)
    elif method == "gradcam++":
        denom = 2 * g**2 + a.sum((2, 3), keepdim=True) * g**3
        alpha = g**2 / denom
        alpha[denom == 0] = 0
        w = torch.einsum("nkhw,nkhw->nk", g.clamp(min=0), alpha)
    elif method == "hirescam":
        return torch.einsum("nkhw,nkhw->nhw", g, a).clamp(min=0)
    elif method == "layercam":
        return torch.einsum("nkhw,nkhw->nhw", g.clamp(min=0), a).clamp(min=0)
    else:
        raise AssertionError(method)
    return torch.einsum("nk,nkhw->nhw", w, a).clamp(min=0)


def plain_scorecam(model: nn.Module, x: torch.Tensor, a: torch.Tensor, t: torch.Tensor):
    """One masked input at a time: each channel upsampled, min-max scaled, times the input."""
    maps = []
    for n in range(x.shape[0]):
        scores = []
        for k in range(a.shape[1]):
            up = F.interpolate(a[n, k][None, None], size=x.shape[2:], mode="bilinear")
            low, high = up.min(), up.max()
            mask = (up - low) / (high - low) if high > low else torch.zeros_like(up)
            with torch.no_grad():
                scores.append(model(x[n : n + 1] * mask)[0, t[n]])
        w = torch.softmax(torch.stack(scores), 0)
        maps.append(torch.einsum("k,khw->hw", w, a[n]).clamp(min=0))
    return torch.stack(maps)


def plain_eigencam(a: torch.Tensor) -> torch.Tensor:
    """numpy's SVD of each sample's positions x channels matrix, centred; the direction
    signed to point along the mean activation (the centred projection sums to 0)."""
    out = []
    for sample in a.double().numpy():
        m = sample.reshape(sample.shape[0], -1).T  # positions x channels
        v = np.linalg.svd(m - m.mean(0), full_matrices=False)[2][0]
        v = v if (m @ v).sum() >= 0 else -v
        out.append(torch.from_numpy(((m - m.mean(0)) @ v).reshape(sample.shape[1:])))
    return torch.stack(out).float()


def close(actual: torch.Tensor, expected: torch.Tensor, rtol: float = 1e-5) -> None:
    """Equal within rtol of the largest value (maps are compared whole)."""
    scale = expected.abs().max().clamp(min=1e-12)
    torch.testing.assert_close(actual / scale, expected / scale, rtol=0, atol=rtol)


def state_of(model: nn.Module) -> dict:
    """Everything explain promises to leave alone, copied."""
    return {
        "modes": [m.training for m in model.modules()],
        "grads": {
            n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()
        },
        "requires_grad": {n: p.requires_grad for n, p in model.named_parameters()},
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "buffers": {n: b.clone() for n, b in model.named_buffers()},
        "rng": torch.get_rng_state(),
    }


def assert_same_state(before: dict, after: dict) -> None:
    assert before["modes"] == after["modes"]
    assert before["requires_grad"] == after["requires_grad"]
    assert before["grads"].keys() == after["grads"].keys()
    for name, g in before["grads"].items():
        other = after["grads"][name]
        assert (g is None) == (other is None), name
        assert g is None or torch.equal(g, other), name
    for kind in ("params", "buffers"):
        for name, t in before[kind].items():
            assert torch.equal(t, after[kind][name]), (kind, name)
    assert torch.equal(before["rng"], after["rng"])


# -- formulas against the oracles ---------------------------------------------------------------


@pytest.mark.parametrize("kind", ["resnet", "densenet", "vgg"])
@pytest.mark.parametrize("method", CAMS)
def test_cam_equals_the_plain_torch_formula_on_the_in_place_model(kind: str, method: str) -> None:
    model, twin, where = _twins(kind)
    x = torch.randn(3, 3, 16, 16)
    exp = hs.explain(model, x, where, method)
    (a,), (g,), t = plain_a_g(twin, x, where)
    assert torch.equal(exp.target, t)
    assert exp[where].dtype == torch.float32 and exp[where].shape == (3, *a.shape[2:])
    close(exp[where], formula(method, a, g))
    assert exp.layout == "NCHW"


@pytest.mark.parametrize("kind", ["resnet", "densenet"])
def test_scorecam_eigencam_grad_x_act_equal_their_oracles(kind: str) -> None:
    model, twin, where = _twins(kind)
    x = torch.randn(2, 3, 16, 16)
    (a,), (g,), t = plain_a_g(twin, x, where)
    close(
        hs.explain(model, x, where, "scorecam", batch_size=5)[where], plain_scorecam(twin, x, a, t)
    )
    close(hs.explain(model, x, where, "eigencam")[where], plain_eigencam(a), rtol=1e-4)
    close(hs.explain(model, x, where, "grad_x_act")[where], g * a)


@pytest.mark.parametrize("method", ALL_METHODS)
def test_in_place_model_and_its_twin_give_the_same_maps(method: str) -> None:
    """torchvision DenseNet's norm5 then F.relu(inplace=True): the peers' maps move by up
    to 0.78 on a [0, 1] scale here; explain's are the twin's."""
    model, twin, where = _twins("densenet")
    x = torch.randn(4, 3, 16, 16)
    kw = {"steps": 8} if method == "integrated_gradients" else {}
    a = hs.explain(model, x, where, method, **kw)
    b = hs.explain(twin, x, where, method, **kw)
    assert torch.equal(a.target, b.target)
    close(a[where], b[where], rtol=1e-6)
    close(a.heatmap(where), b.heatmap(where), rtol=1e-5)


def test_scorecam_batch_size_only_bounds_the_masked_inputs() -> None:
    model, _, where = _twins("vgg")
    x = torch.randn(3, 3, 16, 16)
    one = hs.explain(model, x, where, "scorecam", batch_size=1)[where]
    many = hs.explain(model, x, where, "scorecam", batch_size=1000)[where]
    close(one, many, rtol=1e-6)


# -- Captum as a second oracle ------------------------------------------------------------------


def _captum():
    return pytest.importorskip("captum.attr")


def test_gradcam_grad_x_act_and_integrated_gradients_equal_captum() -> None:
    attr = _captum()
    model, twin, where = _twins("resnet")
    twin.eval()
    layer = dict(twin.named_modules())[where]
    x = torch.randn(3, 3, 16, 16)
    exp = hs.explain(model, x, where, "gradcam")
    t = exp.target
    cam = attr.LayerGradCam(twin, layer).attribute(x, target=t, relu_attributions=True)
    close(exp[where], cam[:, 0])
    gxa = attr.LayerGradientXActivation(twin, layer).attribute(x, target=t)
    close(hs.explain(model, x, where, "grad_x_act", target=t)[where], gxa)
    ig = attr.LayerIntegratedGradients(twin, layer).attribute(
        x, baselines=torch.zeros_like(x), target=t, n_steps=16, method="riemann_middle"
    )
    close(hs.explain(model, x, where, "integrated_gradients", target=t, steps=16)[where], ig, 1e-4)


def test_integrated_gradients_is_complete_at_64_steps() -> None:
    """Its sum is score(x) - score(baseline) within 1 % (the rest of the model runs from the
    patched module, which every path to the output goes through)."""
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(inplace=True),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.Tanh(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 4),
    )
    x = torch.randn(3, 3, 12, 12)
    base = torch.full_like(x, 0.3)
    exp = hs.explain(model, x, "2", "integrated_gradients", target=2, steps=64, baseline=base)
    with torch.no_grad():
        delta = model(x)[:, 2] - model(base)[:, 2]
    total = exp["2"].sum((1, 2, 3))
    assert (delta.abs() > 1e-3).all()
    torch.testing.assert_close(total, delta, rtol=0.01, atol=1e-5)


# -- the model left exactly as it was -----------------------------------------------------------


@pytest.mark.parametrize("train", [False, True])
@pytest.mark.parametrize("method", ["gradcam", "scorecam", "integrated_gradients"])
def test_model_state_is_left_exactly_as_it_was(method: str, train: bool) -> None:
    model, _, where = _twins("vgg")
    model.train()
    model.features[0].eval()  # a submodule in its own mode
    model.features[3].weight.requires_grad_(False)
    x = torch.randn(2, 3, 16, 16)
    model(x).sum().backward()  # accumulated gradients; features[3].weight has none
    model.classifier[0].bias.grad = None
    before = state_of(model)
    hs.explain(model, x, where, method, train=train, steps=4)
    assert_same_state(before, state_of(model))
    assert_no_hooks(model)


def test_bn_statistics_and_rng_survive_a_training_mode_explanation() -> None:
    model, _, where = _twins("resnet")
    x = torch.randn(2, 3, 16, 16)
    before = state_of(model)
    exp = hs.explain(model, x, "layer1.0.bn1", "gradcam", train=True)
    assert exp["layer1.0.bn1"].shape == (2, 8, 8)
    assert_same_state(before, state_of(model))
    # explained in eval mode by default: the eval-mode oracle
    _, twin, _ = _twins("resnet")
    twin.load_state_dict(model.state_dict())
    (a,), (g,), _ = plain_a_g(twin, x, where)
    close(hs.explain(model, x, where)[where], formula("gradcam", a, g))


def test_no_parameter_gradient_and_no_gradient_below_the_module() -> None:
    model, _, where = _twins("resnet")
    reached = []
    # the user's own hook on a module below the explained one: no gradient may reach it
    model.layer1.register_full_backward_hook(lambda m, gi, go: reached.append(1))
    hs.explain(model, torch.randn(2, 3, 16, 16), where, "gradcam")
    assert reached == []
    assert all(p.grad is None for p in model.parameters())
    assert_no_hooks(model, only_hookscope=True)


def test_frozen_model_and_no_grad_and_inference_mode() -> None:
    model, _, where = _twins("densenet")
    x = torch.randn(2, 3, 16, 16)
    expected = hs.explain(model, x, where)[where]
    with torch.no_grad():
        close(hs.explain(model, x, where)[where], expected, 1e-6)
    with torch.inference_mode():
        close(hs.explain(model, torch.randn(2, 3, 16, 16).copy_(x), where)[where], expected, 1e-6)
    model.requires_grad_(False)
    close(hs.explain(model, x, where)[where], expected, 1e-6)
    assert all(not p.requires_grad for p in model.parameters())


def test_no_hook_is_left_when_the_forward_raised() -> None:
    class Fails(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)
            self.bn = nn.BatchNorm2d(4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.bn(self.conv(x))
            raise RuntimeError("boom")

    model = Fails().train()
    x = torch.randn(2, 3, 8, 8)
    before = state_of(model)
    with pytest.raises(RuntimeError, match="boom"):
        hs.explain(model, x, "conv", train=True)
    assert_no_hooks(model)
    assert_same_state(before, state_of(model))


def test_a_sample_s_map_does_not_depend_on_the_batch() -> None:
    model, _, where = _twins("resnet")
    x = torch.randn(4, 3, 16, 16)
    for method in ("gradcam", "scorecam", "eigencam", "layercam"):
        batch = hs.explain(model, x, where, method)[where]
        alone = hs.explain(model, x[2:3], where, method)[where]
        close(batch[2:3], alone, 1e-5)


# -- calls, targets, layouts --------------------------------------------------------------------


class ConvTwice(nn.Module):
    """One conv called twice per forward (weights shared)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 6, 3, padding=1)
        self.block = nn.Conv2d(6, 6, 3, padding=1)
        self.fc = nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.block(torch.relu(self.block(self.stem(x)))))
        return self.fc(x.mean((2, 3)))


def test_a_module_called_twice_gives_one_map_per_call() -> None:
    model = ConvTwice()
    x = torch.randn(2, 3, 10, 10)
    exp = hs.explain(model, x, "block", "gradcam")
    first, second = exp.all("block")
    (a0, a1), (g0, g1), _ = plain_a_g(model, x, "block")
    close(first, formula("gradcam", a0, g0))
    close(second, formula("gradcam", a1, g1))
    assert torch.equal(exp["block"], second)
    assert [p.name for p in exp.save(_tmp("twice"))] == [
        "block.call0_0.png",
        "block.call0_1.png",
        "block.call1_0.png",
        "block.call1_1.png",
    ]


def _tmp(name: str):
    import tempfile
    from pathlib import Path

    return Path(tempfile.mkdtemp(prefix=f"explain-{name}-"))


def test_targets_int_sequence_tensor_and_callable() -> None:
    model, twin, where = _twins("vgg")
    x = torch.randn(3, 3, 16, 16)
    t = torch.tensor([4, 0, 2])
    (a,), (g,), _ = plain_a_g(twin, x, where, t)
    expected = formula("gradcam", a, g)
    for target in (t, [4, 0, 2], (4, 0, 2)):
        exp = hs.explain(model, x, where, target=target)
        close(exp[where], expected)
        assert exp.target.tolist() == [4, 0, 2]
    with torch.no_grad():
        logits = twin(x)
    exp = hs.explain(model, x, where, target=1)
    assert exp.target.tolist() == [1, 1, 1]
    torch.testing.assert_close(exp.score, logits[:, 1])
    by_fn = hs.explain(model, x, where, target=lambda out: out[torch.arange(3), t])
    assert by_fn.target is None
    close(by_fn[where], expected)


def test_bad_input_gives_clear_errors_and_leaves_the_model() -> None:
    model, _, where = _twins("vgg")
    x = torch.randn(2, 3, 16, 16)
    before = state_of(model)
    with pytest.raises(hs.ExplainError, match="did you mean 'gradcam'"):
        hs.explain(model, x, where, "gradcm")
    with pytest.raises(hs.TargetError, match="out of range.*5 classes") as info:
        hs.explain(model, x, where, target=7)
    assert isinstance(info.value, IndexError) and isinstance(info.value, ValueError)
    with pytest.raises(hs.TargetError, match="3 indices.*2 samples"):
        hs.explain(model, x, where, target=[1, 2, 3])
    with pytest.raises(hs.TargetError, match="shape \\[2\\]"):
        hs.explain(model, x, where, target=lambda out: out)
    with pytest.raises(hs.SelectionError):
        hs.explain(model, x, "features.99")
    with pytest.raises(hs.LayoutError, match="no positions"):
        hs.explain(model, x, "classifier.0")
    with pytest.raises(hs.ExplainError, match="does not depend"):
        hs.explain(model, x, where, target=lambda out: out.detach()[:, 0])
    assert_same_state(before, state_of(model))
    assert_no_hooks(model)


def test_outputs_without_logits_need_a_callable_target() -> None:
    class TupleOut(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3, padding=1)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            f = self.conv(x)
            return f.mean((2, 3)), f

    model = TupleOut()
    x = torch.randn(2, 3, 8, 8)
    with pytest.raises(hs.TargetError, match="target=callable"):
        hs.explain(model, x, "conv")
    exp = hs.explain(model, x, "conv", target=lambda out: out[1][:, 2, 3, 3])
    # the score is one position of channel 2: G is 1 there, 0 elsewhere; gradcam weights 1/64
    a = model.conv(x).detach()
    close(exp["conv"], (a[:, 2] / 64).clamp(min=0))


# -- layouts --------------------------------------------------------------------------------------


class SwinLike(nn.Module):
    """torchvision Swin's layout: patches embedded by a conv, permuted to [N, H, W, C],
    LayerNorm and MLPs on the last dimension."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Conv2d(3, 12, 4, stride=4)
        self.norm = nn.LayerNorm(12)
        self.mlp = nn.Sequential(nn.Linear(12, 24), nn.GELU(), nn.Linear(24, 12))
        self.head = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x).permute(0, 2, 3, 1)
        h = self.norm(h)
        h = h + self.mlp(h)
        return self.head(h.mean((1, 2)))


def test_swin_nhwc_is_found_and_equals_the_permuted_oracle() -> None:
    model = SwinLike()
    x = torch.randn(2, 3, 32, 24)  # not square: an 8 x 6 grid
    exp = hs.explain(model, x, "norm")
    assert exp.layout == "NHWC" and exp.layout.detail["norm"] == "NHWC (8x6 grid)"
    (a,), (g,), _ = plain_a_g(model, x, "norm")
    close(exp["norm"], formula("gradcam", a.permute(0, 3, 1, 2), g.permute(0, 3, 1, 2)))
    assert exp.heatmap("norm").shape == (2, 32, 24)


def test_ambiguous_layouts_are_refused_naming_layout() -> None:
    """[N, 8, 8, 8] from a module that does not say (channels first or last?)."""

    class Ambiguous(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 3, stride=4, padding=1)
            self.block = nn.Sequential(nn.Identity())
            self.fc = nn.Linear(8, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(self.block(self.conv(x)).mean((2, 3)))

    model = Ambiguous()
    x = torch.randn(2, 3, 32, 32)
    with pytest.raises(hs.LayoutError, match="layout='NCHW' or layout='NHWC'"):
        hs.explain(model, x, "block")
    assert hs.explain(model, x, "conv").layout == "NCHW"  # a conv says
    # in an nn.Sequential, an elementwise module reads as the module before it
    seq = nn.Sequential(
        nn.Conv2d(3, 8, 3, stride=4, padding=1),
        nn.ReLU(),
        nn.Dropout(),
        nn.Flatten(),
        nn.Linear(512, 2),
    )
    assert hs.explain(seq, x, "2").layout == "NCHW"
    forced = hs.explain(model, x, "block", layout="NCHW")
    close(forced["block"], hs.explain(model, x, "conv")["conv"], 1e-6)
    with pytest.raises(hs.LayoutError, match="layout='NTC' does not fit"):
        hs.explain(model, x, "block", layout="NTC")
    assert_no_hooks(model)


def _vit(classify: bool = True) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.ViTConfig(
        image_size=32,
        patch_size=8,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        num_labels=5,
    )
    make = transformers.ViTForImageClassification if classify else transformers.ViTModel
    return make(config).eval()


def _tokens_to_grid(t: torch.Tensor, prefix: int, h: int, w: int) -> torch.Tensor:
    return t[:, prefix:].reshape(t.shape[0], h, w, -1).permute(0, 3, 1, 2)


def test_vit_class_token_grid_is_found_without_a_reshape() -> None:
    model = _vit()
    x = torch.randn(2, 3, 32, 32)
    where = "vit.layers.1.layernorm_before"
    exp = hs.explain(model, x, where, "gradcam")
    assert exp.layout == "NTC" and "1 token then a 4x4 grid" in exp.layout.detail[where]
    module = dict(model.named_modules())[where]
    outs = []
    handle = module.register_forward_hook(lambda m, i, o: outs.append(o))
    logits = model(pixel_values=x).logits
    handle.remove()
    (g,) = torch.autograd.grad(logits.gather(1, logits.argmax(1)[:, None]).sum(), outs[0])
    a = _tokens_to_grid(outs[0].detach(), 1, 4, 4)
    close(exp[where], formula("gradcam", a, _tokens_to_grid(g, 1, 4, 4)))
    assert exp.heatmap(where).shape == (2, 32, 32)
    assert all(p.grad is None for p in model.parameters())
    by_keyword = hs.explain(model, (), where, forward_kwargs={"pixel_values": x})
    assert torch.equal(by_keyword[where], exp[where])
    assert by_keyword.heatmap(where).shape == (2, 32, 32)


def test_vit_model_without_logits_with_a_callable_target() -> None:
    model = _vit(classify=False)
    x = torch.randn(2, 3, 32, 32)
    exp = hs.explain(model, x, "layers.0", "layercam", target=lambda out: out.pooler_output[:, 0])
    assert exp["layers.0"].shape == (2, 4, 4) and exp.layout == "NTC"
    assert exp.target is None and exp.score.shape == (2,)


@pytest.mark.parametrize(
    ("arch", "where", "layout", "grid"),
    [
        ("swin", "swin.layernorm", "NTC", (4, 4)),
        ("swin", "swin.encoder.layers.0", "NTC", (4, 4)),
        ("convnext", "convnext.encoder.stages.1", "NCHW", (4, 4)),
        ("convnext", "convnext.encoder.stages.1.layers.0.pwconv1", "NHWC", (4, 4)),
        ("resnet", "resnet.encoder.stages.1", "NCHW", (4, 4)),
    ],
)
def test_hugging_face_vision_models(arch: str, where: str, layout: str, grid: tuple) -> None:
    transformers = pytest.importorskip("transformers")
    if arch == "swin":
        model = transformers.SwinForImageClassification(
            transformers.SwinConfig(
                image_size=32,
                patch_size=4,
                embed_dim=16,
                depths=[1, 1],
                num_heads=[2, 2],
                window_size=4,
                num_labels=5,
            )
        )
    elif arch == "convnext":
        model = transformers.ConvNextForImageClassification(
            transformers.ConvNextConfig(
                image_size=32, num_stages=2, hidden_sizes=[12, 20], depths=[1, 1], num_labels=5
            )
        )
    else:
        model = transformers.ResNetForImageClassification(
            transformers.ResNetConfig(
                embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=5
            )
        )
    model.train()
    x = torch.randn(2, 3, 32, 32)
    before = state_of(model)
    exp = hs.explain(model, x, where, "gradcam")
    assert exp.layout == layout
    assert exp[where].shape == (2, *grid)
    assert_same_state(before, state_of(model))
    model.eval()
    logits = model(pixel_values=x).logits
    assert torch.equal(exp.target, logits.argmax(1))
    # hookscope's map equals the oracle read the same way
    module = dict(model.named_modules())[where]
    outs = []
    handle = module.register_forward_hook(lambda m, i, o: outs.append(o))
    logits = model(pixel_values=x).logits
    handle.remove()
    out = outs[0][0] if isinstance(outs[0], tuple) else outs[0]
    (g,) = torch.autograd.grad(logits.gather(1, exp.target[:, None]).sum(), out)
    a = out.detach()
    if layout == "NTC":
        a, g = _tokens_to_grid(a, 0, *grid), _tokens_to_grid(g, 0, *grid)
    elif layout == "NHWC":
        a, g = a.permute(0, 3, 1, 2), g.permute(0, 3, 1, 2)
    close(exp[where], formula("gradcam", a, g))


# -- compiled models ------------------------------------------------------------------------------


def test_compiled_models_give_the_eager_maps() -> None:
    model, _, where = _twins("resnet")
    model.eval()  # the compiled calls below must not move the BatchNorm statistics
    x = torch.randn(2, 3, 16, 16)
    eager = {m: hs.explain(model, x, where, m)[where] for m in ("gradcam", "eigencam")}
    compiled = torch.compile(model, backend="eager")
    for method, expected in eager.items():
        torch.testing.assert_close(
            hs.explain(compiled, x, where, method)[where], expected, rtol=1e-4, atol=1e-6
        )
    compiled(x)  # compiled after an explanation: runs, no hook left
    for method, expected in eager.items():
        torch.testing.assert_close(
            hs.explain(compiled, x, where, method)[where], expected, rtol=1e-4, atol=1e-6
        )
    assert_no_hooks(model)
    in_place = copy.deepcopy(model)
    in_place.compile(backend="eager")
    in_place(x)
    torch.testing.assert_close(
        hs.explain(in_place, x, where)[where], eager["gradcam"], rtol=1e-4, atol=1e-6
    )


# -- leaks ------------------------------------------------------------------------------------------


def test_a_thousand_calls_leave_no_hook_and_no_live_tensors() -> None:
    import gc

    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4, 3),
    )
    x = torch.randn(2, 3, 6, 6)

    def live() -> tuple[int, int]:
        """Live tensors, and every object the garbage collector tracks."""
        gc.collect()
        objects = gc.get_objects()
        return sum(1 for o in objects if issubclass(type(o), torch.Tensor)), len(objects)

    for _ in range(5):
        hs.explain(model, x, "1")
    tensors, objects = live()
    for i in range(1000):
        hs.explain(model, x, "1", "gradcam" if i % 2 else "scorecam")
    now_tensors, now_objects = live()
    assert now_tensors <= tensors
    assert now_objects - objects < 50
    assert_no_hooks(model)


# -- outputs that alias: views changed in place, in-place modules, nested modules ---------------


class Patches(nn.Module):
    """Returns a view of its own conv's output (as Hugging Face ViT's patch embedding)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 4, stride=4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x).flatten(2).transpose(1, 2)


class ViewChangedInPlace(nn.Module):
    def __init__(self, inplace: bool) -> None:
        super().__init__()
        self.inplace = inplace
        self.patches = Patches()
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.patches(x)
        t = t.mul_(2).tanh_() if self.inplace else (t * 2).tanh()
        return self.head(t.mean(1))


@pytest.mark.parametrize("method", ["gradcam", "grad_x_act", "integrated_gradients"])
def test_a_view_changed_in_place_by_the_caller(method: str) -> None:
    model, twin = ViewChangedInPlace(True), ViewChangedInPlace(False)
    twin.load_state_dict(model.state_dict())
    x = torch.randn(2, 3, 16, 16)
    a = hs.explain(model, x, "patches", method, steps=8)
    b = hs.explain(twin, x, "patches", method, steps=8)
    assert a.layout == "NTC" and a["patches"].shape[:2] == b["patches"].shape[:2]
    close(a["patches"], b["patches"], 1e-6)
    (act,), (g,), _ = plain_a_g(twin, x, "patches")
    if method == "gradcam":
        to_grid = lambda t: _tokens_to_grid(t, 0, 4, 4)  # noqa: E731
        close(a["patches"], formula("gradcam", to_grid(act), to_grid(g)))


def test_an_in_place_module_and_nested_modules() -> None:
    model, twin, _ = _twins("vgg")
    x = torch.randn(2, 3, 16, 16)
    # features.4 is ReLU(inplace=True): its output is its input, changed
    a = hs.explain(model, x, "features.4", "hirescam")
    (act,), (g,), _ = plain_a_g(twin, x, "features.4")
    close(a["features.4"], formula("hirescam", act, g))
    # a module and one inside it, in one pass: each as if explained alone
    both = hs.explain(model, x, ["features", "features.3"], "gradcam")
    for name in ("features", "features.3"):
        close(both[name], hs.explain(model, x, name, "gradcam")[name], 1e-6)
    assert_no_hooks(model)


def test_integrated_gradients_per_call_of_a_reused_module() -> None:
    """Each call gets its own path (Captum refuses layers used twice): call k's attribution
    equals a hand-written loop that patches that call only."""
    model = ConvTwice().eval()
    x = torch.randn(2, 3, 8, 8)
    exp = hs.explain(model, x, "block", "integrated_gradients", target=1, steps=6)
    first, second = exp.all("block")
    assert first.shape == second.shape == (2, 6, 8, 8)
    outs = []
    handle = model.block.register_forward_hook(lambda m, i, o: outs.append(o.detach()))
    with torch.no_grad():
        model(x)
        model(torch.zeros_like(x))
    handle.remove()
    for call, attribution in enumerate((first, second)):
        a, a0 = outs[call], outs[2 + call]
        total = torch.zeros_like(a)
        for i in range(6):
            point = (a0 + (i + 0.5) / 6 * (a - a0)).requires_grad_()
            seen = []

            def patch(m, inputs, out, point=point, seen=seen, call=call):
                seen.append(1)
                return point if len(seen) - 1 == call else None

            handle = model.block.register_forward_hook(patch)
            score = model(x)[:, 1].sum()
            handle.remove()
            total += torch.autograd.grad(score, point)[0]
        close(attribution, (a - a0) * total / 6, 1e-5)


class TinyViT(nn.Module):
    """Patches, a class token and torch's own nn.TransformerEncoder, whose fused fast path
    (eval, no autograd) computes differently: explain records it with autograd."""

    def __init__(self) -> None:
        super().__init__()
        self.patches = Patches()
        self.cls = nn.Parameter(torch.randn(1, 1, 6))
        layer = nn.TransformerEncoderLayer(6, 2, 12, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = torch.cat([self.cls.expand(x.shape[0], -1, -1), self.patches(x)], 1)
        return self.head(self.encoder(t)[:, 0])


def test_torch_transformer_layers_explained_at_their_autograd_values() -> None:
    model = TinyViT().eval()
    x = torch.randn(2, 3, 16, 16)
    where = "encoder.layers.1"
    exp = hs.explain(model, x, where, "gradcam")
    assert "1 token then a 4x4 grid" in exp.layout.detail[where]
    (a,), (g,), _ = plain_a_g(model, x, where)
    grid = lambda t: _tokens_to_grid(t, 1, 4, 4)  # noqa: E731
    close(exp[where], formula("gradcam", grid(a), grid(g)))


def test_autograd_records_from_the_explained_module_up() -> None:
    """Below the module nothing is recorded (no saved tensors, a faster forward), except in
    models holding torch's Transformer layers, whose fused no-autograd path differs (~4e-7)."""
    for model, below, above, where in (
        (_twins("resnet")[0], "layer1", "fc", "layer2"),
        (TinyViT(), "encoder.layers.0", "head", "encoder.layers.1"),
    ):
        seen: dict[str, bool] = {}
        modules = dict(model.named_modules())
        for name in (below, above):

            def note(m, i, o, name=name, seen=seen) -> None:
                seen.setdefault(name, torch.is_grad_enabled())

            modules[name].register_forward_hook(note)
        with torch.no_grad():
            hs.explain(model, torch.randn(2, 3, 16, 16), where)
        assert seen == {below: isinstance(model, TinyViT), above: True}
    assert torch.is_grad_enabled()  # the mode the test runs in, back after each call
