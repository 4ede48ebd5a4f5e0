"""The non-finite decision: where a step's first NaN/Inf arose, as precisely as can be told.

The trail's flags (``_step/_trail.py``) name the module whose output or gradient went bad
first. The first time a finding is seen, a replay of the step under the op tracer
(``_nonfinite/_trace.py``) adds the op, the phase and the source line. Only the model's edges are
flagged; where the tracer names no op (the data itself was NaN, say), the step is replayed
once more with every watched module flagged, and where that finds nothing
either, every module is flagged from then on. Weights that an earlier update made
non-finite are one finding, not a new one at every later step (``_nonfinite/_poisoned.py``). Under
``torch.distributed``, the rank where the value first went bad localises it and hands the
finding to the others, so that every rank decides alike.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
from torch import nn

from ..._diagnose import Diagnosis, Finding
from ..._errors import NonFiniteError
from ..._hooks import eager_calls
from ..._tree import tensors
from .._step._buffer import Host
from .._step._dist import Alone, Collective, RankInfo
from .._step._state import StepState
from ._loss import LossOrigin, loss_origin
from ._poisoned import PoisonedWeights
from ._trace import Tape, replay, trace

__all__ = ["NonFiniteDecision", "nonfinite_error"]

NOT_REPLAYED = (
    ". A replay of the step did not reproduce it, so no op is named: the weights or the "
    "model's state changed between the step's forward pass and the check before the update "
    "(e.g. weights perturbed in place and restored before optimizer.step(), as "
    "sharpness-aware minimisation does, or an attribute the forward pass reads, or a "
    "module with its own state changed in place, such as a list it appends to, or a "
    "nondeterministic kernel)"
)
CHECK_MODULES = (
    ". Every watched module's output is checked from the next step on, to name the "
    'module where it starts; Monitor(check="modules") (hookscope watch --check modules) '
    "checks every module on every step and names it without a replay"
)


def not_replayed(changed: list[tuple[str, list[str]]]) -> str:
    """Why a replay did not reproduce a NaN, and the fix. ``changed``: the modules whose own
    attributes the replay changed (a state it could not rewind: the likely origin)."""
    if not changed:
        return NOT_REPLAYED + CHECK_MODULES
    said = "; ".join(
        f"module {name!r} changed its own {', '.join(repr(k) for k in keys)}"
        for name, keys in changed
    )
    where = " or ".join(repr(name) for name, _ in changed)
    return (
        f". A replay of the step did not reproduce it, so no op is named: {said} when it "
        "ran, in a way the replay could not rewind to the step's start (a list or dict "
        "changed in place, or an attribute that first changed after the first two steps), "
        f"so the replay did not run as the step did; the NaN/Inf most likely starts in {where}"
        + CHECK_MODULES
    )


class NonFiniteDecision:
    """Turns a step's non-finite flags into its one ``nonfinite`` finding.

    ``flagged()`` is the Monitor's: a context manager in which its hooks write into a fresh
    :class:`StepState` that flags every watched module, which it yields. ``sharded``: some
    parameters are sharded (FSDP2), so that a replay on one rank cannot run the model.
    ``root_watched``: the model itself is a watched module (it has no children)."""

    def __init__(
        self,
        model: nn.Module,
        tape: Tape,
        diagnosis: Diagnosis,
        params: dict[str, nn.Parameter],
        coll: Alone | Collective,
        *,
        sharded: bool,
        root_watched: bool,
        flagged: Callable[[], AbstractContextManager[StepState]],
    ) -> None:
        self._model, self._tape, self._diagnosis, self._coll = model, tape, diagnosis, coll
        self._flagged = flagged
        self.poison = PoisonedWeights(params)
        # A replay runs the model's forward on one rank: never where that needs the others
        # (FSDP2 gathers its shards, SyncBatchNorm its statistics).
        self.can_trace = not sharded and not any(
            isinstance(m, nn.SyncBatchNorm) for m in model.modules()
        )
        # Every step: the flags at the model's edges (its inputs and outputs, the gradient
        # reaching them, the parameters' gradients) find a NaN/Inf, and a replay of the step
        # finds its module and op; a module call costs next to nothing (a sampled step's
        # measures its sample, not every element). Where no replay can
        # (several ranks, or a replay that found nothing), every module output is flagged.
        self.light = self.can_trace and not coll.synced and not root_watched

    @property
    def synced(self) -> bool:
        """Whether the ranks decide together (``torch.distributed``): a collective each time."""
        return self._coll.synced

    def localised(
        self, state: StepState, host: Host, step: int, findings: list[Finding]
    ) -> Finding | None:
        """This step's non-finite finding, traced to its op; or, where the first NaN/Inf is
        only weights that an earlier update made non-finite, the one finding saying so
        (nothing new at every later step). ``findings``: every finding so far."""
        finding = state.trail.localise(host, step)
        if finding is None:
            return None
        last = max((f.step for f in findings if f.kind == "nonfinite"), default=None)
        poisoned = self.poison.consequence(finding, step, last)
        return poisoned if poisoned is not None else self._traced(state, finding)

    def bad_bits(self, state: StepState) -> torch.Tensor:
        """This rank's bits for the collective: a NaN/Inf in its forward pass, its backward
        pass, its parameters' gradients."""
        flags = [
            (("flag", i), flag.phase) for i, flag in enumerate(state.trail.flags) if flag.checked
        ]
        return self._coll.bad_bits(state.buf, flags)

    def before_update(
        self,
        state: StepState,
        early: Callable[[StepState], Host],
        step: int,
        findings: list[Finding],
        *,
        agree: bool,
    ) -> Finding | None:
        """The step's non-finite finding before its update, from the flags: in one process,
        from ``early(state)``, the update's early transfer; under ``torch.distributed``, where
        every rank must take the same decision there (``agree``: ``on_nonfinite`` is
        ``"raise"`` or ``"skip"``), from a tiny collective, and otherwise none yet (found at
        ``step()``, from the step's one collective)."""
        if not self._coll.synced:
            found = self.localised(state, early(state), step, findings)
            if found is None:  # these flags are finite: ``at_step`` need not read them again
                state.finite_flags = len(state.trail.flags)
            return found
        return self.agreed_now(state, step, findings) if agree else None

    def agreed(
        self, state: StepState, host: Host, info: RankInfo, step: int, findings: list[Finding]
    ) -> Finding | None:
        """The non-finite finding every rank agrees on: the rank where the value first
        went bad localises (and traces) it and hands it to the others."""
        rank = info.origin()
        if rank is None:
            return None
        finding = None
        if self._coll.rank == rank:
            finding = self.localised(state, host, step, findings)
            if finding is not None:
                finding = dataclasses.replace(
                    finding,
                    rank=rank,
                    message=f"{finding.message} (on rank {rank} of {self._coll.world})",
                )
        return self._coll.broadcast(finding, rank)

    def agreed_now(self, state: StepState, step: int, findings: list[Finding]) -> Finding | None:
        """:meth:`agreed` before an update, from the flags alone: a tiny collective, so that
        every rank takes the same decision there."""
        info = self._coll.agree_bad(self.bad_bits(state), step)
        host = state.buf.to_host(only=lambda key: key[0] == "flag")
        return self.agreed(state, host, info, step, findings)

    def at_step(
        self,
        state: StepState,
        host: Host,
        info: RankInfo | None,
        step: int,
        findings: list[Finding],
        scale: float | None,
    ) -> tuple[list[Finding], Finding | None]:
        """At the end of the step: its non-finite findings unless they were made before its
        update (an overflow that GradScaler skipped the step for is the scaler's business: no
        finding), and the finding for the weights its update made non-finite, if it did.
        ``info``: what the step's collective told of every rank (``None``: one process)."""
        found: list[Finding] = []
        if state.nonfinite is None:
            if info is None:
                if state.finite_flags != len(state.trail.flags):  # flags since the update's
                    state.nonfinite = self.localised(state, host, step, findings)
            else:
                state.nonfinite = self.agreed(state, host, info, step, findings)
            if state.nonfinite is not None and state.heard.scalers_overflow(state.nonfinite, scale):
                state.heard.scaler_cause, state.nonfinite = state.nonfinite, None
            if state.nonfinite is not None:
                found = self.with_overflow(state.nonfinite)
        poisoned = None
        if state.nonfinite is not None and not state.skipped:  # the update went ahead
            poisoned = self.poison.after_update(state.nonfinite, step)
        return found, poisoned

    def loss_after_model(
        self, state: StepState, step: int, loss: float | None, findings: list[Finding]
    ) -> list[Finding]:
        """A NaN/Inf loss in a step whose model stayed finite (its outputs, the gradient
        reaching them and every parameter's gradient): made between the model and the
        loss (a ``training_step`` adding a NaN constant, a reduction over an empty batch),
        where no hook of the model sees it. Once per run (its key is the model's, ``""``),
        and not after an earlier non-finite finding (weights it made NaN). Its op from the
        loss's autograd graph (``_nonfinite/_loss.py``); no source line: that code runs
        outside the model's hooks and outside a replay."""
        if loss is None or math.isfinite(loss) or state.nonfinite is not None:
            return []
        if state.heard.scaler_skips or state.heard.scaler_cause is not None:
            return []  # a GradScaler overflow: the scaler's business
        if any(f.kind == "nonfinite" for f in findings):
            return []  # weights an earlier step made NaN: that finding says it

        found = self._loss_origin(state)
        op = None if found is None else found.op
        if op is not None:
            source = "from finite values" if not found.how else "whatever its values"
            made = (
                f": {op}{found.how} made {found.produced} there, {source} (no source line: "
                "autograd keeps none without anomaly mode; look for that op between the "
                "model's output and the loss)"
            )
        elif found is not None and found.candidates:
            made = (
                ": its op could not be re-run from what autograd keeps; the ops there that "
                f"can make a NaN/Inf: {', '.join(found.candidates)}"
            )
        else:
            made = (
                " (a NaN/Inf constant or term with no gradient, a mean over an empty "
                "selection, a log of zero)"
            )
        message = (
            f"the loss is {loss} at step {step} while the model's outputs and every gradient "
            "stayed finite: it was made after the model, in the code that computes the loss "
            f"from the model's outputs{made}. Training goes on with finite gradients, "
            "but the logged loss and anything that reads it (schedulers, early stopping) are "
            "wrong. Check that code with torch.isfinite on each term"
        )
        return [Finding("nonfinite", "", step, loss, message, phase="forward", op=op)]

    def _loss_origin(self, state: StepState) -> LossOrigin | None:
        """The op that made the loss non-finite, from the structure of the loss's graph and
        the model's outputs replayed (on this step only: a forward pass of the model)."""
        graph = state.heard.graph
        if not graph or not self._tape.calls or not self.can_trace:
            return None
        replayed: list[list[torch.Tensor]] = []

        def outputs(k: int) -> list[torch.Tensor] | None:
            if not replayed:
                replayed.extend(self._replayed_outputs())
            return replayed[k] if k < len(replayed) else None

        return loss_origin(graph, outputs)

    def _replayed_outputs(self) -> list[list[torch.Tensor]]:
        """The outputs of the step's calls into the model, replayed bit for bit."""
        self._tape.paused = True  # the tape keeps no call of the replay
        try:
            with eager_calls(), contextlib.closing(replay(self._model, self._tape.calls)) as runs:
                return [[t.detach() for t in tensors(output)] for output, _ in runs]
        finally:
            self._tape.paused = False

    def with_overflow(self, nonfinite: Finding) -> list[Finding]:
        """``nonfinite``, after the exploding gradient it is the consequence of, if any."""
        overflow = self._diagnosis.overflow(nonfinite)
        return [nonfinite] if overflow is None else [overflow, nonfinite]

    def _traced(self, state: StepState, finding: Finding) -> Finding:
        """``finding`` with the op, phase and source line from a replay of this step under
        an op-level tracer (first time only: the replay costs about one training step)."""
        if not self._tape.calls or not self._diagnosis.is_new(finding) or not self.can_trace:
            return finding
        self._tape.paused = True
        changed: list[tuple[str, list[str]]] = []  # modules whose own state the replay moved
        try:
            with eager_calls():  # a compiled model is replayed op by op
                origin = trace(
                    self._model, self._tape.calls, suspect=finding.module, changed=changed
                )
        finally:
            self._tape.paused = False
        # A replay whose forward pass stays finite where the step's did not has not seen
        # this step: it cannot name the origin (below).
        unseen = finding.phase == "forward" and origin is not None and origin.phase != "forward"
        if origin is not None and not unseen:
            # where only the edges were flagged, their message says no more than the op's
            return origin.refine(finding, cheap_check=not state.light)
        if origin is None and finding.phase == "backward" and self._nonfinite_from_loss():
            made = self._made_by_loss_code(state, finding)  # not in the model: after it
            if made is not finding:
                return made
        if state.light:  # only the model's edges were flagged
            flagged = self._flagged_replay(finding.step)
            if flagged is not None and flagged.phase == finding.phase:
                return flagged
            self.light = state.light = False  # no replay finds it: flag every module now on
            if unseen or flagged is not None:
                return dataclasses.replace(finding, message=finding.message + not_replayed(changed))
        return finding

    def _nonfinite_from_loss(self) -> bool:
        """The gradient that reached the model's outputs from the code after it was already
        non-finite (the tape's record of it)."""
        grads = [g for call in self._tape.calls for g in call.grads.values()]
        return any(not bool(torch.isfinite(g).all()) for g in grads if g.is_floating_point())

    def _made_by_loss_code(self, state: StepState, finding: Finding) -> Finding:
        """A NaN/Inf gradient that came into the model from the loss: the op of the loss
        code that made a NaN/Inf from the model's finite outputs, where one did (its
        gradient is then non-finite too: ``sqrt`` of a negative). A replay of the model
        cannot tell more: it starts from that gradient, and found nothing."""
        found = self._loss_origin(state)
        if found is None or (found.op is None and not found.candidates):
            return finding
        if found.op is None:
            message = (
                f"{finding.message}: it was made after the model, in the code that computes "
                "the loss from the model's outputs, whose op could not be re-run from what "
                f"autograd keeps; the ops there that can make a NaN/Inf: "
                f"{', '.join(found.candidates)}"
            )
            return dataclasses.replace(finding, message=message)
        message = (
            f"{finding.message}: it was made after the model, in the code that computes the "
            f"loss from the model's outputs, where {found.op}{found.how} made "
            f"{found.produced} from finite values, and its gradient with it (no source line: "
            "autograd keeps none without anomaly mode; look for that op between the model's "
            "output and the loss)"
        )
        return dataclasses.replace(finding, op=found.op, message=message)

    def _flagged_replay(self, step: int) -> Finding | None:
        """Where the op tracer names no op (the data itself was NaN, say): replay the step
        with every watched module flagged, as on a sampled step, and localise from those."""
        self._tape.paused = True  # the tape keeps no call of the replay
        try:
            with (
                self._flagged() as state,
                eager_calls(),
                contextlib.closing(replay(self._model, self._tape.calls)) as runs,
            ):
                for _, backward in runs:
                    backward()
                return state.trail.localise(state.buf.to_host(), step)
        finally:
            self._tape.paused = False


def nonfinite_error(finding: Finding) -> NonFiniteError:
    """The error ``on_nonfinite="raise"`` raises for ``finding``."""
    return NonFiniteError(
        finding.message,
        module=finding.module,
        step=finding.step,
        phase=finding.phase,
        op=finding.op,
        source=finding.source,
        rank=finding.rank,
    )
