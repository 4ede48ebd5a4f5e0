"""NaN/Inf localisation on runs as users write them (issue 31): bundles of models with two
outputs whose losses are summed replay bit for bit; a module with its own state is named at
its step; a NaN loss made between the model and the loss gets its op."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import hookscope as hs

pytest.importorskip("safetensors")


def line_of(marker: str) -> str:
    lines = Path(__file__).read_text().splitlines()
    number = next(i + 1 for i, line in enumerate(lines) if line.rstrip().endswith(marker))
    return f"{Path(__file__).name}:{number}"


# -- flight-recorder bundles of models with two outputs --------------------------------------


class ShiftedLog(nn.Module):
    """log(x + shift), the shift a buffer (part of the state a bundle records)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("shift", torch.tensor(1.0))

    def forward(self, x):
        return torch.log(x + self.shift)  # <- the two-head op


class TwoHeads(nn.Module):
    """A CNN trunk with in-place ReLUs, a classification head whose first ReLU is in place
    (it changes the trunk's output it is given) and a regression head; ``kind`` says how
    the two outputs are returned."""

    def __init__(self, kind: str = "tuple") -> None:
        super().__init__()
        self.kind = kind
        self.trunk = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(inplace=True),
            nn.Conv2d(8, 8, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            ShiftedLog(),
        )
        self.cls = nn.Sequential(nn.ReLU(inplace=True), nn.Linear(8, 4))
        self.reg = nn.Sequential(nn.ReLU(), nn.Linear(8, 1))

    def forward(self, x):
        h = self.trunk(x)
        a, b = self.cls(h), self.reg(h)
        if self.kind == "dict":
            return {"logits": a, "boxes": b}
        return a, b


def two_heads(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return TwoHeads(kind)


def record_two_heads(tmp_path: Path, kind: str, how: str, every: int | None = 10):
    """Four steps of ``ce(a, y) + mse(b, z)``; at step 2 the trunk's log gets negative inputs
    (3 of the 8 rows NaN, not all). ``how`` the loop gets the two outputs: calling the model
    (``"model"``), then changing the logits in place (``"in place"``), or calling its parts
    as a Lightning ``training_step`` does (``"parts"``)."""
    model = two_heads(kind)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(0)
    x, y, z = torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 4, (8,)), torch.randn(8, 1)
    with hs.Monitor(model, every=every, record_dir=tmp_path) as mon:
        for step in range(4):
            model.trunk[-1].shift.fill_(-0.05 if step == 2 else 1.0)
            if how == "parts":
                h = model.trunk(x)
                a, b = model.cls(h), model.reg(h)
            else:
                out = model(x)
                a, b = (out["logits"], out["boxes"]) if kind == "dict" else out
            if how == "in place":
                a = nn.functional.relu(a, inplace=True)
            loss = nn.functional.cross_entropy(a, y) + nn.functional.mse_loss(b, z)
            opt.zero_grad()
            loss.backward()
            opt.step()
            mon.step()
    first = next(f for f in mon.findings if f.kind == "nonfinite")
    (bundle,) = tmp_path.glob("step*-nonfinite")
    return first, bundle


@pytest.mark.parametrize(
    ("kind", "how"),
    [("tuple", "model"), ("tuple", "in place"), ("tuple", "parts"), ("dict", "in place")],
)
def test_a_bundle_of_two_summed_outputs_replays_bit_for_bit(tmp_path, kind, how) -> None:
    first, bundle = record_two_heads(tmp_path, kind, how)
    where = ("trunk.7", "aten.log", "forward")
    assert first.step == 2 and (first.module, first.op, first.phase) == where
    assert first.source.endswith(line_of("# <- the two-head op"))
    result = hs.replay(bundle, two_heads(kind))
    assert result.loss_matches is True
    (replayed,) = result.findings
    assert (replayed.module, replayed.op, replayed.phase) == where
    assert replayed.source.endswith(line_of("# <- the two-head op"))


def test_a_bundle_still_tells_a_replay_that_differs(tmp_path) -> None:
    """The comparison is real: the same bundle replayed on other weights does not match."""
    _, bundle = record_two_heads(tmp_path, "tuple", "in place")
    model = two_heads("tuple")
    result = hs.replay(bundle, model)
    assert result.loss_matches is True
    meta = json.loads((bundle / "bundle.json").read_text())
    assert sorted(meta["calls"][0]["outputs"]) == ["0", "1"]
    from safetensors.torch import load_file, save_file

    store = load_file(str(bundle / "tensors.safetensors"))
    store["model/cls.1.bias"] = store["model/cls.1.bias"] + 1.0
    save_file(store, str(bundle / "tensors.safetensors"))
    assert hs.replay(bundle, two_heads("tuple")).loss_matches is False


# -- a NaN loss made between the model and the loss ------------------------------------------


class SmallCNN(nn.Module):
    """A torchvision-style CNN with in-place ReLUs."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(8, 8, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d(1),
        )
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(torch.flatten(self.features(x), 1))


def nan_loss_run(term, steps: int = 4, bad_at: int | None = 2):
    """A cross-entropy loop whose loss adds ``term(logits)`` at step ``bad_at``; the
    gradients stay finite where the term's gradient does."""
    torch.manual_seed(0)
    model = SmallCNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    losses = []
    with hs.Monitor(model, every=10) as mon:
        for step in range(steps):
            x, y = torch.randn(8, 3, 8, 8), torch.randint(0, 4, (8,))
            logits = model(x)
            loss = nn.functional.cross_entropy(logits, y)
            if step == bad_at:
                loss = loss + term(logits)
            opt.zero_grad()
            loss.backward()
            grads_finite = all(torch.isfinite(p.grad).all() for p in model.parameters())
            opt.step()
            mon.step()
            losses.append((loss.item(), grads_finite))
    return mon, losses


def nonfinite(mon):
    return [f for f in mon.findings if f.kind == "nonfinite"]


def test_a_nan_loss_made_by_a_log_after_the_model_names_the_op() -> None:
    mon, losses = nan_loss_run(lambda logits: 1e-3 * logits.log().mean())  # <- loss log
    assert losses[2][0] != losses[2][0] and losses[2][1]  # plain torch: NaN loss, finite grads
    (finding,) = nonfinite(mon)
    assert (finding.module, finding.step, finding.op) == ("", 2, "aten.log")
    assert "aten.log made NaN there, from finite values" in finding.message
    assert "no source line" in finding.message


def test_a_mean_over_an_empty_selection_is_named_whatever_the_values() -> None:
    mon, _ = nan_loss_run(lambda logits: logits[logits > 1e6].mean())
    (finding,) = nonfinite(mon)
    assert (finding.step, finding.op) == (2, "aten.mean")
    assert "aten.mean of an empty tensor made NaN" in finding.message


def test_an_op_that_cannot_be_re_run_is_left_unnamed_with_the_candidates() -> None:
    """``logits - 0.5``: autograd keeps no scalar of a subtraction, so the log after it
    cannot be re-run; the finding names no op and lists the log as the candidate."""
    mon, _ = nan_loss_run(lambda logits: 1e-3 * torch.log(logits - 0.5).mean())
    (finding,) = nonfinite(mon)
    assert finding.step == 2 and finding.op is None
    assert "could not be re-run" in finding.message and "aten.log" in finding.message


def test_a_healthy_twin_has_no_finding() -> None:
    mon, losses = nan_loss_run(lambda logits: 1e-3 * logits.abs().add(1).log().mean())
    assert all(loss == loss for loss, _ in losses)
    assert nonfinite(mon) == []


def test_a_nan_loss_in_a_lightning_training_step_names_the_op(tmp_path) -> None:
    L = pytest.importorskip("lightning.pytorch")
    from hookscope.integrations.lightning import HookscopeCallback

    class AutoEncoder(L.LightningModule):
        """Lightning's pattern: training_step calls the parts, never forward."""

        def __init__(self) -> None:
            super().__init__()
            self.encoder = nn.Sequential(nn.Linear(12, 16), nn.ReLU(inplace=True), nn.Linear(16, 3))
            self.decoder = nn.Sequential(nn.Linear(3, 16), nn.ReLU(inplace=True), nn.Linear(16, 12))

        def training_step(self, batch, batch_idx):
            (x,) = batch
            x_hat = self.decoder(self.encoder(x))
            loss = nn.functional.mse_loss(x_hat, x)
            if batch_idx == 2:
                loss = loss + 1e-3 * x_hat.log().mean()  # NaN where x_hat < 0
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-2)

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(32, 12))
    cb = HookscopeCallback(every=10, log_dir=None)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=4,
        logger=False,
        callbacks=[cb],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(AutoEncoder(), torch.utils.data.DataLoader(data, batch_size=8))
    (finding,) = nonfinite(cb.monitor)
    assert (finding.module, finding.step, finding.op) == ("", 2, "aten.log")


# -- a module with its own state, under the default check ------------------------------------


class NaNOnCall(nn.Module):
    """Counts its training calls and makes a NaN on call ``bad`` (e.g. a schedule kept in
    the module)."""

    def __init__(self, bad: int) -> None:
        super().__init__()
        self.calls, self.bad = 0, bad

    def forward(self, x):
        if self.training:
            self.calls += 1
            if self.calls == self.bad:
                return x * float("nan")  # <- the stateful op
        return x


def stateful_cnn(bad: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(inplace=True),
        NaNOnCall(bad),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 4),
    )


@pytest.mark.parametrize("every", [10, None])
def test_a_module_with_its_own_state_is_named_at_its_step_under_the_default_check(
    every,
) -> None:
    model = stateful_cnn(bad=6)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with hs.Monitor(model, every=every, on_nonfinite="skip") as mon:
        for _ in range(8):
            loss = nn.functional.cross_entropy(
                model(torch.randn(4, 3, 8, 8)), torch.randint(0, 4, (4,))
            )
            opt.zero_grad()
            loss.backward()
            opt.step()
            mon.step()
    (first,) = nonfinite(mon)
    assert (first.module, first.step, first.phase, first.op) == ("3", 5, "forward", "aten.mul")
    assert first.source.endswith(line_of("# <- the stateful op"))
    assert model[3].calls == 8  # the replays left the module's count as training made it


def test_a_state_changed_in_place_is_still_said_not_reproduced_with_the_fix() -> None:
    """A module that appends to a list it keeps (changed in place, not rebound) is not
    rewound: the finding says the replay did not reproduce it, names that module as the
    likely origin and check="modules", which names it for sure."""

    class History(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[int] = []

        def forward(self, x):
            self.seen.append(len(self.seen))
            return x * float("nan") if len(self.seen) == 4 else x

    def run(check):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(inplace=True), History(), nn.Linear(16, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        with hs.Monitor(model, every=10, check=check, on_nonfinite="skip") as mon:
            for _ in range(6):
                model(torch.randn(4, 8)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
                mon.step()
        return nonfinite(mon)[0], model

    edges, model = run("edges")
    assert edges.step == 3 and edges.module == ""
    assert "did not reproduce" in edges.message and 'check="modules"' in edges.message
    assert "module '2' changed its own 'seen' when it ran" in edges.message
    assert "most likely starts in '2'" in edges.message
    assert len(model[2].seen) == 6  # the replays appended nothing: it was put back
    modules, _ = run("modules")
    assert (modules.step, modules.module) == (3, "2")


def gpt2():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=100, n_positions=32)
    return transformers.GPT2LMHeadModel(config)


def test_a_bundle_of_a_weight_made_inf_blames_no_op_of_another_block(tmp_path) -> None:
    """An Inf written into a GPT-2 weight by the loop: the replay of its bundle names no op
    (no op made it; the causal mask's -inf before the softmax is no culprit) and matches."""
    model = gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 100, (4, 16), generator=torch.Generator().manual_seed(0))
    with hs.Monitor(model, every=10, record_dir=tmp_path) as mon:
        for step in range(4):
            if step == 2:
                with torch.no_grad():
                    model.transformer.h[1].mlp.c_fc.weight[0, :5] = float("inf")
            out = model(input_ids=ids, labels=ids)
            loss = out.loss + 1e-2 * out.logits.pow(2).mean()  # two terms of the outputs
            opt.zero_grad()
            loss.backward()
            opt.step()
            mon.step()
    first = next(f for f in mon.findings if f.kind == "nonfinite")
    assert (first.step, first.module, first.op) == (2, "transformer.h.1.mlp.c_fc", None)
    (bundle,) = tmp_path.glob("step*-nonfinite")
    result = hs.replay(bundle, gpt2())
    assert result.loss_matches is True and result.findings == []


def test_a_sqrt_of_negative_outputs_in_the_loss_names_the_op_of_the_nan_gradient() -> None:
    """``sqrt`` of negative logits: the loss and the gradient reaching the model are NaN;
    the finding at the model's output gradient names the op of the loss code that made it."""
    mon, losses = nan_loss_run(lambda logits: 1e-3 * torch.sqrt(logits).mean())
    assert not losses[2][1]  # plain torch: the gradients are NaN
    first = nonfinite(mon)[0]
    assert (first.step, first.phase, first.op) == (2, "backward", "aten.sqrt")
    assert "aten.sqrt made NaN from finite values, and its gradient with it" in first.message


def test_an_op_of_a_nan_gradient_that_cannot_be_re_run_is_listed() -> None:
    mon, _ = nan_loss_run(lambda logits: 1e-3 * torch.sqrt(logits - 0.5).mean())
    first = nonfinite(mon)[0]
    assert (first.step, first.phase, first.op) == (2, "backward", None)
    assert "could not be re-run" in first.message and "aten.sqrt" in first.message
