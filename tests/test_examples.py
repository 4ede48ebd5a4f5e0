"""The scripts in examples/ run."""

import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from _gloo import teardown_abort

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.py"))


@pytest.mark.slow
@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_runs(path: Path, capfd: pytest.CaptureFixture[str], monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(sys, "argv", [str(path)])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    try:
        runpy.run_path(str(path), run_name="__main__")
    except subprocess.CalledProcessError:  # an example that runs torchrun: see tests/_gloo.py
        if not teardown_abort(capfd.readouterr().err):
            raise
        runpy.run_path(str(path), run_name="__main__")
    assert capfd.readouterr().out.strip()
