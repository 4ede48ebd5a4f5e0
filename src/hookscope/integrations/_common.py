"""What the trainer integrations share: Monitor options checked when the callback is made,
the compact subset of a run sent to the framework's own loggers, and the end of a run.

Nothing here imports a training framework.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import fields
from pathlib import Path
from typing import Any

from .._diagnose import Thresholds
from .._errors import HookscopeWarning, did_you_mean
from .._monitor import Monitor, monitor_options
from .._report import report

__all__ = ["Window", "check_options", "close_and_report", "step_grad_norm"]

PREFIX = "hookscope/"


def check_options(options: dict[str, Any], taken: dict[str, str]) -> dict[str, Any]:
    """``options`` for ``hs.Monitor``, checked when the callback is made rather than when
    training starts. ``taken``: options the callback sets itself, with the reason."""
    names = monitor_options()
    allowed = [*names, *(f.name for f in fields(Thresholds))]
    for key in options:
        if key in taken:
            raise TypeError(f"HookscopeCallback() does not take {key}=: {taken[key]}")
        if key not in allowed:
            raise TypeError(
                f"HookscopeCallback() got an unexpected keyword argument {key!r}"
                f"{did_you_mean(key, allowed)}. It takes the options of hs.Monitor: "
                f"{', '.join(names)}, and threshold fields (see hs.Thresholds)."
            )
    return dict(options)


def last_step(monitor: Monitor) -> dict[str, Any] | None:
    """The record of the step the Monitor closed last (findings and events follow it)."""
    for record in reversed(monitor.records):
        if record.get("type") == "step":
            return record if record.get("step") == monitor.step_count - 1 else None
    return None


def total_grad_norm(record: dict[str, Any]) -> float | None:
    """The norm of all the model's gradients as one vector (what ``clip_grad_norm_``
    measures), from a sampled step's per-parameter norms."""
    norms = [
        s["grad_norm"] for s in record.get("param", {}).values() if s.get("grad_norm") is not None
    ]
    return math.sqrt(math.fsum(n * n for n in norms)) if norms else None


def step_grad_norm(record: dict[str, Any]) -> float | None:
    """That step's total gradient norm before clipping: on a sampled step, from its
    per-parameter norms; else the norm ``clip_grad_norm_`` measured, logged on every step
    that clipped (the Hugging Face Trainer measures it on every optimizer step, with
    ``max_norm=inf`` when it does not clip); ``None`` on a step with neither, never another
    step's value."""
    if record.get("sampled"):
        found = total_grad_norm(record)
        if found is not None:
            return found
    clipped = (record.get("scalars") or {}).get("grad_norm")
    return float(clipped) if isinstance(clipped, (int, float)) else None


class Window:
    """The compact subset for a framework's loggers, over the steps since it was last read:
    the mean loss (unfiltered: a NaN stays NaN), the total gradient norm of the window's
    last step (before clipping; absent when that step has none: see
    :func:`step_grad_norm`), the number of findings so far and of those new in the window."""

    def __init__(self) -> None:
        self._seen = 0  # findings already counted in an earlier window
        self._reset()

    def _reset(self) -> None:
        self._losses: list[float] = []
        self._grad_norm: float | None = None
        self._sampled = False

    def add(self, monitor: Monitor) -> None:
        """Take in the step the Monitor just closed."""
        self._grad_norm = None  # the last step's or none: never an older step's
        record = last_step(monitor)
        if record is None:
            return
        loss = record.get("scalars", {}).get("loss")
        if loss is not None:
            self._losses.append(float(loss))
        self._sampled = self._sampled or bool(record.get("sampled"))
        self._grad_norm = step_grad_norm(record)

    def fresh(self, monitor: Monitor) -> bool:
        """A sampled step or a new finding since the last read."""
        return self._sampled or len(monitor.findings) > self._seen

    def read(self, monitor: Monitor) -> dict[str, float]:
        """The metrics, keys prefixed ``hookscope/``; starts a new window."""
        out: dict[str, float] = {}
        if self._losses:
            out["loss"] = math.fsum(self._losses) / len(self._losses)
        if self._grad_norm is not None:
            out["grad_norm"] = self._grad_norm
        # Counted here, not from step()'s return: a non-finite finding is made just before
        # the optimizer's update, ahead of the step() that closes its step.
        out["findings"] = float(len(monitor.findings))
        out["new_findings"] = float(len(monitor.findings) - self._seen)
        self._seen = len(monitor.findings)
        self._reset()
        return {PREFIX + key: value for key, value in out.items()}


def close_and_report(monitor: Monitor, log_dir: str | Path | None, *, write: bool) -> Path | None:
    """Close ``monitor`` (every hook removed) and, if ``write``, write the HTML report of
    its log. A report that fails warns instead of raising: the training run itself is done,
    and the report can be written again from the log."""
    monitor.close()
    log = monitor.log_path  # this run's (hookscope-<n>.jsonl beside an earlier run's log)
    if not write or log_dir is None or log is None or log.parent != Path(log_dir):
        return None
    try:
        return report(log)
    except Exception as exc:
        warnings.warn(
            f"hookscope could not write the report of {str(log_dir)!r} ({exc!r}). The log is "
            f"intact; write the report with `hookscope report {log_dir}`.",
            HookscopeWarning,
            stacklevel=2,
        )
        return None
