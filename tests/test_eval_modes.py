"""Evaluation under ``torch.inference_mode()`` or ``no_grad()`` inside a watched run: the script
runs as it does bare (an inference tensor keeps no version counter, and reading it raises), the
evaluation's outputs are the bare model's, and training around it is watched as before."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import hookscope as hs
import models
from hookscope._cli import main

EVAL_MODES = [torch.inference_mode, torch.no_grad]


def _train_and_evaluate(
    model: nn.Module, make_input, log_dir: Path, mode, every: int, nan_at: int | None = None
) -> tuple[hs.Monitor, list[torch.Tensor], list[torch.Tensor]]:
    """Six SGD steps; after each odd step an evaluation under ``mode``, also run by a
    twin of the model, unwatched, as the oracle."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    evals, bare = [], []
    with hs.Monitor(model, every=every, log_dir=log_dir) as mon:
        for step in range(6):
            x = make_input()
            if step == nan_at:
                x[0].view(-1)[0] = float("nan")
            opt.zero_grad()
            model(x).float().pow(2).mean().backward()
            opt.step()
            mon.step()
            if step % 2 == 1:
                model.eval()
                x = make_input()
                with mode():
                    evals.append(model(x).clone())
                twin = _twin(model)
                with torch.no_grad():
                    bare.append(twin(x))
                model.train()
    return mon, evals, bare


def _twin(model: nn.Module) -> nn.Module:
    twin = type(model)()
    twin.load_state_dict(model.state_dict())
    return twin.eval()


class Net(nn.Module):
    """A torchvision-style CNN: in-place ReLUs after BatchNorm, an in-place residual add."""

    def __init__(self) -> None:
        super().__init__()
        self.net = models.ResNet(width=4, classes=3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@pytest.mark.parametrize("every", [1, 2, 10])
@pytest.mark.parametrize("mode", EVAL_MODES, ids=lambda m: m.__name__)
def test_a_cnn_evaluated_under_inference_mode_or_no_grad_trains_on_watched(
    tmp_path: Path, mode, every: int
) -> None:
    torch.manual_seed(0)
    mon, evals, bare = _train_and_evaluate(
        Net(), lambda: models.images(2, 8), tmp_path, mode, every
    )
    assert len(evals) == 3
    for got, want in zip(evals, bare, strict=True):
        torch.testing.assert_close(got, want)
    steps = [r["step"] for r in hs.read_log(tmp_path) if r["type"] == "step"]
    assert steps == list(range(6))
    assert mon.findings == []


@pytest.mark.parametrize("mode", EVAL_MODES, ids=lambda m: m.__name__)
def test_a_nan_after_an_inference_mode_evaluation_is_still_found_at_its_step(
    tmp_path: Path, mode
) -> None:
    torch.manual_seed(0)
    mon, _, _ = _train_and_evaluate(
        Net(), lambda: models.images(2, 8), tmp_path, mode, every=10, nan_at=4
    )
    found = [(f.kind, f.step) for f in mon.findings if f.kind == "nonfinite"]
    assert found[:1] == [("nonfinite", 4)]


@pytest.mark.parametrize("every", [1, 3])
def test_gpt2_generating_under_inference_mode_between_steps(tmp_path: Path, every: int) -> None:
    torch.manual_seed(0)
    model = models.gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with hs.Monitor(model, every=every, log_dir=tmp_path) as mon:
        for _ in range(4):
            ids = models.token_ids()
            opt.zero_grad()
            model(ids, labels=ids).loss.backward()
            opt.step()
            mon.step()
            model.eval()
            with torch.inference_mode():
                logits = model(ids).logits
            model.train()
    assert logits.is_inference() and torch.isfinite(logits).all()
    assert mon.step_count == 4 and [f.kind for f in mon.findings if f.kind == "nonfinite"] == []


@pytest.mark.parametrize("clone", [True, False])
def test_capture_under_inference_mode_keeps_what_the_module_returned(clone: bool) -> None:
    """An in-place ReLU changes bn1's output after its hook ran: under inference_mode that
    change cannot be told from a version counter, so even ``clone=False`` keeps a copy."""
    torch.manual_seed(0)
    model = models.ResNet(width=4).eval()
    x = models.images(2, 8)
    with torch.inference_mode(), hs.capture(model, ["bn1", "relu"], clone=clone) as cap:
        model(x)
    plain = models.ResNet(width=4, inplace=False).eval()
    plain.load_state_dict(model.state_dict())
    with torch.no_grad():
        want = plain.bn1(plain.conv1(x))
    torch.testing.assert_close(cap["bn1"].output, want)
    assert (cap["bn1"].output < 0).any()  # before the ReLU, not after it
    torch.testing.assert_close(cap["relu"].output, want.relu())


# -- under `hookscope watch` -----------------------------------------------------------------

# makemore's loop: a character MLP, evaluated under inference_mode every few steps.
MAKEMORE = """
import torch, torch.nn as nn, torch.nn.functional as F
torch.manual_seed(0)
model = nn.Sequential(nn.Embedding(27, 16), nn.Flatten(), nn.Linear(48, 64), nn.Tanh(),
                      nn.Linear(64, 27))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
X, Y = torch.randint(0, 27, (200, 3)), torch.randint(0, 27, (200,))

@torch.inference_mode()
def evaluate():
    model.eval()
    loss = F.cross_entropy(model(X), Y).item()
    model.train()
    return loss

for step in range(12):
    ix = torch.randint(0, 200, (32,))
    loss = F.cross_entropy(model(X[ix]), Y[ix])
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    if step % 5 == 0:
        print("eval", step, round(evaluate(), 4))
print("done")
"""


def _steps(out: Path) -> list[int]:
    lines = (out / "hookscope.jsonl").read_text(encoding="utf-8").splitlines()
    return [r["step"] for r in map(json.loads, lines) if r["type"] == "step"]


@pytest.mark.parametrize("every", ["1", "10"])
def test_watch_keeps_a_makemore_loop_that_evaluates_under_inference_mode(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], every: str
) -> None:
    script = tmp_path / "makemore.py"
    script.write_text(textwrap.dedent(MAKEMORE), encoding="utf-8")
    out = tmp_path / "out"
    status = main(["watch", "--out", str(out), "--every", every, "--", sys.executable, str(script)])
    stdout, err = capfd.readouterr()
    assert status == 0, err
    assert stdout.splitlines()[-1] == "done" and stdout.count("eval") == 3
    assert _steps(out) == list(range(12))


LIGHTNING = """
import torch, torch.nn as nn, lightning as L
from hookscope.integrations.lightning import HookscopeCallback

class Regressor(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(inplace=True), nn.Linear(8, 1))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, i):
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch, i):
        self.log("val", nn.functional.mse_loss(self(batch[0]), batch[1]))

    def test_step(self, batch, i):
        self.log("test", nn.functional.mse_loss(self(batch[0]), batch[1]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-2)

torch.manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
loader = torch.utils.data.DataLoader(data, batch_size=4)
trainer = L.Trainer(accelerator="cpu", max_epochs=2, logger=False, enable_progress_bar=False,
                    enable_model_summary=False, enable_checkpointing=False,
                    default_root_dir=__import__("os").path.dirname(__file__),
                    callbacks=[HookscopeCallback(every=3)] if {callback} else [])
model = Regressor()
trainer.fit(model, loader, loader)
print("test", trainer.test(model, loader, verbose=False)[0]["test"] > 0)
"""


@pytest.mark.filterwarnings("ignore::UserWarning")  # Lightning's advice (workers, intervals)
@pytest.mark.parametrize("callback", [False, True], ids=["watch", "watch+callback"])
def test_watch_keeps_a_lightning_trainer_test_which_runs_under_inference_mode(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], callback: bool
) -> None:
    pytest.importorskip("lightning")
    script = tmp_path / "fit.py"
    script.write_text(textwrap.dedent(LIGHTNING.format(callback=callback)), encoding="utf-8")
    out = tmp_path / "out"
    status = main(["watch", "--out", str(out), "--every", "1", "--", sys.executable, str(script)])
    stdout, err = capfd.readouterr()
    assert status == 0, err
    assert "test True" in stdout
    # two epochs of 8 batches, watched: by watch, or by the script's own callback's Monitor
    # (which watch then leaves alone)
    assert _steps(tmp_path / "hookscope" if callback else out) == list(range(16))


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("every", [1, 3])
def test_a_monitor_around_lightning_fit_and_test(tmp_path: Path, every: int) -> None:
    L = pytest.importorskip("lightning")
    namespace: dict = {}
    exec(LIGHTNING.split("torch.manual_seed(0)")[0], namespace)  # the module class only
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    trainer = L.Trainer(
        accelerator="cpu",
        max_epochs=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    model = namespace["Regressor"]()

    class Steps(L.Callback):  # the user's own loop hook: one mon.step() per training batch
        def on_train_batch_end(self, *args: object) -> None:
            mon.step()

    trainer.callbacks.append(Steps())
    with hs.Monitor(model, every=every, log_dir=tmp_path) as mon:
        trainer.fit(model, loader)
        result = trainer.test(model, loader, verbose=False)  # under inference_mode
    assert result[0]["test"] > 0 and mon.step_count == 8
