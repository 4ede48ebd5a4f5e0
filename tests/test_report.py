"""report(): one self-contained HTML file from a log; checked as text and in headless Chromium."""

from __future__ import annotations

import base64
import dataclasses
import json
import re
import shutil
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from torch import nn

import hookscope as hs
from _synthetic_log import write_log
from hookscope._log import Cleared
from hookscope._report._data import load_run

CHROMIUM = shutil.which("chromium") or (
    "/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None
)
IMG = re.compile(r'<img class="plot" alt="([^"]*)" src="data:image/png;base64,([^"]+)">')


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


def test_report_embeds_every_plot_as_a_png_and_fetches_nothing(html_path: Path) -> None:
    html = html_path.read_text()
    images = IMG.findall(html)
    alts = [alt for alt, _ in images]
    assert alts == [
        "scalars over steps",
        "activation mean and std",
        "zero fraction",
        "gradient norm",
        "update ratio",
        "gradient norm heatmap",
        "activation histograms",
        "feature maps of conv",
    ]
    for _, data in images:
        assert base64.b64decode(data).startswith(b"\x89PNG\r\n\x1a\n")
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", html)
    assert "<script" not in html and "@import" not in html


def test_report_lists_findings_first_with_evidence_and_hint(html_path: Path) -> None:
    html = html_path.read_text()
    assert html.index('id="findings"') < html.index('id="curves"') < html.index('id="summary"')
    findings = html[
        html.index('id="findings"') : html.index("</section>", html.index('id="findings"'))
    ]
    assert "Findings (1)" in findings
    assert "<td>bn</td>" in findings and ">12</td>" in findings
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


def test_report_without_matplotlib_keeps_the_tables_and_says_how_to_get_plots(
    run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in [
        m
        for m in sys.modules
        if m == "matplotlib" or m.startswith(("matplotlib.", "hookscope._report._plots"))
    ]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    html = hs.report(run_dir, tmp_path / "plain.html").read_text()
    assert "pip install 'hookscope[plot]'" in html
    assert "<img" not in html
    for cls in ("findings", "scalars", "summary mono", "latest"):
        assert f'<table class="{cls}">' in html


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
    current, cleared = findings.split("Cleared (1)")
    assert "Findings (2)" in current and "Current (1)" in current
    assert "<td>bn</td>" in current and "<td>fc</td>" not in current
    assert "<td>fc</td>" in cleared and ">9</td>" in cleared and "Cleared at" in cleared


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

_CHECK = """<script>
window.__errors = [];
window.addEventListener('error', e => window.__errors.push(String(e.message)));
window.addEventListener('load', () => {
  const imgs = [...document.images];
  const ok = imgs.filter(i => i.complete && i.naturalWidth > 0 && i.naturalHeight > 0);
  const d = document.createElement('div');
  d.id = 'hs-check';
  d.dataset.imgs = imgs.length; d.dataset.ok = ok.length;
  d.dataset.tables = document.querySelectorAll('table').length;
  d.dataset.errors = window.__errors.length;
  document.body.appendChild(d);
});
</script>"""


def _chromium(html: Path, tmp: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    assert CHROMIUM is not None
    cmd = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp / 'profile'}",
        "--enable-logging=stderr",
        "--v=0",
        "--virtual-time-budget=5000",
        "--hide-scrollbars",
        *extra,
        html.as_uri(),
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def check_in_browser(html_path: Path, tmp: Path, screenshot: Path | None = None) -> dict[str, int]:
    """Open a copy of the report with a checking script; return what the page saw."""
    probe = tmp / "probe.html"
    probe.write_text(html_path.read_text().replace("</head>", _CHECK + "</head>", 1))
    dom = _chromium(probe, tmp, "--dump-dom")
    assert "Uncaught" not in dom.stderr and "ERROR:CONSOLE" not in dom.stderr, dom.stderr
    found = re.search(
        r'<div id="hs-check" data-imgs="(\d+)" data-ok="(\d+)" data-tables="(\d+)" data-errors="(\d+)"',
        dom.stdout,
    )
    assert found, dom.stdout[-2000:] + dom.stderr[-2000:]
    if screenshot is not None:
        shot = _chromium(html_path, tmp, f"--screenshot={screenshot}", "--window-size=1280,2400")
        assert screenshot.is_file() and screenshot.stat().st_size > 10_000, shot.stderr[-2000:]
    imgs, ok, tables, errors = map(int, found.groups())
    return {"imgs": imgs, "ok": ok, "tables": tables, "errors": errors}


@pytest.mark.browser
@pytest.mark.skipif(CHROMIUM is None, reason="needs chromium")
def test_report_renders_in_headless_chromium(html_path: Path, tmp_path: Path) -> None:
    seen = check_in_browser(html_path, tmp_path, screenshot=tmp_path / "report.png")
    assert seen == {"imgs": 8, "ok": 8, "tables": 4, "errors": 0}
