"""The step's one transfer (``_monitor/_wiring/_transfer.py``): the activation probe settles before the
buffer moves (only each module's top channels travel), and what a compiled graph measured is
drained into the buffer and unpacked into the entries and flags eager hooks write."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch
import torch._dynamo
from torch import nn

import hookscope as hs
from hookscope._monitor._probes._outputs import TOP_CHANNELS
from hookscope.testing import internals, step_state
from models import gpt2, token_ids

pytestmark = [  # Dynamo's own warnings under our "error" filter (as in test_compile.py)
    pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor:UserWarning"),
    pytest.mark.filterwarnings("ignore:.*should not be instantiated:DeprecationWarning"),
]


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_a_sampled_step_moves_each_modules_top_channels_and_not_its_channel_maxima() -> None:
    torch.manual_seed(0)
    model = gpt2().train()  # statistics come from modules in training mode
    name = "transformer.h.0.mlp.c_fc"
    outputs: list[torch.Tensor] = []
    model.get_submodule(name).register_forward_hook(lambda m, a, out: outputs.append(out))
    with hs.Monitor(model, every=1, sample=None) as mon:
        model(token_ids(), labels=token_ids()).loss.backward()
        state, host = step_state(mon), internals(mon).host_values()
        assert not [k for k in host if k[0] == "act_chan"]  # settled: none of it moves
        row = host[("act_top", name)]
        assert len(row) == 2 * TOP_CHANNELS + 1  # top values, their channels, the median
        (out,) = outputs
        chans = out.detach().abs().amax(dim=(0, 1))
        top, index = chans.topk(TOP_CHANNELS)
        assert row[TOP_CHANNELS : 2 * TOP_CHANNELS] == [float(i) for i in index]
        assert row[:TOP_CHANNELS] == pytest.approx(top.tolist())
        assert row[-1] == pytest.approx(chans[chans > 0].median().item())
        assert ("act", name) in host and ("grad", name) in host
        assert all(("flag", i) in host for i in range(len(state.trail.flags)))


def test_an_unsampled_step_moves_the_flags_and_no_statistics() -> None:
    model = gpt2()
    with hs.Monitor(model, every=2) as mon:
        mon.step(loss=0.0)  # step 1: unsampled
        model(token_ids(), labels=token_ids()).loss.backward()
        state, host = step_state(mon), internals(mon).host_values()
    assert not state.sampled and state.trail.flags
    assert {k[0] for k in host} == {"flag"}
    assert sorted(host) == [("flag", i) for i in range(len(state.trail.flags))]
    assert all(len(v) == 1 and math.isfinite(v[0]) for v in host.values())  # sums, all finite


def test_a_compiled_step_is_unpacked_into_the_entries_and_flags_of_an_eager_one() -> None:
    def measured(compiled: bool) -> tuple[dict, list]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
        x = torch.randn(8, 6)
        with hs.Monitor(model, every=1, sample=None) as mon:
            run = torch.compile(model, backend="aot_eager") if compiled else model
            run(x).square().mean().backward()
            state, host = step_state(mon), internals(mon).host_values()
        return host, [(f.module, f.phase) for f in state.trail.flags]

    eager, eager_flags = measured(compiled=False)
    compiled, compiled_flags = measured(compiled=True)
    assert ("compiled",) not in compiled  # drained, moved, spread out
    outputs = ("forward", "backward")  # eager hooks also flag the model's inputs
    assert {f for f in compiled_flags if f[1] in outputs} == {
        f for f in eager_flags if f[1] in outputs
    }
    assert len({f for f in compiled_flags if f[1] in outputs}) == 6
    for name in ("0", "1", "2"):
        assert compiled[("act", name)] == pytest.approx(eager[("act", name)], rel=1e-4)
        assert compiled[("grad", name)] == pytest.approx(eager[("grad", name)], rel=1e-4)
