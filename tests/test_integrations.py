"""The trainer integrations, with the real trainers: Lightning's ``Trainer.fit`` and the Hugging
Face ``Trainer.train`` on CPU, no downloads. Oracles: the gradient norms each framework itself
sees before it clips, and what it logs."""

from __future__ import annotations

import csv
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import hookscope as hs
import models
from _gloo import teardown_abort
from hookscope.testing import assert_no_hooks

pytestmark = [
    # Lightning's advice for real runs (more workers, a logging interval) is not our business.
    pytest.mark.filterwarnings("ignore:.*does not have many workers:UserWarning"),
    pytest.mark.filterwarnings("ignore:.*smaller than the logging interval:UserWarning"),
]


def _steps(monitor: hs.Monitor) -> list[dict[str, Any]]:
    return [r for r in monitor.records if r["type"] == "step"]


def _total(record: dict[str, Any]) -> float:
    return math.sqrt(sum(s["grad_norm"] ** 2 for s in record["param"].values()))


def _grad_norms(model: nn.Module) -> dict[str, float]:
    return {n: p.grad.norm().item() for n, p in model.named_parameters() if p.grad is not None}


def test_the_window_sends_its_last_steps_grad_norm_or_none_never_an_older_one() -> None:
    """What both callbacks send as hookscope/grad_norm, in a plain loop: the window's last
    step's total norm before clipping (a sampled step's, or the one clip_grad_norm_
    measured), and no key at all on a step that has neither."""
    from hookscope.integrations._common import Window

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    window, sent, measured = Window(), [], {}
    with hs.Monitor(model, every=3, log_dir=None) as mon:
        for step in range(5):
            opt.zero_grad()
            model(torch.randn(8, 4)).pow(2).mean().backward()
            if step in (1, 4):  # clips on these steps only
                measured[step] = float(nn.utils.clip_grad_norm_(model.parameters(), 1e-3))
            opt.step()
            mon.step()
            window.add(mon)
            if step != 1:  # step 1's window is read with step 2's: step 2 has no norm
                sent.append(window.read(mon).get("hookscope/grad_norm"))
    steps = _steps(mon)
    assert [r["sampled"] for r in steps] == [True, False, False, True, False]
    assert sent[0] == pytest.approx(_total(steps[0]))
    assert sent[1] is None  # step 2: not sampled, not clipped; not step 1's, not step 0's
    assert sent[2] == pytest.approx(_total(steps[3]))
    assert sent[3] == pytest.approx(measured[4], rel=1e-6)


# -- Lightning ---------------------------------------------------------------------------------
L = pytest.importorskip("lightning.pytorch")
from hookscope.integrations.lightning import HookscopeCallback as LightningCallback  # noqa: E402


class Regressor(L.LightningModule):
    def __init__(self, nan_at: int | None = None) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
        self.nan_at = nan_at
        self.losses: list[float] = []  # each micro-batch's

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        x, y = batch
        if batch_idx == self.nan_at:
            x = x * float("nan")
        loss = nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        return {"loss": loss}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


class PreClipNorms(L.Callback):
    """What Lightning shows in ``on_before_optimizer_step``: gradients before clipping."""

    def __init__(self) -> None:
        self.norms: list[dict[str, float]] = []

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self.norms.append(_grad_norms(pl_module))


def _fit(
    tmp_path: Path,
    callbacks: list,
    module: nn.Module,
    ckpt_path: Path | None = None,
    **trainer_kwargs: Any,
) -> Any:
    data = torch.utils.data.TensorDataset(torch.randn(32, 4), 10 * torch.randn(32, 1))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        logger=L.loggers.CSVLogger(tmp_path),
        callbacks=callbacks,
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        **trainer_kwargs,
    )
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4), ckpt_path=ckpt_path)
    return trainer


def test_lightning_logs_gradients_before_clipping_once_per_optimizer_step(tmp_path: Path) -> None:
    cb, seen, module = LightningCallback(every=1), PreClipNorms(), Regressor()
    lr = L.callbacks.LearningRateMonitor()
    trainer = _fit(
        tmp_path,
        [cb, seen, lr],
        module,
        max_steps=3,
        accumulate_grad_batches=2,
        gradient_clip_val=0.1,
    )
    steps = _steps(cb.monitor)
    assert trainer.global_step == len(steps) == len(seen.norms) == 3
    for record, truth in zip(steps, seen.norms, strict=True):
        logged = {n: s["grad_norm"] for n, s in record["param"].items()}
        assert logged == pytest.approx(truth, rel=1e-5)
        assert _total(record) > 10 * 0.1  # well above what clipping leaves: read before it
    # two micro-batches of 4 per record
    assert steps[0]["act"]["net.0"]["numel"] == 2 * 4 * 16
    # the loss of a step is the mean over its micro-batches, as Lightning optimizes it
    pairs = zip(module.losses[::2], module.losses[1::2], strict=True)
    assert [r["scalars"]["loss"] for r in steps] == pytest.approx([(a + b) / 2 for a, b in pairs])

    with open(Path(trainer.logger.log_dir) / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    ours = [r for r in rows if r.get("hookscope/grad_norm")]
    # at the steps Lightning logs its own metrics of the same optimizer step at
    assert [int(r["step"]) for r in ours] == [r["step"] for r in steps] == [0, 1, 2]
    assert sorted({int(r["step"]) for r in rows if r.get("lr-Adam")}) == [0, 1, 2]
    assert [float(r["hookscope/grad_norm"]) for r in ours] == pytest.approx(
        [_total(r) for r in steps], rel=1e-6
    )
    assert [float(r["hookscope/loss"]) for r in ours] == pytest.approx(
        [r["scalars"]["loss"] for r in steps], rel=1e-6
    )
    assert {r["hookscope/findings"] for r in ours} == {"0.0"}

    assert cb.report == Path(trainer.logger.log_dir) / "hookscope" / "report.html"
    assert cb.report.is_file()
    assert_no_hooks(module)


def test_lightning_ends_the_run_and_writes_the_report_when_fit_raises(tmp_path: Path) -> None:
    cb, module = (
        LightningCallback(every=1, on_nonfinite="raise", log_dir=tmp_path / "hs"),
        Regressor(nan_at=2),
    )
    with pytest.raises(hs.NonFiniteError, match="net.0"):
        _fit(tmp_path, [cb], module, max_steps=5)
    assert cb.report == tmp_path / "hs" / "report.html" and cb.report.is_file()
    assert [f.kind for f in cb.monitor.findings] == ["nonfinite"]
    assert len(_steps(cb.monitor)) == 2  # steps 0 and 1; step 2 raised before its update
    assert_no_hooks(module)


def test_lightning_resumed_fit_records_only_its_own_optimizer_steps(tmp_path: Path) -> None:
    first = _fit(tmp_path, [], Regressor(), max_epochs=1, accumulate_grad_batches=2)
    first.save_checkpoint(tmp_path / "epoch.ckpt")  # 8 batches: 4 optimizer steps
    cb = LightningCallback(every=1, log_dir=None)
    trainer = _fit(
        tmp_path,
        [cb],
        Regressor(),
        max_steps=6,
        accumulate_grad_batches=2,
        ckpt_path=tmp_path / "epoch.ckpt",
    )
    assert trainer.global_step == 6
    assert len(_steps(cb.monitor)) == 2  # steps 5 and 6, each after its two micro-batches


def test_lightning_callback_checks_its_options_when_made() -> None:
    with pytest.raises(TypeError, match="did you mean 'every'"):
        LightningCallback(evrey=5)
    with pytest.raises(TypeError, match="where="):
        LightningCallback(model=nn.Linear(1, 1))
    LightningCallback(every=5, explode_growth=10.0)  # threshold fields are options too


@pytest.mark.slow
def test_lightning_ddp_two_ranks_write_one_global_log(tmp_path: Path) -> None:
    """Against the Monitor's distributed contract: rank 0 writes one log of global values."""
    script = Path(__file__).with_name("_lightning_ddp.py")
    out = subprocess.run(
        [sys.executable, str(script), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    log_dir = tmp_path / "hookscope"
    records = hs.read_log(log_dir / "hookscope.jsonl")
    steps = [r for r in records if r["type"] == "step"]
    assert len(steps) == 3
    # 4 rows a micro-batch, 2 micro-batches a step, on each rank: global statistics count both
    assert steps[0]["act"]["net.0"]["numel"] == 2 * 2 * 4 * 16
    seen = [line.split() for line in (tmp_path / "preclip.rank0.txt").read_text().splitlines()]
    assert [_total(r) for r in steps] == pytest.approx([float(t) for _, t in seen], rel=1e-5)
    assert (log_dir / "report.html").is_file()
    assert sorted(p.name for p in log_dir.glob("*.jsonl")) == ["hookscope.jsonl"]


# -- Hugging Face Trainer ------------------------------------------------------------------------
transformers = pytest.importorskip("transformers")
from hookscope.integrations.transformers import HookscopeCallback as HFCallback  # noqa: E402


def _gpt2() -> nn.Module:
    return models.gpt2(n_embd=32, n_positions=16).train()


def _tokens(n: int = 24) -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, 100, (n, 8))
    return [{"input_ids": row, "labels": row} for row in ids]


class Recorder(transformers.TrainerCallback):
    """Stands where ``report_to`` loggers stand: before the user's callbacks. Also notes the
    gradients Trainer's callbacks see, after clipping."""

    def __init__(self) -> None:
        self.logs: list[dict[str, float]] = []
        self.clipped: list[float] = []

    def on_pre_optimizer_step(
        self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any
    ) -> None:
        self.clipped.append(math.sqrt(sum(n**2 for n in _grad_norms(model).values())))

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
        self.logs.append(dict(logs))


class FailingTrainer(transformers.Trainer):
    """A NaN loss (``fail="nan"``) or an exception (``fail="raise"``) at step ``at``."""

    def __init__(self, *args: Any, fail: str, at: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fail, self.at = fail, at

    def compute_loss(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        loss = super().compute_loss(model, inputs, *args, **kwargs)
        if self.state.global_step == self.at:
            if self.fail == "raise":
                raise RuntimeError("boom inside training")
            loss = loss * float("nan")
        return loss


def _train_args(tmp_path: Path, **overrides: Any) -> Any:
    kwargs: dict[str, Any] = {
        "output_dir": str(tmp_path / "out"),
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 2,
        "max_steps": 3,
        "logging_steps": 1,
        "learning_rate": 1e-3,
        "use_cpu": True,
        "report_to": "none",
        "save_strategy": "no",
        "disable_tqdm": True,
        **overrides,
    }
    return transformers.TrainingArguments(**kwargs)


def _no_wrappers_left(trainer: Any) -> None:
    assert "unscale_gradients" not in vars(trainer.accelerator)
    assert "training_step" not in vars(trainer) and "log" not in vars(trainer)


def test_trainer_logs_gradients_before_clipping_once_per_optimizer_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TENSORBOARD_LOGGING_DIR", raising=False)  # events go under output_dir
    model, recorder, cb = _gpt2(), Recorder(), HFCallback(every=1, log_dir=None)
    trainer = transformers.Trainer(
        model=model,
        args=_train_args(tmp_path, max_grad_norm=0.01, report_to=["tensorboard"]),
        train_dataset=_tokens(),
        callbacks=[recorder, cb],
    )
    trainer.train()
    steps = _steps(cb.monitor)
    assert len(steps) == trainer.state.global_step == 3
    trainer_logs = [h for h in trainer.state.log_history if "grad_norm" in h]
    totals = [_total(r) for r in steps]
    # the Trainer logs the total norm clip_grad_norm_ measured, before clipping ...
    assert totals == pytest.approx([h["grad_norm"] for h in trainer_logs], rel=1e-5)
    # ... while its callbacks see the clipped gradients
    assert recorder.clipped == pytest.approx([0.01] * 3, rel=1e-3)
    assert min(totals) > 10 * 0.01
    # one record covers both micro-batches: 2 x 4 sequences x 8 tokens x 128 features
    assert steps[0]["act"]["transformer.h.0.mlp.c_fc"]["numel"] == 2 * 4 * 8 * 128
    assert [r["scalars"]["loss"] for r in steps] == pytest.approx([h["loss"] for h in trainer_logs])

    # the subset reaches the loggers: a callback before ours, log_history, and TensorBoard
    ours = [h for h in recorder.logs if "loss" in h]
    assert [h["hookscope/grad_norm"] for h in ours] == pytest.approx(totals, rel=1e-6)
    assert [h["hookscope/loss"] for h in ours] == pytest.approx([h["loss"] for h in ours])
    assert [h["hookscope/findings"] for h in trainer_logs] == [0.0, 0.0, 0.0]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = (tmp_path / "out").glob("runs/*/events.out.tfevents.*")
    tags = EventAccumulator(str(events)).Reload().Tags()["scalars"]
    assert {"train/hookscope/grad_norm", "train/hookscope/loss", "train/hookscope/findings"} <= set(
        tags
    )

    assert_no_hooks(model)
    _no_wrappers_left(trainer)


@pytest.mark.parametrize("max_grad_norm", [1.0, 0.0])
def test_trainer_logs_each_logging_steps_own_grad_norm_between_sampled_steps(
    tmp_path: Path, max_grad_norm: float
) -> None:
    """The README's run: every=5, a log every 2 steps. hookscope/grad_norm is the norm of the
    step the Trainer logs (its own grad_norm), not of the last sampled step (steps 1 and 3
    are not sampled: they used to carry step 0's). Also without clipping (max_grad_norm=0:
    the Trainer still measures the norm)."""
    model, recorder = _gpt2(), Recorder()
    cb = HFCallback(every=5, log_dir=None)
    args = _train_args(tmp_path, max_steps=6, logging_steps=2, max_grad_norm=max_grad_norm)
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=_tokens(48), callbacks=[recorder, cb]
    )
    trainer.train()
    steps = _steps(cb.monitor)
    assert [r["sampled"] for r in steps] == [True, False, False, False, False, True]
    logs = [h for h in recorder.logs if "loss" in h]
    assert len(logs) == 3 and all("hookscope/grad_norm" in h for h in logs)
    ours = [h["hookscope/grad_norm"] for h in logs]
    assert ours == pytest.approx([h["grad_norm"] for h in logs], rel=1e-5)  # the Trainer's
    assert ours == pytest.approx([steps[k]["scalars"]["grad_norm"] for k in (1, 3, 5)])
    assert len({round(v, 6) for v in ours}) == 3  # three steps, three norms
    assert_no_hooks(model)


def test_trainer_flags_a_nan_loss_that_its_log_filter_hides(tmp_path: Path) -> None:
    model, recorder, cb = _gpt2(), Recorder(), HFCallback(every=1, log_dir=None)
    trainer = FailingTrainer(
        model=model,
        args=_train_args(tmp_path),
        train_dataset=_tokens(),
        callbacks=[recorder, cb],
        fail="nan",
        at=1,
    )
    trainer.train()
    logs = [h for h in recorder.logs if "loss" in h]
    assert all(math.isfinite(h["loss"]) for h in logs)  # logging_nan_inf_filter at work
    assert math.isnan(logs[1]["hookscope/loss"])
    # the NaN, and (the update went ahead: on_nonfinite="log") the weights it poisoned
    assert [h["hookscope/new_findings"] for h in logs][:2] == [0.0, 2.0]
    found = [(f.kind, f.phase) for f in cb.monitor.findings if f.step == 1]
    assert found[0][0] == "nonfinite" and found[1] == ("nonfinite", "update")


class DictRegressor(nn.Module):
    """The least the Trainer takes: keyword inputs in, a dict with the loss out. (The report
    plots every parameter: this keeps it quick to write, where GPT-2 has 26 parameters.)"""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": nn.functional.mse_loss(self.net(x), labels)}


def test_trainer_writes_the_report_when_training_raises_and_when_it_ends(tmp_path: Path) -> None:
    model, cb = DictRegressor(), HFCallback(every=1)
    data = [{"x": torch.randn(4), "labels": torch.randn(1)} for _ in range(24)]
    trainer = FailingTrainer(
        model=model,
        args=_train_args(tmp_path),
        train_dataset=data,
        callbacks=[cb],
        fail="raise",
        at=1,
    )
    with pytest.raises(RuntimeError, match="boom inside training"):
        trainer.train()
    assert cb.report == tmp_path / "out" / "hookscope" / "report.html"
    assert cb.report.is_file()
    assert len(_steps(cb.monitor)) == 1
    assert_no_hooks(model)
    _no_wrappers_left(trainer)

    trainer.at = -1  # the same trainer trains again, to the end
    cb.report.unlink()
    trainer.train()
    assert cb.report.is_file() and len(_steps(cb.monitor)) == 3
    assert_no_hooks(model)
    _no_wrappers_left(trainer)


def test_trainer_callback_added_late_ends_a_failed_run_at_the_next_train(tmp_path: Path) -> None:
    model, cb = _gpt2(), HFCallback(every=1, log_dir=None)
    trainer = FailingTrainer(
        model=model, args=_train_args(tmp_path), train_dataset=_tokens(), fail="raise", at=1
    )
    trainer.add_callback(cb)  # after the Trainer's init: the first train() is not guarded
    with pytest.raises(RuntimeError):
        trainer.train()
    first = cb.monitor
    assert cb._end is not None and cb._end.alive and cb._end.atexit  # ended at exit if not before
    with pytest.raises(RuntimeError):
        trainer.train()  # ends the first run at its start; this one is guarded
    assert cb.monitor is not first and not cb._end.alive
    assert_no_hooks(model)
    _no_wrappers_left(trainer)


def test_trainer_callback_checks_its_options_when_made() -> None:
    with pytest.raises(TypeError, match="did you mean 'on_nonfinite'"):
        HFCallback(on_nonfinit="raise")
    with pytest.raises(TypeError, match="where="):
        HFCallback(model=nn.Linear(1, 1))


def test_trainer_callback_called_by_no_trainer_monitors_and_says_what_it_cannot_do(
    tmp_path: Path,
) -> None:
    model, cb = _gpt2(), HFCallback(every=1, log_dir=None)
    args, state, control = (
        _train_args(tmp_path),
        transformers.TrainerState(),
        transformers.TrainerControl(),
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(hs.HookscopeWarning, match="no transformers.Trainer"):
        cb.on_train_begin(args, state, control, model=model, optimizer=opt)
    ids = torch.randint(0, 100, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    cb.on_step_end(args, state, control)
    cb.on_train_end(args, state, control)
    assert len(_steps(cb.monitor)) == 1 and cb.monitor.records[1]["param"]
    assert_no_hooks(model)


@pytest.mark.parametrize(
    ("module", "missing", "extra"),
    [
        ("lightning", ["lightning", "lightning.pytorch", "pytorch_lightning"], "lightning"),
        ("transformers", ["transformers"], "transformers"),
    ],
)
def test_integration_without_its_framework_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, module: str, missing: list[str], extra: str
) -> None:
    import importlib

    for name in missing:
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed
    monkeypatch.delitem(sys.modules, f"hookscope.integrations.{module}")
    with pytest.raises(ModuleNotFoundError, match=rf"pip install 'hookscope\[{extra}\]'"):
        importlib.import_module(f"hookscope.integrations.{module}")


@pytest.mark.slow
def test_trainer_under_torchrun_two_processes_writes_one_global_log(tmp_path: Path) -> None:
    """Against the Monitor's distributed contract, through Accelerate's DDP on gloo."""
    import json
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = Path(__file__).with_name("_transformers_ddp.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    cmd += ["--master_addr", "127.0.0.1", "--master_port", str(port), str(script), str(tmp_path)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    if out.returncode != 0 and teardown_abort(out.stderr):  # see tests/_gloo.py
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    log_dir = tmp_path / "hookscope"
    steps = [r for r in hs.read_log(log_dir / "hookscope.jsonl") if r["type"] == "step"]
    assert len(steps) == 3
    # 2 processes x 2 micro-batches x 4 sequences x 8 tokens x 128 features
    assert steps[0]["act"]["transformer.h.0.mlp.c_fc"]["numel"] == 2 * 2 * 4 * 8 * 128
    history = [
        h for h in json.loads((tmp_path / "log_history.json").read_text()) if "grad_norm" in h
    ]
    assert [_total(r) for r in steps] == pytest.approx([h["grad_norm"] for h in history], rel=1e-5)
    assert [h["hookscope/grad_norm"] for h in history] == pytest.approx([_total(r) for r in steps])
    assert (log_dir / "report.html").is_file()
    assert sorted(p.name for p in log_dir.glob("*.jsonl")) == ["hookscope.jsonl"]
