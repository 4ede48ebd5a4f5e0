"""Read a hookscope log into the plain series the report draws: nothing here knows HTML."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._errors import HookscopeError

__all__ = ["LOG_NAME", "Run", "load_run", "log_path"]

LOG_NAME = "hookscope.jsonl"
_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def log_path(log_dir: str | Path) -> Path:
    """The JSON-lines file of a run: ``DIR/hookscope.jsonl``, or the file itself."""
    path = Path(log_dir)
    if path.is_dir():
        path = path / LOG_NAME
    if not path.is_file():
        raise HookscopeError(
            f"no hookscope log at {str(path)!r}. Expected a directory holding {LOG_NAME}, "
            "as written by hs.Monitor(model, log_dir=DIR), or the .jsonl file itself."
        )
    return path


def _floats(obj: Any) -> Any:
    if isinstance(obj, str):
        return _NONFINITE.get(obj, obj)
    if isinstance(obj, dict):
        return {
            key: (value if key in ("message", "kind", "module", "type", "name") else _floats(value))
            for key, value in obj.items()
        }
    if isinstance(obj, list):
        return [_floats(item) for item in obj]
    return obj


def read_records(path: Path) -> list[dict[str, Any]]:
    """Every record of the log; a torn last line (a crash mid-write) is skipped."""
    records = []
    with path.open(encoding="utf-8") as f:
        lines = f.read().splitlines()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            records.append(_floats(json.loads(line)))
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                break
            raise HookscopeError(f"{path}:{i + 1}: not a JSON line: {line[:80]!r}") from None
    return records


@dataclass
class Run:
    """A run as series: ``{name: (steps, values)}`` per scalar, module and statistic."""

    path: Path
    header: dict[str, Any] = field(default_factory=dict)
    steps: list[dict[str, Any]] = field(default_factory=list)
    findings: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    feature_maps: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] | None = None

    @property
    def sampled(self) -> list[dict[str, Any]]:
        return [s for s in self.steps if s.get("sampled")]

    def scalars(self) -> dict[str, tuple[list[int], list[float]]]:
        out: dict[str, tuple[list[int], list[float]]] = {}
        for s in self.steps:
            for name, value in (s.get("scalars") or {}).items():
                xs, ys = out.setdefault(name, ([], []))
                xs.append(s["step"])
                ys.append(_num(value))
        return out

    def stat(self, group: str, key: str) -> dict[str, tuple[list[int], list[float]]]:
        """``{module: (steps, values)}`` of one statistic of ``act``, ``grad``, ``param`` or ``bn``."""
        out: dict[str, tuple[list[int], list[float]]] = {}
        for s in self.sampled:
            for name, stats in (s.get(group) or {}).items():
                if key in stats:
                    xs, ys = out.setdefault(name, ([], []))
                    xs.append(s["step"])
                    ys.append(_num(stats[key]))
        return self._ordered(out)

    def hists(self) -> dict[str, list[tuple[int, float, float, list[float]]]]:
        """``{module: [(step, lo, hi, counts), ...]}`` for modules with activation histograms."""
        out: dict[str, list[tuple[int, float, float, list[float]]]] = {}
        for s in self.sampled:
            for name, stats in (s.get("act") or {}).items():
                h = stats.get("hist")
                if h and h.get("counts"):
                    out.setdefault(name, []).append(
                        (s["step"], _num(h["lo"]), _num(h["hi"]), [_num(c) for c in h["counts"]])
                    )
        return self._ordered(out)

    def update_ratios(self) -> dict[str, tuple[list[int], list[float]]]:
        """Update ratios of weight matrices and kernels (2+ dimensions), by parameter name."""
        ratios = self.stat("param", "update_ratio")
        shapes = self.header.get("params") or {}
        return {
            name: series
            for name, series in ratios.items()
            if name not in shapes or len(shapes[name]) >= 2
        }

    def _ordered(self, series: dict[str, Any]) -> dict[str, Any]:
        order = list(self.header.get("modules") or {}) + list(self.header.get("params") or {})
        rank = {name: i for i, name in enumerate(order)}
        return dict(sorted(series.items(), key=lambda kv: rank.get(kv[0], len(rank))))


def _num(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def load_run(log_dir: str | Path) -> Run:
    """Read the log of a run (a directory or the ``.jsonl`` file) into a :class:`Run`."""
    path = log_path(log_dir)
    run = Run(path)
    for rec in read_records(path):
        kind = rec.get("type")
        if kind == "header":
            run.header = rec
        elif kind == "step":
            run.steps.append(rec)
        elif kind == "finding":
            run.findings.append(rec)
        elif kind == "event":
            run.events.append(rec)
        elif kind == "feature_maps":
            run.feature_maps.append(rec)
        elif kind == "summary":
            run.summary = rec
    return run
