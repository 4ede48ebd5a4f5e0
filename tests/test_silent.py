"""Silent errors: each check fires on its bug, at the right step, naming the right module, and
stays silent on the fixed twin. Each bug is first shown with plain torch (the oracle)."""

from __future__ import annotations

import json
import re
from dataclasses import fields
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hookscope as hs
from hookscope._log import EvalRecord
from models import bert, gpt2, images, resnet_pair, token_ids

SILENT_KINDS = {
    "not_updated",
    "stale_gradients",
    "eval_randomness",
    "autocast_skipped",
    "eval_mismatch",
    "frozen_changed",
    "replica_divergence",
}


def found(mon: hs.Monitor, kind: str) -> list[hs.Finding]:
    return [f for f in mon.findings if f.kind == kind]


def silent(mon: hs.Monitor) -> list[hs.Finding]:
    return [f for f in mon.findings if f.kind in SILENT_KINDS]


def lm_step(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    loss = model(ids, labels=ids).loss
    loss.backward()
    return loss


# -- stale_gradients ----------------------------------------------------------------------------
def test_missing_zero_grad_is_found_at_the_first_step_that_accumulates_onto_old_gradients() -> None:
    torch.manual_seed(0)
    model = gpt2().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = token_ids(4, 16)
    with hs.Monitor(model, every=5) as mon:
        for step in range(5):
            if step < 2:  # the bug: zero_grad dropped from step 2 on
                opt.zero_grad()
            if step == 2:  # oracle: the gradient is not reset, it still holds step 1's
                assert model.lm_head.weight.grad is not None
                assert model.lm_head.weight.grad.abs().sum() > 0
            lm_step(model, ids)
            opt.step()
            mon.step()
    (finding,) = found(mon, "stale_gradients")
    assert finding.step == 2
    assert finding.module in dict(model.named_modules())
    assert "zero_grad" in finding.message


@pytest.mark.parametrize("set_to_none", [True, False])
def test_gradient_accumulation_and_zeroed_gradients_are_not_stale(set_to_none: bool) -> None:
    torch.manual_seed(0)
    model = gpt2().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with hs.Monitor(model, every=1) as mon:
        for _ in range(4):
            for _ in range(3):  # three micro-batches per optimizer step
                lm_step(model, token_ids(2, 8))
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)
            mon.step()
    assert silent(mon) == []


def test_a_gan_whose_generator_loss_reaches_the_discriminator_is_not_stale() -> None:
    torch.manual_seed(0)
    gen, disc = nn.Linear(4, 8), nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt_g = torch.optim.Adam(gen.parameters(), lr=1e-3)
    opt_d = torch.optim.Adam(disc.parameters(), lr=1e-3)
    with hs.Monitor(disc, every=1) as mon:
        for _ in range(4):
            opt_d.zero_grad()
            real, fake = torch.randn(8, 8), gen(torch.randn(8, 4))
            (F.softplus(-disc(real)) + F.softplus(disc(fake.detach()))).mean().backward()
            opt_d.step()
            opt_g.zero_grad()  # the discriminator keeps its gradients through this phase
            F.softplus(-disc(fake)).mean().backward()
            opt_g.step()
            mon.step()
    assert silent(mon) == []


# -- not_updated ----------------------------------------------------------------------------
def test_an_optimizer_of_frozen_parameters_is_found_at_its_first_step() -> None:
    torch.manual_seed(0)
    model, _ = resnet_pair()
    opt = torch.optim.SGD(model.fc.parameters(), lr=0.1)
    model.fc.requires_grad_(False)  # the bug: the head meant to be trained is frozen instead
    with hs.Monitor(model, every=10) as mon:
        for _ in range(3):
            opt.zero_grad()
            F.cross_entropy(model(images()), torch.tensor([0, 1, 2, 3])).backward()
            before = model.fc.weight.detach().clone()
            opt.step()
            assert torch.equal(before, model.fc.weight)  # oracle: the step did nothing
            mon.step()
    (finding,) = found(mon, "not_updated")
    assert (finding.step, finding.module) == (0, "fc")
    assert "requires_grad=False" in finding.message
    assert "raise the learning rate" not in finding.message


class RebindingSGD(torch.optim.Optimizer):
    """A hand-written SGD with the classic bug: ``p = p - lr * g`` rebinds a local name."""

    def __init__(self, params, lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p = p - group["lr"] * p.grad
        return None


def test_an_update_that_never_reaches_the_weights_is_found_naming_the_weight() -> None:
    torch.manual_seed(0)
    model = bert().train()
    opt = RebindingSGD(model.parameters(), lr=0.1)
    with hs.Monitor(model, every=10) as mon:
        for _ in range(3):
            opt.zero_grad()
            model(token_ids(2, 8)).last_hidden_state[..., :4].sum().backward()
            opt.step()
            mon.step()
    findings = found(mon, "not_updated")
    assert findings and {f.step for f in findings} == {0}
    largest = max(model.named_parameters(), key=lambda kv: kv[1].numel())[0]
    assert largest.rsplit(".", 1)[0] in {f.module for f in findings}
    assert all("learning rate is not the cause" in f.message for f in findings)


def test_an_unsampled_steps_update_is_judged_at_the_next_step_naming_its_own() -> None:
    # Unsampled steps read the verdict with the next step's first transfer (one host sync
    # per step on a GPU, not two): found one step late, dated to the step it happened in.
    torch.manual_seed(0)
    model = bert().train()
    opt = RebindingSGD(model.parameters(), lr=0.1)
    returned = []
    with hs.Monitor(model, every=None) as mon:
        for _ in range(3):
            opt.zero_grad()
            model(token_ids(2, 8)).last_hidden_state[..., :4].sum().backward()
            opt.step()
            returned.append([f for f in mon.step() if f.kind == "not_updated"])
    assert returned[0] == []
    assert returned[1] and {f.step for f in returned[1]} == {0}
    assert {f.step for f in found(mon, "not_updated")} == {0}


def test_a_late_verdicts_bundle_is_named_by_the_step_it_holds(tmp_path: Path) -> None:
    # The flight recorder writes what the model holds now: for a verdict read a step late,
    # that is the next step (the bug repeats there), and the bundle says so.
    torch.manual_seed(0)
    model = bert().train()
    opt = RebindingSGD(model.parameters(), lr=0.1)
    kw = {"record_dir": tmp_path, "record_on": ("not_updated",)}
    with hs.Monitor(model, every=None, **kw) as mon:
        for _ in range(3):
            opt.zero_grad()
            model(token_ids(2, 8)).last_hidden_state[..., :4].sum().backward()
            opt.step()
            mon.step()
    (bundle,) = tmp_path.iterdir()
    assert bundle.name == "step000001-not_updated"
    meta = json.loads((bundle / "bundle.json").read_text())
    assert (meta["step"], meta["finding"]["step"]) == (1, 0)
    (event,) = [r for r in mon.records if r["type"] == "event" and r["kind"] == "recorded"]
    assert event["step"] == 1 and "of step 0, read a step late" in event["message"]


class SGDThatBreaks(torch.optim.Optimizer):
    """Plain SGD until its step ``broken_from``, then an update that rebinds a local name."""

    def __init__(self, params, lr: float, broken_from: int) -> None:
        super().__init__(params, {"lr": lr})
        self.broken_from, self.steps = broken_from, 0

    @torch.no_grad()
    def step(self, closure=None):
        self.steps += 1
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if self.steps <= self.broken_from:
                    p.sub_(group["lr"] * p.grad)
                else:
                    p = p - group["lr"] * p.grad
        return None


@pytest.mark.parametrize("every", [None, 10])
def test_an_update_that_stops_reaching_the_weights_is_found_within_ten_steps(
    every: int | None,
) -> None:
    # Weights are compared at an optimizer's first steps and at every tenth.
    torch.manual_seed(0)
    model = gpt2().train()
    opt = SGDThatBreaks(model.parameters(), lr=0.5, broken_from=4)
    with hs.Monitor(model, every=every) as mon:
        for _ in range(12):
            opt.zero_grad()
            model(token_ids(2, 8), labels=token_ids(2, 8)).loss.backward()
            opt.step()
            mon.step()
    assert {f.step for f in found(mon, "not_updated")} == {10}


def test_zero_learning_rate_skipped_steps_and_weight_decay_are_not_reported() -> None:
    torch.manual_seed(0)
    model = gpt2().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    warmup = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: s / 3)  # lr 0 at step 0
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**60)  # overflows: skips steps
    with hs.Monitor(model, every=1) as mon:
        for _ in range(5):
            opt.zero_grad()
            scaler.scale(model(token_ids(2, 8), labels=token_ids(2, 8)).loss).backward()
            scaler.step(opt)
            scaler.update()
            warmup.step()
            mon.step()
    assert silent(mon) == []


# -- eval_randomness ----------------------------------------------------------------------------
class AlwaysDropout(nn.Module):
    """Dropout through the functional API, with the mode hard-coded (the bug)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x, 0.1, training=True)


def evaluate_twice(model: nn.Module, ids: torch.Tensor) -> bool:
    model.eval()
    with torch.no_grad():
        a, b = model(ids).logits, model(ids).logits
    return torch.equal(a, b)


@pytest.mark.parametrize("bug", [True, False])
def test_dropout_left_on_in_evaluation_is_named(bug: bool) -> None:
    torch.manual_seed(0)
    model = gpt2()
    model.transformer.h[1].mlp.dropout = AlwaysDropout() if bug else nn.Dropout(0.1)
    ids = token_ids(2, 8)
    assert evaluate_twice(model, ids) is not bug  # oracle: evaluation is random
    with hs.Monitor(model, every=1) as mon:
        model.eval()
        with torch.no_grad():
            model(ids)
        mon.step()
    if bug:
        (finding,) = found(mon, "eval_randomness")
        assert (finding.step, finding.module) == (0, "transformer.h.1.mlp.dropout")
    else:
        assert silent(mon) == []


class Attention(nn.Module):
    """nanoGPT's attention; ``fixed=False`` passes its dropout whatever the mode."""

    def __init__(self, width: int, fixed: bool) -> None:
        super().__init__()
        self.qkv, self.proj, self.p, self.fixed = (
            nn.Linear(width, 3 * width),
            nn.Linear(width, width),
            0.1,
            fixed,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        p = self.p if self.training or not self.fixed else 0.0
        return self.proj(F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True))


@pytest.mark.parametrize("fixed", [False, True])
def test_attention_dropout_in_evaluation_is_named_to_the_attention_module(fixed: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 16), Attention(16, fixed), nn.Linear(16, 50))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with hs.Monitor(model, every=1) as mon:
        for _ in range(2):  # training draws random numbers: fine
            F.cross_entropy(
                model(token_ids(2, 8, 50)).flatten(0, 1), token_ids(2, 8, 50).flatten()
            ).backward()
            opt.step()
            opt.zero_grad()
            mon.step()
        model.eval()
        with torch.no_grad():
            model(token_ids(2, 8, 50))
        mon.step()
    if fixed:
        assert silent(mon) == []
    else:
        (finding,) = found(mon, "eval_randomness")
        assert (finding.step, finding.module) == (2, "1")


# -- autocast_skipped ---------------------------------------------------------------------------
class Float32Linear(nn.Linear):
    """A head that turns autocast off for itself (the bug: the caller asked for bf16)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", enabled=False):
            return super().forward(x.float())


@pytest.mark.parametrize("bug", [True, False])
def test_a_layer_autocast_does_not_cover_is_named(bug: bool) -> None:
    torch.manual_seed(0)
    model, _ = resnet_pair()
    if bug:
        head = Float32Linear(model.fc.in_features, model.fc.out_features)
        head.load_state_dict(model.fc.state_dict())
        model.fc = head
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with hs.Monitor(model, every=1) as mon:
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(images())
                assert (out.dtype == torch.float32) is bug  # oracle
            F.cross_entropy(out.float(), torch.tensor([0, 1, 2, 3])).backward()
            opt.step()
            opt.zero_grad()
            mon.step()
    if bug:
        (finding,) = found(mon, "autocast_skipped")
        assert (finding.step, finding.module) == (0, "fc")
        assert "torch.float32" in finding.message
    else:
        assert silent(mon) == []


# -- eval_mismatch ------------------------------------------------------------------------------
def sn_discriminator(parametrized: bool) -> nn.Module:
    """An SNGAN-style discriminator; the old ``spectral_norm`` runs its power iteration only in
    training forwards, the parametrization also once when it is applied."""
    sn = nn.utils.parametrizations.spectral_norm if parametrized else nn.utils.spectral_norm
    return nn.Sequential(
        sn(nn.Conv2d(3, 32, 3, padding=1)),
        nn.LeakyReLU(0.1),
        sn(nn.Conv2d(32, 64, 4, 2, 1)),
        nn.LeakyReLU(0.1),
        sn(nn.Conv2d(64, 64, 4, 2, 1)),
        nn.LeakyReLU(0.1),
        nn.Flatten(),
        sn(nn.Linear(64 * 4 * 4, 1)),
    )


@pytest.mark.parametrize("parametrized", [False, True])
def test_evaluation_before_the_first_training_forward_of_spectral_norm(parametrized: bool) -> None:
    torch.manual_seed(0)
    model = sn_discriminator(parametrized)
    x = torch.randn(8, 3, 16, 16)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    with hs.Monitor(model, every=1) as mon:
        model.eval()
        with torch.no_grad():
            scale_eval = model(x).pow(2).mean().sqrt()
        model.train()
        for _ in range(2):
            out = model(x)
            out.mean().backward()
            opt.step()
            opt.zero_grad()
            mon.step()
    scale_train = out.detach().pow(2).mean().sqrt()
    assert (scale_eval / scale_train > 100) is not parametrized  # oracle
    evals = [r for r in mon.records if r["type"] == "eval"]
    assert len(evals) == 1 and evals[0]["step"] == 0
    assert set(evals[0]["modules"]) == set(mon.modules)
    if parametrized:
        assert silent(mon) == []
    else:
        (finding,) = found(mon, "eval_mismatch")
        assert finding.step == 0
        assert finding.module in {"2", "3"}  # where the scales first part by 100x
        assert finding.value > 100


def test_the_eval_record_is_documented() -> None:
    doc = (Path(__file__).parents[1] / "docs" / "log-format.md").read_text()
    row = next(line for line in doc.splitlines() if line.startswith("| `eval` |"))
    documented = set(re.findall(r"`(\w+)`", row.split("|")[3]))
    assert {f.name for f in fields(EvalRecord)} - {"type"} <= documented
    for kind in SILENT_KINDS:
        assert f"`{kind}`" in doc


# -- frozen_changed -----------------------------------------------------------------------------
@pytest.mark.parametrize("bug", [True, False])
def test_declared_frozen_embeddings_that_train_are_found(bug: bool) -> None:
    torch.manual_seed(0)
    model = bert().train()
    # The bug: the freezing loop matches no name ("embedding." is not "embeddings.").
    pattern = "embedding." if bug else "embeddings."
    for name, p in model.named_parameters():
        if name.startswith(pattern):
            p.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    before = model.embeddings.word_embeddings.weight.detach().clone()
    with hs.Monitor(model, every=1, frozen="embeddings") as mon:
        for _ in range(2):
            model(token_ids(2, 8)).last_hidden_state[..., :4].sum().backward()
            opt.step()
            opt.zero_grad()
            mon.step()
    changed = not torch.equal(before, model.embeddings.word_embeddings.weight)
    assert changed is bug  # oracle
    if bug:
        modules = {f.module for f in found(mon, "frozen_changed")}
        assert "embeddings.word_embeddings" in modules
        assert all(f.step == 0 for f in found(mon, "frozen_changed"))
        assert "requires_grad=True" in found(mon, "frozen_changed")[0].message
    else:
        assert silent(mon) == []


def test_frozen_batchnorm_running_statistics_in_training_mode_are_found() -> None:
    torch.manual_seed(0)
    model, _ = resnet_pair()
    model.bn1.requires_grad_(False)  # frozen, but model.train() still updates its statistics
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.01)
    with hs.Monitor(model, every=1, frozen="bn1") as mon:
        F.cross_entropy(model(images()), torch.tensor([0, 1, 2, 3])).backward()
        opt.step()
        mon.step()
    (finding,) = found(mon, "frozen_changed")
    assert finding.module == "bn1" and "running" in finding.message
