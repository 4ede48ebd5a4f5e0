"""summary(): shapes and parameter counts, checked against torchinfo on real architectures."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

import hookscope as hs
from hookscope._demo import DigitsCNN
from hookscope.testing import assert_no_hooks
from models import bert

torchinfo = pytest.importorskip("torchinfo")


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2Model

    return GPT2Model(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=100, n_positions=32))


CASES = {
    "gpt2": (_gpt2, lambda: torch.zeros(2, 8, dtype=torch.long)),
    "bert": (bert, lambda: torch.zeros(2, 8, dtype=torch.long)),
    "cnn": (DigitsCNN, lambda: torch.zeros(2, 1, 8, 8)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_summary_totals_match_torchinfo(case: str) -> None:
    build, make_input = CASES[case]
    model, x = build(), make_input()
    ours = hs.summary(model, x)
    theirs = torchinfo.summary(model, input_data=x, verbose=0)
    assert ours.total["params"] == theirs.total_params
    assert ours.total["trainable"] == theirs.trainable_params
    assert_no_hooks(model)


def test_summary_counts_tied_parameters_once() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(
        GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100, n_positions=16)
    )
    assert model.lm_head.weight is model.transformer.wte.weight
    s = hs.summary(model, torch.zeros(1, 4, dtype=torch.long))
    unique = {id(p): p.numel() for p in model.parameters()}
    assert s.total["params"] == sum(unique.values())
    rows = {r.name: r for r in s.rows}
    assert rows["lm_head"].params == rows["transformer.wte"].params == 100 * 32


def test_summary_rows_hold_shapes_bytes_and_trainable_counts() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    model[0].weight.requires_grad_(False)
    s = hs.summary(model, torch.zeros(3, 4))
    names = [r.name for r in s.rows]
    assert names == ["", "0", "1", "2"]
    first = s.rows[1]
    assert (first.input_shape, first.output_shape, first.params, first.trainable) == (
        [[3, 4]],
        [[3, 8]],
        40,
        8,
    )
    assert first.bytes == 3 * 8 * 4
    assert s.total == {"params": 58, "trainable": 26, "bytes": (24 + 24 + 6) * 4}
    d = s.to_dict()
    assert d["rows"][3] == {
        "name": "2",
        "type": "Linear",
        "input_shape": [[3, 8]],
        "output_shape": [[3, 2]],
        "params": 18,
        "trainable": 18,
        "bytes": 24,
    }


def test_summary_restores_training_mode_and_leaves_no_hooks_or_grads() -> None:
    model = DigitsCNN().train()
    model.classifier.eval()
    before = model.features[1].running_mean.clone()
    hs.summary(model, torch.randn(2, 1, 8, 8))
    assert model.training and model.features.training and not model.classifier.training
    assert torch.equal(model.features[1].running_mean, before)  # ran in eval mode
    assert all(p.grad is None for p in model.parameters())
    assert_no_hooks(model)


def test_summary_removes_hooks_when_forward_raises() -> None:
    model = nn.Sequential(nn.Linear(4, 8))
    with pytest.raises(RuntimeError):
        hs.summary(model, torch.zeros(3, 5))
    assert_no_hooks(model)


def test_summary_marks_modules_called_twice_and_never_called() -> None:
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.unused = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(self.lin(x))

    s = hs.summary(Twice(), torch.zeros(1, 4))
    text = str(s)
    assert "Linear x2" in text
    unused = next(line for line in text.splitlines() if line.strip().startswith("unused"))
    assert unused.split()[2:4] == ["-", "-"]


def test_summary_str_is_a_fixed_width_table_with_a_total_line() -> None:
    s = hs.summary(DigitsCNN(), torch.zeros(2, 1, 8, 8))
    lines = str(s).splitlines()
    assert lines[0].split()[:2] == ["Module", "Type"]
    assert lines[-1].startswith("Total params: 38,378  trainable: 38,378")
    assert any(line.strip().startswith("features.0") and "[2, 16, 8, 8]" in line for line in lines)
    assert "\x1b[" not in str(s)
    assert repr(s).startswith("Summary(DigitsCNN, 14 modules, 38,378 params")


def test_summary_renders_with_rich() -> None:
    rich_console = pytest.importorskip("rich.console")
    buf = io.StringIO()
    rich_console.Console(file=buf, width=140, color_system=None).print(
        hs.summary(DigitsCNN(), torch.zeros(1, 1, 8, 8))
    )
    out = buf.getvalue()
    assert "features.0" in out and "Conv2d" in out and "Total params: 38,378" in out
