"""Read a hookscope log into the plain series the report draws: nothing here knows HTML."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._log import LOG_NAME, log_path, read_log

__all__ = ["EVENT_KINDS", "LOG_NAME", "Run", "load_run", "log_path"]

# Findings that are events at a step, not conditions that hold and then clear: the Monitor
# writes no ``cleared`` record for them, so "current" would say the NaN is there forever.
EVENT_KINDS = frozenset({"nonfinite", "loss_spike"})


@dataclass
class Run:
    """A run as series: ``{name: (steps, values)}`` per scalar, module and statistic."""

    path: Path
    header: dict[str, Any] = field(default_factory=dict)
    steps: list[dict[str, Any]] = field(default_factory=list)
    findings: list[dict[str, Any]] = field(default_factory=list)
    cleared: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    feature_maps: list[dict[str, Any]] = field(default_factory=list)
    windows: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    explanations: list[dict[str, Any]] = field(default_factory=list)  # hs.Probe's maps
    explain_probe: dict[str, Any] | None = None  # its images
    summary: dict[str, Any] | None = None
    name: str = ""

    @property
    def sampled(self) -> list[dict[str, Any]]:
        return [s for s in self.steps if s.get("sampled")]

    def split_findings(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """``(current, cleared)``: each finding with ``cleared_at`` set from the log's
        ``cleared`` records (matched by kind, module and the step it was found at). Findings
        of an event kind (:data:`EVENT_KINDS`) are in neither: see :meth:`event_findings`."""
        ends = {
            (c.get("kind"), c.get("module"), c.get("found_at")): c.get("step") for c in self.cleared
        }
        current, cleared = [], []
        for f in self.findings:
            if f.get("kind") in EVENT_KINDS:
                continue
            end = ends.get((f.get("kind"), f.get("module"), f.get("step")), f.get("cleared_at"))
            if end is None:
                current.append(f)
            else:
                cleared.append({**f, "cleared_at": end})
        return current, cleared

    def event_findings(self) -> list[dict[str, Any]]:
        """Findings that happened at one step (a NaN appearing, the loss spiking): no
        condition goes on holding after them, so none is ever cleared, nor is it current."""
        return [f for f in self.findings if f.get("kind") in EVENT_KINDS]

    def never_ran(self) -> list[str]:
        """Watched modules (the header's) that are in no sampled step's statistics: never
        called in training mode (used by weight only, as ``MultiheadAttention.out_proj``,
        or skipped by the model's forward)."""
        seen: set[str] = set()
        for s in self.sampled:
            seen.update(s.get("act") or {}, s.get("grad") or {})
        if not self.sampled:
            return []
        return [name for name in self.header.get("modules") or {} if name not in seen]

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

    @property
    def label(self) -> str:
        """A short name for the run in an overlay: its log directory's name."""
        return self.name or self.path.parent.name or str(self.path)

    def order(self) -> list[str]:
        """Watched modules in the order they ran: the reverse of the backward pass's
        ``grad_order`` (gradients arrive last layer first); a module with no gradient keeps
        its place after the ``named_modules`` neighbour that precedes it."""
        backward: list[str] = []
        for s in self.sampled:
            backward += [n for n in s.get("grad_order") or [] if n not in backward]
        declared = list(self.header.get("modules") or {})
        for s in self.sampled:
            declared += [n for n in s.get("act") or {} if n not in declared]
            for n in s.get("attn") or {}:  # an attention block: before its first child
                if n not in declared:
                    child = next((i for i, d in enumerate(declared) if d.startswith(n + ".")), None)
                    declared.insert(len(declared) if child is None else child, n)
        ran = backward[::-1]
        if not ran:
            return declared
        placed = set(ran)
        out = list(ran)
        for i, name in enumerate(declared):
            if name in placed:
                continue
            before = next((d for d in reversed(declared[:i]) if d in out), None)
            out.insert(out.index(before) + 1 if before is not None else 0, name)
        return out

    def nan_start(self) -> dict[str, Any] | None:
        """Where non-finite values began: the earliest ``nonfinite`` finding, else the first
        step whose loss or activations hold a NaN/Inf; ``None`` for a finite run."""
        found = [f for f in self.findings if f.get("kind") == "nonfinite"]
        if found:
            first = min(found, key=lambda f: f.get("step", 0))
            return {k: first.get(k) for k in ("step", "module", "phase", "op", "source")}
        for s in self.steps:
            bad = [n for n, v in (s.get("scalars") or {}).items() if not math.isfinite(_num(v))]
            bad += [n for n, a in (s.get("act") or {}).items() if a.get("nan") or a.get("inf")]
            if bad:
                return {"step": s["step"], "module": bad[0], "phase": None, "op": None}
        return None

    def last_sampled_before(self, step: int) -> dict[str, Any] | None:
        """The last sampled step before ``step`` that holds statistics (a sampled step with
        no module call, as the first of some runs, is skipped)."""
        for s in reversed(self.sampled):
            if s["step"] < step and (s.get("act") or s.get("grad")):
                return s
        return None

    def _ordered(self, series: dict[str, Any]) -> dict[str, Any]:
        order = self.order() + list(self.header.get("params") or {})
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
    for rec in read_log(path):
        kind = rec.get("type")
        if kind == "header":
            run.header = rec
        elif kind == "step":
            run.steps.append(rec)
        elif kind == "finding":
            run.findings.append(rec)
        elif kind == "cleared":
            run.cleared.append(rec)
        elif kind == "event":
            run.events.append(rec)
        elif kind == "feature_maps":
            run.feature_maps.append(rec)
        elif kind == "window":
            run.windows.append(rec)
        elif kind == "eval":
            run.evals.append(rec)
        elif kind == "summary":
            run.summary = rec
        elif kind == "explain":
            run.explanations.append(rec)
        elif kind == "explain_probe":
            run.explain_probe = rec
    return run
