"""A compiled model under a Monitor compiles on its first step and not again.

Nothing a compiled graph guards on may change between steps: the Monitor's state read inside
a graph is one bool (is the step sampled), and an unsampled step's graph is the same whether
the model's edges are checked or not (which changes once an optimizer is adopted, after the
first step) and whatever the attention probe's thread state. Counted with a backend that
counts the graphs Dynamo hands it (and runs them as they are).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch._dynamo
from torch import nn

import hookscope as hs
from models import Counting, gpt2, token_ids

pytestmark = [
    # Dynamo's own warnings under the project's "error" filter (see test_compile.py)
    pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor:UserWarning"),
    pytest.mark.filterwarnings("ignore:.*should not be instantiated:DeprecationWarning"),
]


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def graphs_per_step(every: int | None, steps: int) -> tuple[list[int], list[dict[str, Any]]]:
    """A small GPT-2 compiled after the Monitor was attached, trained ``steps`` SGD steps:
    the graphs compiled in each step, and the Monitor's step records."""
    torch.manual_seed(0)
    model = gpt2(2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0).train()
    backend = Counting()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    per_step = []
    with hs.Monitor(model, every=every) as mon:
        compiled = torch.compile(model, backend=backend)
        for step in range(steps):
            before = backend.graphs
            torch.manual_seed(step)
            compiled(token_ids()).logits.float().square().mean().backward()
            opt.step()
            opt.zero_grad()
            mon.step()
            per_step.append(backend.graphs - before)
    return per_step, [r for r in mon.records if r["type"] == "step"]


def test_every_none_compiles_on_the_first_step_only() -> None:
    per_step, records = graphs_per_step(None, 3)
    assert per_step[0] > 0 and per_step[1:] == [0, 0]
    assert all(r["scalars"]["loss"] > 0 for r in records)


def test_every_10_compiles_a_sampled_and_an_unsampled_graph_once_each() -> None:
    per_step, records = graphs_per_step(10, 12)
    # step 0: the sampled graph; step 1: the unsampled one; step 10 reuses step 0's
    assert per_step[0] > 0 and per_step[1] > 0 and per_step[2:] == [0] * 10
    sampled = [r["step"] for r in records if r.get("act")]
    assert sampled == [0, 10]
    assert set(records[10]["act"]) == set(records[0]["act"]) != set()


def test_a_nan_in_a_compiled_unsampled_step_is_named_before_the_update() -> None:
    torch.manual_seed(0)
    model = gpt2(2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0).train()
    backend = Counting()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with hs.Monitor(model, every=None, on_nonfinite="raise") as mon:
        compiled = torch.compile(model, backend=backend)
        for _ in range(2):
            compiled(token_ids()).logits.float().square().mean().backward()
            opt.step()
            opt.zero_grad()
            mon.step()
        graphs = backend.graphs
        with torch.no_grad():
            model.transformer.h[1].mlp.c_fc.weight.fill_(1e38)  # finite: its matmul overflows
        before = model.transformer.h[0].mlp.c_fc.weight.detach().clone()
        with pytest.raises(hs.NonFiniteError) as raised:
            compiled(token_ids()).logits.float().square().mean().backward()
            opt.step()
    assert backend.graphs == graphs  # no recompile for the bad step either
    assert raised.value.step == 2
    assert raised.value.module == "transformer.h.1.mlp.c_fc"
    assert (raised.value.op, raised.value.phase) == ("aten.addmm", "forward")
    assert torch.equal(model.transformer.h[0].mlp.c_fc.weight, before)  # not updated


def test_an_nn_sequential_compiled_whole_keeps_its_graphs_after_the_first_step() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    backend = Counting()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    counts = []
    with hs.Monitor(model, every=None) as mon:
        compiled = torch.compile(model, backend=backend)
        for _ in range(4):
            before = backend.graphs
            compiled(torch.randn(4, 8)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            mon.step()
            counts.append(backend.graphs - before)
    assert counts[0] > 0 and counts[2:] == [0, 0]
