"""The Monitor finds the loss without ``loss=`` and logs gradients as they were before clipping.

Oracles: the loss each training loop computed itself, and ``clip_grad_norm_``'s own return
value (the total norm before clipping), recomputed by hand from the gradients.
"""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hookscope as hs
from hookscope.testing import assert_no_hooks, step_state
from models import ResNet, gpt2, images, token_ids


def steps(mon: hs.Monitor) -> list[dict]:
    return [r for r in mon.records if r["type"] == "step"]


class TupleGPT(nn.Module):
    """The common GPT pattern: ``logits, loss = model(idx, targets)``."""

    def __init__(self, vocab: int = 50, width: int = 32) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.block = nn.TransformerEncoderLayer(width, 4, 64, dropout=0.0, batch_first=True)
        self.head = nn.Linear(width, vocab)

    def forward(self, idx, targets=None):
        logits = self.head(self.block(self.wte(idx)))
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def test_loss_returned_in_a_tuple_is_found_also_with_accumulation() -> None:
    torch.manual_seed(0)
    model = TupleGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    truth = []
    with hs.Monitor(model, every=2) as mon:
        for _ in range(4):
            total = 0.0
            for _ in range(3):  # accumulation, each micro-batch's loss scaled by 1/3
                idx = torch.randint(0, 50, (2, 8))
                _, loss = model(idx, idx)
                (loss / 3).backward()
                total += loss.item() / 3
            opt.step()
            opt.zero_grad(set_to_none=True)
            mon.step()
            truth.append(total)
            with torch.no_grad():  # an evaluation pass: no backward, no loss of its own
                model(torch.randint(0, 50, (2, 8)))
    assert [r["scalars"]["loss"] for r in steps(mon)] == pytest.approx(truth, rel=1e-6)


def test_hugging_face_output_loss_is_found() -> None:
    torch.manual_seed(0)
    model = gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    truth = []
    with hs.Monitor(model, every=1) as mon:
        for _ in range(3):
            ids = token_ids()
            out = model(input_ids=ids, labels=ids)
            out.loss.backward()
            opt.step()
            opt.zero_grad()
            mon.step()
            truth.append(out.loss.item())
    assert [r["scalars"]["loss"] for r in steps(mon)] == pytest.approx(truth)


def test_a_loss_module_outside_the_model_and_a_users_loss_wins() -> None:
    torch.manual_seed(0)
    model = ResNet(width=4)
    criterion = nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    truth = []
    with hs.Monitor(model, every=1) as mon:
        for i in range(3):
            loss = criterion(model(images()), torch.tensor([0, 1, 2, 3]))
            loss.backward()
            opt.step()
            opt.zero_grad()
            truth.append(loss.item())
            mon.step(**({"loss": 7.0} if i == 2 else {}))
    logged = [r["scalars"]["loss"] for r in steps(mon)]
    assert logged[:2] == pytest.approx(truth[:2])
    assert logged[2] == 7.0  # step(loss=...) wins when given


def test_grad_scaler_loss_is_logged_unscaled() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    truth = []
    with hs.Monitor(model, every=1) as mon:
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(torch.randn(16, 8)).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            before = torch.linalg.vector_norm(
                torch.stack([p.grad.norm() for p in model.parameters()])
            ).item()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            mon.step()
            truth.append((loss.item(), before, norm.item()))
    for record, (loss, before, norm) in zip(steps(mon), truth, strict=True):
        assert record["scalars"]["loss"] == pytest.approx(loss)
        assert record["scalars"]["grad_norm"] == pytest.approx(norm, rel=1e-5)
        assert record["scalars"]["grad_norm"] == pytest.approx(before, rel=1e-4)


class Skips:
    """A listener of the calls into torch with the optional ``scaler_skipped``."""

    def __init__(self) -> None:
        self.skipped: list[torch.optim.Optimizer] = []

    def before_backward(self) -> None:
        return None

    def after_backward(self, token: None, loss: torch.Tensor | None) -> None:
        return None

    def before_clip(self, params: list[torch.Tensor]) -> None:
        return None

    def clipped(self, params: list[torch.Tensor], total_norm: torch.Tensor, p: float) -> None:
        return None

    def scaler_skipped(self, optimizer: torch.optim.Optimizer) -> None:
        self.skipped.append(optimizer)


def test_a_step_grad_scaler_skips_is_heard_and_only_that_one() -> None:
    """A real CPU GradScaler skips ``opt.step()`` where the gradients hold an Inf: the
    listener hears exactly those calls of ``scaler.step``; the Monitor beside it (no
    ``scaler_skipped``) logs the step without an update, as before."""
    from hookscope._monitor._wiring._calls import listen

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    listener, heard = Skips(), []
    with hs.Monitor(model, every=1) as mon:
        stop = listen(listener)
        try:
            for step in range(4):
                x = torch.randn(16, 8)
                if step == 2:
                    x[0, 0] = float("inf")
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = model(x).float().pow(2).mean()
                scaler.scale(loss).backward()
                before = len(listener.skipped)
                scaler.step(opt)
                heard.append(len(listener.skipped) - before)
                scaler.update()
                opt.zero_grad()
                mon.step()
        finally:
            stop()
    assert heard == [0, 0, 1, 0] and listener.skipped == [opt]
    skipped = [e["step"] for e in mon.records if e.get("kind") == "skipped_step"]
    assert skipped == [2]


def test_gradients_are_read_before_clipping() -> None:
    """Gradients clipped on every step: the logged gradient norms are the pre-clip ones
    (read after clip_grad_norm_, they would all be the clip value), per parameter and in total."""
    torch.manual_seed(0)
    model = TupleGPT()
    opt = torch.optim.SGD(model.parameters(), lr=5.0)
    clip = 0.1
    with hs.Monitor(model, every=1) as mon:
        for _ in range(4):
            idx = torch.randint(0, 50, (4, 8))
            _, loss = model(idx, idx)
            loss.backward()
            head = model.head.weight.grad.norm().item()
            total = torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item()
            assert model.head.weight.grad.norm().item() <= clip * 1.001
            opt.step()
            opt.zero_grad()
            mon.step()
            record = steps(mon)[-1]
            assert record["scalars"]["grad_norm"] == pytest.approx(total, rel=1e-5)
            assert record["param"]["head.weight"]["grad_norm"] == pytest.approx(head, rel=1e-5)
    assert min(r["scalars"]["grad_norm"] for r in steps(mon)) > 5 * clip


def test_clipping_imported_by_name_and_clip_grad_value_are_seen() -> None:
    from torch.nn.utils import clip_grad_value_

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with hs.Monitor(model, every=1) as mon:
        for _ in range(2):
            model(torch.randn(8, 8)).pow(2).sum().mul(100).backward()
            truth = model[2].weight.grad.norm().item()
            torch.nn.utils.clip_grad_value_(model.parameters(), 1e-4)
            opt.step()
            opt.zero_grad()
            mon.step()
            assert steps(mon)[-1]["param"]["2.weight"]["grad_norm"] == pytest.approx(truth)
            assert "grad_norm" not in steps(mon)[-1]["scalars"]  # clip_grad_value_ has no norm
    # Bound before the Monitor existed: torch's own function, so the Monitor cannot see it.
    assert clip_grad_value_ is torch.nn.utils.clip_grad.clip_grad_value_


def test_torch_functions_are_put_back_and_nothing_is_kept() -> None:
    originals = (
        torch.autograd.backward,
        torch.nn.utils.clip_grad_norm_,
        torch.nn.utils.clip_grad_value_,
        torch.amp.GradScaler.scale,
        torch.amp.GradScaler.step,
    )
    from torch.optim.optimizer import _global_optimizer_pre_hooks

    global_hooks = len(_global_optimizer_pre_hooks)
    model = TupleGPT()
    with hs.Monitor(model) as outer:
        with hs.Monitor(TupleGPT()):  # another model's (one open Monitor per model)
            assert torch.autograd.backward is not originals[0]
        _, loss = model(token_ids(vocab=50), token_ids(vocab=50))
        loss.backward()
        outer.step()
        assert outer.records[-1]["scalars"]["loss"] == pytest.approx(loss.item())
        pickle.dumps(torch.nn.utils.clip_grad_norm_)  # still the same importable name
    current = (
        torch.autograd.backward,
        torch.nn.utils.clip_grad_norm_,
        torch.nn.utils.clip_grad_value_,
        torch.amp.GradScaler.scale,
        torch.amp.GradScaler.step,
    )
    assert current == originals
    assert len(_global_optimizer_pre_hooks) == global_hooks  # GradScaler.step's step counter
    assert_no_hooks(model)
    assert step_state(outer).heard.loss is None  # the last step's loss is not kept alive after it
