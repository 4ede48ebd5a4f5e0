"""The field corpus: training scripts written the way people write them, run under ``watch``.

Each script in ``tests/field/`` (listed in its README) runs twice at the same time, bare and
under ``hookscope watch``, as separate processes (several at a time), each in its own working
directory (the scripts save checkpoints there). Watching must change nothing the script does: the same exit
status, the same stdout (the watch parent writes only on stderr), and a log and a report
written. A healthy script gets no finding. With ``FIELD_FAULT`` set, the script injects one
fault at a known step: a NaN/Inf from an op on a line marked ``# <- fault`` must be found at
that step with its op and that line; a learning rate made far too large there must first show
as a learning-rate finding (exploding gradient, update ratio, divergence) within a few steps.
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import hookscope as hs

FIELD = Path(__file__).resolve().parent / "field"
SCRIPTS = sorted(p.name for p in FIELD.glob("*.py") if p.name != "conftest.py")
MARKER = "# <- fault"
TIMEOUT = 240  # seconds, per process: a hang fails the test instead of stalling the suite
# Finding kinds that say "the learning rate is too large" (including divergence rules).
# What a learning rate far too high shows as: exploding gradients or updates, a diverging
# loss, or (a policy that collapses to certainty) gradients that all vanish.
LR_KINDS = {"exploding_gradient", "update_ratio", "loss_spike", "vanishing_gradient"}
# The learning-rate finding comes by the second sampled step after the change: a rule holds
# over a span of training steps, seen on at least two sampled steps (watch's --every is 10).
LR_WINDOW = 2 * 10


@dataclass(frozen=True)
class Fault:
    """``FIELD_FAULT=fault`` in ``script``: at ``step``, ``op`` makes a NaN/Inf on the marked
    line; or, with ``op=None``, the learning rate becomes far too large from ``step`` on."""

    script: str
    fault: str
    step: int
    op: str | None = None

    @property
    def id(self) -> str:
        return f"{self.script.removesuffix('.py')}-{self.fault}"


FAULTS = [
    Fault("amp_accum.py", "nan", 8, "aten.log"),
    Fault("amp_scaler.py", "nan", 8, "aten.log"),
    Fault("compiled.py", "nan", 6, "aten.log"),
    Fault("dcgan.py", "nan", 5, "aten.log"),
    Fault("ema.py", "nan", 11, "aten.log"),
    Fault("gpt.py", "div", 6, "aten.div"),
    Fault("gpt.py", "lr", 10),
    Fault("hf_trainer.py", "nan", 10, "aten.log"),
    Fault("lbfgs_seq.py", "nan", 3, "aten.log"),
    Fault("lightning_script.py", "nan", 9, "aten.log"),
    Fault("loader_cnn.py", "nan", 7, "aten.log"),
    Fault("lstm_lm.py", "nan", 9, "aten.log"),
    Fault("multitask.py", "lr", 12),
    Fault("reinforce.py", "lr", 15),
    Fault("sam.py", "nan", 7, "aten.log"),
    Fault("transformer_lm.py", "nan", 12, "aten.log"),
]


@dataclass
class Run:
    code: int | None  # None: killed after TIMEOUT seconds
    out: str
    err: str


def _env(fault: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("HOOKSCOPE_WATCH", "FIELD_FAULT")}
    # One thread each: several runs share the machine's cores.
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    if fault:
        env["FIELD_FAULT"] = fault
    return env


def _run(command: list[str], cwd: Path, fault: str) -> Run:
    cwd.mkdir(parents=True)
    try:
        done = subprocess.run(
            command, cwd=cwd, env=_env(fault), capture_output=True, text=True, timeout=TIMEOUT
        )
    except subprocess.TimeoutExpired as exc:
        err = exc.stderr.decode() if isinstance(exc.stderr, bytes) else exc.stderr or ""
        return Run(None, "", f"{err}\n(killed after {TIMEOUT} s)")
    return Run(done.returncode, done.stdout, done.stderr)


class Runs:
    """Every run the selected tests need, started at once on a pool of a few processes (the
    bare runs fill the cores while the longer watched runs go on); each test waits for its
    own two. Each run has its working directory under ``root``."""

    def __init__(self, root: Path, keys: list[tuple[str, str]]) -> None:
        self.root = root
        self.pool = ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 2))
        self.jobs: dict[tuple[str, str], tuple[Future[Run], Future[Run], Path]] = {}
        for key in keys:
            self._submit(key)

    def _submit(self, key: tuple[str, str]) -> None:
        script, fault = key
        base = self.root / f"{script.removesuffix('.py')}-{fault or 'healthy'}"
        out, program = base / "watch-out", [sys.executable, str(FIELD / script)]
        watch = [sys.executable, "-m", "hookscope", "watch", "--out", str(out), "--"]
        watched = self.pool.submit(_run, [*watch, *program], base / "watched", fault)
        bare = self.pool.submit(_run, program, base / "bare", fault)
        self.jobs[key] = (bare, watched, out)

    def get(self, script: str, fault: str = "") -> tuple[Run, Run, Path]:
        """The bare run, the watched run and the watch's ``--out`` directory."""
        if (script, fault) not in self.jobs:
            self._submit((script, fault))
        bare, watched, out = self.jobs[script, fault]
        return bare.result(), watched.result(), out


@pytest.fixture(scope="module")
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    keys = []
    for item in request.session.items:  # the tests selected in this module, in their order
        params = getattr(item, "callspec", None) and item.callspec.params
        if getattr(item, "module", None) is not request.module or not params:
            continue
        case = params.get("case")
        keys.append((case.script, case.fault) if case else (params["script"], ""))
    runs = Runs(tmp_path_factory.mktemp("field"), keys)
    yield runs
    runs.pool.shutdown(cancel_futures=True)


def _same_run(bare: Run, watched: Run) -> None:
    """The watched run did what the bare one did."""
    context = f"watched stderr:\n{watched.err[-3000:]}\nbare stderr:\n{bare.err[-1500:]}"
    assert watched.code == bare.code, context
    assert watched.out == bare.out, context


def _findings(out: Path, watched: Run) -> list[dict[str, Any]]:
    """Every finding of every model's log under ``out``, after checking each log has its
    report; at least one log must be there."""
    logs = sorted({p.parent for p in out.glob("**/hookscope.jsonl")})
    assert logs, f"no log under {out}; watched stderr:\n{watched.err[-3000:]}"
    findings = []
    for log_dir in logs:
        records = hs.read_log(log_dir)
        assert records[0]["type"] == "header"
        assert any(r["type"] == "step" for r in records), f"no step logged in {log_dir}"
        assert (log_dir / "report.html").is_file(), watched.err[-3000:]
        findings += [r for r in records if r["type"] == "finding"]
    return sorted(findings, key=lambda f: f["step"])


def _brief(findings: list[dict[str, Any]]) -> str:
    return "\n".join(
        f"  step {f['step']} {f['kind']} in {f['module']!r} (op={f.get('op')}, "
        f"source={f.get('source')}): {str(f['message'])[:300]}"
        for f in findings
    )


def line_of_fault(script: str) -> str:
    """``"<script path>:<line>"`` of the script's line marked ``# <- fault``."""
    lines = (FIELD / script).read_text(encoding="utf-8").splitlines()
    number = next(i + 1 for i, line in enumerate(lines) if line.rstrip().endswith(MARKER))
    return f"{FIELD / script}:{number}"


def test_the_corpus_is_complete() -> None:
    """Every script is listed in the README and has a fault case; every fault line exists."""
    readme = (FIELD / "README.md").read_text(encoding="utf-8")
    assert len(SCRIPTS) >= 12
    assert [s for s in SCRIPTS if f"`{s}`" not in readme] == []
    assert sorted({f.script for f in FAULTS}) == SCRIPTS
    for fault in FAULTS:
        assert f'FAULT == "{fault.fault}"' in (FIELD / fault.script).read_text()
        line_of_fault(fault.script)


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS, ids=[s.removesuffix(".py") for s in SCRIPTS])
def test_a_healthy_script_runs_the_same_watched_and_gets_no_finding(
    runs: Runs, script: str
) -> None:
    bare, watched, out = runs.get(script)
    assert bare.code == 0, bare.err[-3000:]
    _same_run(bare, watched)
    findings = _findings(out, watched)
    assert findings == [], f"false alarms on a healthy run:\n{_brief(findings)}"
    for log_dir in sorted({p.parent for p in out.glob("**/hookscope.jsonl")}):
        sampled = [r for r in hs.read_log(log_dir) if r["type"] == "step" and r["sampled"]]
        # Watched, not just logged: activations on sampled steps, compiled scripts included.
        assert any(r["act"] for r in sampled), f"no activation statistics in {log_dir}"


@pytest.mark.slow
@pytest.mark.parametrize("case", FAULTS, ids=[f.id for f in FAULTS])
def test_an_injected_fault_is_named_at_its_step(runs: Runs, case: Fault) -> None:
    bare, watched, out = runs.get(case.script, case.fault)
    _same_run(bare, watched)
    findings = _findings(out, watched)
    early = [f for f in findings if f["step"] < case.step]
    assert early == [], f"findings before the fault at step {case.step}:\n{_brief(early)}"
    assert findings, f"no finding; watched stderr:\n{watched.err[-3000:]}"
    if case.op is not None:
        want = ("nonfinite", case.step, case.op, line_of_fault(case.script))
        got = [(f["kind"], f["step"], f.get("op"), f.get("source")) for f in findings]
        assert want in got, f"want {want}; findings:\n{_brief(findings)}"
    else:
        nonfinite = min((f["step"] for f in findings if f["kind"] == "nonfinite"), default=None)
        lr = [f for f in findings if f["kind"] in LR_KINDS]
        assert lr, f"no learning-rate finding; findings:\n{_brief(findings)}"
        assert lr[0]["step"] <= case.step + LR_WINDOW, f"too late:\n{_brief(findings)}"
        assert nonfinite is None or lr[0]["step"] <= nonfinite, (
            f"the NaN came first, not the learning rate:\n{_brief(findings)}"
        )
