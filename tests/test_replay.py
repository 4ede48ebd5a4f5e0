"""The flight recorder: a failing step written to disk and replayed bit for bit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import hookscope as hs

HERE = Path(__file__).parent


class Risky(nn.Module):
    """log(|x| + eps), with eps a buffer: part of the state a bundle records."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("eps", torch.tensor(1.0))

    def forward(self, x):
        return torch.log(x.abs() + self.eps)  # <- the op


def build() -> nn.Module:
    """The factory the CLI test names (tests/test_replay.py:build)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16), nn.Dropout(0.2), nn.BatchNorm1d(16), Risky(), nn.Linear(16, 4)
    )


def record(tmp_path, on_nonfinite="skip"):
    model = build()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = torch.randn(32, 8), torch.randint(0, 4, (32,))
    with hs.Monitor(model, record_dir=tmp_path, on_nonfinite=on_nonfinite) as mon:
        for step in range(4):
            model[3].eps.fill_(-1.0 if step == 2 else 1.0)
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            if step == 2:
                state_before = {k: v.clone() for k, v in model.state_dict().items()}
            opt.step()
            mon.step(loss=loss)
    (bundle,) = tmp_path.glob("step*-nonfinite")
    return bundle, mon, state_before


def test_the_bundle_holds_the_state_from_before_the_failing_update(tmp_path) -> None:
    from safetensors.torch import load_file

    bundle, mon, state_before = record(tmp_path)
    meta = json.loads((bundle / "bundle.json").read_text())
    assert meta["finding"]["step"] == 2 and meta["state_before_update"] is True
    stored = load_file(str(bundle / "tensors.safetensors"))
    for name, value in state_before.items():
        assert torch.equal(stored[f"model/{name}"], value), name
    assert [e["kind"] for e in mon.records if e["type"] == "event"].count("recorded") == 1
    assert not any(p.suffix == ".pkl" for p in bundle.iterdir())  # nothing to unpickle


def test_replay_reruns_the_step_bit_for_bit_and_names_the_op(tmp_path) -> None:
    bundle, _mon, _ = record(tmp_path)
    model = build()  # the user's code builds it again; replay loads the recorded state
    result = hs.replay(bundle, model)
    assert result.loss_matches is True
    (finding,) = result.findings
    assert (finding.module, finding.op, finding.phase) == ("3", "aten.log", "forward")
    assert finding.source.endswith(f"{Path(__file__).name}:{_line('# <- the op')}")
    assert result.recorded.step == 2


def test_replay_refuses_another_model_with_the_fix(tmp_path) -> None:
    bundle, _, _ = record(tmp_path)
    with pytest.raises(hs.HookscopeError, match="Build the model exactly"):
        hs.replay(bundle, nn.Sequential(nn.Linear(8, 4)))
    with pytest.raises(hs.HookscopeError, match="no replay bundle"):
        hs.replay(tmp_path / "nope", build())


def test_cli_replay_prints_the_finding_op_and_line(tmp_path) -> None:
    bundle, _, _ = record(tmp_path)
    out = subprocess.run(
        [sys.executable, "-m", "hookscope", "replay", str(bundle), "--model", "test_replay:build"],
        capture_output=True,
        text=True,
        cwd=HERE,
    )
    assert out.returncode == 0, out.stderr
    assert "aten.log" in out.stdout and f"test_replay.py:{_line('# <- the op')}" in out.stdout


def _line(marker: str) -> int:
    lines = Path(__file__).read_text().splitlines()
    return next(i + 1 for i, line in enumerate(lines) if line.rstrip().endswith(marker))
