"""How faithful a heatmap is to the model: average drop and increase in confidence
(Chattopadhyay et al. 2018, Grad-CAM++), and the deletion and insertion areas (Petsiuk et
al. 2018, RISE).

The score of a sample is the softmax probability of its explained class (for a callable
target: the callable's score). Average drop is the mean over samples of
``max(0, Y - O) / Y`` and increase in confidence the fraction of samples with ``O > Y``,
where Y is the score of the input and O that of the input times its heatmap (fractions, not
percent). Deletion removes the most salient pixels first (set to ``baseline``), ``steps``
equal shares at a time, insertion adds them to the baseline in the same order; each area is
the mean of the score curve over the fraction of pixels, by the trapezoid rule (lower is
better for deletion, higher for insertion).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .._errors import ExplainError
from .._hooks import eager_calls, uncompiled
from ._inputs import Inputs
from ._state import untouched
from ._target import logits_of, scores_of

__all__ = ["Metrics", "faithfulness"]


@dataclass
class Metrics:
    """The means over the batch; ``per_sample`` holds each sample's values and curves."""

    average_drop: float
    increase_in_confidence: float
    deletion: float
    insertion: float
    per_sample: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)

    def as_dict(self) -> dict[str, float]:
        return {
            "average_drop": self.average_drop,
            "increase_in_confidence": self.increase_in_confidence,
            "deletion": self.deletion,
            "insertion": self.insertion,
        }


def faithfulness(
    model: nn.Module,
    inputs: Inputs,
    heat: torch.Tensor,
    target: Any,
    *,
    steps: int = 32,
    batch_size: int = 64,
    baseline: float = 0.0,
) -> Metrics:
    """The metrics of ``heat`` (``[N, H, W]`` in [0, 1]) for the primary input of
    ``inputs``; ``target`` is one index per sample or a callable. The model is left as it
    was (eval mode for the passes)."""
    x = inputs.primary
    if inputs.image_size is None or len(inputs.image_size) != 2:
        raise ExplainError(
            "metrics mask the input with the heatmap, so they need a floating-point "
            f"[N, C, H, W] input; the input is {x.dtype} of shape {list(x.shape)}."
        )
    model = uncompiled(model)
    n, size = inputs.n, inputs.image_size
    heat = heat.to(x.device, x.dtype)
    with untouched(model, False), eager_calls(), torch.no_grad():
        y = _score(model, inputs, target, torch.arange(n), x)
        o = _score(model, inputs, target, torch.arange(n), x * heat.unsqueeze(1))
        drop = torch.relu(y - o) / y
        increase = (o > y).float()
        rank = _rank(heat)
        curves = {
            kind: _curve(model, inputs, target, rank, kind, steps, batch_size, baseline, size)
            for kind in ("deletion", "insertion")
        }
    areas = {kind: (c.sum(1) - (c[:, 0] + c[:, -1]) / 2) / steps for kind, c in curves.items()}
    return Metrics(
        drop.mean().item(),
        increase.mean().item(),
        areas["deletion"].mean().item(),
        areas["insertion"].mean().item(),
        {
            "drop": drop,
            "increase": increase,
            **areas,
            "deletion_curve": curves["deletion"],
            "insertion_curve": curves["insertion"],
        },
    )


def _score(
    model: nn.Module, inputs: Inputs, target: Any, rows: torch.Tensor, x: torch.Tensor
) -> torch.Tensor:
    output = inputs.rows(rows).with_primary(x).call(model)
    if callable(target):
        return scores_of(output, target, len(rows)).float()
    probs = torch.softmax(logits_of(output).float(), dim=1)
    return probs.gather(1, target[rows].to(probs.device).unsqueeze(1)).squeeze(1)


def _rank(heat: torch.Tensor) -> torch.Tensor:
    """Each pixel's place in the order of decreasing saliency (ties: first pixel first)."""
    flat = heat.flatten(1)
    order = torch.sort(flat, dim=1, descending=True, stable=True).indices
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(flat.shape[1], device=flat.device).expand_as(order))
    return rank.view(heat.shape)


def _curve(
    model: nn.Module,
    inputs: Inputs,
    target: Any,
    rank: torch.Tensor,
    kind: str,
    steps: int,
    batch_size: int,
    baseline: float,
    size: tuple[int, ...],
) -> torch.Tensor:
    """``[N, steps + 1]`` scores as the top pixels are deleted (or inserted)."""
    n = inputs.n
    x = inputs.primary
    pixels = rank[0].numel()
    base = torch.full_like(x, baseline)
    scores = torch.empty(n * (steps + 1), dtype=torch.float32, device=x.device)
    for rows in torch.arange(n * (steps + 1)).split(batch_size):
        step, sample = rows // n, rows % n
        count = torch.round(step.double() * pixels / steps).to(rank.device)
        top = (rank[sample.to(rank.device)] < count.view(-1, 1, 1)).unsqueeze(1)
        xs, bs = x[sample.to(x.device)], base[sample.to(x.device)]
        masked = torch.where(top, bs, xs) if kind == "deletion" else torch.where(top, xs, bs)
        scores[rows.to(x.device)] = _score(model, inputs, target, sample, masked).to(x.device)
    return scores.view(steps + 1, n).T
