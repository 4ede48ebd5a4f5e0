"""_repr_html_: what a notebook shows for a Monitor, a Finding, a Record, a Capture, a
summary and a FeatureStore (checked as parsed HTML: well formed, with the object's data)."""

from __future__ import annotations

import math
from html.parser import HTMLParser
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

import hookscope as hs
from hookscope._notebook import sparkline


class _Check(HTMLParser):
    """Collects the text and the tags; fails on a closing tag that does not match."""

    VOID: ClassVar[set[str]] = {"br", "circle", "polyline", "img"}

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.tags: list[str] = []
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)

    def handle_endtag(self, tag: str) -> None:
        if tag in self.VOID:
            return
        assert self.stack and self.stack.pop() == tag, tag

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def parse(html: str) -> _Check:
    check = _Check()
    check.feed(html)
    check.close()
    assert check.stack == [], check.stack
    assert "<script" not in html
    return check


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def test_monitor_shows_steps_findings_and_a_loss_sparkline() -> None:
    torch.manual_seed(0)
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with hs.Monitor(net, every=1) as mon:
        assert "step 0" in " ".join(parse(mon._repr_html_()).text)
        for step in range(6):
            x = torch.randn(8, 4)
            if step == 4:
                x[0, 0] = math.nan
            loss = net(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            mon.step(loss=loss)
        html = mon._repr_html_()
    seen = parse(html)
    text = " ".join(seen.text)
    assert "step 6" in text and "3 modules watched" in text
    assert "polyline" in seen.tags  # the loss, drawn
    assert mon.findings and mon.findings[0].kind in text and "current" in text


def test_sparkline_skips_nonfinite_values_and_needs_two_points() -> None:
    svg = sparkline([3.0, math.nan, 2.0, 1.0])
    points = svg.split('points="')[1].split('"')[0].split()
    assert len(points) == 3
    assert sparkline([1.0]) == "" and sparkline([math.nan, 1.0]) == ""


def test_finding_shows_kind_module_step_and_whether_it_cleared() -> None:
    f = hs.Finding("dead_units", "features.5", 12, 0.93, "93% of units never fire", cleared_at=40)
    text = " ".join(parse(f._repr_html_()).text)
    assert "dead_units" in text and "features.5" in text and "12" in text
    assert "cleared at step 40" in text and "93% of units never fire" in text


def test_record_and_capture_show_shapes_and_modules_that_never_ran() -> None:
    net = model()
    with hs.capture(net, ["0", "2"], what=("output",)) as cap:
        net(torch.randn(3, 4))
    text = " ".join(parse(cap._repr_html_()).text)
    assert "Capture: 2 of 2 modules" in text and "[3, 8]" in text.replace("(", "[")
    record = cap["0"]
    rtext = " ".join(parse(record._repr_html_()).text)
    assert "Record '0', call 0" in rtext and "output" in rtext


def test_summary_shows_every_module_and_the_total() -> None:
    s = hs.summary(model(), torch.zeros(2, 4))
    text = " ".join(parse(s._repr_html_()).text)
    assert "Linear" in text and "ReLU" in text and "Total params: 58" in text


def test_feature_store_shows_its_sites_and_rows(tmp_path: Path) -> None:
    loader = torch.utils.data.DataLoader(torch.randn(10, 4), batch_size=4)
    store = hs.extract_dataset(model(), loader, "1", tmp_path / "fs", progress=False)
    text = " ".join(parse(store._repr_html_()).text)
    assert "10 rows" in text and "complete" in text and "[8]" in text
