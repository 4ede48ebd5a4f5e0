"""What a Monitor cannot do on a step, said once: a run is never silently unwatched."""

from __future__ import annotations

import warnings

from .._errors import HookscopeWarning
from ._step._state import StepState

__all__ = ["Warnings"]


class Warnings:
    """The Monitor's warnings, each given once per Monitor, at the line of the script that
    called ``Monitor.step()`` (each method's ``stacklevel`` counts the frames up to it)."""

    def __init__(self) -> None:
        self.given: set[str] = set()

    def unhooked(self, state: StepState, step: int, model: str) -> None:
        """A step that ran a backward pass and updated the model (``model``, its class name),
        while none of the Monitor's hooks on its modules ran, has no activation or
        output-gradient records and no non-finite check of them: say so, with the likely
        cause."""
        if state.hooks_ran or not state.backward_ran or not state.updates:
            return
        self._once(
            "unhooked",
            f"hookscope: Monitor: at step {step}, {model} was trained "
            "(a backward pass and an optimizer step) but none of the Monitor's hooks on its "
            "modules ran: no activation or output-gradient statistics, and no NaN/Inf check "
            "of them. The likely cause: a graph that torch.compile built before the Monitor "
            "was attached runs the model without its hooks (a compiled function that calls "
            "the model, say). Fix: attach the Monitor before the first compiled call, or call "
            "torch._dynamo.reset() after attaching it (everything compiles again once). "
            "Or the model is run through `.forward(...)`, which skips every hook: call the "
            "model itself.",
            stacklevel=4,  # _once, this, Monitor.step, the script
        )

    def compiled_per_rank(self) -> None:
        """What compiled graphs measure is not combined across ranks yet."""
        self._once(
            "compiled_per_rank",
            "hookscope: Monitor: the model runs compiled under torch.distributed: the "
            "activation and output-gradient statistics measured inside the compiled graph are "
            "this rank's own (not combined across ranks, as eager ones are), and a NaN/Inf "
            "found there is localised on this rank only (on_nonfinite='raise'/'skip' decide "
            "per rank). Parameter statistics, the loss and the checks are combined as usual. "
            "For combined figures, watch an eager twin.",
            stacklevel=6,  # _once, this, Transfer.step, Monitor._measure, Monitor.step, the script
        )

    def _once(self, key: str, message: str, *, stacklevel: int) -> None:
        if key not in self.given:
            self.given.add(key)
            warnings.warn(message, HookscopeWarning, stacklevel=stacklevel)
