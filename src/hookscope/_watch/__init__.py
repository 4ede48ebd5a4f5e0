"""``hookscope watch -- COMMAND``: run a training command unchanged and monitor what it trains.

This is the parent side. It runs COMMAND as a child whose ``PYTHONPATH`` starts with the
start-up directory ``_boot/`` and whose ``HOOKSCOPE_WATCH`` holds the settings; every Python
process of the command then finds its models by itself (``_agent.py``). The child keeps
the terminal, its stdout and its stderr: the parent only adds ``[hookscope]`` lines on stderr
(each model as it is found, each finding as it is logged, the step reached every few
seconds). The parent forwards SIGINT and SIGTERM, writes ``report.html`` from each log once
the child has ended (also after a crash or a kill: the log is flushed record by record), and
exits with the child's status, 128 + N when the child was killed by signal N.

A SIGINT typed at the terminal reaches the child directly (same process group), so the
parent forwards SIGINT only when it did not come from the terminal: a second copy would
interrupt the script's own clean-up. A second signal ends things: a child still running
``_KILL_AFTER`` seconds after it (a script that ignores signals, or is stuck) is killed, and
the parent exits with the status of the signal it received. The signal handler only sends
signals and reads the clock; it never waits.

The package is the whole feature: this module (the parent), ``_settings`` (what it hands to
the child), ``_boot/sitecustomize.py`` (the start-up hook, which imports nothing) and
``_agent`` (the child side, imported by the start-up hook once a process trains).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from .._log import run_logs
from .._paths import check_writable
from ._settings import ENV, Settings

__all__ = ["BOOT", "ENV", "Settings", "child_env", "watch"]

BOOT = Path(__file__).resolve().parent / "_boot"
_POLL = 0.25  # seconds between looks at the child and the logs
_FORWARDED = (signal.SIGINT, signal.SIGTERM)
_KILL_AFTER = 3.0  # seconds after a second signal before the child is killed


def watch(
    command: Sequence[str],
    *,
    out: str | Path = "hookscope-watch",
    every: int | None = 10,
    where: Sequence[str] | None = None,
    on_nonfinite: str = "log",
    check: str = "edges",
    stream: TextIO | None = None,
    interval: float = 10.0,
) -> int:
    """Run ``command`` with every model its optimizers step monitored (and every model it
    trains by hand, without ``torch.optim``: a step per forward and backward); return its
    exit status.

    Logs go to ``out`` (the first model) and ``out/<ModelClass>/`` (any further one), each with
    its ``report.html``. ``stream`` receives the progress lines (default: stderr), the step
    reached every ``interval`` seconds. Raises :class:`HookscopeError` before the command
    starts when ``out`` cannot be written.
    """
    stream = sys.stderr if stream is None else stream
    out = Path(out).resolve()
    check_writable(out, "the logs", "--out ")  # before the command runs, not unwatched after
    settings = Settings(str(out), every, list(where) if where else None, on_nonfinite, check)
    progress = _Progress(out, stream, interval)
    with _Forward() as forward:
        try:
            child = subprocess.Popen(list(command), env=child_env(os.environ, settings))
        except OSError as exc:
            status = 127 if isinstance(exc, FileNotFoundError) else 126
            hint = " Is it installed and on PATH?" if status == 127 else ""
            stream.write(f"Error: cannot run {command[0]!r}: {exc.strerror or exc}.{hint}\n")
            return status
        forward.start(child)
        while True:
            try:
                code = child.wait(timeout=_POLL)
                break
            except subprocess.TimeoutExpired:
                progress.poll()
                forward.kill_if_due()
    status = 128 - code if code < 0 else code
    if forward.killed:
        name = _signal_name(forward.received[-1])
        progress.say(f"the command did not end after a second {name}: killed it (SIGKILL)")
        status = 128 + forward.received[-1]
    progress.poll()
    try:
        progress.finish(code)
    except KeyboardInterrupt:  # a second Ctrl-C while the reports are being written
        progress.say(f"reports not written; later: hookscope report {_shorten(out)}")
    return status


def child_env(environ: Mapping[str, str], settings: Settings) -> dict[str, str]:
    """``environ`` with the start-up directory first on ``PYTHONPATH`` and the settings."""
    env = dict(environ)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if not any(_same_dir(p, BOOT) for p in paths):
        paths.insert(0, str(BOOT))
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env[ENV] = settings.to_env()
    return env


def _same_dir(path: str, directory: Path) -> bool:
    try:
        return Path(path).resolve() == directory
    except OSError:
        return False


class _Forward:
    """Forward SIGINT and SIGTERM to the child while it runs (held until it has started);
    after a second signal, kill a child that has not ended within ``_KILL_AFTER`` seconds."""

    def __init__(self) -> None:
        self.child: subprocess.Popen[bytes] | None = None
        self.received: list[int] = []  # every signal received, in order
        self.killed = False
        self._kill_at: float | None = None
        self._early: list[int] = []
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _Forward:
        for sig in _FORWARDED:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def start(self, child: subprocess.Popen[bytes]) -> None:
        self.child = child
        for sig in self._early:
            self._send(sig)

    def _handle(self, signum: int, frame: Any) -> None:
        self.received.append(signum)
        if len(self.received) == 2:
            self._kill_at = time.monotonic() + _KILL_AFTER
        self._send(signum)

    def _send(self, signum: int) -> None:
        if self.child is None:
            self._early.append(signum)
        elif signum != signal.SIGINT or not _from_terminal():
            self.child.send_signal(signum)  # does nothing once the child has ended

    def kill_if_due(self) -> None:
        """From the wait loop: the second signal's grace is over, the child still runs."""
        due = self._kill_at is not None and time.monotonic() >= self._kill_at
        if due and not self.killed and self.child is not None and self.child.poll() is None:
            self.child.kill()
            self.killed = True

    def __exit__(self, *exc: object) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)


def _from_terminal() -> bool:
    """Whether we are in the terminal's foreground process group, the one a typed Ctrl-C
    goes to (and the child with us)."""
    for stream in (sys.stdin, sys.stdout, sys.stderr):
        try:
            if stream is not None and stream.isatty():
                return os.tcgetpgrp(stream.fileno()) == os.getpgrp()
        except (OSError, ValueError):
            continue
    return False


@dataclass
class _Log:
    """One model's log, read as it grows."""

    path: Path
    offset: int = 0
    model: str = "model"
    steps: int = 0  # step records seen
    findings: list[dict[str, Any]] = field(default_factory=list)

    def read_new(self) -> list[dict[str, Any]]:
        try:
            with self.path.open("rb") as f:
                if os.fstat(f.fileno()).st_size < self.offset:  # rewritten from the start
                    self.offset = 0
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return []
        end = data.rfind(b"\n") + 1  # complete lines only
        self.offset += end
        records = []
        for line in data[:end].splitlines():
            try:
                records.append(json.loads(line))
            except ValueError:
                continue
        return records


class _Progress:
    """The ``[hookscope]`` lines: models found, findings, the step reached; then the reports."""

    def __init__(self, out: Path, stream: TextIO, interval: float) -> None:
        self.out, self.stream, self.interval = out, stream, interval
        self.logs: dict[Path, _Log] = {}
        self._stale = {path: _signature(path) for path in self._candidates()}
        self._shown = (time.monotonic(), 0)  # when the step count was last shown, and what

    def _candidates(self) -> list[Path]:
        """Every run log under ``out`` and its model folders (an earlier run's among them:
        this run's logs are those that change, ``hookscope-2.jsonl`` beside it)."""
        found = run_logs(self.out)
        for folder in sorted(p for p in self.out.glob("*") if p.is_dir()):
            found += run_logs(folder)
        return found

    def poll(self) -> None:
        for path in self._candidates():
            if path not in self.logs and _signature(path) != self._stale.get(path):
                self.logs[path] = _Log(path)  # written by this run, not left by an earlier one
        for log in self.logs.values():
            for record in log.read_new():
                self._take(log, record)
        now, total = time.monotonic(), sum(log.steps for log in self.logs.values())
        if now - self._shown[0] >= self.interval and total != self._shown[1]:
            self._shown = (now, total)
            self.say("; ".join(f"{log.model}: {_steps(log)}" for log in self.logs.values()))

    def _take(self, log: _Log, record: dict[str, Any]) -> None:
        kind = record.get("type")
        if kind == "header":
            log.model = str(record.get("model", "model"))
            where = _shorten(log.path.parent)
            self.say(
                f"watching {log.model} ({len(record.get('modules') or {})} modules) -> {where}"
            )
        elif kind == "step":
            log.steps = int(record.get("step", -1)) + 1
        elif kind == "finding":
            log.findings.append(record)
            message = str(record.get("message", "")).replace("\n", "\n    ")  # whole
            self.say(
                f"{log.model} step {record.get('step')}: {record.get('kind')} in "
                f"{record.get('module') or 'the model'}: {message}"
            )

    def finish(self, code: int) -> None:
        """Write each log's report and say where; say so when there is nothing to report."""
        if code != 0:
            how = f"was killed by {_signal_name(-code)}" if code < 0 else f"exited with {code}"
            self.say(f"the command {how}")
        if not self.logs:
            self.say(
                "nothing to report: no model was watched. hookscope watches the models whose "
                "parameters a torch.optim optimizer steps in the Python processes of the "
                "command, or that receive gradients from its backward() with no optimizer "
                "(trained by hand); a 'hookscope watch:' line above says why, if one was found"
            )
            return
        from .._report import report

        for log in self.logs.values():
            count = len(log.findings)
            try:
                where = f"report: {_shorten(report(log.path))}"
            except Exception as exc:  # a log cut short before its header, say
                where = f"no report ({type(exc).__name__}: {exc})"
            self.say(f"{log.model}: {_steps(log)}, {count} finding{'s' * (count != 1)} -> {where}")

    def say(self, text: str) -> None:
        self.stream.write(f"[hookscope] {text}\n")
        self.stream.flush()


def _signature(path: Path) -> tuple[int, int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def _steps(log: _Log) -> str:
    return f"{log.steps} step{'s' * (log.steps != 1)}"


def _shorten(path: Path) -> str:
    """``path`` relative to the working directory when it lies below it."""
    try:
        relative = os.path.relpath(path)
    except ValueError:
        return str(path)
    return str(path) if relative.startswith("..") else relative


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
