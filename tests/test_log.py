"""The log's typed records, their JSON form, and docs/log-format.md, kept in step."""

from __future__ import annotations

import math
import re
from dataclasses import fields
from pathlib import Path

import torch
import torch.nn as nn

import hookscope as hs
from hookscope._diagnose import Finding
from hookscope._log import (
    ACT_STATS,
    BN_STATS,
    GRAD_STATS,
    PARAM_STATS,
    Event,
    Header,
    StepRecord,
    decode,
    encode,
)

DOC = (Path(__file__).parents[1] / "docs" / "log-format.md").read_text()


def documented(type_name: str) -> set[str]:
    """Names in backticks in the fields cell of the table row for ``type_name``."""
    row = next(line for line in DOC.splitlines() if line.startswith(f"| `{type_name}` |"))
    return set(re.findall(r"`(\w+)`", row.split("|")[3]))


def test_every_field_of_every_record_type_is_documented() -> None:
    for type_name, record_type in [
        ("header", Header),
        ("step", StepRecord),
        ("event", Event),
        ("finding", Finding),
    ]:
        names = {f.name for f in fields(record_type)} - {"type"}
        assert names <= documented(type_name), (type_name, names - documented(type_name))


def test_every_statistic_is_documented_in_its_group() -> None:
    for group, stats in [
        ("act", ACT_STATS),
        ("grad", GRAD_STATS),
        ("param", PARAM_STATS),
        ("bn", BN_STATS),
    ]:
        line = next(line for line in DOC.splitlines() if line.startswith(f"- `{group}`:"))
        listed = re.findall(r"`(\w+)`", line.split("—")[0])
        assert [s for s in listed if s in stats] == list(stats), group


def test_a_real_record_has_exactly_the_documented_statistics() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with hs.Monitor(model, every=1) as mon:
        model(torch.randn(16, 4)).sum().backward()
        opt.step()
        mon.step(loss=1.0)
    record = mon.records[1]
    assert set(record) == {f.name for f in fields(StepRecord)}
    assert set(record["act"]["2"]) == {*ACT_STATS, "channels"}  # optional: 2 dims or more
    assert set(record["grad"]["2"]) == set(GRAD_STATS)
    assert set(record["param"]["0.weight"]) == set(PARAM_STATS)
    assert set(record["bn"]["1"]) == set(BN_STATS)
    assert set(mon.records[0]) == {f.name for f in fields(Header)}


def test_nonfinite_floats_round_trip_and_text_is_left_alone() -> None:
    record = {"type": "finding", "message": "inf", "value": math.inf, "xs": [math.nan, -math.inf]}
    back = decode(encode(record))
    assert back["message"] == "inf" and back["value"] == math.inf
    assert math.isnan(back["xs"][0]) and back["xs"][1] == -math.inf
