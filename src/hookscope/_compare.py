"""compare(): the first module and step where two monitored runs part, read from their logs.

Overlaid curves show *that* two runs differ; what a user needs is *where* they started to:
the earliest step, and in it the first module in execution order whose statistics differ.
Within a step the order is the order things happen: activations in the order the modules
ran (forward), then output gradients in the order they arrived (backward), then the
parameters the optimizer stepped, then the step's scalars (the loss, the learning rate).
So a weight perturbed before step k's forward is found at that module's activations at step
k, not at the loss or at a later layer that inherited the difference.

Two runs are comparable when they are runs of one model: the same parameters with the same
shapes, and the same module types under the same names. Runs of different models are an
error that names what differs, not a statistic "absent" from one of them. A run that ended
earlier than the other parts from it at the first step it did not log.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ._errors import HookscopeError
from ._report._data import Run, load_run

__all__ = ["Divergence", "compare"]

# A histogram's bins move with its range; counts of reads; the top channels' order swaps.
_SKIP = frozenset({"hist", "sampled", "channels"})
_LISTED = 4  # names listed in a "different models" message before "and N more"


@dataclass(frozen=True)
class Divergence:
    """Where two runs first part.

    Attributes:
        module: The module (for a ``param.*`` statistic, the parameter's name; ``""`` for a
            scalar of the whole step such as the loss, and for ``"steps"``).
        step: The first step where they differ: among the steps sampled in both runs for a
            module's statistic; for ``"steps"``, the first step only one run logged (the
            step after the shorter run's last).
        stat: Which statistic: ``"act.mean"``, ``"grad.norm"``, ``"param.update_ratio"``,
            ``"scalars.loss"``, ...; ``"steps"`` when every step both runs logged agrees but
            one run logged steps the other did not (it ended earlier).
        a: Its value in the first run (``None`` where the module has no statistics there:
            it ran, or got a gradient, in one run only); for ``"steps"``, the number of
            steps the first run logged.
        b: Its value in the second run.
        note: The difference in words where the values alone do not say it (a module that
            ran in one run only, a run that ended earlier); ``""`` otherwise.
    """

    module: str
    step: int
    stat: str
    a: float | None
    b: float | None
    note: str = field(default="", compare=False)

    def __str__(self) -> str:
        if self.note:
            return f"the runs part at step {self.step}: {self.note}"
        where = f"module {self.module!r}" if self.module else "the whole step"
        return (
            f"the runs part at step {self.step}, {where}: {self.stat} is {_show(self.a)} "
            f"in the first run and {_show(self.b)} in the second"
        )


def compare(
    log_a: str | Path, log_b: str | Path, *, rtol: float = 1e-3, atol: float = 1e-6
) -> Divergence | None:
    """The first divergence between two monitored runs of one model, or ``None`` when
    they agree.

    Two values agree when ``|a - b| <= atol + rtol * max(|a|, |b|)``; NaN agrees with NaN
    and an infinity with the same infinity. Modules' statistics are compared on the steps
    sampled in both runs (log both with the same ``every``; ``every=1`` finds the exact
    step), the step's scalars (the loss) on every step both logged. Runs agree only if they
    also logged the same steps: a run of 4 steps parts from one of 10 at step 4.

    Args:
        log_a: The first run's ``log_dir`` or log file.
        log_b: The second run's.
        rtol: Relative tolerance, ``>= 0`` (eager and compiled runs agree to about 1e-3).
        atol: Absolute tolerance, ``>= 0``, for values near zero (an activation mean of 1e-9).

    Returns:
        A :class:`Divergence` (``.module``, ``.step``, ``.stat``, ``.a``, ``.b``), or
        ``None`` if every common statistic of every step agrees and both runs logged the
        same steps.

    Raises:
        ValueError: If a tolerance is negative or not a finite number.
        HookscopeError: If a log cannot be read, the runs are of different models (it names
            the parameters and modules in one run only, or of other shapes or types), or
            they share no sampled step.

    Example:
        >>> import hookscope as hs
        >>> d = hs.compare("runs/fp32", "runs/bf16", rtol=1e-2)  # doctest: +SKIP
        >>> print(d)  # doctest: +SKIP
        the runs part at step 0, module 'blocks.3.mlp': act.absmax is 412.5 in the first run
        and 398.0 in the second
    """
    tol = (_tolerance("rtol", rtol), _tolerance("atol", atol))
    run_a, run_b = load_run(log_a), load_run(log_b)
    _same_model(run_a, run_b)
    steps_a = {s["step"]: s for s in run_a.steps}
    steps_b = {s["step"]: s for s in run_b.steps}
    common = steps_a.keys() & steps_b.keys()
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
    unwatched = _watched_by_one(run_a, run_b)
    for step in sorted(steps_a.keys() | steps_b.keys()):
        if step not in common:
            return _length(step, run_a, run_b)
        found = _compare_step(steps_a[step], steps_b[step], order, unwatched, tol)
        if found is not None:
            module, stat, a, b, note = found
            return Divergence(module, step, stat, a, b, note)
    return None


def _tolerance(name: str, value: object) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
    ):
        raise ValueError(
            f"{name} must be a finite number >= 0 (how far apart two values may be and still "
            f"agree; 0 compares exactly), got {value!r}"
        )
    return float(value)


def _same_model(run_a: Run, run_b: Run) -> None:
    """Raise, naming what differs, unless the two logs' headers describe one model: the
    same parameter names and shapes (a module swapped for a parameter-free one of another
    type, ReLU for GELU, is a change to one model, found where it parts the runs)."""
    params_a, params_b = run_a.header.get("params"), run_b.header.get("params")
    mods_a = run_a.header.get("modules") or {}
    mods_b = run_b.header.get("modules") or {}
    parts: list[str] = []
    if isinstance(params_a, dict) and isinstance(params_b, dict):
        parts += _only("parameters", params_a, params_b)
        shapes = [
            f"{n} {list(params_a[n])} against {list(params_b[n])}"
            for n in params_a
            if n in params_b and list(params_a[n]) != list(params_b[n])
        ]
        if shapes:
            parts.append("parameters of other shapes: " + _names(shapes))
    elif mods_a and mods_b and not mods_a.keys() & mods_b.keys():
        parts += _only("modules", mods_a, mods_b)  # no parameter list to go by
    if not parts:
        return
    models = (run_a.header.get("model", "?"), run_b.header.get("model", "?"))
    what = f"{models[0]} and {models[1]}" if models[0] != models[1] else f"two {models[0]}s"
    raise HookscopeError(
        f"{run_a.path} and {run_b.path} are runs of different models ({what}): "
        + "; ".join(parts)
        + ". compare() and `hookscope diff` find where two runs of one model part (before and "
        "after a change of code, data or settings, eager and compiled, fp32 and bf16); "
        "to look at different models side by side, overlay them with hs.report([a, b])."
    )


def _only(what: str, a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    out = []
    for side, mine, theirs in (("first", a, b), ("second", b, a)):
        names = [n for n in mine if n not in theirs]
        if names:
            out.append(f"{what} only in the {side} run: {_names(names)}")
    return out


def _names(names: list[str]) -> str:
    shown = ", ".join(repr(n) if " " not in n else n for n in names[:_LISTED])
    more = len(names) - _LISTED
    return shown + (f" and {more} more" if more > 0 else "")


def _watched_by_one(run_a: Run, run_b: Run) -> frozenset[str]:
    """Modules that only one run watched (``Monitor(where=...)`` differed): no statistics
    to compare, which is not a module that ran in one run only."""
    mods_a = run_a.header.get("modules") or {}
    mods_b = run_b.header.get("modules") or {}
    if not mods_a or not mods_b:
        return frozenset()
    return frozenset(mods_a.keys() ^ mods_b.keys())


def _length(step: int, run_a: Run, run_b: Run) -> Divergence:
    """The first step one run logged and the other did not."""
    n_a, n_b = len(run_a.steps), len(run_b.steps)
    has_a = any(s["step"] == step for s in run_a.steps)
    longer, shorter = ("first", "second") if has_a else ("second", "first")
    short_run = run_b if has_a else run_a
    before = [s["step"] for s in short_run.steps if s["step"] < step]
    after = [s["step"] for s in short_run.steps if s["step"] > step]
    if after:
        note = f"step {step} is in the {longer} run's log only"
    else:
        note = f"the {shorter} run ended at step {before[-1]}" if before else ""
        note = note or f"the {shorter} run logged no step up to {step}"
    agreed = sum(1 for s in short_run.steps if s["step"] < step)
    note += (
        f" ({n_a} steps logged in the first run, {n_b} in the second); "
        f"the {agreed} step{'s' if agreed != 1 else ''} before it agree"
    )
    return Divergence("", step, "steps", float(n_a), float(n_b), note)


def _execution_order(run_a: Run, run_b: Run) -> list[str]:
    order = run_a.order()
    return order + [n for n in run_b.order() if n not in order]


Found = tuple[str, str, float | None, float | None, str]  # module, stat, a, b, note


def _compare_step(
    a: dict[str, Any],
    b: dict[str, Any],
    order: list[str],
    unwatched: frozenset[str],
    tol: tuple[float, float],
) -> Found | None:
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
            names = [n for n in names if group == "param" or n not in unwatched]
            found = _compare_group(group, names, a.get(group) or {}, b.get(group) or {}, tol)
            if found is not None:
                return found
    sa, sb = a.get("scalars") or {}, b.get("scalars") or {}
    for name in [*sa, *(n for n in sb if n not in sa)]:
        if name in sa and name in sb and not _close(sa[name], sb[name], tol):
            return "", f"scalars.{name}", _num(sa[name]), _num(sb[name]), ""
    return None


_ONE_SIDED = {
    "act": "ran (in training mode) in the {side} run only",
    "grad": "got an output gradient in the {side} run only",
    "param": "had a gradient for the optimizer in the {side} run only",
}


def _compare_group(
    group: str,
    names: list[str],
    a: dict[str, dict[str, Any]],
    b: dict[str, dict[str, Any]],
    tol: tuple[float, float],
) -> Found | None:
    for name in names:
        if (name in a) != (name in b):  # ran (or got a gradient) in one run only
            there = a.get(name) or b.get(name) or {}
            key = next((k for k in ("numel", "norm") if k in there), next(iter(there), ""))
            value = _num(there.get(key))
            side = "first" if name in a else "second"
            what = "parameter" if group == "param" else "module"
            note = f"{what} {name!r} " + _ONE_SIDED[group].format(side=side)
            if value is not None:
                note += f" ({group}.{key} is {_show(value)} there)"
            return (
                name,
                f"{group}.{key}",
                value if name in a else None,
                value if name in b else None,
                note,
            )
        stats_a, stats_b = a[name], b[name]
        for key in [*stats_a, *(k for k in stats_b if k not in stats_a)]:
            if key in _SKIP:
                continue
            va, vb = stats_a.get(key), stats_b.get(key)
            if va is None or vb is None:
                continue
            if not _close(va, vb, tol):
                return name, f"{group}.{key}", _num(va), _num(vb), ""
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
