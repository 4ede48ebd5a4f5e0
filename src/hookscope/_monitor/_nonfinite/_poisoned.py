"""Weights made non-finite: one finding for the update that wrote NaN/Inf into them.

Once an update has applied non-finite gradients, every later forward pass turns non-finite
at the first module whose weights are bad, from finite inputs: to the trail, a new origin at
every step. :class:`PoisonedWeights` says what it is instead, once: "the weights of X became
non-finite in step N's update", and makes every later step's non-finite finding that one
(nothing new) for as long as those weights stay non-finite.
"""

from __future__ import annotations

import math

import torch

from ..._diagnose import Finding
from ..._stats import norms
from .._step._dist import local

__all__ = ["PoisonedWeights"]

_LISTED = 3  # parameters named in a message, before "and N more"


class PoisonedWeights:
    """The parameters an update made non-finite, and the finding that said so."""

    def __init__(self, params: dict[str, torch.nn.Parameter]) -> None:
        self.params = params
        self.finding: Finding | None = None
        self.names: list[str] = []  # the parameters found non-finite

    def after_update(self, cause: Finding, step: int) -> Finding | None:
        """At the end of step ``step``, whose non-finite finding is ``cause`` and whose
        update went ahead: the finding for the weights it made non-finite, if it did."""
        if cause.phase == "update" or cause == self.finding:
            return None  # the weights were already bad: this step only showed it
        bad = _nonfinite(self.params, list(self.params))
        if not bad:
            return None
        self.names = bad
        self.finding = _finding(
            bad,
            len(self.params),
            step,
            f"in step {step}'s update, which applied the non-finite gradients of step {step} "
            f"(the finding at {cause.module!r})",
        )
        return self.finding

    def consequence(self, finding: Finding, step: int, last: int | None) -> Finding | None:
        """What ``finding`` (localised by the trail at ``step``) is, when it is no new origin:
        the earlier weights finding while those weights are still non-finite; or a new one
        when the module it names holds non-finite weights (an update not checked here made
        them so: before the Monitor was attached, or outside the step's optimizer). ``last``
        is the step of the last non-finite finding before this one, if any."""
        if self.finding is not None:
            if _nonfinite(self.params, self.names):
                return self.finding
            self.finding, self.names = None, []  # repaired: a checkpoint was loaded
        if finding.phase != "forward":
            return None
        prefix = f"{finding.module}." if finding.module else ""
        own = [n for n in self.params if n.startswith(prefix) or not finding.module]
        bad = _nonfinite(self.params, own)
        if not bad:
            return None
        when = (
            f"before step {step}: in the update of step {last}, after the non-finite finding "
            f"there, or in one that was not checked"
            if last is not None
            else f"before step {step}, in an update this Monitor did not check (it was "
            "attached after it, or the weights were loaded so)"
        )
        self.names = _nonfinite(self.params, list(self.params))
        self.finding = _finding(self.names, len(self.params), step, when)
        return self.finding


def _nonfinite(params: dict[str, torch.nn.Parameter], names: list[str]) -> list[str]:
    """Those of ``names`` whose parameter holds a NaN/Inf: the largest magnitude of each (one
    fused reduction), which, unlike a sum, cannot overflow from finite values."""
    if not names:
        return []
    peaks = norms([local(params[n]) for n in names], math.inf)
    values = torch.stack([v.to(peaks[0].device) for v in peaks]).tolist()
    return [n for n, value in zip(names, values, strict=True) if not math.isfinite(value)]


def _finding(bad: list[str], total: int, step: int, when: str) -> Finding:
    module = bad[0].rsplit(".", 1)[0] if "." in bad[0] else ""
    listed = ", ".join(repr(n) for n in bad[:_LISTED])
    more = f" and {len(bad) - _LISTED} more" if len(bad) > _LISTED else ""
    return Finding(
        "nonfinite",
        module,
        step,
        float(len(bad)),
        f"update: the weights became non-finite {when}: {len(bad)} of {total} parameters hold "
        f"NaN/Inf ({listed}{more}). Every later forward pass inherits them, so later steps "
        "report nothing new; fix the first non-finite finding, or have such updates skipped "
        "(hs.Monitor(on_nonfinite='skip'); hookscope watch --on-nonfinite skip)",
        phase="update",
    )
