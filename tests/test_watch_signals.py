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
from hookscope._watch import Settings, child_env

pytest.importorskip("tensorboard")

BOUND = 30.0  # seconds a signalled run may take to end; a hang is a run that does not
TRIES = 50
BATCH = 10  # tries running at once
STEPS = 60

TRAIN = f"""
import os
import torch, torch.nn as nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
open(os.environ["READY"], "w").close()  # imports done (torch's lazy ones too), Monitor on
for step in range({STEPS}):
    loss = model(torch.randn(8, 4)).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
"""


def _start(tmp_path: Path, name: str, script: str) -> tuple[subprocess.Popen, Path]:
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(script), encoding="utf-8")
    out = tmp_path / name
    ready = {"READY": str(tmp_path / f"{name}.ready")}
    environ = child_env({**os.environ, **ready}, Settings(str(out), every=1))
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
    tmp_path: Path, sig: signal.Signals, delays: list[float], first: int, *, from_ready: bool
) -> list[tuple[float, int | None, str]]:
    """Start one run per delay; signal each ``delay`` seconds after its start, or after its
    imports (``from_ready``); return (delay, exit status or None for a hang, stderr)."""
    started = []
    for i, delay in enumerate(delays):
        name = f"try{first + i}"
        child, out = _start(tmp_path, name, TRAIN)
        started.append((time.monotonic(), tmp_path / f"{name}.ready", delay, child, out))
    waiting = list(started)
    while waiting:
        time.sleep(0.005)
        for entry in list(waiting):
            begin, ready, delay, child, _ = entry
            if child.poll() is not None:
                waiting.remove(entry)
            elif from_ready and not ready.exists():
                continue
            elif time.monotonic() >= (begin if not from_ready else _mtime(ready, begin)) + delay:
                child.send_signal(sig)
                waiting.remove(entry)
    results = []
    for _, _, delay, child, out in started:
        code, err = _ended(child)
        results.append((delay, code, err))
        if code is not None:
            _check_log(out)
    return results


def _mtime(path: Path, default: float) -> float:
    """When ``path`` appeared, on the clock of ``time.monotonic()``."""
    return time.monotonic() - (time.time() - path.stat().st_mtime) if path.exists() else default


def _bare_duration(tmp_path: Path) -> tuple[float, float]:
    """How long one watched run takes without a signal, whole and from its imports' end (the
    spans signals are spread over)."""
    begin = time.monotonic()
    child, out = _start(tmp_path, "unsignalled", TRAIN)
    code, err = _ended(child)
    end = time.monotonic()
    assert code == 0, err
    assert len([r for r in hs.read_log(out) if r["type"] == "step"]) == STEPS
    return end - begin, end - _mtime(tmp_path / "unsignalled.ready", begin)


# SIGTERM at any moment. SIGINT once the imports are done: Python turns it into a
# KeyboardInterrupt, which an import interrupted half-way (numpy's, inside torch's) reports as
# another error, exit status 1, with or without hookscope.
@pytest.mark.slow
@pytest.mark.parametrize(
    ("sig", "tries", "from_ready"), [(signal.SIGTERM, TRIES, False), (signal.SIGINT, 10, True)]
)
def test_a_signal_at_any_moment_ends_the_run_by_that_signal(
    tmp_path: Path, sig: signal.Signals, tries: int, from_ready: bool
) -> None:
    # the shorter of two unsignalled runs: one slowed by a moment of load would spread the
    # signals past the end of every signalled run
    whole, after_imports = min(_bare_duration(tmp_path), _bare_duration(tmp_path))
    span = 1.1 * (after_imports if from_ready else whole)  # up to the end and just after
    rng = random.Random(int(sig))
    delays = [rng.uniform(0.0, span) for _ in range(tries)]
    results = []
    for first in range(0, tries, BATCH):
        batch = delays[first : first + BATCH]
        results += _run_batch(tmp_path, sig, batch, first, from_ready=from_ready)
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


# -- a script that handles SIGTERM itself keeps its exit status ------------------------------

# Lightning's trainer installs its SIGTERM handler when fit() starts (after the optimizer, so
# after the watch agent's), chaining to the one it found; it stops at the next batch and the
# script ends normally, exit status 0.
LIGHTNING = """
import os, signal, torch, torch.nn as nn, lightning as L

class Regressor(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))

    def training_step(self, batch, i):
        if i == 5:
            os.kill(os.getpid(), signal.SIGTERM)
        return nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-2)

torch.manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
trainer = L.Trainer(accelerator="cpu", max_epochs=3, logger=False, enable_progress_bar=False,
                    enable_model_summary=False, enable_checkpointing=False)
trainer.fit(Regressor(), torch.utils.data.DataLoader(data, batch_size=4))
print("stopped at", trainer.global_step, "interrupted", trainer.interrupted)
"""

# The same pattern without Lightning: a handler installed after the first step (so after the
# agent's) that notes the signal, calls the previous handler if it is a function, and lets the
# loop end early; the script then exits 0.
CHAINING = """
import os, signal, torch, torch.nn as nn
stop = []
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
for step in range(50):
    loss = model(torch.randn(8, 4)).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    if step == 0:
        previous = signal.getsignal(signal.SIGTERM)
        def on_sigterm(signum, frame):
            stop.append(signum)
            if callable(previous):
                previous(signum, frame)
        signal.signal(signal.SIGTERM, on_sigterm)
    if step == 5:
        os.kill(os.getpid(), signal.SIGTERM)
    if stop:
        break
print("stopped at", step)
"""


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("script", [LIGHTNING, CHAINING], ids=["lightning", "chaining"])
def test_a_script_that_handles_sigterm_keeps_its_exit_status_under_watch(
    tmp_path: Path, script: str
) -> None:
    if script is LIGHTNING:
        pytest.importorskip("lightning")
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(script), encoding="utf-8")
    bare = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=300)
    command = [sys.executable, "-m", "hookscope", "watch", "--out", str(tmp_path / "out")]
    watched = subprocess.run(
        [*command, "--", sys.executable, str(path)], capture_output=True, text=True, timeout=300
    )
    assert bare.returncode == 0, bare.stderr
    assert watched.returncode == bare.returncode, watched.stderr
    assert watched.stdout == bare.stdout  # it stopped where the bare run stopped
    assert "killed by SIGTERM" not in watched.stderr
    steps = [r["step"] for r in hs.read_log(tmp_path / "out") if r["type"] == "step"]
    assert steps == list(range(len(steps))) and len(steps) >= 5
    assert (tmp_path / "out" / "report.html").is_file()
