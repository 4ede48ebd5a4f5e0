"""Monitor(explain=hs.Probe(...)): a fixed batch explained every N steps during training.

The training run is bit-identical with and without the probe (losses, weights, optimizer
state, gradients, RNG, and every record the Monitor writes); the logged maps are hs.explain's
at that step (quantized to uint8, at most 32 x 32), readable with hs.read_log; bad probes
are refused when the Monitor is built, leaving no hook; the report's Explanations part
carries the logged images and maps and draws them as overlays in Chromium, offline."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import hookscope as hs
from _browser import CHROMIUM, Browser
from hookscope._explain._probe import quantize
from hookscope.testing import assert_no_hooks
from models import vit


class CNN(nn.Module):
    """Conv-BN-ReLU (in place) x2, max-pool, dropout, linear: 8x8 images -> 10 classes."""

    def __init__(self, size: int = 8) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(inplace=True),
            nn.Conv2d(8, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Dropout(0.5), nn.Linear(16 * (size // 2) ** 2, 10)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


DATA = torch.Generator().manual_seed(1)
X = torch.randn(64, 1, 8, 8, generator=DATA)
Y = torch.randint(0, 10, (64,), generator=DATA)
PROBE = torch.randn(4, 1, 8, 8, generator=DATA)


def train(
    optimizer: str,
    probe: hs.Probe | None,
    steps: int = 20,
    log_dir: Path | None = None,
    check: list | None = None,
) -> dict:
    """A run with dropout, BatchNorm and random batches; ``check(step, model)`` after each
    ``mon.step()`` (in the loop, as a user's code would)."""
    torch.manual_seed(0)
    model = CNN()
    if optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    with hs.Monitor(model, every=3, explain=probe, log_dir=log_dir) as mon:
        for step in range(steps):
            idx = torch.randint(0, 64, (16,))
            loss = nn.functional.cross_entropy(model(X[idx]), Y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            mon.step(loss=loss)
            losses.append(loss.item())
            if check is not None:
                check.append((step, {k: v.clone() for k, v in model.state_dict().items()}))
        model.eval()  # an evaluation pass, logged apart
        with torch.no_grad():
            model(X[:8])
    return {
        "model": model,
        "losses": losses,
        "state": model.state_dict(),
        "grads": [p.grad for p in model.parameters()],
        "opt": opt.state_dict()["state"],
        "rng": torch.get_rng_state(),
        "records": mon.records,
    }


def _plain(records: list[dict]) -> str:
    kept = [
        {k: v for k, v in r.items() if k != "time"}
        for r in records
        if not r["type"].startswith("explain")
    ]
    return json.dumps(kept)  # NaN-safe equality of everything the Monitor wrote


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_the_run_is_bit_identical_with_and_without_the_probe(optimizer: str) -> None:
    bare = train(optimizer, None)
    probed = train(optimizer, hs.Probe(PROBE, where="features.3", every=4))
    assert probed["losses"] == bare["losses"]
    assert all(torch.equal(bare["state"][k], probed["state"][k]) for k in bare["state"])
    assert all(torch.equal(a, b) for a, b in zip(bare["grads"], probed["grads"], strict=True))
    for i, s in bare["opt"].items():
        assert all(torch.equal(s[k], probed["opt"][i][k]) for k in s if torch.is_tensor(s[k]))
    assert torch.equal(bare["rng"], probed["rng"])
    assert _plain(probed["records"]) == _plain(bare["records"])  # statistics, evals, findings
    steps = [r["step"] for r in probed["records"] if r["type"] == "explain"]
    assert steps == [0, 4, 8, 12, 16]
    assert_no_hooks(probed["model"])


def test_logged_maps_are_explain_at_that_step(tmp_path: Path) -> None:
    labels = Y[:4]
    probe = hs.Probe(PROBE, ["features.0", "features.4"], "layercam", every=5, target=labels)
    states: list = []
    run = train("adam", probe, steps=12, log_dir=tmp_path, check=states)
    records = hs.read_log(tmp_path)
    assert [r["type"] for r in records].count("explain_probe") == 1
    head = next(r for r in records if r["type"] == "explain_probe")
    assert head["modules"] == ["features.0", "features.4"] and head["every"] == 5
    assert head["channels"] == 1 and head["size"] == [8, 8]
    shown = torch.tensor(head["images"], dtype=torch.uint8)
    low = PROBE.flatten(1).amin(1).view(-1, 1, 1)
    high = PROBE.flatten(1).amax(1).view(-1, 1, 1)
    assert torch.equal(shown, ((PROBE[:, 0] - low) / (high - low) * 255).round().to(torch.uint8))
    explained = [r for r in records if r["type"] == "explain"]
    assert [(r["step"], r["module"]) for r in explained] == [
        (s, m) for s in (0, 5, 10) for m in ("features.0", "features.4")
    ]
    model = CNN()
    for rec in explained:
        model.load_state_dict(states[rec["step"]][1])  # the weights at that step() call
        exp = hs.explain(model, PROBE, rec["module"], "layercam", target=labels)
        maps, lo, hi = quantize(exp[rec["module"]])
        assert rec["method"] == "layercam" and rec["grid"] == [8, 8]
        assert torch.equal(torch.tensor(rec["maps"], dtype=torch.uint8), maps)
        assert rec["low"] == lo and rec["high"] == hi
        assert rec["target"] == labels.tolist() and rec["score"] == exp.score.tolist()
        # the map itself, back from the record to within one step of 255
        back = torch.tensor(lo).view(-1, 1, 1) + maps.float() / 255 * torch.tensor(
            [h - lo_ for h, lo_ in zip(hi, lo, strict=True)]
        ).view(-1, 1, 1)
        span = exp[rec["module"]].flatten(1).amax(1) - exp[rec["module"]].flatten(1).amin(1)
        assert ((back - exp[rec["module"]]).abs() <= span.view(-1, 1, 1) / 255).all()
    assert run["losses"] == train("adam", None, steps=12)["losses"]


def test_large_maps_and_images_are_logged_small() -> None:
    torch.manual_seed(0)
    model = CNN(size=96)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    probe = hs.Probe(torch.randn(2, 1, 96, 96), where="features.0", every=1, target=3)
    with hs.Monitor(model, explain=probe) as mon:
        model(torch.randn(4, 1, 96, 96)).sum().backward()
        opt.step()
        mon.step()
    head, rec = [r for r in mon.records if r["type"].startswith("explain")]
    assert torch.tensor(head["images"]).shape == (2, 64, 64) and head["size"] == [96, 96]
    assert rec["grid"] == [32, 32] and torch.tensor(rec["maps"]).shape == (2, 32, 32)
    assert rec["target"] == [3, 3]
    assert len(json.dumps(rec)) < 2 * 32 * 32 * 4 + 1000  # uint8 lists: a few KiB


def test_a_vit_probe_reads_its_token_grid_and_keeps_colour_images() -> None:
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = vit().train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    pictures = torch.rand(2, 3, 32, 32)
    where = "vit.layers.1.layernorm_before"
    probe = hs.Probe((), where, every=2, forward_kwargs={"pixel_values": pictures})
    with hs.Monitor(model, explain=probe) as mon:
        for _ in range(3):
            out = model(pixel_values=torch.rand(4, 3, 32, 32), labels=torch.arange(4))
            out.loss.backward()
            opt.step()
            opt.zero_grad()
            mon.step()
        assert model.training  # put back in train mode after each probe
    head, *explained = [r for r in mon.records if r["type"].startswith("explain")]
    assert head["channels"] == 3 and head["size"] == [32, 32]
    # images in [0, 1] are shown as they are (no rescaling)
    shown = torch.tensor(head["images"], dtype=torch.uint8)
    assert torch.equal(shown, (pictures.permute(0, 2, 3, 1) * 255).round().to(torch.uint8))
    assert [(r["step"], r["grid"]) for r in explained] == [(0, [4, 4]), (2, [4, 4])]


def test_quantize_scales_each_sample_and_keeps_its_range() -> None:
    grid = torch.stack([torch.arange(16.0).view(4, 4), torch.full((4, 4), 2.0)])
    q, low, high = quantize(grid)
    assert q.dtype == torch.uint8 and low == [0.0, 2.0] and high == [15.0, 2.0]
    assert q[0, 0, 0] == 0 and q[0, 3, 3] == 255 and q[0, 1, 2] == round(6 / 15 * 255)
    assert (q[1] == 0).all()  # a constant map: zeros, its value in low and high
    tokens, _, _ = quantize(torch.arange(6.0).view(1, 6))  # a 1-d grid: one row
    assert tokens.shape == (1, 1, 6)


def test_bad_probes_are_refused_when_the_monitor_is_built() -> None:
    model = CNN()
    with pytest.raises(TypeError, match=r"takes an hs.Probe, got str"):
        hs.Monitor(model, explain="features.3")
    with pytest.raises(hs.SelectionError):
        hs.Monitor(model, explain=hs.Probe(PROBE, where="features.9"))
    assert_no_hooks(model)
    with pytest.raises(ValueError, match="positive number of steps"):
        hs.Probe(PROBE, "features.3", every=0)
    with pytest.raises(TypeError, match="always runs in eval mode"):
        hs.Probe(PROBE, "features.3", train=True)
    with pytest.raises(hs.ExplainError, match="not an explain method"):
        hs.Probe(PROBE, "features.3", method="gradcan")
    with pytest.raises(hs.TargetError):
        hs.Probe(PROBE, "features.3", target=1.5)
    with pytest.raises(hs.ExplainError, match="at least one input tensor"):
        hs.Probe("images", "features.3")


def test_a_probe_that_fails_warns_once_and_training_goes_on() -> None:
    bad = hs.Probe(PROBE, where="features.3", every=5, target=12)  # the model has 10 classes
    with pytest.warns(hs.HookscopeWarning, match="at step 0 failed.*TargetError") as told:
        run = train("sgd", bad, steps=12)
    assert len([w for w in told if "hs.Probe" in str(w.message)]) == 1
    failed = [r for r in run["records"] if r.get("kind") == "explain_failed"]
    assert [r["step"] for r in failed] == [0, 5, 10]
    assert "out of range" in failed[0]["message"]
    assert run["losses"] == train("sgd", None, steps=12)["losses"]


# -- the report's Explanations part ---------------------------------------------------------------


@pytest.fixture(scope="module")
def probed_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """20 steps, the probe explained at every one (more than the report's 16 columns)."""
    log = tmp_path_factory.mktemp("probed")
    probe = hs.Probe(PROBE, ["features.0", "features.3"], every=1, target=Y[:4])
    train("adam", probe, steps=20, log_dir=log)
    return log


def _data(html: str) -> dict:
    found = re.search(r'<script id="hs-data" type="application/json">(.*?)</script>', html, re.S)
    assert found
    return json.loads(found.group(1))


def test_the_report_carries_the_logged_images_and_maps(probed_log: Path, tmp_path: Path) -> None:
    html = hs.report(probed_log, tmp_path / "r.html").read_text()
    assert '<a href="#explanations">Explanations</a>' in html
    assert html.index('id="evals"') < html.index('id="explanations"') < html.index('id="heatmaps"')
    part = _data(html)["runs"][0]["explanations"]
    records = hs.read_log(probed_log)
    head = next(r for r in records if r["type"] == "explain_probe")
    image = part["image"]
    assert (image["n"], image["h"], image["w"], image["c"]) == (4, 8, 8, 1)
    pixels = np.frombuffer(base64.b64decode(image["data"]), np.uint8).reshape(4, 8, 8)
    assert pixels.tolist() == head["images"]
    assert [m["module"] for m in part["modules"]] == ["features.0", "features.3"]
    for m in part["modules"]:
        logged = {
            r["step"]: r for r in records if r["type"] == "explain" and r["module"] == m["module"]
        }
        assert len(logged) == 20
        assert len(m["steps"]) == 16 and m["steps"][0] == 0 and m["steps"][-1] == 19
        assert m["steps"] == sorted(set(m["steps"]))
        for step, b64, target in zip(m["steps"], m["maps"], m["target"], strict=True):
            maps = np.frombuffer(base64.b64decode(b64), np.uint8).reshape(4, 8, 8)
            assert maps.tolist() == logged[step]["maps"] and target == Y[:4].tolist()
    # a run without a probe has no such part
    plain = tmp_path / "plain"
    train("adam", None, steps=2, log_dir=plain)
    assert 'id="explanations"' not in hs.report(plain).read_text()


def test_the_demo_explains_one_test_digit_per_class_over_training(tmp_path: Path) -> None:
    from hookscope._demo import load_digits, run_demo

    result = run_demo(tmp_path / "demo", epochs=1, progress=False)
    records = hs.read_log(result.log_dir)
    head = next(r for r in records if r["type"] == "explain_probe")
    _, _, x_test, y_test = load_digits(0)
    firsts = [int((y_test == c).nonzero()[0, 0]) for c in range(10)]
    assert head["modules"] == ["features.3"] and len(head["images"]) == 10
    assert head["every"] == 45 // 8  # one epoch of 45 steps: about 8 explanations
    explained = [r for r in records if r["type"] == "explain"]
    assert [r["step"] for r in explained] == list(range(0, 45, 5))
    assert all(r["grid"] == [8, 8] and len(r["maps"]) == 10 for r in explained)
    # by the end, the model explains (predicts) most digits as their own class
    assert sum(t == c for c, t in enumerate(explained[-1]["target"])) >= 8
    pixels = torch.tensor(head["images"], dtype=torch.float32)
    assert torch.equal(pixels.argmax(-1), x_test[firsts, 0].argmax(-1))  # the same digits
    assert 'id="explanations"' in result.report.read_text()


browser = pytest.mark.skipif(CHROMIUM is None, reason="needs chromium (make test installs it)")


@pytest.mark.browser
@browser
def test_the_explanations_render_as_overlays_in_chromium(probed_log: Path, tmp_path: Path) -> None:
    page = hs.report(probed_log, tmp_path / "r.html")
    with Browser(tmp_path / "profile", 1300, 1000) as b:
        b.open(page)
        assert b.console_errors == []
        assert [u for u in b.requests if u != page.resolve().as_uri()] == []  # offline
        strips = b.eval(
            "[...document.querySelectorAll('#hs-explain table.explain-strip')].map(t => "
            "[t.rows.length, t.rows[0].cells.length, t.querySelectorAll('canvas').length])"
        )
        assert strips == [[5, 17, 4 * 17]] * 2  # a header, 4 images x (image + 16 steps)
        # Each canvas drawn (not blank), the overlays differ from the image and over steps.
        pixels = b.eval(
            """(() => {
              const t = document.querySelector('#hs-explain table.explain-strip');
              const sum = (c) => { const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
                let s = [0, 0, 0]; for (let i = 0; i < d.length; i += 4) { s[0] += d[i]; s[1] += d[i + 1]; s[2] += d[i + 2]; }
                return s; };
              return [...t.rows[1].querySelectorAll('canvas')].map(c => [c.width, c.height, c.title, sum(c)]);
            })()"""
        )
    assert all(w == 72 and h == 72 for w, h, _, _ in pixels)
    image, overlays = pixels[0], pixels[1:]
    assert image[2] == "probe image 0" and image[3][0] == image[3][1] == image[3][2] > 0  # grey
    assert all(o[3] != image[3] and sum(o[3]) > 0 for o in overlays)  # jet colours on it
    assert len({tuple(o[3]) for o in overlays}) > 8  # the maps change as the model learns
    assert overlays[0][2].startswith("image 0 at step 0: class ")
