"""A Monitor's hooks and the parts that read what they gather, built and connected once.

Every hook goes into one :class:`HookSet`: the probes' on the model's modules
(``_wiring/_probeset.py``, ``_wiring/_modules.py``), the optimizers' global step hooks (``_wiring/_update.py``) and
the checks' (``_checks/``); a listener hears the script's calls into torch (``_wiring/_calls.py``,
``_step/_heard.py``). Between them sit the non-finite decision (``_nonfinite/_decide.py``) and the step's one
transfer (``_wiring/_transfer.py``). :class:`Wiring` builds them in the order they depend on each
other, and removes every hook again.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..._diagnose import Diagnosis
from ..._hooks import HookSet
from ..._select import Where
from .._checks import Checks, Context
from .._nonfinite._decide import NonFiniteDecision
from .._output import Output
from .._step._dist import Alone, Collective, Entry
from .._step._heard import Ears
from .._warnings import Warnings
from ._calls import listen
from ._modules import CHECKS
from ._probeset import ProbeSet
from ._transfer import Transfer
from ._update import UpdateHooks

__all__ = ["Wiring"]


class Wiring:
    """The Monitor's hooks on ``model`` (watching ``modules``), its optimizers and the
    script's calls, with the parts they feed.

    ``coll``: the collective when the ranks' figures are combined, over ``world`` ranks;
    ``light()``: whether a step starting now checks only the model's edges;
    ``keep_outputs``: the tape keeps the outermost calls' outputs (for a replay bundle);
    ``step()``: the number of the step under way. The hooks are removed when building fails
    half-way, as by :meth:`close`. (The constructor is long, and straight: each part once, in
    the order they depend on each other; the optimizer hooks go on before the checks'.)"""

    def __init__(
        self,
        model: nn.Module,
        modules: dict[str, nn.Module],
        probes: ProbeSet,
        diagnosis: Diagnosis,
        out: Output,
        *,
        coll: Alone | Collective,
        world: int,
        warnings: Warnings,
        on_nonfinite: str,
        light: Callable[[], bool],
        keep_outputs: bool,
        step: Callable[[], int],
        frozen: Where | None,
        replicated: Where | None,
    ) -> None:
        self.hooks, self._probes = HookSet("Monitor"), probes
        self._stop_listening: Callable[[], None] = lambda: None
        self.checks: Checks | None = None
        try:
            skip = on_nonfinite == "skip"
            self.module_hooks = probes.attach(
                self.hooks, model, keep_outputs=keep_outputs, skip=skip
            )
            self.tape = self.module_hooks.tape
            self.decision = NonFiniteDecision(
                model,
                self.tape,
                diagnosis,
                probes.params.params,
                coll,
                sharded=probes.sharded,
                root_watched="" in modules,
                flagged=self.module_hooks.flagging,
            )
            self.transfer = Transfer(
                model,
                self.tape,
                probes,
                coll=coll,
                layout=self._layout,
                bad_bits=self.decision.bad_bits,
                warnings=warnings,
            )
            self.updates = UpdateHooks(
                self.hooks,
                self.module_hooks,
                probes,
                self.decision,
                self.transfer,
                out,
                on_nonfinite=on_nonfinite,
                light=light,
                step=step,
            )
            # The checks' module hooks act in evaluation passes and autocast regions only
            # (each returns at once otherwise): the gate puts them on for those calls.
            with self.hooks.grouped(CHECKS, besides=model):
                self.checks = Checks(
                    Context(
                        model,
                        modules,
                        probes.params.params,
                        self.hooks,
                        out.write,
                        # a replay, or a graph being compiled (the checks' hooks are eager-only)
                        paused=lambda: self.tape.paused or torch.compiler.is_compiling(),
                        skipping=lambda: self.module_hooks.now.nonfinite is not None and skip,
                        sampler=probes.sampler,
                        rank=coll.rank,
                        world=world,
                    ),
                    frozen=frozen,
                    replicated=replicated,
                )
            # listen() keeps a weak reference: the wiring holds its listener
            self._listener = Ears(
                self.module_hooks, probes.params, self.checks, self.updates.read_gradients
            )
            self._stop_listening = listen(self._listener)
        except BaseException:
            self.close()
            raise

    def _layout(self, rank: int) -> list[Entry]:
        """What the probes and the checks put in a sampled step's collective."""
        return self._probes.layout(rank) + self.checks.layout(rank)

    def close(self) -> None:
        """Remove every hook and stop listening. Safe to call more than once."""
        self.hooks.remove()
        self._stop_listening()
        if self.checks is not None:
            self.checks.close()
