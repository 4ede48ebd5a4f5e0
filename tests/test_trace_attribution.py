"""An op in a container's own forward (between its children) is blamed on that container.

The cheap per-module flags can only see the children: a NaN/Inf made between two of them
shows up as the next child's bad input (or, in backward, as a gradient that turned bad
between two children). The replay under the op-level tracer names the innermost module
whose own code called the op, in both phases, with the user's line.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn

import hookscope as hs
from hookscope.testing import assert_no_hooks
from models import BasicBlock, ResNet, gpt2, images, token_ids


def line_of(marker: str) -> str:
    """``"<this file>:<line>"`` of the line holding ``marker``."""
    lines = Path(__file__).read_text().splitlines()
    number = next(i + 1 for i, line in enumerate(lines) if line.rstrip().endswith(marker))
    return f"{__file__}:{number}"


def first_nonfinite(model, x, loss, steps=2, **kw):
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with hs.Monitor(model, every=1, **kw) as mon:
        for _ in range(steps):
            opt.zero_grad()
            loss(model(x)).backward()
            opt.step()
            mon.step()
    assert_no_hooks(model)
    return next(f for f in mon.findings if f.kind == "nonfinite")


def where(finding):
    return finding.module, finding.op, finding.phase, finding.source


# -- a GPT-2-style block written by hand --------------------------------------------------------


class MLP(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc, self.act, self.proj = nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)

    def forward(self, x):
        return self.proj(self.act(self.fc(x)))


class Attention(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()
        scores = (q @ k.transpose(-1, -2) / 4).masked_fill(~mask, float("-inf"))
        return self.proj(torch.softmax(scores, dim=-1) @ v)


class Block(nn.Module):
    """Pre-LN transformer block; ``fault`` puts an op between ``attn`` and ``ln_2``."""

    def __init__(self, d: int, fault: str | None = None) -> None:
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(d), Attention(d)
        self.ln_2, self.mlp = nn.LayerNorm(d), MLP(d)
        self.fault = fault

    def forward(self, x):
        h = self.attn(self.ln_1(x))
        if self.fault == "log":
            h = torch.log(h)  # <- block log
        elif self.fault == "sqrt":
            h = h + torch.sqrt(h - h.detach())  # <- block sqrt
        x = x + h
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, fault: str | None = None, temperature: float = 1.0, d: int = 16) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(50, d), nn.Embedding(8, d)
        self.h = nn.ModuleList([Block(d), Block(d, fault)])
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, 50)
        self.temperature = temperature

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        return self.head(self.ln_f(x)) / self.temperature  # <- temperature


def lm_loss(logits):
    return logits.square().mean()


@pytest.mark.parametrize(
    ("fault", "op", "phase", "marker"),
    [
        ("log", "aten.log", "forward", "# <- block log"),
        ("sqrt", "aten.sqrt", "backward", "# <- block sqrt"),
    ],
    ids=["forward", "backward"],
)
def test_an_op_between_a_blocks_children_is_the_blocks(fault, op, phase, marker) -> None:
    torch.manual_seed(0)
    finding = first_nonfinite(GPT(fault), torch.randint(0, 50, (4, 8)), lm_loss)
    assert where(finding) == ("h.1", op, phase, line_of(marker))
    assert "'h.1' (its own code, outside its children)" in finding.message


def test_an_op_in_the_models_top_level_forward_is_the_models() -> None:
    torch.manual_seed(0)
    finding = first_nonfinite(GPT(temperature=0.0), torch.randint(0, 50, (4, 8)), lm_loss)
    assert where(finding) == ("", "aten.div", "forward", line_of("# <- temperature"))
    assert "the model's own code" in finding.message


# -- Hugging Face GPT-2, one block subclassed -------------------------------------------------


def gpt2_block(fault: str):
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    class FaultyBlock(GPT2Block):
        """GPT2Block's forward with an op between its attention and its MLP."""

        def forward(
            self,
            hidden_states,
            cache=None,
            attention_mask=None,
            encoder_hidden_states=None,
            encoder_attention_mask=None,
            use_cache=False,
            **kwargs,
        ):
            attn_output, _ = self.attn(
                self.ln_1(hidden_states),
                cache=cache,
                attention_mask=attention_mask,
                use_cache=use_cache,
                **kwargs,
            )
            if fault == "log":
                attn_output = torch.log(attn_output)  # <- gpt2 log
            else:
                a = attn_output
                attn_output = a + torch.sqrt(a - a.detach())  # <- gpt2 sqrt
            hidden_states = hidden_states + attn_output
            return hidden_states + self.mlp(self.ln_2(hidden_states))

    return FaultyBlock


@pytest.mark.parametrize(
    ("fault", "op", "phase", "marker"),
    [
        ("log", "aten.log", "forward", "# <- gpt2 log"),
        ("sqrt", "aten.sqrt", "backward", "# <- gpt2 sqrt"),
    ],
    ids=["forward", "backward"],
)
def test_hugging_face_gpt2_block_with_an_op_of_its_own(fault, op, phase, marker) -> None:
    torch.manual_seed(0)
    model = gpt2().train()
    model.transformer.h[1].__class__ = gpt2_block(fault)
    finding = first_nonfinite(model, token_ids(), lambda out: out.logits.square().mean())
    assert where(finding) == ("transformer.h.1", op, phase, line_of(marker))


# -- a CNN: ops in the model's own forward and in a residual block's ---------------------------


class NormalisedResNet(ResNet):
    """ResNet whose forward rescales the features between its two stages (by their norm:
    zero features make 0/0), or takes the log of the pooled features (backward: sqrt)."""

    def __init__(self, fault: str) -> None:
        super().__init__()
        self.fault = fault

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer1(x)
        if self.fault == "div":
            x = x / (x * 0).flatten(1).norm(dim=1)[:, None, None, None]  # <- cnn div
        elif self.fault == "sqrt":
            x = x + torch.sqrt(x - x.detach())  # <- cnn sqrt
        x = self.layer2(x)
        return self.fc(torch.flatten(self.avgpool(x), 1))


@pytest.mark.parametrize(
    ("fault", "op", "phase", "marker"),
    [
        ("div", "aten.div", "forward", "# <- cnn div"),
        ("sqrt", "aten.sqrt", "backward", "# <- cnn sqrt"),
    ],
    ids=["forward", "backward"],
)
def test_a_cnns_top_level_op_between_its_stages(fault, op, phase, marker) -> None:
    torch.manual_seed(0)
    finding = first_nonfinite(NormalisedResNet(fault), images(), lambda out: out.square().mean())
    assert where(finding) == ("", op, phase, line_of(marker))


class LogBasicBlock(BasicBlock):
    """A residual block that takes the log of its residual sum before the last ReLU."""

    def forward(self, x):
        out = self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x)))))
        return self.relu(torch.log(out + x))  # <- basic block log


def test_a_nested_residual_blocks_own_op_in_a_cnn() -> None:
    torch.manual_seed(0)
    model = ResNet()
    model.layer2[1].__class__ = LogBasicBlock
    finding = first_nonfinite(model, images(), lambda out: out.square().mean())
    assert where(finding) == ("layer2.1", "aten.log", "forward", line_of("# <- basic block log"))


# -- nested containers: the innermost module whose own code ran the op -------------------------


class Log(nn.Module):
    def forward(self, x):
        return torch.log(x)  # <- leaf log


class Inner(nn.Module):
    def __init__(self, fault: str | None) -> None:
        super().__init__()
        self.fc, self.log, self.fault = nn.Linear(8, 8), Log(), fault

    def forward(self, x):
        h = self.fc(x)
        if self.fault == "leaf":
            h = self.log(h)
        elif self.fault == "inner":
            h = torch.log(h)  # <- inner log
        elif self.fault == "made here":
            h = Log()(h)  # a module made on the fly is no module of the model: Inner's code
        return torch.tanh(h)


class Middle(nn.Module):
    def __init__(self, fault: str | None) -> None:
        super().__init__()
        self.first, self.second, self.fault = Inner(None), Inner(fault), fault

    def forward(self, x):
        h = self.first(x)
        if self.fault == "middle":
            h = torch.log(h)  # <- middle log
        return self.second(h)


class Top(nn.Module):
    def __init__(self, fault: str | None) -> None:
        super().__init__()
        self.stem, self.middle, self.head = nn.Linear(8, 8), Middle(fault), nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.middle(self.stem(x)))


@pytest.mark.parametrize(
    ("fault", "module", "marker"),
    [
        ("leaf", "middle.second.log", "# <- leaf log"),
        ("inner", "middle.second", "# <- inner log"),
        ("made here", "middle.second", "# <- leaf log"),
        ("middle", "middle", "# <- middle log"),
    ],
)
def test_nested_containers_name_the_innermost_module_whose_code_ran_the_op(
    fault, module, marker
) -> None:
    torch.manual_seed(0)
    finding = first_nonfinite(Top(fault), torch.randn(16, 8), lambda out: out.square().mean())
    assert where(finding) == (module, "aten.log", "forward", line_of(marker))
    assert ("its own code" in finding.message) == (fault in ("inner", "made here", "middle"))


def test_a_replayed_bundle_names_the_container_too(tmp_path) -> None:
    pytest.importorskip("safetensors")
    torch.manual_seed(0)
    model = GPT("log")
    first_nonfinite(model, torch.randint(0, 50, (4, 8)), lm_loss, steps=1, record_dir=tmp_path)
    (bundle,) = tmp_path.iterdir()
    torch.manual_seed(1)
    result = hs.replay(bundle, GPT("log"))
    (finding,) = result.findings
    assert where(finding) == ("h.1", "aten.log", "forward", line_of("# <- block log"))
