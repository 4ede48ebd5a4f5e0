"""What an Explanation shows: heatmaps, overlays, PNG files (decoded here with zlib, no
imaging library), the notebook view, and the faithfulness metrics against a hand-written
computation of each formula."""

from __future__ import annotations

import base64
import re
import struct
import zlib
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hookscope as hs
from hookscope.testing import assert_no_hooks


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1),
        nn.BatchNorm2d(6),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
        nn.Conv2d(6, 8, 3, padding=1),
        nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 4),
    ).eval()


def read_png(path_or_bytes: Path | bytes) -> torch.Tensor:
    """Decode an 8-bit RGB, filter-0 PNG (what hookscope writes) into uint8 [H, W, 3]."""
    data = path_or_bytes if isinstance(path_or_bytes, bytes) else path_or_bytes.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, {}
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        assert crc == zlib.crc32(kind + body)
        chunks[kind] = chunks.get(kind, b"") + body
        pos += 12 + length
    width, height, depth, color = struct.unpack(">IIBB", chunks[b"IHDR"][:10])
    assert (depth, color) == (8, 2)
    raw = zlib.decompress(chunks[b"IDAT"])
    rows = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(height, 1 + 3 * width)
    assert (rows[:, 0] == 0).all()
    return rows[:, 1:].reshape(height, width, 3)


def test_heatmap_is_the_map_upsampled_then_scaled_to_0_1() -> None:
    model = cnn()
    x = torch.randn(3, 3, 20, 12)
    exp = hs.explain(model, x, "4")
    heat = exp.heatmap("4")
    assert heat.shape == (3, 20, 12)
    up = F.interpolate(exp["4"][:, None], size=(20, 12), mode="bilinear", align_corners=False)
    up = up[:, 0].flatten(1)
    expected = (up - up.min(1, keepdim=True).values) / (
        up.max(1, keepdim=True).values - up.min(1, keepdim=True).values
    )
    torch.testing.assert_close(heat.flatten(1), expected)
    assert heat.amin() == 0 and heat.amax() == 1
    assert exp.heatmap().shape == heat.shape  # one module: no name needed
    assert exp.heatmap("4", size=(5, 5)).shape == (3, 5, 5)


def test_attribution_heatmap_sums_channels() -> None:
    model = cnn()
    x = torch.randn(2, 3, 8, 8)
    exp = hs.explain(model, x, "4", "grad_x_act")
    assert exp["4"].shape == (2, 8, 4, 4)
    direct = hs.explain(model, x, "4", "grad_x_act")["4"].sum(1)
    torch.testing.assert_close(exp.grid("4"), direct)
    assert exp.heatmap("4").shape == (2, 8, 8)


def test_overlay_blends_jet_on_the_images() -> None:
    model = cnn()
    x = torch.rand(2, 3, 8, 8)  # in [0, 1]: shown as they are
    exp = hs.explain(model, x, "4")
    out = exp.overlay(x, alpha=0.5)
    assert out.dtype == torch.uint8 and out.shape == (2, 8, 8, 3)
    heat = exp.heatmap("4")[..., None]
    jet = torch.cat([(1.5 - (4 * heat - c).abs()).clamp(0, 1) for c in (3.0, 2.0, 1.0)], dim=-1)
    expected = ((0.5 * x.permute(0, 2, 3, 1) + 0.5 * jet) * 255).round().to(torch.uint8)
    assert (out.int() - expected.int()).abs().max() <= 1
    # the explained input by default; uint8 channels-last images too
    assert torch.equal(exp.overlay(), out)
    as_uint8 = (x.permute(0, 2, 3, 1) * 255).round().to(torch.uint8)
    assert (exp.overlay(as_uint8).int() - out.int()).abs().max() <= 2


def test_save_writes_one_png_per_sample_and_module(tmp_path: Path) -> None:
    model = cnn()
    x = torch.rand(3, 3, 8, 8)
    exp = hs.explain(model, x, ["0", "4"])
    paths = exp.save(tmp_path / "cams")
    assert sorted(p.name for p in paths) == [f"{m}_{i}.png" for m in "04" for i in range(3)]
    for i in range(3):
        assert torch.equal(read_png(tmp_path / "cams" / f"4_{i}.png"), exp.overlay(name="4")[i])


def test_notebook_view_shows_overlays_inline() -> None:
    model = cnn()
    x = torch.rand(2, 3, 8, 8)
    exp = hs.explain(model, x, "4")
    page = exp._repr_html_()
    images = re.findall(r'src="data:image/png;base64,([^"]+)"', page)
    assert len(images) == 2
    assert torch.equal(read_png(base64.b64decode(images[1])), exp.overlay()[1])
    assert "gradcam" in page and "score" in page
    assert "Explanation(method='gradcam'" in repr(exp)


def test_reading_errors_name_the_modules() -> None:
    model = cnn()
    exp = hs.explain(model, torch.rand(2, 3, 8, 8), ["0", "4"])
    with pytest.raises(
        hs.MissingRecordError, match="not one of the explained modules \\('0', '4'\\)"
    ):
        exp["5"]
    with pytest.raises(hs.MissingRecordError, match="say which"):
        exp.heatmap()
    assert exp.names == ["0", "4"] and "4" in exp and len(exp) == 2


# -- metrics ------------------------------------------------------------------------------------


def test_metrics_equal_a_hand_computation() -> None:
    model = cnn()
    x = torch.rand(3, 3, 8, 8)
    exp = hs.explain(model, x, "4")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    m = exp.metrics(model, steps=4)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert_no_hooks(model)
    heat, t = exp.heatmap("4"), exp.target
    with torch.no_grad():

        def prob(inputs: torch.Tensor) -> torch.Tensor:
            return torch.softmax(model(inputs), 1)[torch.arange(3), t]

        y, o = prob(x), prob(x * heat[:, None])
        drop = (y - o).clamp(min=0) / y
        assert m.average_drop == pytest.approx(drop.mean().item(), rel=1e-5)
        assert m.increase_in_confidence == pytest.approx((o > y).float().mean().item())
        # deletion: the most salient k/4 of the 64 pixels set to 0, k = 0..4
        order = heat.flatten(1).argsort(dim=1, descending=True, stable=True)
        curve = []
        for k in range(5):
            keep = torch.ones(3, 64)
            keep.scatter_(1, order[:, : 16 * k], 0.0)
            curve.append(prob(x * keep.view(3, 1, 8, 8)))
        curve = torch.stack(curve, 1)
    area = (curve.sum(1) - (curve[:, 0] + curve[:, -1]) / 2) / 4
    assert m.deletion == pytest.approx(area.mean().item(), rel=1e-5)
    torch.testing.assert_close(m.per_sample["deletion_curve"], curve)
    assert m.per_sample["insertion_curve"][:, -1] == pytest.approx(y.tolist(), rel=1e-5)
    assert 0 <= m.insertion <= 1 and set(m.as_dict()) == {
        "average_drop",
        "increase_in_confidence",
        "deletion",
        "insertion",
    }


def test_metrics_of_a_callable_target_use_its_scores() -> None:
    """A callable target's metrics read the callable's scores (here a logit), not a softmax."""
    model = cnn()
    x = torch.rand(2, 3, 8, 8)
    by_index = hs.explain(model, x, "4", target=1)
    by_fn = hs.explain(model, x, "4", target=lambda out: out[:, 1])
    torch.testing.assert_close(by_fn.heatmap("4"), by_index.heatmap("4"))
    m = by_fn.metrics(model, steps=4)
    with torch.no_grad():
        logit, at_zero = model(x)[:, 1], model(torch.zeros_like(x))[:, 1]
        masked = model(x * by_fn.heatmap("4")[:, None])[:, 1]
    torch.testing.assert_close(m.per_sample["deletion_curve"][:, 0], logit)
    torch.testing.assert_close(m.per_sample["deletion_curve"][:, -1], at_zero)
    torch.testing.assert_close(m.per_sample["increase"], (masked > logit).float())
