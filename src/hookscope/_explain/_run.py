"""The runner: explain one batch, given the model, its inputs, the chosen modules, the method
and the target, and return plain tensors (:class:`Explained`).

``hs.explain`` wraps it in an :class:`~._result.Explanation`; anything else that explains a
batch (a probe during training, a data set) calls :func:`explain_batch` directly. It leaves
the model as it was (mode, buffers, RNG, every ``.grad``), runs compiled models eagerly (the
eager maps), and works inside ``torch.no_grad()`` and ``torch.inference_mode()``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .._errors import ExplainError, LayoutError, did_you_mean, never_ran_message
from .._hooks import eager_calls, uncompiled
from ._forward import Call, grad_mode_free, record
from ._inputs import Inputs
from ._layout import Layout, find_layout, previous_in_sequential
from ._methods import ATTRIBUTIONS, CAMS, METHODS, cam, eigencam, score_weights
from ._rerun import integrated_gradients, masked_scores, unused_message
from ._state import untouched
from ._target import check_target, pick

__all__ = ["Explained", "check_method", "explain_batch"]


@dataclass
class Explained:
    """What one batch's explanation is, as plain tensors.

    ``maps[name]``: one float32 tensor per call of the module, ``[N, *grid]`` for the CAM
    methods, shaped like the module's output for the attribution methods. ``layouts[name]``:
    per call, how the output reads as a grid (a :class:`LayoutError` where it does not, for
    attribution methods on outputs without positions). ``target``: ``[N]`` indices (``None``
    for a callable target); ``score``: ``[N]`` the explained scores.
    """

    method: str
    maps: dict[str, list[torch.Tensor]]
    layouts: dict[str, list[Layout | LayoutError]]
    target: torch.Tensor | None
    score: torch.Tensor
    image_size: tuple[int, ...] | None
    missing: list[str] = field(default_factory=list)


def check_method(method: str) -> None:
    if method not in METHODS:
        raise ExplainError(
            f"method={method!r} is not an explain method{did_you_mean(str(method), METHODS)}; "
            f"choose one of {', '.join(METHODS)}"
        )


def explain_batch(
    model: nn.Module,
    inputs: Inputs,
    modules: dict[str, nn.Module],
    method: str,
    target: Any = None,
    *,
    layout: str | dict[str, str] = "auto",
    train: bool = False,
    batch_size: int = 64,
    steps: int = 50,
    baseline: Any = None,
) -> Explained:
    """Explain one batch. ``modules`` are the chosen modules of the eager model by name
    (``hs.select``); see :func:`hookscope.explain` for the rest."""
    check_method(method)
    check_target(target)
    if batch_size < 1 or steps < 1:
        raise ExplainError(f"batch_size and steps must be >= 1, got {batch_size} and {steps}")
    model = uncompiled(model)
    grads = method in CAMS or method == "grad_x_act"
    with untouched(model, train), eager_calls(), torch.inference_mode(False):
        prefix = grad_mode_free(model)
        with torch.set_grad_enabled(grads):
            calls, output = record(
                model, inputs, modules, keep_src=grads, from_module=grads and prefix
            )
            index, score = pick(output, target, inputs.n)
        del output
        missing = [name for name, c in calls.items() if not c]
        calls = {name: c for name, c in calls.items() if c}
        if not calls:
            raise ExplainError("explain: " + never_ran_message(missing))
        layouts = _layouts(
            model, calls, modules, inputs.image_size, layout, strict=method not in ATTRIBUTIONS
        )
        chosen = target if callable(target) else index
        if grads:
            maps = _gradient_maps(method, calls, layouts, score)
        elif method == "eigencam":
            maps = {
                n: [eigencam(_grid(lay, a)) for (_, a), lay in zip(c, layouts[n], strict=True)]
                for n, c in calls.items()
            }
        elif method == "scorecam":
            maps = {
                n: [
                    score_weights(
                        masked_scores(model, inputs, _grid(lay, a), chosen, batch_size),
                        _grid(lay, a),
                    )
                    for (_, a), lay in zip(c, layouts[n], strict=True)
                ]
                for n, c in calls.items()
            }
        else:
            maps = integrated_gradients(
                model,
                inputs,
                modules,
                calls,
                chosen,
                baseline=baseline,
                steps=steps,
                batch_size=batch_size,
            )
    return Explained(
        method, maps, layouts, index, score.detach().float(), inputs.image_size, missing
    )


def _grid(layout: Layout | LayoutError, a: torch.Tensor) -> torch.Tensor:
    if isinstance(layout, LayoutError):
        raise layout
    return layout.to_grid(a.float())


def _layouts(
    model: nn.Module,
    calls: dict[str, list[Call]],
    modules: dict[str, nn.Module],
    image: tuple[int, ...] | None,
    layout: str | dict[str, str],
    *,
    strict: bool,
) -> dict[str, list[Layout | LayoutError]]:
    found: dict[str, list[Layout | LayoutError]] = {}
    for name, c in calls.items():
        asked = layout.get(name, "auto") if isinstance(layout, dict) else layout
        before = previous_in_sequential(model, name)
        found[name] = []
        for _, a in c:
            try:
                found[name].append(
                    find_layout(name, modules[name], tuple(a.shape), image, asked, before)
                )
            except LayoutError as error:
                if strict:
                    raise
                found[name].append(error)
    return found


def _gradient_maps(
    method: str,
    calls: dict[str, list[Call]],
    layouts: dict[str, list[Layout | LayoutError]],
    score: torch.Tensor,
) -> dict[str, list[torch.Tensor]]:
    """G = d(sum of the N target scores)/dA for every call at once, then the formula."""
    flat = [(name, i, src, a) for name, c in calls.items() for i, (src, a) in enumerate(c)]
    no_grad = [name for name, _, src, _ in flat if src is None]
    if no_grad or not score.requires_grad:
        raise ExplainError(unused_message(sorted(set(no_grad)) or list(calls)))
    grads = torch.autograd.grad(score.sum(), [src for _, _, src, _ in flat], allow_unused=True)
    unused = sorted({name for (name, *_), g in zip(flat, grads, strict=True) if g is None})
    if unused:
        raise ExplainError(unused_message(unused))
    maps: dict[str, list[torch.Tensor]] = {name: [] for name in calls}
    for (name, i, _, a), g in zip(flat, grads, strict=True):
        if method == "grad_x_act":
            maps[name].append(g.float() * a.float())
        else:
            lay = layouts[name][i]
            maps[name].append(cam(method, _grid(lay, a), _grid(lay, g)))
    return maps
