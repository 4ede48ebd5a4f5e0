"""compare(): the first module and step where two monitored runs part, read from their logs.

Overlaid curves show *that* two runs differ; what a user needs is *where* they started to:
the earliest step, and in it the first module in execution order whose statistics differ.
Within a step the order is the order things happen: activations in the order the modules
ran (forward), then output gradients in the order they arrived (backward), then the
parameters the optimizer stepped, then the step's scalars (the loss, the learning rate).
So a weight perturbed before step k's forward is found at that module's activations at step
k, not at the loss or at a later layer that inherited the difference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ._errors import HookscopeError
from ._report._data import Run, load_run

__all__ = ["Divergence", "compare"]

# A histogram's bins move with its range; counts of reads; the top channels' order swaps.
_SKIP = frozenset({"hist", "sampled", "channels"})


@dataclass(frozen=True)
class Divergence:
    """Where two runs first part.

    Attributes:
        module: The module (for a ``param.*`` statistic, the parameter's name; ``""`` for a
            scalar of the whole step such as the loss).
        step: The first step (among the steps sampled in both runs) where they differ.
        stat: Which statistic: ``"act.mean"``, ``"grad.norm"``, ``"param.update_ratio"``,
            ``"scalars.loss"``, ...
        a: Its value in the first run (``None`` where the module has no statistics there:
            it ran, or got a gradient, in one run only).
        b: Its value in the second run.
    """

    module: str
    step: int
    stat: str
    a: float | None
    b: float | None

    def __str__(self) -> str:
        where = f"module {self.module!r}" if self.module else "the whole step"
        return (
            f"the runs part at step {self.step}, {where}: {self.stat} is {_show(self.a)} "
            f"in the first run and {_show(self.b)} in the second"
        )


def compare(
    log_a: str | Path, log_b: str | Path, *, rtol: float = 1e-3, atol: float = 1e-6
) -> Divergence | None:
    """The first divergence between two monitored runs, or ``None`` when they agree.

    Two values agree when ``|a - b| <= atol + rtol * max(|a|, |b|)``; NaN agrees with NaN
    and an infinity with the same infinity. Only steps sampled in both runs are compared
    (log both with the same ``every``; ``every=1`` finds the exact step).

    Args:
        log_a: The first run's ``log_dir`` or log file.
        log_b: The second run's.
        rtol: Relative tolerance (eager and compiled runs agree to about 1e-3).
        atol: Absolute tolerance, for values near zero (an activation mean of 1e-9).

    Returns:
        A :class:`Divergence` (``.module``, ``.step``, ``.stat``, ``.a``, ``.b``), or
        ``None`` if every common statistic of every common step agrees.

    Raises:
        HookscopeError: If a log cannot be read, or the runs share no sampled step.

    Example:
        >>> import hookscope as hs
        >>> d = hs.compare("runs/fp32", "runs/bf16", rtol=1e-2)  # doctest: +SKIP
        >>> print(d)  # doctest: +SKIP
        the runs part at step 0, module 'blocks.3.mlp': act.absmax is 412.5 in the first run
        and 398.0 in the second
    """
    run_a, run_b = load_run(log_a), load_run(log_b)
    steps_a = {s["step"]: s for s in run_a.steps}
    steps_b = {s["step"]: s for s in run_b.steps}
    common = sorted(steps_a.keys() & steps_b.keys())
    if not common:
        raise HookscopeError(
            f"{run_a.path} and {run_b.path} share no step: compare runs of the same training "
            "loop, both logged from step 0."
        )
    if not any(steps_a[s].get("sampled") and steps_b[s].get("sampled") for s in common):
        raise HookscopeError(
            f"{run_a.path} and {run_b.path} share no sampled step: log both runs with the "
            "same Monitor(every=N)."
        )
    order = _execution_order(run_a, run_b)
    tol = (rtol, atol)
    for step in common:
        found = _compare_step(steps_a[step], steps_b[step], order, tol)
        if found is not None:
            module, stat, a, b = found
            return Divergence(module, step, stat, a, b)
    return None


def _execution_order(run_a: Run, run_b: Run) -> list[str]:
    order = run_a.order()
    return order + [n for n in run_b.order() if n not in order]


def _compare_step(
    a: dict[str, Any], b: dict[str, Any], order: list[str], tol: tuple[float, float]
) -> tuple[str, str, float | None, float | None] | None:
    if a.get("sampled") and b.get("sampled"):
        rank = {n: i for i, n in enumerate(order)}
        forward = sorted(
            (a.get("act") or {}).keys() | (b.get("act") or {}).keys(),
            key=lambda n: rank.get(n, len(rank)),
        )
        backward = list(a.get("grad_order") or [])
        backward += [n for n in b.get("grad_order") or [] if n not in backward]
        backward += [
            n
            for n in (a.get("grad") or {}).keys() | (b.get("grad") or {}).keys()
            if n not in backward
        ]
        params = list(a.get("param") or {})
        params += [n for n in b.get("param") or {} if n not in params]
        for group, names in (("act", forward), ("grad", backward), ("param", params)):
            found = _compare_group(group, names, a.get(group) or {}, b.get(group) or {}, tol)
            if found is not None:
                return found
    sa, sb = a.get("scalars") or {}, b.get("scalars") or {}
    for name in [*sa, *(n for n in sb if n not in sa)]:
        if name in sa and name in sb and not _close(sa[name], sb[name], tol):
            return "", f"scalars.{name}", _num(sa[name]), _num(sb[name])
    return None


def _compare_group(
    group: str,
    names: list[str],
    a: dict[str, dict[str, Any]],
    b: dict[str, dict[str, Any]],
    tol: tuple[float, float],
) -> tuple[str, str, float | None, float | None] | None:
    for name in names:
        if (name in a) != (name in b):  # ran (or got a gradient) in one run only
            there = a.get(name) or b.get(name) or {}
            key = next((k for k in ("numel", "norm") if k in there), next(iter(there), ""))
            value = _num(there.get(key))
            return (
                name,
                f"{group}.{key}",
                value if name in a else None,
                value if name in b else None,
            )
        stats_a, stats_b = a[name], b[name]
        for key in [*stats_a, *(k for k in stats_b if k not in stats_a)]:
            if key in _SKIP:
                continue
            va, vb = stats_a.get(key), stats_b.get(key)
            if va is None or vb is None:
                continue
            if not _close(va, vb, tol):
                return name, f"{group}.{key}", _num(va), _num(vb)
    return None


def _num(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _close(a: Any, b: Any, tol: tuple[float, float]) -> bool:
    x, y = _num(a), _num(b)
    if x is None or y is None:
        return a == b
    if math.isnan(x) or math.isnan(y):
        return math.isnan(x) and math.isnan(y)
    if math.isinf(x) or math.isinf(y):
        return x == y
    rtol, atol = tol
    return abs(x - y) <= atol + rtol * max(abs(x), abs(y))


def _show(value: float | None) -> str:
    return "absent" if value is None else f"{value:.6g}"
