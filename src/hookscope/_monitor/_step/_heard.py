"""What a Monitor hears of a step from the script's own calls into torch (``_wiring/_calls.py``).

:class:`Heard` is the step's account: the loss each backward pass started from (summed over
an accumulated step), the scale a GradScaler multiplied it by, the total norms
``clip_grad_norm_`` measured before clipping, and the optimizer steps GradScaler skipped.
:class:`Ears` is the Monitor's listener that fills it in.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.linalg import vector_norm

from ..._diagnose import Finding

if TYPE_CHECKING:
    from .._checks import Checks
    from .._probes._params import Params
    from .._wiring._modules import ModuleHooks

__all__ = ["Ears", "Heard"]


class Heard:
    """One step's loss, loss scale, pre-clip gradient norms and GradScaler skips."""

    def __init__(self) -> None:
        self.loss: torch.Tensor | None = None  # the backpropagated loss, unscaled
        self.scale: torch.Tensor | None = None  # the GradScaler scale of that loss
        self.clip_norms: list[tuple[torch.Tensor, float]] = []  # (total norm, p), pre-clip
        self.scaler_skips: list[torch.optim.Optimizer] = []  # steps GradScaler skipped
        self.scaler_cause: Finding | None = None  # the overflow it skipped for, if located
        self._grad_norm: tuple[int, torch.Tensor] | None = None  # (clips, their norm)
        self.graph: list[Any] = []  # the autograd nodes of the losses backpropagated

    def scalars(self) -> dict[str, torch.Tensor]:
        """``loss``, ``grad_scale`` and, when the step clipped, ``grad_norm`` (the norm of
        the clips' norms when several clipped, one per model part)."""
        found = {}
        if self.loss is not None:
            found["loss"] = self.loss
        if self.scale is not None:
            found["grad_scale"] = self.scale
        if self.clip_norms:
            found["grad_norm"] = self._clip_norm()
        return found

    def _clip_norm(self) -> torch.Tensor:
        """The clips' total norm, made once per clip heard: the same tensor every time it is
        asked for (the transfer before an update carries it, ``step()`` then knows it moved)."""
        if self._grad_norm is None or self._grad_norm[0] != len(self.clip_norms):
            norms = [n.float().reshape(()) for n, _ in self.clip_norms]
            p = self.clip_norms[0][1]
            total = norms[0] if len(norms) == 1 else vector_norm(torch.stack(norms), p)
            self._grad_norm = (len(self.clip_norms), total)
        return self._grad_norm[1]

    def scalers_overflow(self, nonfinite: Finding, scale: float | None) -> bool:
        """A gradient that overflowed under a loss scale above 1, in a step GradScaler then
        skipped: the scaler's own business (it lowers the scale and goes on), an event and
        no finding. A NaN of the forward pass, or one at a scale of 1 or less, stays a
        finding."""
        return (
            bool(self.scaler_skips)
            and nonfinite.phase == "backward"
            and scale is not None
            and scale > 1
        )

    def skip_message(self, step: int, scale: float | None) -> str:
        names = ", ".join(dict.fromkeys(type(o).__name__ for o in self.scaler_skips))
        at = "" if scale is None else f" at loss scale {scale:g}"
        cause = "" if self.scaler_cause is None else f". First: {self.scaler_cause.message}"
        return (
            f"step {step}: GradScaler skipped the step of {names}: its gradients held Inf/NaN"
            f"{at} (weights and optimizer state unchanged; the scaler lowers its scale){cause}"
        )


class Ears:
    """The Monitor's listener on the script's calls into torch (``_calls.Listener``): the
    loss each backward pass started from, and the gradients before they are clipped.

    It reads what the module hooks (``_wiring/_modules.py``) saw: the step's state, the count of
    output gradients (did a backward pass reach the model?) and the tape (a replay of ours
    is not the script's). ``read_gradients`` reads the step's gradients before a clip."""

    def __init__(
        self,
        hooks: ModuleHooks,
        params: Params,
        checks: Checks,
        read_gradients: Callable[[], None],
    ) -> None:
        self._hooks, self._params, self._checks = hooks, params, checks
        self._read_gradients = read_gradients

    def before_backward(self) -> tuple[int, bool]:
        h = self._hooks
        # No gradient on any parameter: a new accumulation starts (zero_grad ran), and the
        # losses backpropagated before it (a GAN's other phase) are not this step's.
        fresh = True
        for p in self._params.params.values():  # (a loop: no generator per backward)
            if p.grad is not None:
                fresh = False
                break
        if not h.tape.paused:
            h.now.backward_ran = True
            self._checks.before_backward()
        return h.grad_calls, fresh

    def after_backward(self, token: tuple[int, bool], loss: torch.Tensor | None) -> None:
        h = self._hooks
        calls, fresh = token
        if h.tape.paused:
            return  # a replay of ours
        if h.grad_calls == calls:  # it did not reach the model: another model's
            self._checks.backward_missed()
            return
        h.now.reached = True
        if loss is None:
            return
        heard = h.now.heard
        heard.loss = (
            loss if fresh or heard.loss is None else heard.loss + loss.to(heard.loss.device)
        )

    def loss_graph(self, token: tuple[int, bool], nodes: list[Any]) -> None:
        """The autograd nodes of the losses a backward pass that reached the model started
        from, kept (by reference: their saved tensors are freed) until the step ends."""
        h = self._hooks
        if h.grad_calls != token[0] and not h.tape.paused:
            h.now.heard.graph += nodes

    def loss_scaled(self, token: tuple[int, bool], scale: torch.Tensor) -> None:
        """The loss was multiplied by a GradScaler's ``scale``: logged as ``grad_scale``
        when that backward pass reached the model."""
        h = self._hooks
        if h.grad_calls != token[0] and not h.tape.paused:
            h.now.heard.scale = scale

    def scaler_skipped(self, optimizer: torch.optim.Optimizer) -> None:
        """GradScaler skipped ``optimizer.step()`` (Inf/NaN gradients): the step's one
        ``skipped_step`` event says so, with the scale."""
        if self._concerns([p for g in optimizer.param_groups for p in g["params"]]):
            self._hooks.now.heard.scaler_skips.append(optimizer)

    def before_clip(self, params: list[torch.Tensor]) -> None:
        if self._concerns(params):
            self._read_gradients()

    def clipped(self, params: list[torch.Tensor], total_norm: torch.Tensor, p: float) -> None:
        if self._concerns(params):
            self._hooks.now.heard.clip_norms.append((total_norm.detach(), p))

    def _concerns(self, params: list[torch.Tensor]) -> bool:
        return self._params.owns_any(params)
