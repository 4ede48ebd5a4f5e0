"""The child side of ``hookscope watch``: find the models a script trains and monitor them.

The start-up hook (``_boot/sitecustomize.py``) calls :meth:`Agent.created` at the end of every
``Optimizer.__init__`` and :meth:`Agent.before_step` from a global optimizer step pre-hook.
When an optimizer is created, the agent looks for the top-level modules owning its parameters
(one scan of the garbage collector's objects, by ``type(o)``: ``isinstance`` on torch's
deprecated proxies warns) and attaches one :class:`Monitor` per model right then, before the
first forward: step 0 is watched like any other (a NaN in it is found, with its op, before its
update). An optimizer created before the start-up hook could see it is found at its first
step instead, and the Monitor attached from a pre-hook on that optimizer, which torch runs
later in the same ``step()`` (a global hook registered while torch iterates the global hooks
would break that iteration); that step's forward and backward then came before the Monitor.

Log layout: the first model watched (the one whose optimizer was made first) logs to ``out``,
every further one to ``out/<ModelClass>`` (``-2``, ``-3`` for a class seen twice), each a
Monitor ``log_dir``.

Step boundary: after the optimizer step, from a global post-hook registered after the
Monitor's own (so the update has been measured). A model stepped by several optimizers gets
one step per round, once every optimizer that steps it has stepped (the round is the
optimizers alive at the model's first step that own its parameters); one that steps again
before the round is complete ends the round early and the round shrinks to what really steps.
A ``GradScaler.step(optimizer)`` that skipped the optimizer's step (Inf/NaN gradients) counts
as that optimizer's step: the training step is over, without an update.

Models trained without ``torch.optim`` (plain SGD by hand, ``p.data.add_(p.grad, alpha=-lr)``,
as PyTorch's word-language-model example does): the start-up hook also calls
:meth:`Agent.first_backward` after the first ``backward()`` of the process. The top-level
models whose parameters then hold gradients and that no optimizer owns get a Monitor. For
them each forward + backward is a step: a step ends at the model's next forward that follows a
backward (and at exit). Their step 0 is the step whose backward found them, seen from its
end (its gradients, the loss that backward started from; not its forward). The script's own
update comes right after the backward (and its clipping), unseen: the non-finite check runs at
the end of each backward instead, while the weights are still those that made the NaN, so
that a replay can name its op; ``--on-nonfinite skip`` cannot skip such an update (a NaN is
logged, not skipped).

Signals: SIGTERM ends the process by SIGTERM (the exit status launchers expect), after the
logs are closed by a thread of their own, waited for at most ``_CLOSE_WITHIN`` seconds: the
handler itself takes no lock, so a signal that lands inside a sink (TensorBoard's writer
holding its lock) cannot hang the process. SIGINT stays Python's ``KeyboardInterrupt``; the
logs are closed at exit. The JSON-lines log is flushed record by record, so what a signal
cuts short is at most the record being written.

The loss and the gradients before clipping are the Monitor's own business (it hears every
``backward()`` and ``clip_grad_norm_``): the agent only ends steps. It hears the same calls
(``_monitor/_calls.py``) for the skipped scaler steps and the backward passes of the models
trained by hand.
"""

from __future__ import annotations

import atexit
import functools
import os
import signal
import sys
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .._errors import NonFiniteError
from .._hooks import HookSet
from .._monitor import Monitor
from .._monitor._lifetime import open_monitor
from .._monitor._wiring._calls import listen, loss_of
from .._monitor._wiring._optim import unwrap
from ._closer import Closer, die
from ._find import owns, scan, trained_by_hand
from ._settings import Settings

__all__ = ["Agent"]

_CLOSE_WITHIN = 5.0  # seconds a process ended by a signal waits for its logs to close


@dataclass(eq=False)
class _Watched:
    """One model and its Monitor, with the optimizers that step it (its round: empty until
    the model's first step when the Monitor was attached as its optimizer was created)."""

    model: nn.Module
    monitor: Monitor
    log_dir: Path
    params: set[int] = field(default_factory=set)  # id() of the model's parameters
    optimizers: weakref.WeakSet = field(default_factory=weakref.WeakSet)
    checked: weakref.WeakSet = field(default_factory=weakref.WeakSet)  # optimizers looked at
    stepped: weakref.WeakSet = field(default_factory=weakref.WeakSet)  # since its last step()
    skip_post: bool = False
    broken: bool = False
    # Trained by hand (no optimizer steps it): steps end at its forwards, after a backward.
    manual: bool = False
    backward: bool = False  # a backward ran since its last step ended
    first_loss: torch.Tensor | None = None  # the loss of the backward that found it (step 0)


@dataclass(eq=False)
class _Pending:
    """Models found at an optimizer's first step, to attach later in that same step."""

    models: list[nn.Module]
    optimizers: list[torch.optim.Optimizer]
    hooks: HookSet
    done: bool = False


class Agent:
    """Everything ``hookscope watch`` does inside one process of the watched command."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.watched: list[_Watched] = []
        self._seen: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()  # looked at
        self._optimizers: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()  # known
        self._hooks = HookSet("hookscope watch")
        self._pid = os.getpid()
        self._exit_handlers = False
        self._previous_sigterm: Any = None
        self._sigterm: Any = None  # the handler this agent installed
        self._closer: Closer | None = None
        self._signalled = False
        self._off = False
        self._stop_listening: Callable[[], None] | None = None
        self._busy = False  # in a Monitor's check or step(): its replays are no training

    @classmethod
    def from_env(cls, text: str) -> Agent:
        return cls(Settings.from_env(text))

    # -- every optimizer, as it is created ---------------------------------------------------
    def created(self, opt: torch.optim.Optimizer) -> None:
        """From the start-up hook, at the end of every ``Optimizer.__init__``: watch the models
        owning its parameters from now on, before their first forward."""
        if self._off or os.getpid() != self._pid:
            return
        self._optimizers.add(opt)
        if opt in self._seen:  # an optimizer whose __init__ runs Optimizer.__init__ twice
            return
        self._seen.add(opt)
        try:
            models, _ = scan(opt)
            for model in models:
                if all(w.model is not model for w in self.watched):
                    self._watch(model)
        except Exception as exc:  # never break the user's training
            self._fail(f"cannot find the model of {type(opt).__name__}", exc)

    # -- every optimizer step -------------------------------------------------------------
    def before_step(self, opt: torch.optim.Optimizer) -> None:
        """From the start-up hook's global pre-hook, before every ``optimizer.step()``."""
        if self._off or os.getpid() != self._pid:  # a fork of the training process
            return
        self._steps_again(opt)
        self._join_rounds(opt)
        if opt in self._seen:
            return
        self._seen.add(opt)
        self._optimizers.add(opt)
        try:
            self._discover(opt)
        except Exception as exc:  # never break the user's training
            self._fail(f"cannot find the model stepped by {type(opt).__name__}", exc)

    def scaler_skipped(self, optimizer: Any) -> None:
        """From ``_calls.py``: ``GradScaler.step(optimizer)`` skipped the optimizer's step
        (Inf/NaN gradients), so no step hook ran; for the round it stepped all the same."""
        if self._off or os.getpid() != self._pid:
            return
        try:
            opt = unwrap(optimizer)
            self._steps_again(opt)
            self._join_rounds(opt)
            for w in self.watched:
                if not w.broken and opt in w.optimizers:
                    self._stepped(w, opt)
        except NonFiniteError:
            raise
        except Exception as exc:  # never break the user's training
            self._fail("cannot end the step GradScaler skipped", exc)

    def _steps_again(self, opt: torch.optim.Optimizer) -> None:
        """``opt`` steps a model again before its round was complete: the round ends early
        and shrinks to the optimizers that really step."""
        for w in self.watched:
            if opt in w.stepped:
                w.optimizers = weakref.WeakSet(w.stepped)
                self._end_step(w)

    def _join_rounds(self, opt: torch.optim.Optimizer) -> None:
        """At a model's first step, its round: every known optimizer owning its parameters;
        later, an optimizer that starts stepping it joins the round (and a model trained by
        hand so far is trained by it now)."""
        for w in self.watched:
            if opt in w.checked:
                continue
            w.checked.add(opt)
            if not owns(opt, w.params):
                continue
            w.manual = False
            if len(w.optimizers):
                w.optimizers.add(opt)
            else:
                w.optimizers = weakref.WeakSet(o for o in self._optimizers if owns(o, w.params))
                w.optimizers.add(opt)

    def _discover(self, opt: torch.optim.Optimizer) -> None:
        """An optimizer created before the start-up hook could see it, at its first step."""
        models, optimizers = scan(opt)
        new = []
        for model in models:
            if all(w.model is not model for w in self.watched):
                new.append(model)
        if new:  # attach from a hook on this optimizer: torch runs it later in this step()
            pending = _Pending(new, optimizers, HookSet("hookscope watch: attach"))
            pending.hooks.optimizer_step_pre(opt, functools.partial(self._attach, pending))

    def _attach(
        self, pending: _Pending, opt: torch.optim.Optimizer, args: Any, kwargs: Any
    ) -> None:
        if pending.done:  # once, even if this step raised before the hook was removed
            return
        pending.done = True
        for model in pending.models:
            try:
                self._watch_late(model, pending, opt)
            except Exception as exc:  # never break the user's training
                self._fail(f"cannot watch {type(model).__name__}", exc)

    def _watch(self, model: nn.Module, once: HookSet | None = None) -> _Watched | None:
        """Attach a Monitor to ``model``; ``once``: hooks to remove after this step."""
        if open_monitor(model) is not None:  # the script's own hs.Monitor: left alone
            sys.stderr.write(
                f"hookscope watch: not watching {type(model).__name__}: the script watches it "
                "with its own hs.Monitor\n"
            )
            return None
        self._install_exit_handlers()
        log_dir = self._log_dir(model)
        try:
            monitor = Monitor(
                model,
                where=self.settings.where,
                every=self.settings.every,
                on_nonfinite=self.settings.on_nonfinite,
                check=self.settings.check,
                log_dir=log_dir,
            )
        except Exception as exc:  # a --where that matches nothing here, a compiled model
            sys.stderr.write(
                f"hookscope watch: not watching {type(model).__name__}: {_whole(exc)}\n"
            )
            return None
        w = _Watched(model, monitor, log_dir, {id(p) for p in model.parameters()})
        self.watched.append(w)
        self._hooks.optimizer_step_post_global(functools.partial(self._after_step, w, once))
        if self._stop_listening is None:  # after the first Monitor's: it finds the loss first
            self._stop_listening = listen(self)
        return w

    def _watch_late(self, model: nn.Module, pending: _Pending, opt: torch.optim.Optimizer) -> None:
        """Attach a Monitor during ``opt``'s first step (an optimizer we did not see created)."""
        w = self._watch(model, pending.hooks)
        if w is None:
            return
        monitor = w.monitor
        for o in [opt, *pending.optimizers]:  # the round: every optimizer that steps this model
            w.checked.add(o)
            if owns(o, w.params):
                w.optimizers.add(o)
        # The Monitor came too late for this step's forward and backward. With one optimizer,
        # step 0 is logged now: gradient and weight norms before this update (whose end is
        # then not a step boundary). With several, step 0 ends with the round, as any does.
        if len(w.optimizers) == 1:
            w.skip_post = True
            monitor.attach_optimizer(opt)  # for the learning rate
            monitor.step()
        else:
            monitor.read_gradients(opt)
            w.stepped.add(opt)

    def _log_dir(self, model: nn.Module) -> Path:
        """``out`` for the first model, ``out/<ModelClass>`` (``-2``, ...) for the others."""
        out = Path(self.settings.out)
        if not self.watched:
            return out
        taken = {w.log_dir for w in self.watched}
        base, n = type(model).__name__, 1
        path = out / base
        while path in taken:
            n += 1
            path = out / f"{base}-{n}"
        return path

    def _after_step(
        self, w: _Watched, once: HookSet | None, opt: Any, args: Any, kwargs: Any
    ) -> None:
        if once is not None:
            once.remove()
        if w.broken or opt not in w.optimizers or os.getpid() != self._pid:
            return
        if w.skip_post:  # the step during which the Monitor was attached: it is logged
            w.skip_post = False
            return
        self._stepped(w, opt)

    def _stepped(self, w: _Watched, opt: torch.optim.Optimizer) -> None:
        w.stepped.add(opt)
        if all(o in w.stepped for o in w.optimizers):
            self._end_step(w)

    def _end_step(self, w: _Watched) -> None:
        w.stepped = weakref.WeakSet()
        w.backward = False
        if open_monitor(w.model) is not w.monitor:  # the script made its own: it replaced ours
            w.broken = True
            sys.stderr.write(
                f"hookscope watch: stopped watching {type(w.model).__name__}: the script "
                "watches it with its own hs.Monitor from here on\n"
            )
            return
        self._busy = True
        try:
            w.monitor.step(**_first_loss(w))
        except NonFiniteError:
            raise  # on_nonfinite="raise": the script stops here, as asked
        except Exception as exc:
            w.broken = True
            self._fail(f"stopped watching {type(w.model).__name__}", exc)
        finally:
            self._busy = False

    # -- models trained by hand: every backward ---------------------------------------------
    def first_backward(self, roots: Any) -> None:
        """From the start-up hook, after the first ``backward()`` of the process (``roots``:
        the tensors it started from): watch the models trained without an optimizer."""
        if self._off or os.getpid() != self._pid:
            return
        try:
            for model in trained_by_hand():
                if any(w.model is model for w in self.watched):
                    continue
                w = self._watch(model)
                if w is None:
                    continue
                w.manual, w.backward, w.first_loss = True, True, loss_of(roots)
                self._hooks.forward_pre(model, functools.partial(self._forward, w), prepend=True)
                self._check(w)
        except NonFiniteError:
            raise
        except Exception as exc:  # never break the user's training
            self._fail("cannot find the model trained without an optimizer", exc)

    def _forward(self, w: _Watched, module: nn.Module, args: Any, kwargs: Any) -> None:
        """A forward of a model trained by hand: the first after a backward begins a step.
        (Registered first: the step ends before the Monitor's tape keeps this call.)"""
        if w.manual and w.backward and not w.broken and not self._busy and not self._off:
            self._end_step(w)

    def before_backward(self) -> None:
        return None

    def after_backward(self, token: None, loss: torch.Tensor | None) -> None:
        """Every backward: the models trained by hand have a step to end at their next
        forward, and are checked for NaN/Inf now, before the script updates them."""
        if self._off or self._busy or os.getpid() != self._pid:
            return
        for w in self.watched:
            if w.manual and not w.broken:
                w.backward = True
                self._check(w)

    def before_clip(self, params: list[torch.Tensor]) -> None:
        return None

    def clipped(self, params: list[torch.Tensor], total_norm: torch.Tensor, p: float) -> None:
        return None

    def _check(self, w: _Watched) -> None:
        """The non-finite check of a model trained by hand, now that its gradients are
        final and before the script's own update: the one the Monitor runs before an
        optimizer's update. (At ``step()``, the weights would already hold the NaN and a
        replay could not find the op that made it.) Nothing to skip: not with ``skip``."""
        if self.settings.on_nonfinite == "skip":
            return
        self._busy = True
        try:
            w.monitor.check_hand_update()
        except NonFiniteError:
            raise
        except Exception as exc:
            w.broken = True
            self._fail(f"stopped watching {type(w.model).__name__}", exc)
        finally:
            self._busy = False

    # -- the end ----------------------------------------------------------------------------
    def _install_exit_handlers(self) -> None:
        if self._exit_handlers:
            return
        self._exit_handlers = True
        atexit.register(self.close)
        if threading.current_thread() is threading.main_thread():
            self._closer = Closer(functools.partial(self.close, finish=False))
            self._previous_sigterm = signal.getsignal(signal.SIGTERM)
            self._sigterm = self._on_sigterm  # one object: the handler in place is it, or not
            signal.signal(signal.SIGTERM, self._sigterm)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        """Let SIGTERM do what it did before (the previous handler), or close the logs and
        die by the signal (the exit status the parent and launchers expect).

        It takes no lock: the signal may have interrupted a sink holding its own (TensorBoard's
        ``add_scalar``), which this thread would then wait for for ever. The logs are closed by
        :class:`Closer`'s thread, waited for at most ``_CLOSE_WITHIN`` seconds; a second
        signal ends the process at once.

        Called by another handler, installed after this one, that chains to it (Lightning's
        trainer stops at the next batch and exits cleanly), it does what the handler it
        replaced would have done there: ``SIG_DFL`` or ``SIG_IGN`` is no function to call, so
        nothing; the process goes on, and ends with the status the bare run has."""
        previous = self._previous_sigterm
        if callable(previous):
            previous(signum, frame)
            return
        if previous == signal.SIG_IGN or signal.getsignal(signal.SIGTERM) is not self._sigterm:
            return
        if not self._signalled and self._closer is not None and os.getpid() == self._pid:
            self._signalled = True
            self._closer.close_within(_CLOSE_WITHIN)
        die(signum)

    def close(self, *, finish: bool = True) -> None:
        """Close every Monitor (at exit); ``finish`` first ends a round of optimizer steps
        still open. Only in the process that attached them, not in a fork."""
        if self._off or os.getpid() != self._pid:
            return
        self._off = True
        self._hooks.remove()
        if self._stop_listening is not None:
            self._stop_listening()
        # Under several ranks, a step at exit could meet another rank's unrelated collective.
        finish = finish and not (dist.is_available() and dist.is_initialized())
        for w in self.watched:
            try:
                if finish and (len(w.stepped) or w.backward) and not w.broken:
                    w.monitor.step(**_first_loss(w))
            except Exception:
                pass  # the log keeps every step already ended
            finally:
                w.monitor.close()

    def _fail(self, what: str, exc: BaseException) -> None:
        sys.stderr.write(f"hookscope watch: {what}: {type(exc).__name__}: {_whole(exc)}\n")


def _first_loss(w: _Watched) -> dict[str, torch.Tensor]:
    """Step 0 of a model trained by hand began before its Monitor: the loss of the backward
    that found it, handed to ``step()`` once (later ones the Monitor finds itself)."""
    loss, w.first_loss = w.first_loss, None
    return {} if loss is None else {"loss": loss}


def _whole(exc: BaseException) -> str:
    """An error's whole message (its "Fix:" too), further lines indented under the first."""
    return (str(exc) or type(exc).__name__).replace("\n", "\n    ")
