"""Rules on one sampled step's activations: dead ReLU units, saturated bounded activations."""

from __future__ import annotations

from ._finding import Finding
from ._thresholds import Thresholds

__all__ = ["units"]


def units(t: Thresholds, step: int, act: dict[str, dict[str, float]]) -> list[Finding]:
    """``dead_units`` and ``saturated_units``: span 0, one sampled step shows them."""
    found = []
    for name, s in act.items():
        if s.get("dead_frac", 0.0) >= t.dead_layer:
            found.append(
                Finding(
                    "dead_units",
                    name,
                    step,
                    s["dead_frac"],
                    f"{s['dead_frac']:.0%} of the units of {name!r} are <= 0 on at least "
                    f"{t.dead_unit:.0%} of their inputs (zero fraction "
                    f"{s['zero_frac']:.0%}) at step {step}: dying ReLUs; lower the "
                    "learning rate, check the bias/initialization, or try LeakyReLU",
                )
            )
        if s.get("sat_frac", 0.0) > t.saturated:
            found.append(
                Finding(
                    "saturated_units",
                    name,
                    step,
                    s["sat_frac"],
                    f"{s['sat_frac']:.0%} of the outputs of {name!r} sit at the "
                    f"activation's bounds at step {step} (mean {s['mean']:.3g}, "
                    f"min {s['min']:.3g}, max {s['max']:.3g}): its gradients vanish; "
                    "normalize its inputs or lower the initialization scale",
                )
            )
    return found
