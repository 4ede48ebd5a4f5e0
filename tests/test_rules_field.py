"""Rules judged on runs they were not tuned on: converging fast, plateaued, other optimizers
and sizes, each fault beside a healthy twin that must stay silent (issue 31)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import hookscope as hs
from hookscope._diagnose import Thresholds
from hookscope._monitor._probes._signals import Rolling, SpikeWatch, _Row

sys.path.insert(0, str(Path(__file__).parent))
import models


def kinds(mon: hs.Monitor, kind: str) -> list[hs.Finding]:
    return [f for f in mon.findings if f.kind == kind]


# -- loss spikes while the loss still falls fast -------------------------------------------


def perm_run(*, every: int | None, bad_at: int | None, steps: int = 60) -> list[float]:
    """A small GPT-2 learning a fixed permutation of 100 tokens (each token's successor):
    AdamW at 3e-3, no warm-up; the loss falls from 4.6 to ~0.2 by step 50 and keeps falling.
    At ``bad_at``, 2 of the 16 sequences are random tokens."""
    torch.manual_seed(0)
    model = models.gpt2(3).train()
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(100, generator=g)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    with hs.Monitor(model, every=every) as mon:
        for step in range(steps):
            ids = torch.empty(16, 32, dtype=torch.long)
            ids[:, 0] = torch.randint(0, 100, (16,), generator=g)
            for t in range(1, 32):
                ids[:, t] = perm[ids[:, t - 1]]
            if step == bad_at:
                ids[:2] = torch.randint(0, 100, (2, 32), generator=g)
            loss = model(ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            mon.step()
            losses.append(loss.item())
    return losses, mon


@pytest.mark.parametrize("every", [None, 10])
def test_a_spike_while_the_loss_still_falls_fast_is_found_whatever_every(every) -> None:
    losses, mon = perm_run(every=every, bad_at=54)
    # plain torch: 7x the loss before it, below the median of the last 50 (a falling run)
    assert losses[54] > 5 * losses[53]
    assert Rolling(6.0, 0.05, 20).score(losses[4:54], losses[54]) < 1  # the median's rule
    (spike,) = kinds(mon, "loss_spike")
    assert spike.step == 54
    assert "x the median of the 5 losses before it" in spike.message


def test_the_falling_run_without_the_bad_batch_is_silent() -> None:
    _, mon = perm_run(every=10, bad_at=None)
    assert kinds(mon, "loss_spike") == []


def digits_run(optimizer: str, fault: str | None, *, steps: int = 100, width: int = 128):
    """An MLP on scikit-learn's digits, batch 64, falling from 2.3 to ~0.2 in 50 steps; at
    step 54 its labels are random (``"labels"``), or at step 53 layer 2's gradients are
    x30 before the update (``"grads"``)."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x_all = torch.tensor(d.data, dtype=torch.float32) / 16
    y_all = torch.tensor(d.target)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10)
    )
    opt = {
        "sgd": lambda: torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9),
        "adam": lambda: torch.optim.Adam(model.parameters(), lr=3e-3),
        "adamw": lambda: torch.optim.AdamW(model.parameters(), lr=3e-3),
    }[optimizer]()
    g = torch.Generator().manual_seed(0)
    losses = []
    with hs.Monitor(model, every=10) as mon:
        for step in range(steps):
            i = torch.randint(0, len(x_all), (64,), generator=g)
            x, y = x_all[i], y_all[i]
            if fault == "labels" and step == 54:
                y = torch.randint(0, 10, (64,), generator=g)
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            if fault == "grads" and step == 53:
                for p in model[2].parameters():
                    p.grad.mul_(30)
            opt.step()
            opt.zero_grad()
            mon.step()
            losses.append(loss.item())
    return losses, mon


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "adamw"])
def test_healthy_digits_runs_under_three_optimizers_have_no_spike(optimizer) -> None:
    _, mon = digits_run(optimizer, None, steps=150)
    assert kinds(mon, "loss_spike") == []


def test_the_layer_whose_update_broke_leads_by_one_step() -> None:
    losses, mon = digits_run("sgd", "grads")
    assert losses[54] > 5 * max(losses[48:54])
    (spike,) = kinds(mon, "loss_spike")
    assert (spike.step, spike.module) == (54, "2")
    assert "1 step before the loss (at step 53)" in spike.message


def test_an_excursion_long_gone_leads_nothing() -> None:
    """A group whose norm left its range 13 steps before the spike and came back (a fast
    run's drift) is not the leader; the one out of range from the step before is."""
    params = {"a.0.w": nn.Parameter(torch.ones(1)), "b.0.w": nn.Parameter(torch.ones(1))}
    watch = SpikeWatch(params, Thresholds())
    g = torch.Generator().manual_seed(0)
    rows = []
    for step in range(60):
        noise = 1 + 0.05 * torch.rand(2, generator=g)
        a = 30.0 if step == 40 else float(noise[0])
        b = 40.0 if step >= 53 else float(noise[1])
        rows.append((step, a, b))
    window = [_Row(s, {}, {"a.0": a, "b.0": b}, {}) for s, a, b in rows]
    assert watch._leader(window[-41:], weights=False) == ("b.0", 53, "gradient norm")


# -- a divergence: found at every ``every``, once ------------------------------------------


def hf_trainer_run(out: Path, every: int, lr: float) -> tuple[list[hs.Finding], list[dict]]:
    """The Hugging Face ``Trainer`` on a tiny GPT-2 language model (random tokens), with
    ``HookscopeCallback(every=...)``: at lr 10 the loss goes from 4.6 to thousands."""
    from torch.utils.data import Dataset
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        PrinterCallback,
        Trainer,
        TrainingArguments,
    )

    from hookscope.integrations.transformers import HookscopeCallback

    class Tokens(Dataset):
        def __init__(self) -> None:
            self.x = torch.randint(0, 100, (256, 32), generator=torch.Generator().manual_seed(0))

        def __len__(self) -> int:
            return len(self.x)

        def __getitem__(self, i: int) -> dict:
            return {"input_ids": self.x[i], "labels": self.x[i]}

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=100, n_positions=32)
    model = GPT2LMHeadModel(config)
    args = TrainingArguments(
        output_dir=str(out),
        max_steps=16,
        per_device_train_batch_size=8,
        learning_rate=lr,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )
    callback = HookscopeCallback(every=every, log_dir=None)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[callback])
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    return callback.monitor.findings, trainer.state.log_history


@pytest.mark.parametrize("every", [1, 10])
def test_a_divergence_under_the_hf_trainer_is_one_finding_at_every_every(tmp_path, every):
    found, history = hf_trainer_run(tmp_path, every, lr=10.0)
    losses = [h["loss"] for h in history if "loss" in h]
    assert max(losses) > 1000 * losses[0] / 2  # plain Trainer log: it diverged
    diverged = kinds_of(found, "exploding_gradient")
    assert len(diverged) == 1, [f.message[:80] for f in diverged]
    assert diverged[0].step <= 3 and "training diverges" in diverged[0].message


def test_a_healthy_hf_trainer_run_has_no_finding(tmp_path) -> None:
    found, _ = hf_trainer_run(tmp_path, 1, lr=1e-3)
    assert found == []


def kinds_of(found: list[hs.Finding], kind: str) -> list[hs.Finding]:
    return [f for f in found if f.kind == kind]


# -- findings do not clear because their values turned NaN; unbounded growth is a finding ----


def mlp_run(
    case: str, every: int = 10, steps: int = 60
) -> tuple[list[float], hs.Monitor, nn.Module]:
    """An MLP on a linear target under SGD: its losses, Monitor and model. ``"mse"``: lr 3.0,
    the loss overflows and every weight ends NaN. ``"unbounded"``: the loss is
    ``-output.mean()``, which nothing bounds: it falls to -inf while the gradients grow
    ~1e16-fold. ``"healthy"``: MSE at lr 0.05."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1)
    )
    lr = {"mse": 3.0, "unbounded": 0.1, "healthy": 0.05}[case]
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(1)
    w = torch.randn(8, 1, generator=g)
    losses = []
    with hs.Monitor(model, every=every) as mon:
        for _ in range(steps):
            x = torch.randn(64, 8, generator=g)
            out = model(x)
            loss = -out.mean() if case == "unbounded" else (out - x @ w).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            mon.step()
            losses.append(loss.item())
    return losses, mon, model


def test_findings_of_a_run_whose_weights_turned_nan_stay_current() -> None:
    losses, mon, model = mlp_run("mse")
    assert losses[0] < 10 and all(v != v for v in losses[-10:])  # plain torch: NaN
    assert all(not torch.isfinite(p).any() for p in model.parameters())
    diverged = kinds(mon, "exploding_gradient")
    assert diverged and all(f.cleared_at is None for f in mon.findings)


@pytest.mark.parametrize("every", [1, 10])
def test_a_loss_falling_to_minus_inf_with_exploding_gradients_is_a_finding(every) -> None:
    losses, mon, _ = mlp_run("unbounded", every)
    assert losses[20] < -1e5 and float("-inf") in losses  # plain torch
    (diverged,) = kinds(mon, "exploding_gradient")
    assert "gradients' total L2 norm" in diverged.message
    assert diverged.step < losses.index(float("-inf"))  # before it went non-finite


def test_the_healthy_mlp_twin_has_no_finding() -> None:
    losses, mon, _ = mlp_run("healthy", 1, steps=150)
    assert losses[-1] < 0.2 * losses[0]
    assert mon.findings == []


# -- not_updated: one deliberate step without gradients is no bug -----------------------------


@pytest.mark.parametrize("optimizer", [torch.optim.SGD, torch.optim.AdamW])
def test_one_deliberate_step_without_gradients_is_not_not_updated(optimizer) -> None:
    torch.manual_seed(0)
    model = models.bert().train()
    opt = optimizer(model.parameters(), lr=1e-3)
    with hs.Monitor(model, every=1) as mon:
        opt.step()  # deliberate: before any backward (a scheduler's order warning avoided)
        for step in range(6):
            ids = models.token_ids(2, 8)
            model(ids).last_hidden_state.pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            if step == 3:
                opt.step()  # deliberate: an extra step, gradients already cleared
            mon.step()
    assert kinds(mon, "not_updated") == []


def test_zero_grad_between_backward_and_step_is_still_not_updated() -> None:
    torch.manual_seed(0)
    model = models.bert().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with hs.Monitor(model, every=10) as mon:
        for _ in range(4):
            model(models.token_ids(2, 8)).last_hidden_state.pow(2).mean().backward()
            opt.zero_grad()  # the bug: every gradient cleared before the update
            opt.step()
            mon.step()
    (finding,) = kinds(mon, "not_updated")
    assert finding.step <= 1 and "zero_grad()" in finding.message


# -- update_ratio: a lookup table whose rows are mostly unused -------------------------------


class BagOfWords(nn.Module):
    """A 13k-row embedding, mean-pooled, under a linear head (a Lightning example's text
    classifier, shrunk)."""

    def __init__(self, vocab: int = 13_000, dim: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids).mean(1))


def bag_run(lr: float, steps: int = 40) -> hs.Monitor:
    """SGD with gradient clipping on batches that use ~300 of the 13k rows."""
    torch.manual_seed(0)
    model = BagOfWords()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(0)
    used = torch.randperm(13_000, generator=g)[:300]
    with hs.Monitor(model, every=10) as mon:
        for _ in range(steps):
            ids = used[torch.randint(0, 300, (32, 12), generator=g)]
            y = ids[:, 0] % 4
            loss = nn.functional.cross_entropy(model(ids), y)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            mon.step()
    return mon


def test_a_sparsely_updated_embedding_is_no_update_ratio_finding() -> None:
    mon = bag_run(lr=0.1)
    ratios = [r["param"]["embed.weight"]["update_ratio"] for r in mon.records[2:] if "param" in r]
    assert ratios and max(r for r in ratios if r is not None) < 1e-5  # plain: tiny over the table
    assert kinds(mon, "update_ratio") == []


def test_a_learning_rate_too_small_is_still_found_on_the_dense_head() -> None:
    mon = bag_run(lr=1e-6)
    assert {f.module for f in kinds(mon, "update_ratio")} == {"head"}


# -- a nanoGPT-like healthy run under every=1: no eval_mismatch, no attention_logit_growth ----


def nanogpt_run(steps: int = 60, every: int | None = 1) -> tuple[list[float], hs.Monitor]:
    """nanoGPT's ``train.py`` loop, shrunk: a GPT-2 (2 layers x 64, one head, dropout 0),
    AdamW at lr 2e-2 with no warm-up, gradient clipping at 1.0, on sequences where each of
    65 characters has a fixed successor; an evaluation pass (``model.eval()``, ``no_grad``)
    at step 0 before the first update and every 20 steps, as ``estimate_loss()`` does. Its
    loss falls 4.2 -> ~0.5 while its attention logits sharpen from 0.1 to over 100."""
    torch.manual_seed(0)
    model = models.gpt2(
        2, n_head=1, vocab_size=65, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    ).train()
    g = torch.Generator().manual_seed(0)
    successor = torch.randperm(65, generator=g)

    def batch() -> torch.Tensor:
        ids = torch.empty(12, 32, dtype=torch.long)
        ids[:, 0] = torch.randint(0, 65, (12,), generator=g)
        for t in range(1, 32):
            ids[:, t] = successor[ids[:, t - 1]]
        return ids

    opt = torch.optim.AdamW(model.parameters(), lr=2e-2, betas=(0.9, 0.95), weight_decay=0.1)
    losses = []
    with hs.Monitor(model, every=every) as mon:
        for step in range(steps):
            if step % 20 == 0:
                model.eval()
                with torch.no_grad():
                    for _ in range(2):
                        ids = batch()
                        model(ids, labels=ids)
                model.train()
            ids = batch()
            loss = model(ids, labels=ids).loss
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            mon.step()
            losses.append(loss.item())
    return losses, mon


def test_a_healthy_nanogpt_like_run_has_no_eval_mismatch_nor_logit_growth() -> None:
    losses, mon = nanogpt_run()
    assert losses[-1] < 0.3 * losses[0]  # it learns
    logits = [
        max(v["logit_max"] for v in r["attn"].values())
        for r in mon.records
        if r["type"] == "step" and r.get("attn")
    ]
    assert max(logits) > 50 and max(logits) > 10 * logits[5]  # attention sharpens
    assert [f.kind for f in mon.findings] == []


# -- massive_activations: a whole outlier channel ---------------------------------------------


def lm_run(model: nn.Module, outlier: bool, steps: int = 30) -> hs.Monitor:
    """A language model trained ``steps`` steps (AdamW 1e-3, every=5) on random tokens; with
    ``outlier``, output channel 5 of the first block's MLP projection is made x1000 before
    every step (its weight column and bias entry), as the int8/fp8-breaking channels are."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with hs.Monitor(model, every=5) as mon:
        for _ in range(steps):
            if outlier:
                proj = model.transformer.h[0].mlp.c_proj  # Conv1D: weight (in, out)
                with torch.no_grad():
                    scale = 1000.0 / proj.weight[:, 5].abs().max().clamp_min(1e-6)
                    proj.weight[:, 5].mul_(scale * 0.05)
                    proj.bias[5] = 0.0
            ids = models.token_ids(4, 16)
            out = model(ids, labels=ids) if hasattr(model, "lm_head") else model(ids)
            loss = out.loss if hasattr(out, "loss") else out.last_hidden_state.pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            mon.step()
    return mon


def test_an_outlier_channel_is_massive_activations_on_its_module() -> None:
    torch.manual_seed(0)
    model = models.gpt2(2, n_embd=128).train()
    mon = lm_run(model, outlier=True)
    act = [r["act"]["transformer.h.0.mlp.c_proj"] for r in mon.records if r.get("act")][-1]
    assert act["absmax_over_rms"] < 100  # the element rule cannot see it
    assert act["channels"]["index"][0] == 5
    assert act["channels"]["absmax"][0] > 100 * act["channels"]["absmax"][1]  # plain channel
    found = kinds(mon, "massive_activations")
    assert [f.module for f in found][:1] == ["transformer.h.0.mlp.c_proj"]
    assert "channel 5 of" in found[0].message


@pytest.mark.parametrize("build", ["gpt2", "bert"])
def test_healthy_transformers_have_no_massive_activations(build) -> None:
    torch.manual_seed(0)
    model = (models.gpt2(2, n_embd=128) if build == "gpt2" else models.bert()).train()
    mon = lm_run(model, outlier=False)
    assert kinds(mon, "massive_activations") == []


def test_a_healthy_cnn_has_no_massive_activations() -> None:
    torch.manual_seed(0)
    model = models.ResNet(width=8)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    with hs.Monitor(model, every=5) as mon:
        for _ in range(30):
            x, y = torch.randn(16, 3, 16, 16), torch.randint(0, 10, (16,))
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            mon.step()
    assert kinds(mon, "massive_activations") == []


# -- check="edges" / "modules": a NaN the replay cannot reproduce ----------------------------


class CountsCalls(nn.Module):
    """A module with its own state: its training call number ``bad`` returns NaN (a replay of
    the step that did not start from its count would stay finite)."""

    def __init__(self, bad: int) -> None:
        super().__init__()
        self.calls, self.bad = 0, bad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
            if self.calls == self.bad:
                return x * float("nan")
        return x


def stateful_run(check: str) -> hs.Monitor:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 16),
        nn.ReLU(),
        CountsCalls(bad=5),
        nn.Linear(16, 16),
        nn.Tanh(),
        nn.Linear(16, 1),
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with hs.Monitor(model, every=10, check=check) as mon:
        for _ in range(8):
            model(torch.randn(4, 8)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            mon.step()
    return mon


def test_check_modules_names_the_stateful_module_without_a_replay() -> None:
    mon = stateful_run("modules")
    first = kinds(mon, "nonfinite")[0]
    assert (first.module, first.step, first.phase) == ("2", 4, "forward")


def test_check_edges_names_the_stateful_module_at_its_step_too() -> None:
    """The replay starts from the modules' own state before the step (the tape reads it for
    the modules that change theirs), so it reproduces the NaN and names the module."""
    mon = stateful_run("edges")
    first = kinds(mon, "nonfinite")[0]
    assert (first.module, first.step, first.phase, first.op) == ("2", 4, "forward", "aten.mul")


def test_check_is_edges_or_modules() -> None:
    with pytest.raises(ValueError, match="check must be 'edges'"):
        hs.Monitor(nn.Linear(2, 2), check="everything")


STATEFUL_SCRIPT = """
import torch, torch.nn as nn

class CountsCalls(nn.Module):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x * float("nan") if self.calls == 5 else x

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), CountsCalls(), nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(8):
    model(torch.randn(4, 8)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
"""


def test_watch_check_modules_names_the_stateful_module(tmp_path: Path) -> None:
    import json

    from hookscope._cli import main

    script = tmp_path / "train.py"
    script.write_text(STATEFUL_SCRIPT, encoding="utf-8")
    out = tmp_path / "out"
    code = main(
        ["watch", "--out", str(out), "--check", "modules", "--", sys.executable, str(script)]
    )
    assert code == 0
    lines = (out / "hookscope.jsonl").read_text(encoding="utf-8").splitlines()
    found = [r for r in map(json.loads, lines) if r.get("type") == "finding"]
    first = next(r for r in found if r["kind"] == "nonfinite")
    assert (first["module"], first["step"]) == ("2", 4)


# -- a NaN loss with finite gradients, made between the model and the loss --------------------


@pytest.mark.parametrize("every", [None, 10])
def test_a_nan_loss_made_after_the_model_is_a_nonfinite_finding(every) -> None:
    torch.manual_seed(0)
    model = models.ResNet(width=8)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with hs.Monitor(model, every=every) as mon:
        for step in range(6):
            logits = model(torch.randn(8, 3, 16, 16))
            loss = nn.functional.cross_entropy(logits, torch.randint(0, 10, (8,)))
            if step == 3:  # a training_step's extra term: NaN, and no gradient of its own
                loss = loss + torch.log(torch.tensor(-1.0))
            loss.backward()
            assert all(torch.isfinite(p.grad).all() for p in model.parameters())  # plain
            opt.step()
            opt.zero_grad()
            mon.step()
    (finding,) = kinds(mon, "nonfinite")
    assert (finding.step, finding.module) == (3, "")
    assert "made after the model" in finding.message
