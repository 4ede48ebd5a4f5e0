"""``hs.explain``: where the model looks, for one batch."""

from __future__ import annotations

from typing import Any

from torch import nn

from .._errors import ExplainError, never_ran_message
from .._hooks import uncompiled
from .._select import Where, select
from ._inputs import Inputs
from ._result import Explanation
from ._run import check_method, explain_batch
from ._target import check_target

__all__ = ["explain"]


def explain(
    model: nn.Module,
    x: Any,
    where: Where,
    method: str = "gradcam",
    target: Any = None,
    *,
    forward_kwargs: dict[str, Any] | None = None,
    layout: str | dict[str, str] = "auto",
    train: bool = False,
    batch_size: int = 64,
    steps: int = 50,
    baseline: Any = None,
) -> Explanation:
    """Explain the model's output for a batch at the chosen modules: class activation maps
    (where it looks) or layer attributions.

    Args:
        model: The model (eager, or compiled with ``torch.compile``: the eager maps). It is
            left exactly as it was: its mode, every parameter's ``.grad`` (also ``None``),
            ``requires_grad``, buffers (BatchNorm statistics) and the RNG state; no hook
            is left, also when it raised.
        x: The model's input: a tensor, or a tuple of positional inputs. Its first tensor
            is the batch (``[N, C, H, W]`` for images: heatmaps are upsampled to H x W).
        where: Which modules: a name, glob, regex, type, predicate, or a list. One result per
            module, and per call of a module called several times.
        method: ``"gradcam"``, ``"gradcam++"``, ``"xgradcam"``, ``"hirescam"``,
            ``"layercam"``, ``"scorecam"``, ``"eigencam"`` (maps ``[N, *grid]``), or
            ``"grad_x_act"`` and ``"integrated_gradients"`` (attributions shaped like the
            module's output).
        target: ``None`` (each sample's argmax of a ``[N, C]`` output or of its
            ``.logits``), an int, one index per sample (sequence or tensor), or a callable
            ``output -> [N]`` scores.
        forward_kwargs: Keyword inputs of the model.
        layout: How an output reads as a grid: ``"auto"`` (``[N, C, H, W]``, Swin's
            ``[N, H, W, C]`` and a vision transformer's ``[N, (1 +) h*w, C]`` are found from
            the shapes), or ``"NCHW"``, ``"NHWC"``, ``"NTC"`` (or a dict by module name).
        train: Run the model in training mode (its mode and buffers are put back after).
            By default it runs in eval mode, so a sample's map does not depend on the rest
            of the batch.
        batch_size: Rows per forward pass of the methods that run the model again
            (``scorecam``: masked inputs; ``integrated_gradients``: path points).
        steps: Integrated gradients' number of path segments (midpoint rule).
        baseline: Integrated gradients' baseline input (default zeros): a tensor that
            broadcasts to the input, or a number.

    Returns:
        An :class:`Explanation`: ``exp[name]``, ``exp.all(name)``, ``exp.heatmap(name)``,
        ``exp.overlay(images)``, ``exp.target``, ``exp.score``, ``exp.layout``,
        ``exp.save(dir)``, ``exp.metrics(model)``.

    Raises:
        SelectionError: If ``where`` matches nothing.
        ExplainError: An unknown method, a module that never ran or whose output the score
            does not depend on. ``TargetError``: a target that does not fit the output.
            ``LayoutError``: an output that cannot be read as a grid (names ``layout=``).

    Example:
        >>> import torch, hookscope as hs, torch.nn as nn
        >>> model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(inplace=True),
        ...                       nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5))
        >>> exp = hs.explain(model, torch.randn(2, 3, 16, 16), where="0")
        >>> exp["0"].shape, exp.heatmap("0").shape, exp.target.shape
        (torch.Size([2, 16, 16]), torch.Size([2, 16, 16]), torch.Size([2]))
    """
    check_method(method)
    check_target(target)
    eager = uncompiled(model)
    modules = select(eager, where)
    inputs = Inputs.of(x, forward_kwargs)
    explained = explain_batch(
        eager,
        inputs,
        modules,
        method,
        target,
        layout=layout,
        train=train,
        batch_size=batch_size,
        steps=steps,
        baseline=baseline,
    )
    named = _exact_names(where, list(modules))
    never = [name for name in explained.missing if name in named or not explained.maps]
    if never:
        raise ExplainError("explain: " + never_ran_message(never))
    return Explanation(explained, inputs, target)


def _exact_names(where: Where, names: list[str]) -> list[str]:
    items = where if isinstance(where, (list, tuple)) else [where]
    return [item for item in items if isinstance(item, str) and item in names]
