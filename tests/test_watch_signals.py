"""Signals at any moment of a watched run: it ends within seconds, by the signal, log readable.

The child of ``hookscope watch`` is run directly (its environment from ``child_env``): the
parent only forwards signals, and starting it would double the cost of every try. Each try
sends its signal at a random moment (seeded) spread over start-up, training and the end, to a
short training script whose Monitor writes a JSON-lines log and TensorBoard events on every
step, so that a signal often lands inside a sink.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import hookscope as hs
from hookscope._watch import child_env
from hookscope._watch_agent import Settings

pytest.importorskip("tensorboard")

BOUND = 30.0  # seconds a signalled run may take to end; a hang is a run that does not
TRIES = 50
BATCH = 10  # tries running at once
STEPS = 60

TRAIN = f"""
import torch, torch.nn as nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
for step in range({STEPS}):
    loss = model(torch.randn(8, 4)).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
"""


def _start(tmp_path: Path, name: str, script: str, **env: str) -> tuple[subprocess.Popen, Path]:
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(script), encoding="utf-8")
    out = tmp_path / name
    environ = child_env({**os.environ, **env}, Settings(str(out), every=1))
    child = subprocess.Popen(
        [sys.executable, str(path)],
        env=environ,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    return child, out


def _ended(child: subprocess.Popen) -> tuple[int | None, str]:
    """The exit status within BOUND seconds (``None``: it hung, and is killed), and stderr."""
    try:
        _, err = child.communicate(timeout=BOUND)
    except subprocess.TimeoutExpired:
        child.kill()
        return None, child.communicate()[1]
    return child.returncode, err


def _check_log(out: Path) -> None:
    """Where the Monitor had started (its header written), the log reads back whole."""
    log = out / "hookscope.jsonl"
    if log.is_file() and log.read_text(encoding="utf-8").startswith('{"type": "header"'):
        records = hs.read_log(out)
        steps = [r["step"] for r in records if r["type"] == "step"]
        assert steps == list(range(len(steps)))


def _run_batch(
    tmp_path: Path, sig: signal.Signals, delays: list[float], first: int
) -> list[tuple[float, int | None, str]]:
    started = []
    for i, delay in enumerate(delays):
        child, out = _start(tmp_path, f"try{first + i}", TRAIN)
        started.append((time.monotonic() + delay, delay, child, out))
    for when, _, child, _ in sorted(started, key=lambda s: s[0]):
        time.sleep(max(0.0, when - time.monotonic()))
        child.send_signal(sig)  # does nothing if it already ended
    results = []
    for _, delay, child, out in started:
        code, err = _ended(child)
        results.append((delay, code, err))
        if code is not None:
            _check_log(out)
    return results


def _bare_duration(tmp_path: Path) -> float:
    """How long one watched run takes without a signal (the span signals are spread over)."""
    begin = time.monotonic()
    child, out = _start(tmp_path, "unsignalled", TRAIN)
    code, err = _ended(child)
    assert code == 0, err
    assert len([r for r in hs.read_log(out) if r["type"] == "step"]) == STEPS
    return time.monotonic() - begin


@pytest.mark.parametrize(("sig", "tries"), [(signal.SIGTERM, TRIES), (signal.SIGINT, 20)])
def test_a_signal_at_any_moment_ends_the_run_by_that_signal(
    tmp_path: Path, sig: signal.Signals, tries: int
) -> None:
    span = _bare_duration(tmp_path) * 1.1  # start-up, training, the end and just after
    rng = random.Random(int(sig))
    delays = [rng.uniform(0.0, span) for _ in range(tries)]
    results = []
    for first in range(0, tries, BATCH):
        results += _run_batch(tmp_path, sig, delays[first : first + BATCH], first)
    hangs = [delay for delay, code, _ in results if code is None]
    assert not hangs, f"{len(hangs)} of {tries} runs hung, signalled after {hangs} s"
    for delay, code, err in results:  # by the signal, or finished before it came
        assert code in (-sig, 0), f"signalled after {delay:.2f} s: exit {code}\n{err}"
    assert sum(code == -sig for _, code, _ in results) >= tries // 2


STUCK = """
import os, signal, time
import torch, torch.nn as nn
from hookscope import _sinks

write = _sinks.TensorBoardSink.write

def stuck_write(self, record):
    # A signal that lands while TensorBoard's writer holds its lock (inside add_scalar).
    if record.get("type") == "step" and record["step"] == 3:
        lock = self._writer._get_file_writer().event_writer._async_writer._lock
        with lock:
            print("holding the lock", flush=True)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(120)
    write(self, record)

_sinks.TensorBoardSink.write = stuck_write
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
for step in range(10):
    loss = model(torch.randn(8, 4)).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
"""


def test_a_signal_inside_a_stuck_tensorboard_write_still_ends_the_run(tmp_path: Path) -> None:
    child, out = _start(tmp_path, "stuck", STUCK)
    code, err = _ended(child)
    assert code == -signal.SIGTERM, err
    steps = [r["step"] for r in hs.read_log(out) if r["type"] == "step"]
    assert steps[:3] == [0, 1, 2]  # every step ended before the signal is in the log
