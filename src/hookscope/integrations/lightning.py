"""PyTorch Lightning integration: a Monitor on the module being fit.

.. code-block:: python

    from hookscope.integrations.lightning import HookscopeCallback

    trainer = L.Trainer(callbacks=[HookscopeCallback(every=50)], gradient_clip_val=1.0)
    trainer.fit(model)  # then open <trainer.log_dir>/hookscope/report.html

Where Lightning (2.x) calls it:

- ``on_fit_start``, on every rank, after the strategy's setup: ``hs.Monitor(pl_module,
  **options)``, with the trainer's optimizers adopted.
- ``on_before_optimizer_step``: the gradients are accumulated and unscaled but not clipped
  yet. The Monitor reads them here; its own read just before the update would see them
  clipped (Lightning clips between this hook and ``optimizer.step()``).
- ``on_train_batch_end``, when ``trainer.global_step`` has advanced: ``mon.step(loss=...)``,
  so one record per optimizer step whatever ``accumulate_grad_batches`` is; then the compact
  subset (``hookscope/loss``, ``hookscope/grad_norm``, ``hookscope/findings``,
  ``hookscope/new_findings``) goes to ``trainer.loggers`` from rank 0, on sampled steps and
  on steps with a new finding, at the step Lightning logs ``self.log()`` values of the same
  optimizer step at. ``hookscope/grad_norm`` is that step's total norm before clipping (a
  sampled step's, or what ``clip_grad_norm_`` measured with ``gradient_clip_val``); a step
  with a new finding and neither sends none rather than an older step's.
- ``teardown`` (after ``fit``) and ``on_exception``: the Monitor is closed (every hook
  removed) and rank 0 writes ``report.html`` next to the log.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

try:
    import lightning.pytorch as pl
except ModuleNotFoundError as exc:
    if (exc.name or "").partition(".")[0] != "lightning":
        raise  # Lightning is there, but something it imports is not
    try:
        import pytorch_lightning as pl  # the standalone package: callbacks are duck-typed
    except ModuleNotFoundError as inner:
        if (inner.name or "").partition(".")[0] != "pytorch_lightning":
            raise
        raise ModuleNotFoundError(
            "hookscope.integrations.lightning needs PyTorch Lightning: "
            "pip install 'hookscope[lightning]'"
        ) from None

from .._monitor import Monitor
from ._common import Window, check_options, close_and_report

__all__ = ["HookscopeCallback"]

_TAKEN = {
    "model": "it monitors the LightningModule being fit; choose parts of it with where=",
}


class HookscopeCallback(pl.Callback):
    """Monitor the LightningModule being fit, layer by layer, and write the report at the end.

    Args:
        **monitor_options: Options of :class:`hs.Monitor` (``every``, ``where``,
            ``on_nonfinite``, ``log_dir``, threshold fields, ...), checked now. ``log_dir``
            defaults to ``<trainer.log_dir>/hookscope``; ``log_dir=None`` keeps the records
            in memory only (and writes no report).

    Attributes:
        monitor: The Monitor of the last ``fit`` (closed once it ended), or ``None``.
        log_dir: Where its log went.
        report: The HTML report of the last ``fit`` (rank 0), or ``None``.
    """

    def __init__(self, **monitor_options: Any) -> None:
        self.options = check_options(monitor_options, _TAKEN)
        self.monitor: Monitor | None = None
        self.log_dir: Path | None = None
        self.report: Path | None = None
        self._open = False
        self._rank_zero = True
        self._window = Window()
        self._last_step = 0
        self._loss: torch.Tensor | None = None
        self._batches = 0

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._finish()  # a run that a former fit left open
        self.report = None
        options = dict(self.options)
        if "log_dir" not in options:
            options["log_dir"] = Path(trainer.log_dir or trainer.default_root_dir) / "hookscope"
        self.log_dir = None if options["log_dir"] is None else Path(options["log_dir"])
        self._rank_zero = trainer.is_global_zero
        self.monitor = Monitor(pl_module, **options)
        self._open = True
        for optimizer in trainer.optimizers:
            self.monitor.attach_optimizer(optimizer)
        self._window, self._last_step = Window(), trainer.global_step
        self._loss, self._batches = None, 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_step = trainer.global_step  # restored from a checkpoint after on_fit_start

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        if self._open and self.monitor is not None:
            self.monitor.read_gradients(optimizer)

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if not self._open or self.monitor is None:
            return
        self._add_loss(outputs)
        if trainer.global_step == self._last_step:  # accumulating: no optimizer step yet
            return
        self._last_step = trainer.global_step
        # Automatic optimization divides each micro-batch's loss by accumulate_grad_batches:
        # their sum is the step's loss. Manual optimization returns what the user returns.
        loss = self._loss
        if loss is not None and not pl_module.automatic_optimization:
            loss = loss / self._batches
        self._loss, self._batches = None, 0
        self.monitor.step(**({} if loss is None else {"loss": loss}))
        self._window.add(self.monitor)
        if self._window.fresh(self.monitor):
            metrics = self._window.read(self.monitor)
            if trainer.is_global_zero:
                # The step of the record, counted as Lightning counts the steps it logs at
                # (batches that stepped, from 0), so that self.log()'s metrics of the same
                # optimizer step line up: global_step has already advanced here.
                for logger in trainer.loggers:
                    logger.log_metrics(metrics, step=self.monitor.step_count - 1)

    def _add_loss(self, outputs: Any) -> None:
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            loss = loss.detach().float().reshape(())
            self._loss = loss if self._loss is None else self._loss + loss
            self._batches += 1

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._finish()

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._finish()

    def _finish(self) -> None:
        if not self._open or self.monitor is None:
            return
        self._open = False
        self.report = close_and_report(self.monitor, self.log_dir, write=self._rank_zero)
        if self.report is not None:
            pl.utilities.rank_zero_info(f"hookscope report: {self.report}")

    def __repr__(self) -> str:
        state = "running" if self._open else "idle"
        return (
            f"HookscopeCallback({state}, log_dir={str(self.log_dir)!r}, monitor={self.monitor!r})"
        )
