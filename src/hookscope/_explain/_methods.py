"""The formulas: a map from a module's output A and the gradient G of the target scores.

A and G are ``[N, K, *spatial]`` (channels first, :mod:`._layout` reads every output that
way); sums and means run over the spatial positions; maps are not normalised. Each function
is a few lines of plain torch, one per method, so a test can hold it against the paper.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = [
    "ATTRIBUTIONS",
    "CAMS",
    "METHODS",
    "NO_GRADIENT",
    "cam",
    "channel_masks",
    "eigencam",
    "score_weights",
    "upsample",
]


def _spatial(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(range(2, t.dim()))


def _weighted(weights: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """relu(sum_k w_k A_k), ``weights`` ``[N, K]`` (a batched matrix product)."""
    summed = torch.bmm(weights.unsqueeze(1), a.flatten(2)).squeeze(1)
    return torch.relu(summed).view(a.shape[0], *a.shape[2:])


def gradcam(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    return _weighted(g.mean(_spatial(g)), a)


def hirescam(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    return torch.relu((g * a).sum(1))


def xgradcam(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    dims = _spatial(a)
    return _weighted((g * a).sum(dims) / (a.sum(dims) + 1e-7), a)


def gradcam_pp(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    dims = _spatial(a)
    g2 = g * g
    denom = 2 * g2 + a.sum(dims, keepdim=True) * g2 * g
    alpha = torch.where(denom != 0, g2 / torch.where(denom != 0, denom, 1), 0)
    return _weighted((torch.relu(g) * alpha).sum(dims), a)


def layercam(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    return torch.relu((torch.relu(g) * a).sum(1))


CAMS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "gradcam": gradcam,
    "gradcam++": gradcam_pp,
    "xgradcam": xgradcam,
    "hirescam": hirescam,
    "layercam": layercam,
}
NO_GRADIENT = ("scorecam", "eigencam")
ATTRIBUTIONS = ("grad_x_act", "integrated_gradients")
METHODS = (*CAMS, *NO_GRADIENT, *ATTRIBUTIONS)


def cam(method: str, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The map of a gradient CAM method, ``[N, *spatial]``."""
    return CAMS[method](a, g)


def eigencam(a: torch.Tensor) -> torch.Tensor:
    """The projection of A (positions x channels, centred over positions) on its first
    principal direction, ``[N, *spatial]``.

    The sign: a centred projection sums to zero by construction, so its own sum cannot
    choose it; the direction is signed to point along the mean activation (the projection
    of A before centring sums to >= 0). Computed in float64 (the same direction whatever
    the batch), returned in A's dtype.
    """
    n, k = a.shape[:2]
    m = a.reshape(n, k, -1).transpose(1, 2).double()  # [N, P, K]
    mean = m.mean(1, keepdim=True)
    m = m - mean
    direction = torch.linalg.svd(m, full_matrices=False).Vh[:, 0, :]  # [N, K]
    sign = torch.where((mean.squeeze(1) * direction).sum(1, keepdim=True) < 0, -1.0, 1.0)
    proj = (m @ (direction * sign).unsqueeze(-1)).squeeze(-1)  # [N, P]
    return proj.to(a.dtype).reshape(n, *a.shape[2:])


def score_weights(scores: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """Score-CAM: relu(sum_k w_k A_k) with w = softmax over k of the target scores of the
    masked inputs, ``scores`` ``[N, K]``."""
    return _weighted(torch.softmax(scores.to(a.dtype), dim=1), a)


def channel_masks(a: torch.Tensor, size: tuple[int, ...]) -> torch.Tensor:
    """Score-CAM's masks: each channel upsampled to the input's ``size`` and min-max
    normalised to [0, 1] (a constant channel masks everything: zeros), ``[N, K, *size]``."""
    up = upsample(a, size)
    flat = up.flatten(2)
    low = flat.amin(2, keepdim=True)
    span = flat.amax(2, keepdim=True) - low
    masks = torch.where(span > 0, (flat - low) / torch.where(span > 0, span, 1), 0)
    return masks.reshape(up.shape)


_MODES = {1: "linear", 2: "bilinear", 3: "trilinear"}


def upsample(t: torch.Tensor, size: tuple[int, ...]) -> torch.Tensor:
    """``[N, K, *grid]`` resized (linearly: bilinear for images) to ``size``."""
    if tuple(t.shape[2:]) == tuple(size):
        return t
    mode = _MODES[len(size)]
    return torch.nn.functional.interpolate(t, size=tuple(size), mode=mode, align_corners=False)
