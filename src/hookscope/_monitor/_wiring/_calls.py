"""What a Monitor learns from the calls a training script makes into torch itself.

Hooks on modules and tensors cannot see what a training step does around the model:

- which scalar was backpropagated (the loss: a loss module's output, ``output.loss``, the
  ``loss`` of ``logits, loss = model(x, y)``, or ``F.cross_entropy`` in the training loop);
- the gradients *before* ``clip_grad_norm_`` / ``clip_grad_value_`` change them in place (the
  optimizer's pre-hook comes too late: a diverging run would log the clip value);
- the loss behind ``GradScaler.scale(loss)``, which is what is backpropagated under AMP,
  and the scale that multiplied it;
- a ``GradScaler.step(optimizer)`` that skipped the optimizer's step (non-finite gradients):
  no optimizer hook runs then, yet the training step is over.

So, while at least one Monitor is open, ``torch.autograd.backward`` (``Tensor.backward``
calls it), the two clipping functions, ``GradScaler.scale`` and ``GradScaler.step`` are
wrapped (through ``_hooks.use``, the one owner of what hookscope replaces). A wrapper calls
the original unchanged; with no Monitor listening it does nothing else. The last Monitor to
close puts the originals back. (A script that bound
``from torch.nn.utils import clip_grad_norm_`` before the first Monitor was made calls torch's
own function: its gradients are then read at the optimizer step, after clipping.)
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.utils
import torch.nn.utils.clip_grad
from torch.amp import grad_scaler

from ..._hooks import use

__all__ = ["Listener", "listen", "loss_of", "scale_of"]

# The attributes a scaled loss carries: the loss before ``GradScaler.scale``, and the scale
# that multiplied it (a device tensor, copied: ``GradScaler.update`` changes its own in place).
_UNSCALED = "_hookscope_unscaled"
_SCALE = "_hookscope_scale"


class Listener(Protocol):
    """What a Monitor implements to hear of these calls.

    A listener may also have ``scaler_skipped(optimizer)``, called when
    ``GradScaler.step(optimizer)`` returned without running ``optimizer.step()`` (it found
    Inf/NaN gradients): that training step ended without an update. It is optional (called
    only where present): a Monitor whose loop calls ``step()`` itself needs no word of it;
    ``hookscope watch``, which ends steps from optimizer hooks, does.

    It may have ``loss_graph(token, nodes)``, called after ``after_backward`` with the roots'
    autograd nodes (kept by a Monitor until its step ends: where a NaN loss was made after
    the model, their structure names the op). It may have ``loss_scaled(token, scale)``
    too, called after ``after_backward`` when the backward pass started from a loss
    ``GradScaler.scale`` multiplied: ``scale`` is that factor, a one-element tensor on the
    scaler's device (no host sync here).
    """

    def before_backward(self) -> Any:
        """Called before a backward pass; what it returns is handed to ``after_backward``."""

    def after_backward(self, token: Any, loss: torch.Tensor | None) -> None:
        """The backward pass ended; ``loss`` is the sum of its scalar roots, unscaled."""

    def before_clip(self, params: list[torch.Tensor]) -> None:
        """``params``' gradients are about to be clipped in place."""

    def clipped(self, params: list[torch.Tensor], total_norm: torch.Tensor, p: float) -> None:
        """``clip_grad_norm_`` measured ``total_norm`` (the ``p``-norm) before clipping."""


_listeners: list[weakref.ref[Listener]] = []


def listen(listener: Listener) -> Callable[[], None]:
    """Have ``listener`` hear of every backward pass and clip; returns the function that
    stops it (and puts torch's functions back when nothing listens any more)."""
    ref = weakref.ref(listener)
    _listeners.append(ref)
    releases = [use(owner, name, _one_wrapper(wrap)) for owner, name, wrap in _TARGETS]

    def stop() -> None:
        if ref in _listeners:
            _listeners.remove(ref)
        while releases:
            releases.pop()()

    return stop


# id(original) -> (original, its wrapper): one wrapper per function, so that a function two
# modules export (``clip_grad_norm_``) stays one object, picklable by its name
_WRAPPERS: dict[int, tuple[Any, Any]] = {}


def _one_wrapper(wrap: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def make(original: Any) -> Any:
        made = _WRAPPERS.get(id(original))
        if made is None or made[0] is not original:
            made = _WRAPPERS[id(original)] = (original, wrap(original))
        return made[1]

    return make


def _live() -> list[Listener]:
    return [listener for ref in list(_listeners) if (listener := ref()) is not None]


# -- the wrappers ------------------------------------------------------------------------------
def _wrap_backward(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
        listeners = _live()
        if not listeners:
            return original(tensors, *args, **kwargs)
        tokens = [listener.before_backward() for listener in listeners]
        result = original(tensors, *args, **kwargs)
        loss = loss_of(tensors)
        scale = scale_of(tensors)
        graph = None
        for listener, token in zip(listeners, tokens, strict=True):
            listener.after_backward(token, loss)
            if scale is not None:
                loss_scaled = getattr(listener, "loss_scaled", None)
                if loss_scaled is not None:
                    loss_scaled(token, scale)
            loss_graph = getattr(listener, "loss_graph", None)
            if loss_graph is not None:
                if graph is None:
                    graph = graph_of(tensors)
                loss_graph(token, graph)
        return result

    return backward


def _wrap_clip(original: Callable[..., Any], *, norm: bool) -> Callable[..., Any]:
    @functools.wraps(original)
    def clip(parameters: Any, *args: Any, **kwargs: Any) -> Any:
        listeners = _live()
        if not listeners:
            return original(parameters, *args, **kwargs)
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        for listener in listeners:
            listener.before_clip(params)
        result = original(params, *args, **kwargs)
        if norm and isinstance(result, torch.Tensor):
            p = float(kwargs.get("norm_type", args[1] if len(args) > 1 else 2.0))
            for listener in listeners:
                listener.clipped(params, result, p)
        return result

    return clip


def _wrap_scale(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def scale(self: Any, outputs: Any) -> Any:
        scaled = original(self, outputs)
        if isinstance(outputs, torch.Tensor) and scaled is not outputs:
            setattr(scaled, _UNSCALED, outputs)  # dies with the scaled loss
            factor = getattr(self, "_scale", None)
            if isinstance(factor, torch.Tensor) and _live():
                setattr(scaled, _SCALE, factor.detach().clone())
        return scaled

    return scale


def _wrap_scaler_step(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def step(self: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        skipped = [f for listener in _live() if (f := getattr(listener, "scaler_skipped", None))]
        if not skipped or not hasattr(optimizer, "register_step_pre_hook"):
            return original(self, optimizer, *args, **kwargs)
        # Whether the scaler ran the step, told by torch's own step hook (not its private
        # state); the hook lives for this call only.
        ran: list[bool] = []
        handle = optimizer.register_step_pre_hook(lambda *_: ran.append(True))
        try:
            result = original(self, optimizer, *args, **kwargs)
        finally:
            handle.remove()
        if not ran:
            for scaler_skipped in skipped:
                scaler_skipped(optimizer)
        return result

    return step


def graph_of(tensors: Any) -> list[Any]:
    """The autograd nodes of a backward pass's roots, before any GradScaler: the structure
    of the code that made the loss (its saved tensors are freed by then)."""
    roots = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    nodes = [getattr(t, _UNSCALED, t).grad_fn for t in roots if isinstance(t, torch.Tensor)]
    return [n for n in nodes if n is not None]


def loss_of(tensors: Any) -> torch.Tensor | None:
    """The sum of the scalar floating roots of a backward pass, before any GradScaler."""
    roots = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    scalars = [
        getattr(t, _UNSCALED, t).detach()
        for t in roots
        if isinstance(t, torch.Tensor) and t.numel() == 1 and t.is_floating_point()
    ]
    if not scalars:
        return None
    total = scalars[0].reshape(1).float()
    for t in scalars[1:]:
        total = total + t.reshape(1).float().to(total.device)
    return total


def scale_of(tensors: Any) -> torch.Tensor | None:
    """The ``GradScaler`` scale that multiplied a root of a backward pass (the first such
    root's), as a float32 one-element tensor; ``None`` when no root was scaled."""
    roots = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    for t in roots:
        scale = getattr(t, _SCALE, None)
        if scale is not None:
            return scale.detach().float().reshape(1)
    return None


_TARGETS: list[tuple[Any, str, Callable[[Any], Any]]] = [
    (torch.autograd, "backward", _wrap_backward),
    (torch.nn.utils, "clip_grad_norm_", functools.partial(_wrap_clip, norm=True)),
    (torch.nn.utils.clip_grad, "clip_grad_norm_", functools.partial(_wrap_clip, norm=True)),
    (torch.nn.utils, "clip_grad_value_", functools.partial(_wrap_clip, norm=False)),
    (torch.nn.utils.clip_grad, "clip_grad_value_", functools.partial(_wrap_clip, norm=False)),
    (grad_scaler.GradScaler, "scale", _wrap_scale),
    (grad_scaler.GradScaler, "step", _wrap_scaler_step),
]
