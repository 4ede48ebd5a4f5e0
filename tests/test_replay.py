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
from hookscope.testing import internals

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


class Encoder(nn.Module):
    """A NaN made in its own code, between its children: what the cheap flags cannot name."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 3))
        self.poisoned = False

    def forward(self, x):
        z = self.l1(x)
        if self.poisoned:
            z = torch.log(z - 50.0)  # <- the encoder's op
        return z


class AutoEncoder(nn.Module):
    """Lightning's pattern: the training step calls the parts, never ``forward``."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = Encoder()
        self.parts = nn.ModuleList([nn.Sequential(nn.Linear(3, 16), nn.ReLU(), nn.Linear(16, 12))])

    def forward(self, x):
        return self.parts[0](self.encoder(x))


def build_parts() -> nn.Module:
    torch.manual_seed(0)
    return AutoEncoder()


def test_a_loop_calling_the_models_parts_is_replayed_call_by_call(tmp_path) -> None:
    """The NaN is made in the encoder's own code at step 3, an unsampled step: the replay
    re-runs the encoder's and the decoder's calls, in order, and names the op and line; the
    bundle names the module of each call and replays the same."""
    model = build_parts()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    calls = []
    with hs.Monitor(model, every=10, record_dir=tmp_path) as mon:
        for step in range(5):
            x = torch.randn(16, 12)
            model.encoder.poisoned = step == 3
            loss = nn.functional.mse_loss(model.parts[0](model.encoder(x)), x)
            opt.zero_grad()
            loss.backward()
            if step == 3:
                calls = internals(mon).taped_calls
            opt.step()
            mon.step()
    assert [c.module for c in calls] == [model.encoder, model.parts[0]]
    first = next(f for f in mon.findings if f.kind == "nonfinite")
    line = f"{Path(__file__).name}:{_line('# <- the encoder' + chr(39) + 's op')}"
    assert (first.step, first.module, first.op) == (3, "encoder", "aten.log")
    assert first.source.endswith(line)
    (bundle,) = tmp_path.glob("step*-nonfinite")
    meta = json.loads((bundle / "bundle.json").read_text())
    assert [c["module"] for c in meta["calls"]] == ["encoder", "parts.0"]
    fresh = build_parts()
    fresh.encoder.poisoned = True  # the model's own flag is no state a bundle records
    result = hs.replay(bundle, fresh)
    (replayed,) = result.findings
    assert (replayed.module, replayed.op) == ("encoder", "aten.log")
    assert replayed.source.endswith(line) and result.loss_matches is True


def test_a_call_of_the_model_itself_is_still_one_call() -> None:
    """Calling the model (whose forward calls its parts) keeps one call, of the model."""
    model = build_parts()
    with hs.Monitor(model, every=None) as mon:
        model(torch.randn(4, 12)).sum().backward()
        assert [c.module for c in internals(mon).taped_calls] == [None]
        mon.step()
