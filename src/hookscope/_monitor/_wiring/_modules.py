"""The Monitor's hooks on the model's modules: what a step's module calls write.

:class:`ModuleHooks` puts a forward hook on every watched module (the probes, the non-finite
trail and a hook on each output's gradient), one on every other module (which outputs a
container returned: ``StepState.dead_ends``) and the tape on the outermost calls
(``_nonfinite/_trace.py``: the model's edges, flagged on every step where a replay can localise). The
hooks write into the current :class:`StepState` (``now``), which the Monitor replaces as each
step ends and the non-finite decision swaps for a replay's (``flagging``).

They run at every module call: each does its work inline, with no call into another layer.
Inside a compiled graph the forward hook takes the branch of ``_probes/_compiled.py``, which reads
only Python bools and the module's index tensor (nothing a graph would guard on per module).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from ..._hooks import HookSet, alias_grad_outputs, in_backward_recompute
from ..._tap import Tap
from ..._tree import tensors
from .._nonfinite._trace import Tape
from .._options import device_of
from .._probes._compiled import CompiledProbes
from .._probes._outputs import Activations, OutputGrads
from .._probes._precision import PrecisionProbe
from .._step._state import StepState
from .._step._trail import PASS_THROUGH

__all__ = ["CHECKS", "ModuleHooks"]

# The HookSet's groups of module hooks (``HookSet.grouped``) that the gate switches
MODULES = "modules"  # the probes' hooks on every module
TAPE = "tape"  # the tape's on the root's children
CHECKS = "checks"  # the checks' (``_checks/``): evaluation passes and autocast only


class ModuleHooks:
    """Every hook the Monitor puts on the model's modules, in ``hooks`` (its HookSet).

    ``keep_outputs``: the tape keeps the outermost calls' outputs (for a replay bundle).
    ``on_first_call``: called before a step's first outermost call."""

    def __init__(
        self,
        hooks: HookSet,
        model: nn.Module,
        modules: dict[str, nn.Module],
        *,
        acts: Activations,
        grads: OutputGrads,
        precision: PrecisionProbe | None,
        compiled: CompiledProbes,
        keep_outputs: bool,
        on_first_call: Callable[[], None] | None,
    ) -> None:
        self._hooks, self._acts, self._grads = hooks, acts, grads
        self._precision, self._compiled = precision, compiled
        self._model = model
        self._pass_through = {n for n, m in modules.items() if isinstance(m, PASS_THROUGH)}
        self._devices = tuple(dict.fromkeys(("cpu", device_of(model).type)))
        # The gate (``_gate``): the modules' hooks go off once the eager hooks were seen
        # running, and never where a compiled graph holds them (it guards on what they read).
        self._eager_seen = self._compiled_seen = False
        self._outer_calls = 0  # outermost calls this step
        self._transient = False  # the modules' hooks are on for one outermost call
        # What the hooks write this step; the Monitor sets the first step's before any call.
        self._now = StepState(sampled=False, light=False)
        self._grad_calls = 0  # output gradients seen by the hooks here
        self.tape = Tape(
            hooks,
            model,
            keep_outputs=keep_outputs,
            on_first_call=on_first_call,
            on_top_call=self._on_root,
            on_outer=self._on_outer,
        )
        with hooks.grouped(MODULES, besides=model):
            for name, module in modules.items():
                index = compiled.index[name]
                hooks.forward(module, functools.partial(self._on_forward, name, index))
            for name, module in model.named_modules():
                if name not in modules:
                    hooks.forward(module, self._on_container)

    @property
    def grad_calls(self) -> int:
        """Output gradients seen, ever (the tape's at the outermost calls too): did a
        backward pass reach the model?"""
        return self._grad_calls + self.tape.grads_heard

    # -- the gate: which hooks are on the modules this step ----------------------------------
    @property
    def now(self) -> StepState:
        """What the hooks write this step (``_step/_state.py``)."""
        return self._now

    @now.setter
    def now(self, state: StepState) -> None:
        old, self._now = self._now, state
        if old.updates and not self._outer_calls and not self.tape.children_called:
            # the model was trained with no outermost call seen: the loop calls its parts
            # (the children's hooks were off): they stay on from now
            self.tape.children_called = True
        if (old.sampled or not old.light) and old.updates and not old.hooks_ran:
            self._compiled_seen = True  # a compiled graph without the hooks: keep them on
        self._outer_calls = 0
        self._gate()

    def _gate(self) -> None:
        """Put the modules' hooks on for a step that needs them, and take them off for one
        that does not: an unsampled step where the model's edges are flagged and a replay
        localises (``StepState.light``) runs no hook on any module but the outermost calls'
        (torch then calls each module without any hook dispatch), once the eager hooks were
        seen and no compiled graph holds them. The checks' hooks (``CHECKS``) act only in
        evaluation passes and autocast regions: on for those outermost calls
        (:meth:`_on_outer`). The root's own hooks are never switched: the root's hooks
        switch the others (torch runs a module's hooks from its hook dicts)."""
        s, hooks = self._now, self._hooks
        # (the loop calls the model's parts: a part's own hooks would switch its hooks)
        keep = not self._eager_seen or self._compiled_seen or self.tape.children_called
        on = keep or s.reading or not s.light or s.flagging
        hooks.switch(MODULES, on)
        hooks.switch(TAPE, on or self.tape.children_called)
        hooks.switch(CHECKS, keep)
        self._transient = False

    def _on_outer(self, entering: bool, kept: bool) -> None:
        """An outermost call into the model starts (``entering``) or ends: the checks' hooks
        are on for an evaluation pass or inside autocast, and the modules' for a call the
        tape does not keep (no replay can localise in it)."""
        if entering:
            self._outer_calls += 1
        if self._compiled_seen or not self._eager_seen or self.tape.children_called:
            return
        hooks = self._hooks
        if not hooks.is_on(MODULES):  # the modules' hooks are off: this call stands for them
            self._now.hooks_ran = True
        if entering:
            autocast = any(torch.is_autocast_enabled(d) for d in self._devices)
            hooks.switch(CHECKS, autocast or not self._model.training)
            if not kept and not hooks.is_on(MODULES):
                self._transient = True
                hooks.switch(MODULES, True)
        else:
            hooks.switch(CHECKS, False)
            if self._transient:
                self._gate()

    def closure_again(self, *, light: bool) -> None:
        """The step's statistics are complete: its later calls (a closure that ``LBFGS``
        evaluates again in the same ``step()``) are checked as an unsampled step's are, and
        only at the model's edges where ``light`` (a replay localises): the modules' hooks
        off, a step of 20 evaluations of one batch costs one read, not 20."""
        s = self._now
        if s.reading or (light and not s.light):
            s.reading = False
            s.light = s.light or light
            self._gate()

    def measures(self, module: nn.Module) -> bool:
        """Whether a call of ``module`` now adds to the step's statistics: a sampled step in
        training mode, not a replay nor an activation-checkpoint recompute (nor a compiled
        graph: the attention probe is eager-only)."""
        if torch.compiler.is_compiling():
            return False
        paused = self.tape.paused or in_backward_recompute()
        return self.now.reading and module.training and not paused

    @contextlib.contextmanager
    def flagging(self) -> Iterator[StepState]:
        """While the step is replayed with every watched module flagged (``_nonfinite/_decide.py``),
        the hooks write into a state of the replay's own, which this yields."""
        kept = self._now
        self._now = StepState(sampled=False, light=False, flagging=True)
        self._gate()
        try:
            yield self._now
        finally:
            self._now = kept
            self._gate()

    # -- the hooks ---------------------------------------------------------------------------
    def _on_forward(
        self,
        name: str,
        index: torch.Tensor,
        module: nn.Module,
        args: Any,
        kwargs: Any,
        output: Any,
    ) -> Any:
        if torch.compiler.is_compiling():  # traced into a graph: ``_probes/_compiled.py``
            return self._on_forward_compiled(index, module, args, output)
        s = self._now
        if self.tape.paused and not s.flagging:  # a replay under the op tracer
            return
        s.hooks_ran = self._eager_seen = True
        sampled = s.reading
        if not sampled and s.light and self.tape.recording:
            return  # the edges' flags and a replay stand for this call's
        if type(module) is Tap:  # a site of its own: what it passes on is not its input
            output = alias_grad_outputs(output, args, kwargs)[0]
            self._on_output(name, module, args, s, output)
            return output
        self._on_output(name, module, args, s, output)
        return None

    def _on_output(
        self, name: str, module: nn.Module, args: Any, s: StepState, output: Any
    ) -> None:
        sampled = s.reading
        outs = [t for t in tensors(output) if t.is_floating_point()]
        if in_backward_recompute():
            # Activation checkpointing re-runs forward during backward: never count it again.
            # A reentrant checkpoint ran the first pass without autograd; the gradients flow
            # through this re-run, so hook them here.
            if name in s.no_grad_names:
                self._hook_grads(name, outs)
            return
        if not outs:
            return
        passes = not sampled and name in self._pass_through
        # A sampled step where the edges are checked: the trail still learns who fed whom
        # (the graph, aliases), without a reduction of every output (``check``).
        outs = s.trail.forward(
            s.buf, name, tensors(args), outs, pass_through=passes, check=not s.light
        )
        if not outs:  # it returned its input: an alias of the module that made it
            return
        if torch.is_grad_enabled():
            if sampled:
                s.made[name] = {t.data_ptr() for t in outs if t.requires_grad}
            if not passes:
                self._hook_grads(name, outs)
        else:
            s.no_grad_names.add(name)
            if self.tape.grad_enabled:  # no_grad inside the model's own forward
                s.trail.detached.add(name)
        if sampled and module.training:
            self._acts.forward(s.buf, name, outs)
            if self._precision is not None:
                self._precision.forward(s.buf, name, outs)

    def _on_forward_compiled(
        self, index: torch.Tensor, module: nn.Module, args: Any, output: Any
    ) -> Any:
        """The forward hook inside a compiled graph: it reads one Python bool, ``sampled``
        (one graph for sampled steps, one for all the others), and the module's index
        tensor. Nothing else a graph would guard on: whether the edges are checked
        (``light``, which turns on once an optimizer is adopted, after the first step) or
        the tape records would change between steps and recompile the graph. An unsampled
        step's graph adds nothing: the edges' flags (:meth:`_on_root`, also on a step that
        is not light), the parameters' and a replay stand for its modules' flags."""
        s = self.now
        s.hooks_ran = self._compiled_seen = True
        if not s.sampled:
            return None
        return self._compiled.forward(index, module, args, output, sampled=True)

    def _on_root(self, name: str, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        """Where the edges are checked (``StepState.light``): flag the inputs and outputs of
        each outermost call into the model (the model, or a child the training loop calls
        directly: ``name``), and hook the gradient that reaches its outputs (every NaN/Inf
        that matters passes one of them, or a parameter's gradient). Called by the tape as
        each such call returns."""
        if self._compiled.ran and not self.tape.paused and torch.is_grad_enabled():
            self._hear_backward(output)
        s = self._now
        light = s.light or self._compiled_seen  # compiled graphs flag no module unsampled
        if not light or self.tape.paused or in_backward_recompute():
            return
        outs = [t for t in tensors(output) if t.is_floating_point()]
        # Positional inputs only, as for every module: keyword ones are often masks that
        # hold -inf on purpose.
        outs = s.trail.forward(s.buf, name, tensors(args), outs, nan_inputs=True)
        if outs and torch.is_grad_enabled():
            kept = self.tape.aliased
            if kept is not None and s.light and not self._compiled_seen:
                # the gradients reaching the aliases the tape handed the caller: flagged
                # from the tape's record, with the parameters' (no hook of their own)
                s.trail.backward_later(s.buf, name, kept)
                return
            for t in outs:
                if t.requires_grad:
                    self._hooks.tensor(t, functools.partial(self._on_edge_grad, name))

    def _hear_backward(self, output: Any) -> None:
        """A compiled graph ran the model: its backward calls no Python, so a hook on what
        the call returned tells that a backward pass reached the model (its loss is the
        step's)."""
        for t in tensors(output):
            if t.requires_grad and t.is_floating_point():
                self._hooks.tensor(t, self._count_grad)

    def _count_grad(self, grad: torch.Tensor) -> None:
        self._grad_calls += 1

    def _on_edge_grad(self, name: str, grad: torch.Tensor) -> None:
        self._grad_calls += 1
        s = self.now
        s.trail.backward(s.buf, name, grad, edge=True)

    def _on_container(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        """What a container returns: a watched module's output that no container returns,
        feeds nothing that one does, and gets no gradient, was detached or thrown away."""
        s = self.now
        s.hooks_ran = True
        if torch.compiler.is_compiling():  # eager-only (``_probes/_compiled.py``)
            return
        if s.reading and torch.is_grad_enabled() and not self.tape.paused:
            s.returned.update(t.data_ptr() for t in tensors(output) if t.requires_grad)

    def _hook_grads(self, name: str, outs: list[torch.Tensor]) -> None:
        on_grad = functools.partial(self._on_grad, name, self._now.reading)
        for t in outs:
            if t.requires_grad:
                self._hooks.tensor(t, on_grad)

    def _on_grad(self, name: str, read: bool, grad: torch.Tensor) -> None:
        """``read``: the output came from a call the step's statistics read."""
        self._grad_calls += 1
        s = self.now
        s.got_grad.add(name)
        if not s.light:  # else the edges' flags and the parameters' stand for it
            s.trail.backward(s.buf, name, grad)
        if read and s.sampled:
            self._grads.backward(s.buf, name, grad)
            if self._precision is not None:
                self._precision.backward(s.buf, name, grad)
