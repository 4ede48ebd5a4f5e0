"""Diagnosis rules on small real training runs: the right finding at the right module, and
silence where the rule has nothing to say. (The wide checks: benchmarks/diagnosis.py, and the
129-architecture healthy sweep in test_sweep.py.)"""

from __future__ import annotations

import itertools

import torch
import torch.nn as nn

import hookscope as hs


def run(model, steps=4, *, lr=1e-2, optim=torch.optim.SGD, x=None, y=None, mse=False, **kw):
    torch.manual_seed(0)
    x = torch.randn(64, 16) if x is None else x
    y = torch.randint(0, 4, (len(x),)) if y is None else y
    opt = optim(model.parameters(), lr=lr)
    with hs.Monitor(model, every=1, **kw) as mon:
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
