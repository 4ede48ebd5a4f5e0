"""The methods that run the model again: Score-CAM (the input masked by each channel) and
integrated gradients (the rest of the model run from points on a path of the module's
output). Both go through ``batch_size`` rows per forward pass.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .._errors import ExplainError
from ._forward import Call, grad_mode_free, record
from ._inputs import Inputs
from ._methods import channel_masks
from ._target import scores_of

__all__ = ["integrated_gradients", "masked_scores", "unused_message"]


def masked_scores(
    model: nn.Module,
    inputs: Inputs,
    a: torch.Tensor,
    target: Any,
    batch_size: int,
) -> torch.Tensor:
    """Score-CAM's ``[N, K]`` target scores: sample n's input times channel k's mask.

    ``a`` is ``[N, K, *grid]``; ``target`` a callable or one index per sample. Masks are made
    per forward pass, so memory holds ``batch_size`` masked inputs, not N * K.
    """
    size = inputs.image_size
    if size is None:
        raise ExplainError(
            "method='scorecam' masks the input with each channel, so it needs a floating-point "
            f"[N, C, H, W] input; the input is {inputs.primary.dtype} of shape "
            f"{list(inputs.primary.shape)}. Use a gradient method (method='gradcam')."
        )
    n, k = a.shape[:2]
    x = inputs.primary
    scores = torch.empty(n * k, dtype=torch.float32, device=a.device)
    with torch.no_grad():
        for rows in torch.arange(n * k, device=a.device).split(batch_size):
            sample, channel = rows // k, rows % k
            masks = channel_masks(a[sample, channel].unsqueeze(1), size)
            masked = x[sample.to(x.device)] * masks.to(x.device, x.dtype)
            output = inputs.rows(sample).with_primary(masked).call(model)
            chosen = target if callable(target) else target[sample]
            scores[rows] = scores_of(output, chosen, len(rows)).float().to(a.device)
    return scores.view(n, k)


def integrated_gradients(
    model: nn.Module,
    inputs: Inputs,
    modules: dict[str, nn.Module],
    clean: dict[str, list[Call]],
    target: Any,
    *,
    baseline: Any,
    steps: int,
    batch_size: int,
) -> dict[str, list[torch.Tensor]]:
    """Layer integrated gradients of every call of ``modules``: (A - A') times the mean
    gradient at the midpoints of ``steps`` equal segments of the path from A' to A, where A'
    is the call's output for the baseline input; the model runs on from the patched call
    (Captum's ``LayerIntegratedGradients``, ``method="riemann_middle"``)."""
    base_inputs = inputs.with_primary(_baseline(inputs.primary, baseline))
    with torch.no_grad():
        base, _ = record(model, base_inputs, modules, keep_src=False)
    n = inputs.n
    per = max(1, batch_size // max(n, 1))
    from_module = grad_mode_free(model)
    result: dict[str, list[torch.Tensor]] = {}
    for name, calls in clean.items():
        result[name] = []
        for call, (_, a) in enumerate(calls):
            if call >= len(base[name]) or base[name][call][1].shape != a.shape:
                raise ExplainError(
                    f"{name!r} did not give an output of the same shape for the baseline "
                    f"input (call {call}): integrated gradients needs one A' per call."
                )
            if a.dim() == 0 or a.shape[0] != n:
                raise ExplainError(
                    f"the output of {name!r} has shape {list(a.shape)}: integrated gradients "
                    f"needs the batch ({n} samples) first."
                )
            mean_grad = _mean_gradient(
                model,
                inputs,
                (name, modules[name], call),
                a,
                base[name][call][1],
                target,
                steps,
                per,
                from_module,
            )
            result[name].append((a - base[name][call][1]).float() * mean_grad)
    return result


def _mean_gradient(
    model: nn.Module,
    inputs: Inputs,
    where: tuple[str, nn.Module, int],
    a: torch.Tensor,
    a0: torch.Tensor,
    target: Any,
    steps: int,
    per: int,
    from_module: bool,
) -> torch.Tensor:
    name, module, call = where
    n = a.shape[0]
    alphas = (torch.arange(steps, dtype=torch.float64) + 0.5) / steps
    total = torch.zeros(a.shape, dtype=torch.float32, device=a.device)
    for chunk in alphas.split(per):
        c = len(chunk)
        alpha = chunk.to(a.device, a.dtype).view(c, *([1] * a.dim()))
        path = (a0 + alpha * (a - a0)).reshape(c * n, *a.shape[1:])
        src = path.detach().requires_grad_()
        with torch.enable_grad():
            _, output = record(
                model,
                inputs.repeat(c),
                {name: module},
                keep_src=False,
                patch=(name, call, src),
                from_module=from_module,
            )
            chosen = target if callable(target) else target.repeat(c)
            score = scores_of(output, chosen, c * n)
            if not score.requires_grad:
                raise _unused([name])
            (grad,) = torch.autograd.grad(score.sum(), src, allow_unused=True)
        if grad is None:
            raise _unused([name])
        total += grad.view(c, *a.shape).float().sum(0)
    return total / steps


def _baseline(x: torch.Tensor, baseline: Any) -> torch.Tensor:
    if baseline is None:
        return torch.zeros_like(x)
    if isinstance(baseline, (int, float)):
        return torch.full_like(x, baseline)
    if isinstance(baseline, torch.Tensor):
        try:
            return torch.broadcast_to(baseline.to(x.device, x.dtype), x.shape).clone()
        except RuntimeError:
            pass
    raise ExplainError(
        f"baseline must be None (zeros), a number, or a tensor that broadcasts to the input's "
        f"shape {list(x.shape)}; got {type(baseline).__name__}"
        + (f" of shape {list(baseline.shape)}" if isinstance(baseline, torch.Tensor) else "")
    )


def unused_message(names: list[str]) -> str:
    return (
        f"the target score does not depend on the output of {', '.join(map(repr, names))}: "
        "no gradient reaches it. Either the model does not use that output for its result, "
        "or its own code runs it under torch.no_grad() or detaches it. Choose a module on the "
        "path to the output."
    )


def _unused(names: list[str]) -> ExplainError:
    return ExplainError(unused_message(names))
