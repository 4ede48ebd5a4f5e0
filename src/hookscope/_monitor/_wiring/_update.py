"""What a Monitor does around each optimizer update: read the final gradients, check them.

The optimizers are found by torch's global step hooks (``_wiring/_optim.py``). Around each update of
one that steps the model, :class:`UpdateHooks` reads the parameters' final gradients (their norms
on sampled steps; on every step their non-finite flags, whose L2 norms also feed the rolling
window of ``_probes/_signals.py``), takes the non-finite decision before the optimizer changes
anything (``_nonfinite/_decide.py``), so that ``on_nonfinite="raise"`` raises and ``"skip"`` skips the
update with the weights and optimizer state untouched, and has the parameter probe measure the
update itself (``_probes/_params.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..._hooks import HookSet
from .._nonfinite._decide import NonFiniteDecision, nonfinite_error
from .._output import Output
from ._modules import ModuleHooks
from ._optim import OptimizerWatch
from ._probeset import ProbeSet
from ._transfer import Transfer

__all__ = ["UpdateHooks"]


class UpdateHooks:
    """The optimizers that step the model (``optim``) and what happens around their updates.

    ``hooks``: where the optimizer hooks go; ``module_hooks``: what writes the step's state;
    ``light()``: whether a step starting now checks only the model's edges (``Monitor``);
    ``step()``: the number of the step under way."""

    def __init__(
        self,
        hooks: HookSet,
        module_hooks: ModuleHooks,
        probes: ProbeSet,
        decision: NonFiniteDecision,
        transfer: Transfer,
        out: Output,
        *,
        on_nonfinite: str,
        light: Callable[[], bool],
        step: Callable[[], int],
    ) -> None:
        self._hooks, self._probes, self._decision = module_hooks, probes, decision
        self._transfer, self._out = transfer, out
        self._on_nonfinite, self._light, self._step = on_nonfinite, light, step
        self._plists: dict[int, tuple[list[str], list[torch.nn.Parameter]]] = {}
        self.optim = OptimizerWatch(
            hooks,
            probes.params.owned,
            grads=self.grads,
            check=self.check,
            before=self.before,
            after=self.after,
            ready=lambda: self._hooks.now.reached,
            again=self.again,
            evaluated=self.evaluated,
        )

    def read_gradients(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """The step's gradients are final now: read those of ``optimizer``'s parameters, or
        of every adopted optimizer's, or, before any has stepped the model, of all its
        parameters (and not again before the update)."""
        optim = self.optim
        if optimizer is not None:
            optim.read_now(optimizer)
        elif optim.optimizers:
            for opt in optim.optimizers:
                optim.read_now(opt)
        else:
            self.grads(None, list(self._probes.params.params))
            optim.read_now(None)

    def grads(self, optimizer: torch.optim.Optimizer | None, names: list[str]) -> None:
        """The final gradients of the parameters ``names``: their norms on a sampled step,
        and on every step their non-finite flags and the rolling window's figures."""
        s, probes = self._hooks.now, self._probes
        params = probes.params.params
        first, read, values = s.trail.parameters(s.buf, params, names, self._plist(names))
        if s.sampled:  # the flags' L2 norms are the gradient norms: no second pass
            known = (read, values[: len(read)])  # (the model's edges' may follow)
            probes.params.read_grads(s.buf, names, stepped=optimizer is not None, known=known)
        probes.spikes.flags(first, read)  # their L2 norms feed the rolling window too
        probes.spikes.weights(s.buf)

    def again(self) -> None:
        """A closure optimizer evaluates its closure again in this ``step()`` (``LBFGS``: up
        to ``max_iter`` times, one batch): the step's statistics and its check before the
        update were the first evaluation's; the later ones are checked as a light unsampled
        step's calls are (the model's edges and a replay: the optimizer is adopted now, also
        at the first step), with no hook on any module but the model's own."""
        self._hooks.closure_again(light=self._light())

    def _plist(self, names: list[str]) -> list[torch.nn.Parameter]:
        """The parameters ``names``, kept per list (an optimizer's names are one list while
        its groups stay: ``OptimizerWatch``)."""
        found = self._plists.get(id(names))
        if found is not None and found[0] is names:
            return found[1]
        if len(self._plists) > 16:
            self._plists.clear()
        params = self._probes.params.params
        plist = [params[n] for n in names]
        self._plists[id(names)] = (names, plist)
        return plist

    def check(self, optimizer: torch.optim.Optimizer, names: list[str]) -> bool:
        """The non-finite check, before the optimizer changes anything. True: skip it."""
        s, step = self._hooks.now, self._step()
        if s.nonfinite is None:
            self._decide(step)
        if s.nonfinite is None or self._on_nonfinite != "skip":
            return False
        self._probes.bns.restore_running()
        self._out.event(
            step,
            "skipped_step",
            f"step {step}: skipped the update of {type(optimizer).__name__} "
            f"(weights and optimizer state unchanged): {s.nonfinite.message}",
        )
        s.skipped += 1
        return True

    def evaluated(self, optimizer: torch.optim.Optimizer, names: list[str]) -> None:
        """A closure optimizer's later evaluation returned (``LBFGS``): a NaN/Inf it made is
        localised now, while the weights are the ones it ran with (the optimizer moves them
        before its next evaluation, and a replay at the step's end would run the step's first
        call with the update's), and reported; not skipped (the optimizer is inside its
        ``step()``). In one process: a collective per evaluation would make every rank wait
        for the others' closures."""
        if self._hooks.now.nonfinite is None and not self._decision.synced:
            self._decide(self._step())

    def _decide(self, step: int) -> None:
        """The step's non-finite finding so far, from its flags, reported (``"raise"``:
        raised)."""
        s, decision = self._hooks.now, self._decision
        agree = self._on_nonfinite != "log"  # every rank must decide alike before it
        early = self._transfer.before_update
        s.nonfinite = decision.before_update(s, early, step, self._out.findings, agree=agree)
        if s.nonfinite is not None:
            found = decision.with_overflow(s.nonfinite)
            s.early = self._out.report(found, step, before_update=True)
            if self._on_nonfinite == "raise":
                raise nonfinite_error(s.nonfinite)

    def before(self, optimizer: torch.optim.Optimizer, names: list[str]) -> None:
        self._hooks.now.updates += 1
        if self._hooks.now.sampled:
            self._probes.params.before_update(names)

    def after(self, optimizer: torch.optim.Optimizer, names: list[str]) -> None:
        if self._hooks.now.sampled:
            self._probes.params.after_update(self._hooks.now.buf, names)
