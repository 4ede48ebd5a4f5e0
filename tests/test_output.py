"""The Monitor's sinks and findings (``_monitor/_output.py``): a finding kept and logged once,
the first of each chosen kind recorded, each rank's own log and findings under
``sync=False``, and the sinks closed but the records kept."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path

import torch

import hookscope as hs
from hookscope._diagnose import Diagnosis, Finding, Thresholds
from hookscope._monitor._output import Output
from hookscope._monitor._step._dist import Alone
from models import ResNet, images


def diagnosis_of(model: torch.nn.Module) -> Diagnosis:
    shapes = {n: list(p.shape) for n, p in model.named_parameters()}
    types = {n: type(m).__name__ for n, m in model.named_modules()}
    return Diagnosis(Thresholds(), shapes, types)


def nonfinite(module: str, step: int) -> Finding:
    return Finding("nonfinite", module, step, float("nan"), f"NaN in {module}", phase="forward")


def test_a_finding_is_kept_once_and_the_first_of_a_chosen_kind_is_recorded() -> None:
    bundles = []
    out = Output(
        (),
        diagnosis_of(ResNet()),
        rank=None,
        coll=Alone(),
        record_dir=Path("bundles"),
        record_on=("nonfinite",),
        bundle=lambda finding, before: bundles.append((finding, before)) or Path("b/0"),
    )
    first, again = nonfinite("layer1.0.conv1", 2), nonfinite("layer1.0.conv1", 3)
    other = nonfinite("fc", 3)
    assert out.report([first], 2, before_update=True) == [first]
    assert out.report([again, other], 3, before_update=False) == [other]  # conv1: seen
    assert out.report([again], 3, before_update=False, always=True) == [again]
    assert out.findings == [first, other, again]
    assert bundles == [(first, True)]  # one bundle per kind, from before the update
    assert [(r["type"], r.get("kind"), r["step"]) for r in out.memory.records] == [
        ("finding", "nonfinite", 2),
        ("event", "recorded", 2),
        ("finding", "nonfinite", 3),
        ("finding", "nonfinite", 3),
    ]
    assert out.memory.records[1]["message"] == "replay bundle for the nonfinite finding: b/0"


def test_each_rank_of_an_unsynced_run_has_its_own_log_and_findings(tmp_path: Path) -> None:
    out = Output(
        (),
        diagnosis_of(ResNet()),
        rank=1,
        coll=Alone(),
        record_dir=None,
        record_on=(),
        bundle=lambda finding, before: Path(),
    )
    out.open(tmp_path)
    out.header("ResNet", {"fc": "Linear"}, {"fc.weight": [10, 16]}, {"every": 1}, world=2)
    (found,) = out.report([nonfinite("fc", 0)], 0, before_update=False)
    out.event(0, "skipped_step", "step 0: skipped")
    out.close()
    out.write({"type": "after", "step": 1})  # after close: in memory only
    assert found.rank == 1 and out.findings == [found]
    lines = (tmp_path / "rank1" / "hookscope.jsonl").read_text().splitlines()
    assert [json.loads(line)["type"] for line in lines] == ["header", "finding", "event"]
    assert [r["type"] for r in out.memory.records] == ["header", "finding", "event", "after"]
    header = out.memory.records[0]
    assert (header["model"], header["modules"]) == ("ResNet", {"fc": "Linear"})
    assert header["settings"] == {"every": 1, "world": 2, "sync": False, "rank": 1}


def test_a_monitors_records_and_findings_are_its_outputs(tmp_path: Path) -> None:
    model = ResNet()
    with hs.Monitor(model, every=1, log_dir=tmp_path) as mon:
        model(images()).square().mean().backward()
        mon.step()
        mon.log("note", text="hello")
        model(images() * math.nan).square().mean().backward()  # NaN data: a finding
        found = mon.step()
    lines = (tmp_path / "hookscope.jsonl").read_text().splitlines()
    assert [json.loads(line)["type"] for line in lines] == [r["type"] for r in mon.records]
    assert [r["type"] for r in mon.records] == ["header", "step", "note", "step", "finding"]
    assert [(f.kind, f.module, f.step) for f in found] == [("nonfinite", "conv1", 1)]
    assert mon.findings == found  # the findings kept are the ones logged
    logged = [r for r in mon.records if r["type"] == "finding"]
    assert [{**r, "value": None} for r in logged] == [
        {"type": "finding", **asdict(f), "value": None} for f in mon.findings
    ]
    assert all(math.isnan(r["value"]) for r in logged)  # compared apart: NaN != NaN
