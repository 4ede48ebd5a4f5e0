"""Sinks write what the Monitor measured, and it reads back the same.

A Monitor on a GPT-2 (from a config) and on a CNN with in-place ReLUs writes to a
``MemorySink``, a ``JsonlSink`` and a ``TensorBoardSink`` at once: the JSON-lines log read back
equals the records in memory, and every scalar TensorBoard's own reader finds equals the
record's value at that step.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

import hookscope as hs
from models import gpt2, images, resnet_pair, token_ids


def _train(model: nn.Module, batch: torch.Tensor, sinks: list, steps: int = 3) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with hs.Monitor(model, every=1, sample=None, optimizer=opt, sinks=sinks) as mon:
        for _ in range(steps):
            out = model(batch)
            loss = out.logits.logsumexp(-1).mean() if hasattr(out, "logits") else out.sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            mon.step(loss=loss)


def _same(a: object, b: object) -> bool:
    """Equal, a NaN equal to a NaN (the log writes it as "nan" and reads it back)."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a):
        return math.isnan(b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def test_the_jsonl_log_reads_back_as_the_records_in_memory(tmp_path: Path) -> None:
    model = gpt2()
    memory = hs.MemorySink()
    _train(model, token_ids(), [memory, hs.JsonlSink(tmp_path)])
    logged = hs.read_log(tmp_path)
    assert [r["type"] for r in logged] == [r["type"] for r in memory.records]
    assert sum(r["type"] == "step" for r in logged) == 3
    for got, want in zip(logged, memory.records, strict=True):
        assert _same(got, want), (got.get("type"), got.get("step"))


def test_tensorboard_reads_back_every_scalar_the_monitor_measured(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    model = resnet_pair()[0].train()
    memory = hs.MemorySink()
    board = hs.TensorBoardSink(tmp_path)
    _train(model, images(), [memory, board])
    events = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    steps = [r for r in memory.records if r["type"] == "step"]
    expected: dict[str, dict[int, float]] = {}
    for record in steps:
        for name, value in record["scalars"].items():
            expected.setdefault(name, {})[record["step"]] = value
        for group in ("act", "grad", "param", "bn"):
            for module, stats in record[group].items():
                for stat, value in stats.items():
                    if stat in ("nan", "inf"):
                        tag = f"nonfinite/{module}/{group}_{stat}"
                    elif isinstance(value, (int, float)):
                        tag = f"{group}/{module}/{stat}"
                    else:
                        continue
                    expected.setdefault(tag, {})[record["step"]] = value
    assert {"loss", "act/layer1.0.bn2/mean", "grad/fc/norm", "bn/bn1/running_var"} <= tags
    assert set(expected) <= tags
    for tag, by_step in expected.items():
        written = {e.step: e.value for e in events.Scalars(tag)}
        assert written.keys() == by_step.keys(), tag
        for step, value in by_step.items():  # TensorBoard stores float32
            want = pytest.approx(value, rel=1e-6, abs=1e-30, nan_ok=True)
            assert written[step] == want, (tag, step)


def test_jsonl_log_survives_a_torn_line_and_round_trips_nan(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    with hs.Monitor(model, every=1, log_dir=tmp_path) as mon:
        model(torch.randn(3, 8)).sum().backward()
        mon.step(loss=float("nan"), note=torch.tensor(2.0))
    with open(tmp_path / "hookscope.jsonl", "a") as f:
        f.write('{"type": "step", "ste')  # a crash in the middle of a write
    records = hs.read_log(tmp_path)
    # the NaN loss with finite gradients is a finding of its own (made after the model)
    assert [r["type"] for r in records] == ["header", "step", "finding"]
    assert records[2]["kind"] == "nonfinite" and records[2]["module"] == ""
    assert (
        records[1]["scalars"]["note"] == 2.0
        and records[1]["scalars"]["loss"] != records[1]["scalars"]["loss"]
    )
    json.loads((tmp_path / "hookscope.jsonl").read_text().splitlines()[1])  # strict JSON


def test_histograms_and_tensorboard_events(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    with hs.Monitor(model, every=1, log_dir=tmp_path, histograms=True, bins=8) as mon:
        model(torch.randn(32, 8)).sum().backward()
        mon.step(loss=1.0)
    hist = mon.records[1]["act"]["0"]["hist"]
    assert len(hist["counts"]) == 8 and sum(hist["counts"]) == 32 * 32
    assert hist["lo"] < hist["hi"]
    assert list(tmp_path.glob("events.out.tfevents.*"))
