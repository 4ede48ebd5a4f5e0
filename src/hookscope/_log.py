"""The hookscope log: its typed records, and the one writer and one reader of its JSON lines.

A Monitor writes a :class:`Header` first, then a :class:`StepRecord` per ``step()``, and
findings, :class:`Cleared` records and :class:`Event`\\ s as they happen. ``docs/log-format.md`` documents the same fields;
a test keeps the two in step. Nothing here imports torch or knows about models.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from ._errors import HookscopeError

__all__ = [
    "ACT_STATS",
    "ATTN_STATS",
    "BN_STATS",
    "GRAD_STATS",
    "HOOKSCOPE_LOG",
    "LOG_NAME",
    "PARAM_STATS",
    "PRECISION_STATS",
    "Cleared",
    "EvalRecord",
    "Event",
    "Header",
    "StepRecord",
    "Window",
    "decode",
    "encode",
    "log_path",
    "numbered",
    "read_log",
    "report_name",
    "run_logs",
    "run_number",
]

LOG_NAME = "hookscope.jsonl"
FORMAT = "hookscope-log"
VERSION = 2

# The statistics of each group of a sampled step record, in the order they are documented.
ACT_STATS = (
    "mean",
    "std",
    "min",
    "max",
    "absmax",
    "zero_frac",
    "sat_frac",
    "dead_frac",
    "nan",
    "inf",
    "numel",
    "sampled",
    "kurtosis",
    "absmax_over_rms",
)
GRAD_STATS = ("norm", "rms", "absmax", "numel", "sampled")
PARAM_STATS = ("norm", "grad_norm", "update_ratio")
BN_STATS = ("running_mean", "running_var", "mean_drift", "var_drift")
# Per module and per kind ("act": its output, "grad": its output's gradient), with
# Monitor(precision=...); "underflow" and "overflow" are {dtype name: fraction}.
PRECISION_STATS = ("amax", "dynamic_range", "underflow", "overflow")
# Per attention module (_monitor/_attention.py): the largest pre-softmax logit.
ATTN_STATS = ("logit_max",)


@dataclass
class Header:
    """First line of a log: what was watched, and how."""

    hookscope: str
    model: str
    modules: dict[str, str]
    params: dict[str, list[int]]
    settings: dict[str, Any]
    time: float
    format: str = FORMAT
    version: int = VERSION
    type: str = "header"


@dataclass
class StepRecord:
    """One ``Monitor.step()``; the groups are filled on sampled steps only (``precision``
    with ``Monitor(precision=...)``, ``attn`` for the model's attention modules)."""

    step: int
    time: float
    sampled: bool
    training: bool
    scalars: dict[str, float] = field(default_factory=dict)
    act: dict[str, dict[str, Any]] = field(default_factory=dict)
    grad: dict[str, dict[str, float]] = field(default_factory=dict)
    param: dict[str, dict[str, float]] = field(default_factory=dict)
    bn: dict[str, dict[str, float]] = field(default_factory=dict)
    precision: dict[str, dict[str, Any]] = field(default_factory=dict)
    attn: dict[str, dict[str, float]] = field(default_factory=dict)
    grad_order: list[str] = field(default_factory=list)
    type: str = "step"

    def to_dict(self) -> dict[str, Any]:
        """The record as a dict that shares its values (each step builds them afresh;
        ``asdict``'s deep copy of every statistic cost ~4 % of a GPT-2 step at every=1)."""
        out = {name: getattr(self, name) for name in _STEP_FIELDS}
        if not self.sampled:
            for group in ("act", "grad", "param", "bn", "precision", "attn", "grad_order"):
                del out[group]
        return out


_STEP_FIELDS = tuple(f.name for f in fields(StepRecord))  # once: fields() walks the class


@dataclass
class EvalRecord:
    """The statistics of the evaluation passes (forwards with the model in eval mode) run
    at ``step`` (before that step's ``mon.step()``), apart from training's: per watched
    module, the RMS and largest magnitude of its output, from at most ``sample`` elements of
    each of its first ``calls`` calls (16 at most)."""

    step: int
    modules: dict[str, dict[str, float]]
    type: str = "eval"


@dataclass
class Event:
    """Something that happened at a step: ``skipped_step``, ``evaluation``, ..."""

    step: int
    kind: str
    message: str
    type: str = "event"


@dataclass
class Cleared:
    """A finding whose condition stopped holding for its rule's span (findings are written
    once, when found; this record sets their ``cleared_at`` when read back).

    ``kind``, ``module`` and ``found_at`` (the finding's ``step``) name the finding; ``step``
    is its ``cleared_at``: the first step at which the condition no longer held.
    """

    kind: str
    module: str
    found_at: int
    step: int
    type: str = "cleared"

    @classmethod
    def of(cls, finding: Any) -> Cleared:
        """The record of a finding that :meth:`Diagnosis.cleared` handed back."""
        return cls(finding.kind, finding.module, finding.step, finding.cleared_at)


@dataclass
class Window:
    """The rolling window around a training signal (a ``loss_spike``): the last steps'
    scalars and, per parameter group, the L2 norm of its gradients and the L1 norm of a
    sample of its weights before each update, step by step."""

    step: int
    kind: str
    steps: list[int]
    scalars: dict[str, list[float]]
    groups: dict[str, list[float]]
    weights: dict[str, list[float]] = field(default_factory=dict)
    type: str = "window"


# -- JSON: non-finite floats are the strings "nan", "inf", "-inf" -----------------------------
_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
_TEXT_KEYS = frozenset({"message", "kind", "module", "type", "name", "op", "source", "phase"})


def encode(obj: Any) -> Any:
    """``obj`` with non-finite floats replaced by strings, ready for strict JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {key: encode(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [encode(item) for item in obj]
    return obj


def decode(obj: Any) -> Any:
    """The inverse of :func:`encode` (text fields such as ``message`` are left alone)."""
    if isinstance(obj, str):
        return _NONFINITE.get(obj, obj)
    if isinstance(obj, dict):
        return {k: (v if k in _TEXT_KEYS else decode(v)) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode(item) for item in obj]
    return obj


def to_line(record: dict[str, Any]) -> str:
    return json.dumps(encode(record), allow_nan=False)


HOOKSCOPE_LOG = (
    "a hookscope log is the JSON-lines file hs.Monitor(model, log_dir=DIR) writes as "
    f"DIR/{LOG_NAME} (or `hookscope watch`), whose first line is its header: "
    '{"type": "header", "format": "hookscope-log", ...}'
)

# A directory holds one log per run: hookscope.jsonl for the first, hookscope-2.jsonl for a
# second run there (a notebook cell run again, two Monitors on one log_dir), and so on; a
# run never truncates or shares another's file.
_NUMBERED = re.compile(r"^(?P<stem>.+?)(?:-(?P<n>[0-9]+))?\.jsonl$")


def run_number(path: Path) -> int:
    """1 for ``hookscope.jsonl``, ``n`` for ``hookscope-<n>.jsonl``."""
    match = _NUMBERED.match(path.name)
    return int(match["n"]) if match and match["n"] else 1


def numbered(path: Path, n: int) -> Path:
    """The ``n``-th run's file beside ``path`` (``path`` itself for the first)."""
    return path if n == 1 else path.with_name(f"{path.stem}-{n}{path.suffix}")


def run_logs(directory: str | Path, name: str = LOG_NAME) -> list[Path]:
    """The run logs in ``directory`` (``hookscope.jsonl``, ``hookscope-2.jsonl``, ...), oldest
    run first."""
    stem = Path(name).stem
    found = []
    for path in Path(directory).glob(f"{stem}*.jsonl"):
        match = _NUMBERED.match(path.name)
        if match and match["stem"] == stem and (match["n"] is None or int(match["n"]) >= 2):
            found.append(path)
    return sorted(found, key=run_number)


def report_name(log: Path) -> str:
    """The default report file of a run's log: ``report.html`` for ``hookscope.jsonl``,
    ``report-<n>.html`` for ``hookscope-<n>.jsonl``."""
    n = run_number(log)
    return "report.html" if n == 1 else f"report-{n}.html"


def log_path(log_dir: str | Path) -> Path:
    """The JSON-lines file of a run: the newest run's in a directory (``DIR/hookscope.jsonl``,
    or ``DIR/hookscope-<n>.jsonl`` where later runs wrote there), or the file itself."""
    path = Path(log_dir)
    if path.is_dir():
        runs = run_logs(path)
        path = runs[-1] if runs else path / LOG_NAME
    if not path.is_file():
        raise HookscopeError(
            f"no hookscope log at {str(path)!r}. Expected a directory holding {LOG_NAME}, "
            "as written by hs.Monitor(model, log_dir=DIR), or the .jsonl file itself."
        )
    return path


def read_log(path: str | Path) -> list[dict[str, Any]]:
    """Every record of a Monitor's log, as dicts; ``"nan"``/``"inf"`` strings become floats.

    Args:
        path: The run's ``log_dir`` (its newest run's log, where several runs wrote there)
            or the ``.jsonl`` file itself.

    Returns:
        The records in the order written; a torn last line (a crash mid-write) is skipped.

    Raises:
        HookscopeError: If there is no log there, a line before the last is not JSON, or
            the file does not start with a hookscope header (it is some other file).
    """
    file = log_path(path)
    records = []
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise HookscopeError(
            f"{str(file)!r} is not a hookscope log: it is not UTF-8 text (byte {exc.start} "
            f"is {exc.object[exc.start : exc.start + 1]!r}); {HOOKSCOPE_LOG}."
        ) from None
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            records.append(decode(json.loads(line)))
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                break
            raise HookscopeError(
                f"{file}:{i + 1}: not a JSON line: {line[:80]!r}; {HOOKSCOPE_LOG}"
            ) from None
    if not records or not isinstance(records[0], dict) or records[0].get("type") != "header":
        first = repr(lines[0][:80]) if lines else "nothing (the file is empty)"
        raise HookscopeError(
            f"{str(file)!r} is not a hookscope log: its first line is {first}; "
            f"{HOOKSCOPE_LOG}. Point at the run's log_dir or at that file."
        )
    return records
