"""How a condition lasts over training steps: the run of one condition, and a scalar's growth.

Every rule judges spans of training steps through these, so ``every`` changes when a finding
is first seen, not whether (see the package's docstring).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Growth", "Run"]


@dataclass
class Run:
    """The latest run of observations of one condition with the same outcome (``state``:
    True/False, or a side such as ``"high"``), over training steps."""

    state: object = None  # None: nothing observed since the last forget()
    since: int = 0  # the training step of the run's first observation
    last: int = 0
    seen: int = 0

    def see(self, step: int, state: object) -> None:
        if state != self.state or self.seen == 0:
            self.state, self.since, self.seen = state, step, 0
        self.last, self.seen = step, self.seen + 1

    def forget(self) -> None:
        self.state, self.seen = None, 0

    def lasted(self, span: int, least: int = 2) -> bool:
        """At least ``least`` observations (one for span 0) over at least ``span`` steps."""
        return self.seen >= (least if span > 0 else 1) and self.last - self.since >= span


@dataclass
class Growth:
    """How far a positive scalar (the loss, a gradient norm) rose above its lowest value so
    far; a scalar that was ever <= 0 has no scale and is not judged."""

    first: float | None = None
    low: float = math.inf
    growth: float | None = None  # at the latest observation
    latest: float | None = None
    judged: bool = True

    def see(self, value: float | None, factor: float) -> float | None:
        """The growth at this value over the lowest before it (floored at the first value
        / ``factor``); ``None`` when there is nothing to judge."""
        if value is None or math.isnan(value) or not self.judged:
            return None
        self.latest = value
        if value <= 0:
            self.judged, self.growth = False, None
            return None
        if self.first is None:
            self.first = value
        base = max(self.low, self.first / factor)
        self.growth = value / base if math.isfinite(base) else None
        self.low = min(self.low, value)
        return self.growth
