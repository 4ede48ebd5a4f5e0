"""The report's page as a newcomer reads it (research/newcomer-4.md): the evaluation chart on
the step axis every chart shares, no empty heading, fractions on a 0..1 axis, module types in
the titles, no numpy warning on infinite values, a clear error for an unwritable ``out``, and
sections that a new part joins through one registry."""

from __future__ import annotations

import base64
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import hookscope as hs
from _browser import CHROMIUM, Browser
from hookscope._cli import main
from hookscope._report import _sections
from hookscope._report._html import section
from hookscope._report._payload import _bytes

STEPS = 12
LR = 3e-3


class SmallCNN(nn.Module):
    """A torchvision-like CNN: in-place ReLUs, BatchNorm, no attention."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 4, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(4, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d(1),
        )
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(8, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


@pytest.fixture(scope="module")
def cnn_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """As the demo: Adam at a constant lr, sampled every 2 steps, and one evaluation pass
    after the last training step (logged at step STEPS, past the last step record)."""
    path = tmp_path_factory.mktemp("cnn")
    torch.manual_seed(0)
    model = SmallCNN()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    x, y = torch.randn(16, 1, 8, 8), torch.randint(0, 3, (16,))
    with hs.Monitor(model, every=2, log_dir=path) as mon:
        for _ in range(STEPS):
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            mon.step(loss=loss)
        model.eval()
        with torch.no_grad():
            model(x)
        model.train()
    return path


def _data(html: str) -> dict:
    found = re.search(r'<script id="hs-data" type="application/json">(.*?)</script>', html, re.S)
    assert found
    return json.loads(found.group(1))


def test_the_shared_step_range_holds_an_evaluation_after_the_last_step(cnn_dir: Path) -> None:
    data = _data(hs.report(cnn_dir).read_text())
    run = data["runs"][0]
    assert run["evals"]["x"] == [STEPS]  # after the last training step, 0 .. STEPS - 1
    assert (run["first"], run["last"]) == (0, STEPS - 1)
    assert data["steps"] == [0, STEPS]


def test_a_model_without_attention_has_no_attention_series(cnn_dir: Path) -> None:
    run = _data(hs.report(cnn_dir).read_text())["runs"][0]
    assert "attn.logit_max" not in run["lines"]
    assert {"act.mean", "act.zero_frac", "grad.norm"} <= set(run["lines"])
    assert run["types"]["features.0"] == "Conv2d" and run["types"]["classifier.1"] == "Linear"


def test_a_diverging_run_with_infinite_values_reports_without_a_numpy_warning(
    tmp_path: Path,
) -> None:
    """The newcomer's MSE run at lr 3.0: values overflow to Inf, then NaN. The project's
    filterwarnings=error turns any RuntimeWarning of the report into a failure here."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(m.parameters(), lr=3.0)
    x = torch.randn(32, 8)
    with hs.Monitor(m, every=2, log_dir=tmp_path) as mon:
        for _ in range(12):
            opt.zero_grad()
            (m(x) - 1).pow(2).mean().backward()
            opt.step()
            mon.step()
    logged = (tmp_path / "hookscope.jsonl").read_text()
    assert '"inf"' in logged and '"nan"' in logged
    run = _data(hs.report(tmp_path).read_text())["runs"][0]
    heat = run["heat"]
    cells = np.frombuffer(base64.b64decode(heat["cells"]), dtype=np.uint8)
    assert math.isfinite(heat["lo"]) and math.isfinite(heat["hi"])
    assert (cells == 255).any()  # the NaN steps: no value


def test_cells_put_infinities_at_the_ends_and_nan_nowhere() -> None:
    values = [math.nan, math.inf, -math.inf, 0.0, 0.5, 1.0, 7.0, -7.0]
    cells = np.frombuffer(base64.b64decode(_bytes(np.array(values), 0.0, 1.0)), np.uint8)
    assert cells.tolist() == [255, 254, 0, 0, 127, 254, 254, 0]
    huge = np.array([-1.7e308, 0.0, 1.7e308])  # a range that overflows as hi - lo
    cells = np.frombuffer(base64.b64decode(_bytes(huge, -1.7e308, 1.7e308)), np.uint8)
    assert cells.tolist() == [0, 127, 254]


def test_an_unwritable_report_path_is_a_clear_error(
    cnn_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    out = blocker / "report.html"  # its parent is a file
    with pytest.raises(hs.HookscopeError, match=r"cannot write the report to .*report.html.*out="):
        hs.report(cnn_dir, out)
    assert main(["report", str(cnn_dir), "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("Error: cannot write the report") and "Traceback" not in err


def test_a_section_added_to_the_registry_gets_its_place_link_and_data(
    cnn_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the Explanations part will do: one Section, in the page's order, with its link in
    the header and its JSON in each run's payload under its id."""
    extra = _sections.Section(
        "explanations",
        "Explanations",
        lambda runs: section("explanations", "Explanations", '<div id="hs-explain"></div>'),
        data=lambda run: {"steps": len(run.steps)},
    )
    order = list(_sections.SECTIONS)
    at = [s.ident for s in order].index("heatmaps")
    monkeypatch.setattr("hookscope._report.SECTIONS", (*order[:at], extra, *order[at:]))
    html = hs.report(cnn_dir, tmp_path / "r.html").read_text()
    assert '<a href="#explanations">Explanations</a>' in html
    assert html.index('id="evals"') < html.index('id="explanations"') < html.index('id="heatmaps"')
    assert _data(html)["runs"][0]["explanations"] == {"steps": STEPS}
    # Without it: neither the section nor its link; a section with nothing to show (no
    # feature maps logged) has no link either.
    monkeypatch.undo()
    plain = hs.report(cnn_dir, tmp_path / "plain.html").read_text()
    assert 'href="#evals"' in plain and 'href="#explanations"' not in plain
    assert 'id="feature-maps"' not in plain and 'href="#feature-maps"' not in plain


# -- in a browser -----------------------------------------------------------------------------

browser = pytest.mark.skipif(CHROMIUM is None, reason="needs chromium (make test installs it)")

_SHARED = """Object.entries(hsCharts).filter(([id]) => !id.startsWith('window:'))
  .map(([id, u]) => [id, u.scales.x.min, u.scales.x.max])"""


def _ranges(b: Browser) -> dict[str, list[float]]:
    return {cid: [lo, hi] for cid, lo, hi in b.eval(_SHARED)}


@pytest.mark.browser
@browser
def test_cnn_report_in_chromium_axes_headings_and_titles(cnn_dir: Path, tmp_path: Path) -> None:
    page = hs.report(cnn_dir)
    label = cnn_dir.name
    with Browser(tmp_path / "profile", 1400, 1200) as b:
        b.open(page)
        assert b.console_errors == []
        ranges = _ranges(b)
        # Every chart on the shared axis spans 0 .. STEPS, the evaluation's step included.
        assert {f"eval:{label}", "curve:loss", "act.mean:features.0"} <= set(ranges)
        assert {tuple(r) for r in ranges.values()} == {(0, STEPS)}
        # The evaluation's points lie inside its plot, not past its right edge.
        xs = b.eval(
            f"(() => {{ const u = hsCharts['eval:{label}']; return [u.valToPos({STEPS}, 'x'), "
            "u.bbox.width / devicePixelRatio]; })()"
        )
        assert 0 < xs[0] <= xs[1]
        # Zoom in on one chart, then double-click another: every chart back to 0 .. STEPS.
        b.eval("hsCharts['curve:loss'].setScale('x', {min: 2, max: 6})")
        assert _ranges(b)[f"eval:{label}"] == [2, 6]
        box = b.eval(
            f"(() => {{ const u = hsCharts['eval:{label}']; u.root.scrollIntoView(); "
            "const r = u.over.getBoundingClientRect(); return [r.left + r.width / 2, r.top + r.height / 2]; })()"
        )
        b.mouse("mousePressed", *box, button="left", clickCount=1)
        b.mouse("mouseReleased", *box, button="left", clickCount=1)
        b.mouse("mousePressed", *box, button="left", clickCount=2)
        b.mouse("mouseReleased", *box, button="left", clickCount=2)
        assert {tuple(r) for r in _ranges(b).values()} == {(0, STEPS)}
        # Headings: no attention heading on a CNN; every heading has charts under it.
        heads = b.eval(
            "[...document.querySelectorAll('#hs-modules h3')].map(h => "
            "[h.textContent, h.nextElementSibling.querySelectorAll('.uplot').length])"
        )
        assert heads and all(n > 0 for _, n in heads)
        assert not any("attention" in text for text, _ in heads)
        # A fraction on 0 .. 1 whatever its values; a constant lr drawn flat, from 0.
        zeros = b.eval(
            "[hsCharts['act.zero_frac:features.1'].scales.y.min, hsCharts['act.zero_frac:features.1'].scales.y.max]"
        )
        assert zeros == [0, 1]
        lr = b.eval("[hsCharts['curve:lr'].scales.y.min, hsCharts['curve:lr'].scales.y.max]")
        assert lr == pytest.approx([0, 2 * LR])
        # Module titles name the type.
        title = b.eval(
            "hsCharts['grad.norm:features.2'].root.querySelector('.u-title').textContent"
        )
        assert title == "features.2 · Conv2d"
        assert [u for u in b.requests if u != page.resolve().as_uri()] == []
