"""The step's one transfer to the host: settle, drain, move (or exchange), unpack.

Before the buffer moves, the activation probe settles what it kept during the step (only the
top channels move) and what compiled graphs measured (``_probes/_compiled.py``) is drained into the
buffer. Then the buffer moves to the host in one transfer, or, under ``torch.distributed``,
in the step's one collective with every rank (``_step/_dist.py``), and the compiled graphs' figures
are spread into the entries and flags the eager hooks would have written, so that every
probe reads its record as usual. An update's early transfer (the non-finite check before
``optimizer.step()``) goes the same way, with the scalars heard by then.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .._nonfinite._trace import Tape
from .._step._buffer import Host
from .._step._dist import Alone, Collective, Entry, RankInfo, digest
from .._step._state import StepState
from .._warnings import Warnings
from ._probeset import ProbeSet

__all__ = ["Transfer"]


class Transfer:
    """Moves a step's buffer to the host.

    ``layout(rank)``: what the probes and checks put in a sampled step's collective;
    ``bad_bits(state)``: this rank's non-finite bits for it (``_nonfinite/_decide.py``)."""

    def __init__(
        self,
        model: nn.Module,
        tape: Tape,
        probes: ProbeSet,
        *,
        coll: Alone | Collective,
        layout: Callable[[int], list[Entry]],
        bad_bits: Callable[[StepState], torch.Tensor],
        warnings: Warnings,
    ) -> None:
        self._model, self._tape, self._compiled = model, tape, probes.compiled
        self._acts, self._grads = probes.acts, probes.grads
        self._coll, self._layout, self._bad_bits = coll, layout, bad_bits
        self._warnings = warnings

    def to_host(self, state: StepState) -> Host:
        """The step's buffer on the host, with what compiled graphs measured in it."""
        self._settle(state)
        host = state.buf.to_host()
        self._compiled.unpack(host, state.trail.flags, self._grads.order)
        return host

    def before_update(self, state: StepState) -> Host:
        """An update's early transfer in one process (the non-finite check before
        ``optimizer.step()``): the scalars heard so far (the loss, the clip's norm) go with
        it, so that an unsampled step's ``step()`` has nothing left to move."""
        state.carry_scalars()
        return self.to_host(state)

    def step(
        self, state: StepState, tensor_scalars: list[str], step: int
    ) -> tuple[Host, RankInfo | None]:
        """The step's buffer on the host; under ``torch.distributed``, from the step's one
        collective, with what it told of every rank."""
        if not self._coll.synced:
            return self.to_host(state), None
        compiled = self._settle(state)  # not in the layout: the rank's own
        host, info = self._coll.exchange(
            state.buf,
            self._coll.layout(state.sampled, tensor_scalars, self._layout),
            self._bad_bits(state),
            step,
            digest(",".join(tensor_scalars)),
        )
        if compiled:
            self._compiled.unpack(host, state.trail.flags, self._grads.order)
            self._warnings.compiled_per_rank()
        return host, info

    def _settle(self, state: StepState) -> bool:
        """Ready the buffer for a transfer (an update's early one too): only the top channels
        move, and what compiled graphs measured joins it. True when a compiled graph ran."""
        compiled = self._compiled.ran
        if compiled:
            self._tape.tape_wrappers(self._model)
        if state.sampled:
            self._acts.collect(state.buf)
        self._compiled.drain(state.buf)
        return compiled
