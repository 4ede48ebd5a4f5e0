"""Hugging Face Trainer integration: a Monitor on the model being trained.

.. code-block:: python

    from hookscope.integrations.transformers import HookscopeCallback

    trainer = Trainer(model, args, train_dataset=data, callbacks=[HookscopeCallback(every=50)])
    trainer.train()  # then open <args.output_dir>/hookscope/report.html

A ``TrainerCallback`` sees too little for this (gradients only after clipping, the loss only
after the Trainer's NaN filter, no event when training raises), so the callback also wraps,
on the instances and only while ``train()`` runs, three things of the Trainer that calls it
(found as the ``self`` of the Trainer method up the stack):

- ``trainer.accelerator.unscale_gradients``: Accelerate's ``clip_grad_norm_`` calls it
  right before it clips (and the Trainer calls that on every optimizer step, with
  ``max_norm=inf`` when ``max_grad_norm`` is 0). After it returns, the gradients are
  accumulated, unscaled and not clipped yet: the Monitor reads them there.
- ``trainer.training_step``: what it returns, summed over the micro-batches of a step, is the
  step's loss, as the Trainer sums it, before ``logging_nan_inf_filter`` hides a NaN.
- ``trainer.log``: a training log (one with ``loss``) also gets the compact subset
  (``hookscope/loss``, ``hookscope/grad_norm``, ``hookscope/findings``,
  ``hookscope/new_findings``) before any callback sees it, so it reaches every
  ``report_to`` logger and ``trainer.state.log_history``. ``hookscope/grad_norm`` is the
  logged step's own total norm before clipping, the Trainer's ``grad_norm`` beside it,
  whether or not the step was sampled; a step without one (no clip measured it, not
  sampled) sends none rather than an older step's.

``on_step_end`` closes the step (one record per optimizer step, whatever
``gradient_accumulation_steps`` is), and ``on_train_end`` closes the Monitor (every hook
removed, every wrapper undone) and writes the report on the main process. Training that
raises never reaches ``on_train_end``: given to ``Trainer(callbacks=[...])``, the callback
also wraps that trainer's ``train()`` (a no-op outside training), which ends the run when it
raises. Added later with ``trainer.add_callback``, it can wrap ``train()`` only from its next
call on; a first run that raises is ended when the process exits.
"""

from __future__ import annotations

import functools
import sys
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

try:
    import transformers
except ModuleNotFoundError as exc:
    if (exc.name or "").partition(".")[0] != "transformers":
        raise  # transformers is there, but something it imports is not
    raise ModuleNotFoundError(
        "hookscope.integrations.transformers needs transformers and accelerate: "
        "pip install 'hookscope[transformers]'"
    ) from None

from .._errors import HookscopeWarning
from .._monitor import Monitor
from ._common import Window, check_options, close_and_report

__all__ = ["HookscopeCallback"]

_TAKEN = {"model": "it monitors the Trainer's model; choose parts of it with where="}
_logger = transformers.utils.logging.get_logger(__name__)


class HookscopeCallback(transformers.TrainerCallback):
    """Monitor the Trainer's model layer by layer, and write the report when training ends.

    Args:
        **monitor_options: Options of :class:`hs.Monitor` (``every``, ``where``,
            ``on_nonfinite``, ``log_dir``, threshold fields, ...), checked now. ``log_dir``
            defaults to ``<args.output_dir>/hookscope``; ``log_dir=None`` keeps the records
            in memory only (and writes no report).

    Attributes:
        monitor: The Monitor of the last ``train()`` (closed once it ended), or ``None``.
        log_dir: Where its log went.
        report: The HTML report of the last ``train()`` (main process), or ``None``.
    """

    def __init__(self, **monitor_options: Any) -> None:
        self.options = check_options(monitor_options, _TAKEN)
        self.monitor: Monitor | None = None
        self.log_dir: Path | None = None
        self.report: Path | None = None
        self._run: _Run | None = None
        self._end: weakref.finalize | None = None

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = _calling_trainer()
        if trainer is not None:
            _guard(trainer, self)

    def on_train_begin(
        self,
        args: Any,
        state: Any,
        control: Any,
        model: Any = None,
        optimizer: Any = None,
        **kw: Any,
    ) -> None:
        self._finish()  # a run that a former train() left open
        self.report = None
        trainer = _calling_trainer()
        if trainer is None:
            warnings.warn(
                "HookscopeCallback: no transformers.Trainer is calling it, so it only monitors "
                "the model: gradients are read after clipping, the loss is not logged, nothing "
                "goes to the loggers, and a run that raises ends when the process exits.",
                HookscopeWarning,
                stacklevel=2,
            )
        else:
            _guard(trainer, self)  # for the next train() calls, if added after the Trainer's init
        options = dict(self.options)
        options.setdefault("log_dir", Path(args.output_dir) / "hookscope")
        if optimizer is not None:
            options.setdefault("optimizer", optimizer)  # the Monitor unwraps Accelerate's wrapper
        self.log_dir = None if options["log_dir"] is None else Path(options["log_dir"])
        self.monitor = Monitor(model, **options)
        self._run = _Run(self.monitor, trainer, self.log_dir, rank_zero=state.is_world_process_zero)
        # Ends the run once: at on_train_end, when a guarded train() raises, or at exit. (The
        # run holds the trainer, which holds this callback: it stays alive until then.)
        self._end = weakref.finalize(self, self._run.finish)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._run is not None and self._run.open:
            self._run.step()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._finish()

    def _finish(self) -> None:
        if self._end is None or not self._end.alive or self._run is None:
            return
        self._end()
        self.report = self._run.report
        if self.report is not None:
            _logger.info(f"hookscope report: {self.report}")

    def __repr__(self) -> str:
        state = "running" if self._run is not None and self._run.open else "idle"
        return (
            f"HookscopeCallback({state}, log_dir={str(self.log_dir)!r}, monitor={self.monitor!r})"
        )


class _Run:
    """One ``train()`` call: the Monitor, and the wrappers on the trainer that feed it."""

    def __init__(
        self, monitor: Monitor, trainer: Any, log_dir: Path | None, *, rank_zero: bool
    ) -> None:
        self.monitor, self.log_dir, self.rank_zero = monitor, log_dir, rank_zero
        self.open = True
        self.report: Path | None = None
        self.window = Window()
        self._loss: torch.Tensor | None = None
        self._wraps: list[_Wrap] = []
        if trainer is not None:
            accelerator = trainer.accelerator
            self._wraps = [
                _Wrap(
                    accelerator, "unscale_gradients", functools.partial(self._unscaled, accelerator)
                ),
                _Wrap(trainer, "training_step", self._training_step),
                _Wrap(trainer, "log", self._log),
            ]

    def _unscaled(self, accelerator: Any, original: Callable, *args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        if self.open and accelerator.sync_gradients:
            self.monitor.read_gradients()  # final and not clipped yet
        return out

    def _training_step(self, original: Callable, *args: Any, **kwargs: Any) -> Any:
        loss = original(*args, **kwargs)
        if self.open and isinstance(loss, torch.Tensor) and loss.numel() == 1:
            loss = loss.detach().float().reshape(())
            self._loss = loss if self._loss is None else self._loss + loss
        return loss

    def _log(self, original: Callable, logs: dict[str, float], *args: Any, **kwargs: Any) -> Any:
        if self.open and "loss" in logs:
            logs = {**logs, **self.window.read(self.monitor)}
        return original(logs, *args, **kwargs)

    def step(self) -> None:
        loss, self._loss = self._loss, None
        self.monitor.step(**({} if loss is None else {"loss": loss}))
        self.window.add(self.monitor)

    def finish(self) -> None:
        self.open = False
        for wrap in reversed(self._wraps):
            wrap.remove()
        self.report = close_and_report(self.monitor, self.log_dir, write=self.rank_zero)


class _Wrap:
    """``obj.name`` replaced, on the instance, by ``wrapper(original, *args, **kwargs)``
    until :meth:`remove`."""

    _NONE = object()

    def __init__(self, obj: Any, name: str, wrapper: Callable[..., Any]) -> None:
        self._obj, self._name = obj, name
        self._before = vars(obj).get(name, self._NONE)  # an instance attribute already there
        original = getattr(obj, name)
        self._fn = functools.wraps(original)(functools.partial(wrapper, original))
        setattr(obj, name, self._fn)

    def remove(self) -> None:
        if vars(self._obj).get(self._name) is not self._fn:
            return  # replaced again since, by someone else: theirs stays (ours passes through)
        if self._before is self._NONE:
            delattr(self._obj, self._name)
        else:
            setattr(self._obj, self._name, self._before)


def _calling_trainer() -> Any:
    """The Trainer whose method is running this callback event, or ``None``.

    The Trainer does not pass itself to callbacks; it is the ``self`` of a Trainer method
    up the stack (``Trainer`` -> ``CallbackHandler.on_*`` -> ``call_event`` -> callback).
    """
    frame = sys._getframe(2)
    try:
        for _ in range(16):
            if frame is None:
                return None
            candidate = frame.f_locals.get("self")
            if isinstance(candidate, transformers.Trainer):
                return candidate
            frame = frame.f_back
        return None
    finally:
        del frame


def _guard(trainer: Any, callback: HookscopeCallback) -> None:
    """Wrap ``trainer.train`` (on the instance) so that a run that raises is ended too."""
    current = vars(trainer).get("train")
    if current is not None and callback in getattr(current, "_hookscope_guards", ()):
        return
    original = trainer.train
    ref = weakref.ref(callback)

    @functools.wraps(original)
    def train(*args: Any, **kwargs: Any) -> Any:
        try:
            return original(*args, **kwargs)
        finally:
            cb = ref()
            if cb is not None:
                cb._finish()  # no-op when on_train_end ended the run

    guards = getattr(original, "_hookscope_guards", ())
    train._hookscope_guards = weakref.WeakSet([*guards, callback])  # type: ignore[attr-defined]
    trainer.train = train
