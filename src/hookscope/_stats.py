"""Statistics computed on the tensor's device, as small float vectors: no host sync here.

A Monitor stacks these vectors and moves them to the host once per sampled step.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["ACT_FIELDS", "activation", "bounded", "histogram", "merge_activation", "relu_like"]

# Order of the activation vector. Sums and counts add up over tensors and calls.
ACT_FIELDS = ("sum", "sumsq", "min", "max", "zeros", "sat", "nan", "inf", "numel", "dead")
_ADD = {"sum", "sumsq", "zeros", "sat", "nan", "inf", "numel"}

_RELU_LIKE = (nn.ReLU, nn.ReLU6)
# Saturated: output within this distance of the activation's bound (tanh(5) = 1 - 9e-5 is
# DeepDiagnosis' "pre-activation outside ±5").
_BOUNDED = {
    nn.Tanh: (-1.0, 1.0),
    nn.Sigmoid: (0.0, 1.0),
    nn.Hardtanh: (-1.0, 1.0),
    nn.Softsign: (-1.0, 1.0),
    nn.Hardsigmoid: (0.0, 1.0),
}
SAT_MARGIN = 1e-3


def relu_like(module: nn.Module) -> bool:
    return isinstance(module, _RELU_LIKE)


def bounded(module: nn.Module) -> tuple[float, float] | None:
    for kind, bounds in _BOUNDED.items():
        if isinstance(module, kind):
            return bounds
    return None


@torch.no_grad()
def activation(
    t: torch.Tensor,
    *,
    bounds: tuple[float, float] | None,
    dead: bool,
    dead_at: float,
    total: torch.Tensor | None = None,
) -> torch.Tensor:
    """``ACT_FIELDS`` of one tensor, float32, on ``t``'s device.

    ``total`` is ``t.sum()`` when the caller has it already (the non-finite flag).
    ``dead`` (ReLU-like modules only) is the fraction of units that are <= 0 on at least
    ``dead_at`` of their activations; units lie along dim 1 for 2-D and >=4-D outputs and
    along the last dim for 3-D (batch, sequence, features) outputs.
    """
    t = t.detach()
    x = t if t.dtype in (torch.float32, torch.float64) else t.float()
    lo, hi = torch.aminmax(x)
    finite = torch.isfinite(x).sum()
    nan = torch.isnan(x).sum()
    numel = x.numel()
    sat = (
        ((x <= bounds[0] + SAT_MARGIN) | (x >= bounds[1] - SAT_MARGIN)).sum()
        if bounds is not None
        else x.new_zeros(())
    )
    dead_frac = _dead_fraction(x, dead_at) if dead else x.new_zeros(())
    return torch.stack(
        [
            x.sum() if total is None else total.float(),
            torch.linalg.vector_norm(x).square(),
            lo,
            hi,
            (x == 0).sum(),
            sat,
            nan,
            numel - finite - nan,
            x.new_tensor(numel),
            dead_frac,
        ]
    ).float()


def _dead_fraction(x: torch.Tensor, dead_at: float) -> torch.Tensor:
    if x.dim() < 2:
        return x.new_zeros(())
    unit_dim = x.dim() - 1 if x.dim() == 3 else 1
    off = (x <= 0).movedim(unit_dim, 0).flatten(1).float().mean(1)
    return (off >= dead_at).float().mean()


def merge_activation(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Combine two activation vectors (two tensors of one output, or two calls)."""
    out = a + b
    out[2] = torch.minimum(a[2], b[2])
    out[3] = torch.maximum(a[3], b[3])
    out[9] = torch.maximum(a[9], b[9])
    return out


@torch.no_grad()
def histogram(t: torch.Tensor, bins: int) -> torch.Tensor:
    """``[lo, hi, counts...]``, bucketed on the device (no sync); non-finite values count as 0."""
    x = torch.nan_to_num(t.detach().float().flatten(), nan=0.0, posinf=0.0, neginf=0.0)
    if x.numel() == 0:
        return torch.zeros(bins + 2, device=t.device)
    lo, hi = torch.aminmax(x)
    width = (hi - lo).clamp_min(1e-12) / bins
    index = ((x - lo) / width).long().clamp_(0, bins - 1)
    counts = torch.bincount(index, minlength=bins).float()
    return torch.cat([lo.reshape(1), hi.reshape(1), counts])
