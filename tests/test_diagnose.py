"""Diagnosis rules on small real training runs: the right finding at the right module, and
silence where the rule has nothing to say. (The wide checks: benchmarks/diagnosis.py, and the
129-architecture healthy sweep in test_sweep.py.)"""

from __future__ import annotations

import itertools

import torch
import torch.nn as nn

import hookscope as hs
from hookscope._diagnose import mark_cleared


def run(
    model, steps=4, *, lr=1e-2, optim=torch.optim.SGD, x=None, y=None, mse=False, every=1, **kw
):
    torch.manual_seed(0)
    x = torch.randn(64, 16) if x is None else x
    y = torch.randint(0, 4, (len(x),)) if y is None else y
    opt = optim(model.parameters(), lr=lr)
    with hs.Monitor(model, every=every, **kw) as mon:
        for _ in range(steps):
            out = model(x)
            loss = (
                nn.functional.mse_loss(out, y.float()[:, None].expand_as(out))
                if mse
                else nn.functional.cross_entropy(out, y)
            )
            opt.zero_grad()
            loss.backward()
            opt.step()
            mon.step(loss=loss)
    return [(f.kind, f.module) for f in mon.findings], mon


def mlp(*widths: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(widths):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def test_weights_thirty_times_too_large_explode_by_the_scale_free_rule() -> None:
    torch.manual_seed(0)
    model = mlp(16, 64, 64, 4)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(30)
    _, mon = run(model, steps=1, mse=True)  # the case: loss ~1e7, grads ~1e6
    first = next(f for f in mon.findings if f.kind == "exploding_gradient")
    assert "weight norm" in first.message and "clip" in first.message


def test_recurrent_overflow_is_an_exploding_gradient_then_a_nonfinite() -> None:
    class RNN(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn = nn.RNN(8, 32, nonlinearity="relu", batch_first=True)
            self.head = nn.Linear(32, 4)
            with torch.no_grad():
                self.rnn.weight_hh_l0.copy_(torch.eye(32) * 1.4)

        def forward(self, x):
            return self.head(self.rnn(x)[0][:, -1])

    x = torch.rand(8, 256, 8)
    found, _ = run(RNN(), steps=1, x=x, y=torch.randint(0, 4, (8,)))
    assert ("exploding_gradient", "rnn") in found and ("nonfinite", "rnn") in found


def test_a_deep_sigmoid_stack_vanishes_at_the_starved_input_side() -> None:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(16):
        layers += [nn.Linear(16, 16), nn.Sigmoid()]
    model = nn.Sequential(*layers, nn.Linear(16, 4))
    found, mon = run(model, steps=1)
    assert found[:1] == [("vanishing_gradient", "0")]
    assert "stopped learning" in mon.findings[0].message


def test_zero_initialised_tokens_are_not_judged_by_their_update_ratio() -> None:
    class WithToken(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.token = nn.Parameter(torch.zeros(1, 1, 16))  # as ViT's cls token
            self.fc, self.head = nn.Linear(16, 16), nn.Linear(16, 4)

        def forward(self, x):
            h = torch.cat([self.token.expand(len(x), 1, 16), x[:, None]], 1)
            return self.head(torch.tanh(self.fc(h)).mean(1))

    found, mon = run(WithToken(), steps=6, optim=torch.optim.AdamW, lr=1e-3)
    ratios = [r["param"]["token"]["update_ratio"] for r in mon.records if r["type"] == "step"]
    assert max(ratios[1:]) > 0.1  # ~1/(t+1): large, and meaningless
    assert found == []


def test_a_detached_layer_receives_no_gradient() -> None:
    class Detached(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.proj, self.head = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(64, 4)

        def forward(self, x):
            h = torch.relu(self.fc(x))
            return self.head(torch.cat([h, self.proj(h).detach()], -1))  # a leftover detach

    found, mon = run(Detached(), optim=torch.optim.Adam, lr=1e-3)
    assert found == [("update_ratio", "proj")]
    assert "receives no gradient" in mon.findings[0].message


def test_a_head_computed_and_thrown_away_is_named_but_one_never_called_is_not() -> None:
    class SpareHeads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body, self.head = nn.Linear(16, 32), nn.Linear(32, 4)
            self.wasted, self.spare = nn.Linear(32, 2), nn.Linear(32, 2)  # spare: never called

        def forward(self, x):
            h = torch.relu(self.body(x))
            self.wasted(h)  # computed and thrown away: its weights never learn
            return self.head(h)

    found, mon = run(SpareHeads(), optim=torch.optim.AdamW, lr=1e-3)
    assert found == [("update_ratio", "wasted")]
    assert "thrown away" in mon.findings[0].message


# -- spans of training steps, transients, divergence under clipping, clearing ------------------


def train_gpt2(steps, *, every, lr, optim=torch.optim.Adam, clip=None, **kw):
    """A tiny GPT-2 trained on one batch (the loss computed in its forward); with ``clip``,
    gradients are clipped and their norm before clipping logged as ``grad_norm``."""
    from models import gpt2

    torch.manual_seed(0)
    model = gpt2().train()
    opt = optim(model.parameters(), lr=lr)
    ids = torch.randint(0, 100, (8, 16))
    losses = []
    with hs.Monitor(model, every=every, **kw) as mon:
        for _ in range(steps):
            loss = model(ids, labels=ids).loss
            opt.zero_grad()
            loss.backward()
            norm = {}
            if clip is not None:
                norm["grad_norm"] = nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            losses.append(loss.item())
            mon.step(loss=loss, **norm)
    return mon, losses


def replay(records, thresholds=None):
    """Run a fresh Diagnosis over a log's records as the Monitor does: every step's scalars,
    then the sampled steps' statistics; returns (findings kept, findings cleared)."""
    from dataclasses import fields

    from hookscope._diagnose import Diagnosis, Graph
    from hookscope._log import StepRecord

    header = records[0]
    diagnosis = Diagnosis(thresholds or hs.Thresholds(), header["params"], header["modules"])
    kept, cleared = [], []
    names = {f.name for f in fields(StepRecord)}
    for r in (r for r in records if r["type"] == "step"):
        found = diagnosis.training_step(r["step"], r["scalars"])
        if r["sampled"]:
            found += diagnosis.sampled(
                r["step"], StepRecord(**{k: r[k] for k in names}), Graph(frozenset())
            )
        kept += [f for f in found if diagnosis.first_time(f)]
        cleared += diagnosis.cleared()
    return kept, cleared


def test_a_healthy_adam_run_without_warm_up_has_no_finding_whatever_every_is() -> None:
    for every in (1, 10):  # round 1: 10 update_ratio findings at step 2 with every=1
        mon, losses = train_gpt2(12, every=every, lr=3e-3)
        if every == 1:  # Adam's first updates: lr * sign(g), huge for GPT-2's 0.02 weights
            wte = [r["param"]["transformer.wte.weight"] for r in mon.records[1:4]]
            assert min(s["update_ratio"] for s in wte) > 0.1
        assert losses[-1] < 0.8 * losses[0]
        assert mon.findings == [], every


def test_a_too_high_learning_rate_gives_the_same_findings_whatever_every_is() -> None:
    from models import ResNet

    def findings(every: int) -> set[tuple[str, str]]:
        torch.manual_seed(0)
        model = ResNet(width=8)
        x, y = torch.randn(16, 3, 16, 16), torch.randint(0, 10, (16,))
        found, _ = run(model, steps=21, lr=5.0, x=x, y=y, every=every)
        return set(found)

    assert findings(1) == findings(10) != set()


def test_adam_at_a_learning_rate_that_makes_the_loss_rise_is_judged_in_its_first_steps() -> None:
    mon, losses = train_gpt2(8, every=1, lr=0.3)
    assert max(losses) > 2 * losses[0]
    # The attention logits grow too (0.1 to thousands): attention_logit_growth, also right.
    assert {f.kind for f in mon.findings} == {"update_ratio", "attention_logit_growth"}
    ratio = [f for f in mon.findings if f.kind == "update_ratio"]
    assert "too large" in ratio[0].message and ratio[0].step <= 7


def test_a_divergence_that_clipping_hides_is_found_from_the_loss() -> None:
    for every in (1, 5):
        mon, losses = train_gpt2(12, every=every, lr=1e4, optim=torch.optim.SGD, clip=1.0)
        assert losses[2] > 1e4 * losses[0]  # clipped at 1.0, the loss still diverges
        found, _ = replay(mon.records)
        found = [f for f in found if f.kind != "attention_logit_growth"]  # right, not asked
        assert found[0].kind == "exploding_gradient"
        assert "loss grew" in found[0].message and "clipping" in found[0].message
        assert found[0].step == 2, every  # two steps of growth, whatever every is
        assert "vanishing_gradient" not in {f.kind for f in found}


def test_a_finding_clears_when_its_transient_ends() -> None:
    # Judging Adam's first steps (update_skip=0) makes its transient a finding; it clears.
    thresholds = hs.Thresholds(update_skip=0, update_span=2)
    mon, _ = train_gpt2(14, every=1, lr=3e-3, update_skip=0, update_span=2)
    found, cleared = replay(mon.records, thresholds)
    assert found and {f.kind for f in found} == {"update_ratio"}
    assert {(f.kind, f.module, f.step) for f in cleared} == {
        (f.kind, f.module, f.step) for f in found
    }
    for f in cleared:
        assert f.step < f.cleared_at <= 8 and "cleared at step" in str(f)
        kept = hs.Finding(**{**f.__dict__, "cleared_at": None})
        assert mark_cleared([kept], f) == [f]
