"""Which findings were reported, which still hold, and which cleared.

A finding is reported once per kind and module. One made by the diagnosis's rules stays
current while its condition holds; when the condition has failed for the rule's span it is
handed back with ``cleared_at`` set, and its kind and module can be reported again after.
Only steps that could judge it count towards that: values turned NaN/Inf, or no longer
logged, clear nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from ._finding import Finding
from ._runs import Run
from ._thresholds import Thresholds

__all__ = ["Lifecycle"]

Key = tuple[str, str]  # (kind, module)


class Lifecycle:
    """The reported, current and cleared findings of one run."""

    def __init__(self, thresholds: Thresholds) -> None:
        self.t = thresholds
        self._reported: set[Key] = set()
        self._made: dict[Key, tuple[str, int]] = {}  # key -> (family, span)
        self._current: dict[Key, Finding] = {}
        self._gone: dict[Key, Run] = {}  # current key -> run of "not seen"
        self._cleared: list[Finding] = []

    def is_new(self, finding: Finding) -> bool:
        return (finding.kind, finding.module) not in self._reported

    def first_time(self, finding: Finding) -> bool:
        """Whether ``finding`` is new (not reported, or reported and cleared since); a new
        finding made by these rules becomes current, to be cleared when it no longer holds."""
        key = (finding.kind, finding.module)
        if key in self._reported:
            return False
        self._reported.add(key)
        if key in self._made:
            self._current[key] = finding
            self._gone.pop(key, None)
        return True

    def cleared(self) -> list[Finding]:
        """The current findings cleared since the last call."""
        done, self._cleared = self._cleared, []
        return done

    def track(
        self,
        step: int,
        made: list[Finding],
        family: str,
        judged: Callable[[str], bool] | None = None,
    ) -> None:
        """Note the keys ``made`` at ``step`` by one family of rules, and clear the current
        findings of that family whose condition failed for their span. ``judged(module)``:
        whether this step could tell anything of that module's findings; a step where its
        values were NaN/Inf, or not logged, neither holds a finding nor clears it (weights
        that turned NaN are no recovery)."""
        here = {(f.kind, f.module) for f in made}
        for key in here:
            self._made[key] = (family, self._span(key[0], family))
        for key, finding in list(self._current.items()):
            fam, span = self._made[key]
            if fam != family or (key not in here and judged is not None and not judged(key[1])):
                continue
            run = self._gone.setdefault(key, Run())
            run.see(step, key not in here)
            if run.state and run.lasted(span, least=2):
                del self._current[key]
                self._reported.discard(key)
                self._cleared.append(replace(finding, cleared_at=run.since))

    def _span(self, kind: str, family: str) -> int:
        if family == "step":
            return self.t.diverge_span
        spans = {
            "update_ratio": self.t.update_span,
            "massive_activations": self.t.massive_span,
            "precision_underflow": self.t.precision_span,
            "precision_overflow": self.t.precision_span,
            "attention_logit_growth": self.t.attn_span,
        }
        return spans.get(kind, 0)
