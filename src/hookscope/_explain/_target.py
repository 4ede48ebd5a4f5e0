"""Which score is explained: ``target=`` turned into one score per sample.

``None``: each sample's argmax of a ``[N, C]`` output (or of a ``ModelOutput``'s
``logits``); an int: that index for every sample; a length-N sequence or tensor: one index
per sample; a callable ``output -> [N]`` scores: anything else (tuples, dicts, segmentation
masks, detection scores).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping
from typing import Any, Union

import torch

from .._errors import TargetError

__all__ = ["Target", "check_target", "logits_of", "pick", "scores_of"]

Target = Union[None, int, "torch.Tensor", "list[int]", Callable[[Any], "torch.Tensor"]]


def check_target(target: Any) -> None:
    """Refuse a target of the wrong kind before the model runs."""
    if target is None or callable(target):
        return
    if isinstance(target, torch.Tensor):
        if target.is_floating_point() or target.is_complex() or target.dim() > 1:
            raise TargetError(
                _kinds(f"target is a {target.dtype} tensor of shape {list(target.shape)}")
            )
        return
    if isinstance(target, (bool, float)):
        raise TargetError(_kinds(f"target={target!r} is not an index"))
    if isinstance(target, numbers.Integral):
        return
    if isinstance(target, (list, tuple)) and all(
        isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in target
    ):
        return
    raise TargetError(_kinds(f"target={target!r} is not a target"))


def _kinds(what: str) -> str:
    return (
        f"{what}. A target is None (each sample's top class), an int (one class for every "
        "sample), a length-N sequence or integer tensor (one class per sample), or a "
        "callable output -> [N] scores."
    )


def pick(output: Any, target: Any, n: int) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The index explained for each sample (``None`` for a callable target) and its score."""
    if callable(target):
        return None, scores_of(output, target, n)
    logits = logits_of(output)
    if isinstance(target, torch.Tensor) and target.dim() == 0:
        target = int(target)
    if target is None:
        index = logits.argmax(1)
    elif isinstance(target, numbers.Integral):
        index = torch.full((n,), int(target), dtype=torch.long, device=logits.device)
    else:
        index = torch.as_tensor(target, dtype=torch.long).to(logits.device).reshape(-1)
        if index.numel() != n:
            raise TargetError(
                f"target has {index.numel()} indices, but the batch has {n} samples: give one "
                "index per sample, or an int for all of them."
            )
    classes = logits.shape[1]
    bad = ((index < 0) | (index >= classes)).nonzero().flatten().tolist()
    if bad:
        raise TargetError(
            f"target index {index[bad[0]].item()} (sample {bad[0]}) is out of range: the output "
            f"has {classes} classes, so an index is 0 to {classes - 1}."
        )
    return index, scores_of(output, index, n)


def scores_of(output: Any, target: Any, n: int) -> torch.Tensor:
    """``[n]`` scores of ``output``: ``target`` is a callable or one index per row."""
    if callable(target):
        scores = target(output)
        if not isinstance(scores, torch.Tensor) or scores.shape != (n,):
            shape = (
                list(scores.shape) if isinstance(scores, torch.Tensor) else type(scores).__name__
            )
            raise TargetError(
                f"the target callable returned {shape}; it must return one score per sample, "
                f"a tensor of shape [{n}]."
            )
        return scores
    logits = logits_of(output)
    return logits.gather(1, target.to(logits.device).unsqueeze(1)).squeeze(1)


def logits_of(output: Any) -> torch.Tensor:
    logits = output
    if not isinstance(output, torch.Tensor):
        logits = output.get("logits") if isinstance(output, Mapping) else None
        logits = getattr(output, "logits", None) if logits is None else logits
    if not isinstance(logits, torch.Tensor):
        raise TargetError(
            f"the model returned a {type(output).__name__}, not a [N, C] tensor nor an output "
            "with .logits, so there is no class to pick. Pass target=callable, output -> [N] "
            "scores, e.g. target=lambda out: out[0][:, 3]."
        )
    if logits.dim() != 2:
        raise TargetError(
            f"the model's scores have shape {list(logits.shape)}, not [N, C], so target=None or "
            "an index cannot pick one score per sample. Pass target=callable, output -> [N] "
            "scores (for a language model, e.g. lambda out: out.logits[:, -1, token])."
        )
    return logits
