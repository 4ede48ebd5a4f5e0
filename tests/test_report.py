"""report(): one self-contained HTML file from logs; checked as text and in headless Chromium
driven through the DevTools protocol (tests/_browser.py): charts drawn, a value on hover, a
zoom shared by the charts, no request, no console error, and a screenshot of each kind."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import hookscope as hs
from _browser import CHROMIUM, Browser
from _synthetic_log import write_log
from hookscope._log import Cleared
from hookscope._report._data import load_run
from hookscope._report._html import HINTS
from hookscope._report._payload import _buckets, decimate


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("run")
    write_log(path)
    return path


@pytest.fixture(scope="module")
def html_path(run_dir: Path) -> Path:
    return hs.report(run_dir)


def test_report_is_written_next_to_the_log_by_default(run_dir: Path, html_path: Path) -> None:
    assert html_path == run_dir / "report.html"


def _data(html: str) -> dict:
    found = re.search(r'<script id="hs-data" type="application/json">(.*?)</script>', html, re.S)
    assert found
    return json.loads(found.group(1))


def test_report_embeds_its_data_and_scripts_and_fetches_nothing(html_path: Path) -> None:
    html = html_path.read_text()
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", html)
    assert "@import" not in html and "<script src" not in html and "<img" not in html
    assert "uPlot" in html and "Leon Sorokin" in html  # the vendored library and its notice
    run = _data(html)["runs"][0]
    assert run["modules"] == ["conv", "bn", "relu", "fc"]
    assert run["x"] == [0, 5, 10, 15, 20, 25]
    assert run["lines"]["act.mean"][2] == pytest.approx(
        [0.2 + 0.01 * s for s in run["x"]], rel=1e-3
    )
    assert run["curves"]["series"]["loss"][12] is None  # the NaN: a gap, marked apart
    assert run["nan"]["step"] == 12 and run["nan"]["module"] == "bn"
    assert [h["module"] for h in run["hists"]] == ["conv", "bn", "relu", "fc"]


def test_report_orders_modules_as_they_ran(tmp_path: Path) -> None:
    class Backwards(nn.Module):  # declared in one order, run in the other
        def __init__(self) -> None:
            super().__init__()
            self.last = nn.Linear(8, 2)
            self.first = nn.Linear(4, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.last(self.first(x))

    net = Backwards()
    with hs.Monitor(net, every=1, log_dir=tmp_path) as mon:
        net(torch.randn(2, 4)).sum().backward()
        mon.step()
    assert load_run(tmp_path).order() == ["first", "last"]
    html = hs.report(tmp_path).read_text()
    assert _data(html)["runs"][0]["modules"] == ["first", "last"]
    latest = html[html.index('class="latest"') :]
    assert latest.index("<td>first</td>") < latest.index("<td>last</td>")


def test_decimation_keeps_each_pixel_columns_extremes_in_order() -> None:
    rng = np.random.default_rng(0)
    values = rng.normal(size=(3, 10_000))
    values[1, 4321] = 50.0  # a spike
    values[2, 100:200] = np.nan
    cuts = _buckets(values.shape[1], 300)
    out = decimate(values, cuts)
    assert out.shape == (3, 600)
    assert np.nanmax(out[1]) == 50.0 and np.nanmin(out[0]) == values[0].min()
    for b in (0, 17, 299):  # each bucket: its min and max, the earlier one first
        chunk = values[0, cuts[b] : cuts[b + 1]]
        pair = out[0, 2 * b : 2 * b + 2]
        assert sorted(pair) == [chunk.min(), chunk.max()]
        assert pair[0] == chunk[min(chunk.argmin(), chunk.argmax())]
    assert _buckets(500, 300) is None and decimate(values[:, :500], None).shape == (3, 500)


def test_report_lists_findings_first_with_evidence_and_hint(html_path: Path) -> None:
    html = html_path.read_text()
    assert html.index('id="findings"') < html.index('id="curves"') < html.index('id="summary"')
    findings = html[
        html.index('id="findings"') : html.index("</section>", html.index('id="findings"'))
    ]
    assert "Findings (1)" in findings
    assert "<td>bn</td>" in findings and ">at step 12</td>" in findings
    assert (
        "bn output held 3 NaN values" in findings and "on_nonfinite=&#x27;raise&#x27;" in findings
    )


def test_report_shows_the_model_summary_and_latest_statistics(html_path: Path) -> None:
    html = html_path.read_text()
    assert (
        '<table class="summary mono">' in html
        and "[2, 4, 8, 8]" in html
        and "Total params: 714" in html
    )
    assert '<table class="latest">' in html and "Statistics at the last sampled step (25)" in html
    assert "skipped_step" in html


def test_report_marks_the_nan_step_with_the_statistics_before_it(html_path: Path) -> None:
    html = html_path.read_text()
    nan = html[html.index('id="nan"') : html.index("</section>", html.index('id="nan"'))]
    assert "began at step <b>12</b> in <b>bn</b>" in nan
    assert "Statistics at step 10, the last sampled step before it" in nan
    assert '<table class="before-nan">' in nan and "<td>relu</td>" in nan


def test_report_of_several_runs_overlays_them(run_dir: Path, tmp_path: Path) -> None:
    write_log(tmp_path / "longer", steps=40)
    out = hs.report([run_dir, tmp_path / "longer"])
    assert out == run_dir / "runs.html"
    html = out.read_text()
    runs = _data(html)["runs"]
    assert [r["label"] for r in runs] == [run_dir.name, "longer"]
    assert runs[1]["x"][-1] == 35
    assert f'id="findings-{run_dir.name}"' in html and 'id="findings-longer"' in html


def test_log_reader_turns_nonfinite_strings_into_floats_and_skips_a_torn_last_line(
    run_dir: Path, tmp_path: Path
) -> None:
    text = (run_dir / "hookscope.jsonl").read_text()
    (tmp_path / "hookscope.jsonl").write_text(text + '{"type": "step", "st')
    run = load_run(tmp_path)
    assert len(run.steps) == 30
    loss = run.scalars()["loss"][1]
    assert loss[12] != loss[12]  # nan
    assert run.findings[0]["module"] == "bn" and run.findings[0]["message"].startswith("bn output")


def test_report_of_a_missing_log_says_what_was_expected(tmp_path: Path) -> None:
    with pytest.raises(hs.HookscopeError, match=r"hookscope.jsonl"):
        hs.report(tmp_path)


def test_report_of_a_log_with_only_a_header(tmp_path: Path) -> None:
    (tmp_path / "hookscope.jsonl").write_text(
        '{"type": "header", "model": "M", "modules": {}, "params": {}}\n'
    )
    html = hs.report(tmp_path).read_text()
    assert "No findings" in html and "0 steps" in html


def test_report_separates_current_findings_from_cleared_ones(run_dir: Path, tmp_path: Path) -> None:
    text = (run_dir / "hookscope.jsonl").read_text()
    transient = hs.Finding("update_ratio", "fc", 3, 0.4, "updates are too large")
    lines = [
        json.dumps({"type": "finding", **asdict(transient)}),
        json.dumps(asdict(Cleared.of(dataclasses.replace(transient, cleared_at=9)))),
    ]
    (tmp_path / "hookscope.jsonl").write_text(text + "\n".join(lines) + "\n")
    html = hs.report(tmp_path).read_text()
    findings = html[
        html.index('id="findings"') : html.index("</section>", html.index('id="findings"'))
    ]
    # A NaN happened: the note that nothing is current is not the green "all clear".
    events, rest = findings.split('<p class="note">No condition is current')
    current, cleared = rest.split("Cleared (1)")
    assert 'class="ok"' not in findings
    # The NaN is an event at its step: neither current forever nor cleared.
    assert "Findings (2)" in events and "Events (1)" in events
    assert "<td>bn</td>" in events and ">at step 12</td>" in events
    assert "<td>fc</td>" not in events and "<td>bn</td>" not in current + cleared
    assert "<td>fc</td>" in cleared and ">9</td>" in cleared and "Cleared at" in cleared
    flags = {f["kind"]: f.get("event") for f in _data(html)["runs"][0]["findings"]}
    assert flags == {"nonfinite": True, "update_ratio": None}


def test_report_lists_watched_modules_that_never_ran(tmp_path: Path) -> None:
    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.MultiheadAttention(16, 2, batch_first=True)  # out_proj: by weight
            self.head = nn.Linear(16, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.attn(x, x, x)[0].mean(1))

    model = Attention()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with hs.Monitor(model, every=1, log_dir=tmp_path) as mon:
        assert "attn.out_proj" in mon.modules
        for _ in range(2):
            loss = model(torch.randn(4, 5, 16)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            mon.step(loss=loss)
    html = hs.report(tmp_path).read_text()
    assert "Modules that never ran" in html
    start = html.index('class="never-ran"')
    never = html[start : html.index("</table>", start)]
    assert "<td>attn.out_proj</td>" in never and "NonDynamicallyQuantizableLinear" in never
    assert "<td>head</td>" not in never


def test_report_of_a_file_that_is_not_a_hookscope_log_says_so(tmp_path: Path) -> None:
    other = tmp_path / "metrics.jsonl"
    other.write_text('{"epoch": 1, "loss": 0.5}\n{"epoch": 2, "loss": 0.4}\n')
    with pytest.raises(hs.HookscopeError, match=r"metrics.jsonl.*not a hookscope log.*header"):
        hs.report(other)
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(hs.HookscopeError, match=r"empty.jsonl.*not a hookscope log"):
        hs.report(tmp_path / "empty.jsonl")


def test_report_without_a_loss_says_why(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    with hs.Monitor(model, every=1, log_dir=tmp_path) as mon:
        for _ in range(3):
            model(torch.randn(2, 4))  # forward passes only: no backward, no loss
            mon.step()
    html = hs.report(tmp_path).read_text()
    assert "No loss was logged" in html and "mon.step(loss=loss)" in html


# -- in a browser -----------------------------------------------------------------------------

browser = pytest.mark.skipif(CHROMIUM is None, reason="needs chromium (make test installs it)")

_DRAWN = """(() => Object.entries(window.hsCharts).filter(([id, u]) => {
  const c = u.ctx.canvas, d = u.ctx.getImageData(0, 0, c.width, c.height).data;
  let ink = 0;
  for (let i = 0; i < d.length; i += 4) if (d[i + 3] > 0 && (d[i] < 200 || d[i + 1] < 200)) ink++;
  return ink < 50;
}).map(([id]) => id))()"""


def _at(b: Browser, chart: str, step: float, value: float | None = None) -> tuple[float, float]:
    """Viewport coordinates of (step, value) on a chart, scrolled into view."""
    return tuple(
        b.eval(
            f"""(() => {{ const u = hsCharts[{json.dumps(chart)}]; u.root.scrollIntoView();
            const r = u.over.getBoundingClientRect();
            const y = {"null" if value is None else value};
            return [r.left + u.valToPos({step}, 'x'),
                    r.top + (y === null ? r.height / 2 : u.valToPos(y, 'y'))]; }})()"""
        )
    )


def _legend(b: Browser, chart: str) -> list[str]:
    return b.eval(
        f"[...hsCharts[{json.dumps(chart)}].root.querySelectorAll('.u-legend .u-value')]"
        ".map(e => e.textContent)"
    )


def _open(b: Browser, path: Path) -> None:
    b.open(path)
    assert b.eval("Number(document.documentElement.dataset.hsReady)") > 0
    assert b.eval(_DRAWN) == []  # every chart has ink on its canvas


def _clean(b: Browser, path: Path) -> None:
    assert b.console_errors == []
    assert [u for u in b.requests if u != path.resolve().as_uri()] == []


@pytest.mark.browser
@browser
def test_report_in_chromium_hover_shows_values_and_zoom_is_shared(
    html_path: Path, tmp_path: Path
) -> None:
    with Browser(tmp_path / "profile") as b:
        _open(b, html_path)
        ids = b.eval("Object.keys(hsCharts)")
        assert {"timeline", "curve:loss", "curve:lr", "grad.norm:relu", "ratio:fc.weight"} <= set(
            ids
        )
        # Hover: the loss at step 10 is 2.3 * exp(-1) in the log; the legend says so.
        b.mouse("mouseMoved", *_at(b, "curve:loss", 10, 0.846))
        step, loss = _legend(b, "curve:loss")[:2]
        assert step == "10" and float(loss) == pytest.approx(2.3 * math.exp(-1), rel=1e-3)
        # The cursor is shared: a per-module chart shows its own value at that step.
        step, mean = _legend(b, "act.mean:relu")[:2]
        assert step == "10" and float(mean) == pytest.approx(0.3, rel=1e-3)
        # Zoom: drag across one chart; every chart's step axis follows.
        before = b.eval("[hsCharts['curve:lr'].scales.x.min, hsCharts['curve:lr'].scales.x.max]")
        x0, y = _at(b, "grad.norm:bn", 5)
        x1, _ = _at(b, "grad.norm:bn", 20)
        b.drag(x0, x1, y)
        for chart in ("grad.norm:bn", "curve:lr", "timeline"):
            lo, hi = b.eval(f"[hsCharts['{chart}'].scales.x.min, hsCharts['{chart}'].scales.x.max]")
            assert 4 <= lo <= 6 and 19 <= hi <= 21 and [lo, hi] != before, chart
        # Heatmaps are drawn (canvases with colour) and answer on hover.
        heat = "document.querySelector('canvas[data-id^=\"heat:\"]')"
        box = b.eval(
            f"(() => {{ const c = {heat}; c.scrollIntoView(); const r = c.getBoundingClientRect(); return [r.left, r.top, r.width, r.height]; }})()"
        )
        b.mouse("mouseMoved", box[0] + box[2] - 20, box[1] + 5)
        tip = b.eval(f"{heat}.parentElement.querySelector('.tip').textContent")
        assert tip.startswith("conv · step 25") and "‖grad‖ ≈" in tip
        _clean(b, html_path)
        b.screenshot(tmp_path / "report.png")
    assert (tmp_path / "report.png").stat().st_size > 50_000


@pytest.mark.browser
@browser
def test_each_kind_of_report_renders_cleanly_in_chromium(run_dir: Path, tmp_path: Path) -> None:
    """One run with a NaN, several runs overlaid, a run without findings or loss: each
    drawn, no error, no request; a screenshot of each in the test's output."""
    write_log(tmp_path / "b", steps=40)
    overlay = hs.report([run_dir, tmp_path / "b"], tmp_path / "overlay.html")
    empty = tmp_path / "empty"
    (empty / "hookscope.jsonl").parent.mkdir()
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    with hs.Monitor(model, every=1, log_dir=empty) as mon:
        for _ in range(5):
            model(torch.randn(2, 4)).sum().backward()
            mon.step()
    plain = hs.report(empty)
    with Browser(tmp_path / "profile") as b:
        for page in (overlay, plain):
            b.requests.clear()
            _open(b, page)
            _clean(b, page)
            b.screenshot(tmp_path / f"{page.stem}.png")
        # Overlaid: one series per run on the same chart.
        b.open(overlay)
        assert b.eval("hsCharts['curve:loss'].series.length") == 3
        assert b.eval("hsCharts['curve:loss'].data[0].at(-1)") == 39
    for name in ("overlay", "report"):
        assert (tmp_path / f"{name}.png").stat().st_size > 20_000


# -- the signals: loss spikes, outliers, evaluation passes, silent errors ----------------------

SPIKE = 40  # the step a bad batch makes the loss spike at (tests/test_signals.py)


@pytest.fixture(scope="module")
def signals_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real run: SGD on a linear target, a batch 30x too large at SPIKE (a loss spike and
    its window), an evaluation pass every 10 steps (eval records), activations every 5
    steps (kurtosis, absmax/RMS), and no zero_grad at the last step (stale_gradients)."""
    path = tmp_path_factory.mktemp("signals")
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    w = torch.randn(8, 1, generator=g)
    with hs.Monitor(model, every=5, log_dir=path) as mon:
        for step in range(SPIKE + 5):
            x = torch.randn(64, 8, generator=g)
            y = x @ w + 0.1 * torch.randn(64, 1, generator=g)
            if step % 10 == 0:
                model.eval()
                with torch.no_grad():
                    model(x)
                model.train()
            loss = (model(x * (30 if step == SPIKE else 1)) - y).pow(2).mean()
            loss.backward()
            opt.step()
            if step < SPIKE + 3:
                opt.zero_grad()
            mon.step(loss=loss)
    return path


def test_report_shows_each_signal_the_monitor_logs(signals_dir: Path) -> None:
    html = hs.report(signals_dir).read_text()
    run = _data(html)["runs"][0]
    kinds = {f["kind"] for f in run["findings"]}
    assert {"loss_spike", "stale_gradients"} <= kinds
    # The spike: an event at its step, with its window charted and tabled.
    (window,) = run["windows"]
    assert window["step"] == SPIKE and window["x"][-1] == SPIKE
    assert window["scalars"]["loss"][-1] > 10 * window["scalars"]["loss"][0]
    assert set(window["groups"]) == set(window["weights"]) == {"0", "2", "4"}
    assert 'id="windows"' in html and '<table class="windows">' in html
    assert f">at step {SPIKE}</td>" in html
    # Outlier statistics per module, and the evaluation passes apart from training.
    assert len(run["lines"]["act.kurtosis"]) == len(run["modules"])
    assert len(run["lines"]["act.absmax_over_rms"]) == len(run["modules"])
    assert run["evals"]["x"] == [0, 10, 20, 30, 40]
    assert run["evals"]["modules"][:2] == ["0", "1"]
    assert 'id="evals"' in html and '<table class="evals">' in html
    # A hint for every kind found.
    for kind in kinds:
        assert HINTS[kind].split(":")[0].replace("'", "&#x27;") in html, kind


def test_every_finding_kind_has_a_hint() -> None:
    kinds = {
        "nonfinite",
        "exploding_gradient",
        "vanishing_gradient",
        "dead_units",
        "saturated_units",
        "update_ratio",
        "loss_spike",
        "massive_activations",
        "not_updated",
        "stale_gradients",
        "eval_randomness",
        "eval_mismatch",
        "autocast_skipped",
        "frozen_changed",
        "replica_divergence",
    }
    assert kinds <= set(HINTS)


@pytest.mark.browser
@browser
def test_signal_charts_draw_in_chromium(signals_dir: Path, tmp_path: Path) -> None:
    page = hs.report(signals_dir, tmp_path / "signals.html")
    with Browser(tmp_path / "profile") as b:
        _open(b, page)
        ids = set(b.eval("Object.keys(hsCharts)"))
        spike = f"window:{signals_dir.name}:{SPIKE}"
        assert {f"{spike}:scalars", f"{spike}:groups", f"{spike}:weights"} <= ids
        assert f"eval:{signals_dir.name}" in ids
        assert {"act.kurtosis:0", "act.absmax_over_rms:2"} <= ids
        # The window's chart spans its own steps, ending at the spike; hover reads the loss.
        lo, hi = b.eval(
            f"[hsCharts['{spike}:scalars'].scales.x.min, hsCharts['{spike}:scalars'].scales.x.max]"
        )
        assert hi == SPIKE and lo < SPIKE
        b.mouse("mouseMoved", *_at(b, f"{spike}:scalars", SPIKE - 0.3))  # snaps to the spike
        step, loss = _legend(b, f"{spike}:scalars")[:2]
        assert step == str(SPIKE) and float(loss) > 1
        # Zooming the training charts leaves the window's own axis alone.
        x0, y = _at(b, "curve:loss", 5)
        x1, _ = _at(b, "curve:loss", 20)
        b.drag(x0, x1, y)
        assert b.eval(f"hsCharts['{spike}:scalars'].scales.x.max") == SPIKE
        _clean(b, page)
        b.screenshot(tmp_path / "signals.png")
    assert (tmp_path / "signals.png").stat().st_size > 20_000


def test_attention_logits_are_charted_per_attention_block(tmp_path: Path) -> None:
    """GPT-2's attention blocks are not leaves; their logit chart sits before their children."""
    from models import gpt2, token_ids

    model = gpt2(2).train()
    with hs.Monitor(model, every=1, log_dir=tmp_path) as mon:
        for _ in range(3):
            model(token_ids(), labels=token_ids()).loss.backward()
            mon.step()
    run = _data(hs.report(tmp_path).read_text())["runs"][0]
    logged = [r["attn"]["transformer.h.1.attn"]["logit_max"] for r in mon.records[1:]]
    row = run["modules"].index("transformer.h.1.attn")
    assert run["lines"]["attn.logit_max"][row] == pytest.approx(logged, rel=1e-3)  # 4 digits
    assert row < run["modules"].index("transformer.h.1.attn.c_attn")


def test_precision_losses_are_charted_per_module_and_dtype(tmp_path: Path) -> None:
    """A loss scaled by 1e-12: its gradients would underflow in float16, not in bfloat16."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with hs.Monitor(model, every=2, precision=("bf16", "fp16"), log_dir=tmp_path) as mon:
        for _ in range(6):
            (model(torch.randn(32, 8)).pow(2).mean() * 1e-12).backward()
            opt.step()
            opt.zero_grad()
            mon.step()
    page = hs.report(tmp_path, tmp_path / "report.html")
    run = _data(page.read_text())["runs"][0]
    sampled = [r for r in mon.records if r["type"] == "step" and r["sampled"]]
    row = run["modules"].index("1")
    logged = [r["precision"]["1"]["grad"]["underflow"]["fp16"] for r in sampled]
    assert min(logged) > 0.5
    assert run["precision"]["grad"]["fp16 underflow"][row] == pytest.approx(logged, rel=1e-3)
    assert "bf16 underflow" not in run["precision"]["grad"]  # never above zero: no series
    if CHROMIUM is None:
        return
    with Browser(tmp_path / "profile") as b:
        _open(b, page)
        assert "precision.grad:1" in b.eval("Object.keys(hsCharts)")
        # A fraction's axis starts at 0 (no swing magnified) and ends near its largest value.
        lo, hi = b.eval(
            "[hsCharts['precision.grad:1'].scales.y.min, hsCharts['precision.grad:1'].scales.y.max]"
        )
        assert lo == 0 and max(logged) <= hi <= min(1, 1.1 * max(logged)) + 1e-9
