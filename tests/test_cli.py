"""The `hookscope` command: golden text output, exit statuses, error messages, the demo."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import hookscope as hs
from hookscope._cli import main
from hookscope._demo import FAULTS

GOLDEN = Path(__file__).parent / "golden"
UPDATE = os.environ.get("HOOKSCOPE_UPDATE_GOLDEN") == "1"


def _golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if UPDATE:
        path.write_text(text, encoding="utf-8")
    assert text == path.read_text(encoding="utf-8"), (
        f"differs from {path}; rerun with HOOKSCOPE_UPDATE_GOLDEN=1"
    )


def test_summary_command_prints_the_golden_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["summary", "hookscope._demo:DigitsCNN", "--input", "2,1,8,8"]) == 0
    out = capsys.readouterr().out
    assert "\x1b[" not in out
    _golden("summary_digits_cnn.txt", out)


def test_summary_command_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["summary", "hookscope._demo:DigitsCNN", "--input", "1x1x8x8", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["total"]["params"] == 38378
    assert data["rows"][2]["output_shape"] == [[1, 16, 8, 8]]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["summary", "hookscope._demo:DigitCNN", "--input", "1,1,8,8"], "Did you mean 'DigitsCNN'"),
        (
            ["summary", "no_such_module_xyz:build", "--input", "1,1,8,8"],
            "cannot import module 'no_such_module_xyz'",
        ),
        (["summary", "hookscope._demo", "--input", "1,1,8,8"], "expected MODULE:FACTORY"),
        (
            ["summary", "hookscope._demo:DigitsCNN", "--input", "1,3,8,8"],
            "failed on an input of shape [1, 3, 8, 8]",
        ),
        (["report", "/nonexistent/run"], "no hookscope log at"),
    ],
)
def test_errors_exit_1_with_a_hint(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("Error: ") and message in err
    assert f"Try 'hookscope {argv[0]} --help' for help." in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "argv",
    [
        ["demo", "--fault", "boom"],
        ["summary", "m:f", "--input", "a,b"],
        ["summary", "m:f"],
        ["nope"],
        ["demo", "--epochs", "0"],
    ],
)
def test_usage_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Error: " in err and "--help' for help." in err


@pytest.mark.parametrize("command", [[], ["demo"], ["report"], ["summary"]])
def test_every_command_has_help(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([*command, "--help"])
    assert exc.value.code == 0
    assert "usage: hookscope" in capsys.readouterr().out


def test_report_command_writes_the_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from _synthetic_log import write_log

    write_log(tmp_path / "run")
    assert main(["report", str(tmp_path / "run"), "-o", str(tmp_path / "r.html")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "r.html")
    assert "<table" in (tmp_path / "r.html").read_text()


def test_python_dash_m_runs_the_cli() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "hookscope", "--version"], capture_output=True, text=True
    )
    assert out.returncode == 0 and out.stdout.strip() == f"hookscope {hs.__version__}"


# -- the demo -------------------------------------------------------------------------------


def _demo_findings(tmp_path: Path, fault: str, epochs: int) -> tuple[float, list[dict]]:
    from hookscope._demo import run_demo

    result = run_demo(tmp_path / fault, epochs=epochs, fault=fault, progress=False)
    assert result.report.is_file()
    return result.accuracy, [
        {"kind": f.kind, "module": f.module, "step": f.step} for f in result.findings
    ]


@pytest.mark.slow
def test_demo_without_fault_learns_and_finds_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["demo", "--out", str(tmp_path / "run"), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "findings: none" in out
    accuracy = float(out.split("test accuracy: ")[1].split("%")[0]) / 100
    assert accuracy > 0.9
    assert f"report: {tmp_path / 'run' / 'report.html'}" in out
    kinds = {
        json.loads(line)["type"]
        for line in (tmp_path / "run" / "hookscope.jsonl").read_text().splitlines()
    }
    assert {"header", "step", "summary", "feature_maps"} <= kinds


@pytest.mark.slow
def test_the_cli_offers_every_demo_fault_without_importing_torch() -> None:
    from hookscope._cli import DEMO_FAULTS

    assert list(DEMO_FAULTS) == list(FAULTS)
    code = (
        "import sys; from hookscope._cli import _parser; _parser(); print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("fault", [f for f in FAULTS if f != "none"])
def test_demo_fault_yields_its_finding_on_the_right_layer(tmp_path: Path, fault: str) -> None:
    kind, module = FAULTS[fault]  # type: ignore[misc]
    _, findings = _demo_findings(tmp_path, fault, epochs=1)
    first = next((f for f in findings if f["kind"] == kind), None)
    assert first is not None, findings
    assert first["module"] == module, findings
