import pytest
import torch
import torch.nn as nn

import hookscope as hs
from hookscope.testing import assert_no_hooks
from models import gpt2, token_ids


class Counting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x + 1


def stack() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(4, 4), nn.BatchNorm1d(4), nn.ReLU(inplace=True), Counting(), nn.Linear(4, 2)
    )


def test_extract_returns_features_and_stops_after_the_last_chosen_module() -> None:
    model = stack().eval()
    x = torch.randn(3, 4)
    feats = hs.extract(model, x, where=["1", "0"])
    assert list(feats) == ["0", "1"]
    assert torch.equal(feats["0"], model[0](x))
    assert torch.equal(feats["1"], model[1](model[0](x)))  # before the in-place ReLU
    assert model[3].calls == 0
    assert_no_hooks(model)


def test_extract_runs_in_eval_mode_and_restores_training_flags() -> None:
    model = stack().train()
    model[0].eval()  # a mixed state must come back exactly
    before = model[1].running_mean.clone()
    hs.extract(model, torch.randn(3, 4), where="2")
    assert torch.equal(model[1].running_mean, before)
    assert [m.training for m in model] == [False, True, True, True, True]


def test_extract_without_gradients_and_with_kwargs() -> None:
    class KW(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(2, 2)

        def forward(self, x, *, scale=1.0):
            return self.fc(x * scale)

    model = KW()
    feats = hs.extract(model, torch.ones(1, 2), where="fc", scale=3.0)
    assert not feats["fc"].requires_grad
    assert torch.equal(feats["fc"], model.fc(torch.full((1, 2), 3.0)).detach())


def test_module_that_never_runs_is_an_error_not_a_missing_key() -> None:
    model = nn.ModuleDict({"a": nn.Linear(2, 2), "b": nn.Linear(2, 2)})
    model.forward = lambda x: model["a"](x)  # type: ignore[method-assign]
    with pytest.raises(hs.HookscopeError, match="'b' never ran"):
        hs.extract(model, torch.ones(1, 2), where="b")
    assert_no_hooks(model)


def test_exception_in_forward_propagates_and_leaves_no_hooks() -> None:
    class Bad(nn.Module):
        def forward(self, x):
            raise RuntimeError("broken layer")

    model = nn.Sequential(nn.Linear(2, 2), Bad(), nn.Linear(2, 2))
    with pytest.raises(RuntimeError, match="broken layer"):
        hs.extract(model, torch.ones(1, 2), where="2")
    assert_no_hooks(model)
    assert model.training


# -- on GPT-2 ------------------------------------------------------------------------------------


def test_extract_gpt2_block_0_equals_hidden_states_1_and_restores_training() -> None:
    model = gpt2(n_layer=3).train()  # dropout on: extract must run in eval mode
    model.transformer.h[1].eval()  # a mixed state must come back exactly
    flags = [m.training for m in model.modules()]
    ids = token_ids()
    heads = []
    model.lm_head.register_forward_hook(lambda *a: heads.append(1))
    feats = hs.extract(model, ids, where="transformer.h.0")
    assert [m.training for m in model.modules()] == flags
    assert heads == []  # stopped after block 0
    model.eval()
    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True).hidden_states
    assert list(feats) == ["transformer.h.0"]
    assert torch.equal(feats["transformer.h.0"], hidden[1])
    assert feats["transformer.h.0"].grad_fn is None
    assert_no_hooks(model, only_hookscope=True)
