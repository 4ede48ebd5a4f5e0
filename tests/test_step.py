"""One step's state (``_monitor/_step/_state.py``): a new one each step, the graph of the modules
that ran and the ones whose output went nowhere, and the step's ``skipped_step`` event."""

from __future__ import annotations

import torch
from torch import nn

import hookscope as hs
from hookscope.testing import step_state
from models import ResNet, gpt2, images, token_ids


class SpareHead(nn.Module):
    """A ResNet with a second head that is computed and thrown away."""

    def __init__(self) -> None:
        super().__init__()
        self.net, self.spare = ResNet(), nn.Linear(10, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.net(x)
        self.spare(out)  # its weights never learn
        return out


def test_each_step_starts_a_new_state_with_nothing_of_the_last() -> None:
    model = ResNet()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with hs.Monitor(model, every=2) as mon:
        first = step_state(mon)
        model(images()).square().mean().backward()
        opt.step()
        assert first.sampled and first.updates == 1 and first.trail.flags and first.made
        assert first.heard.loss is not None and first.backward_ran and first.hooks_ran
        mon.step()
        now = step_state(mon)
    assert now is not first
    assert (now.sampled, now.light, now.updates, now.nonfinite, now.heard.loss) == (
        False,
        True,  # unsampled, one process, replayable: only the model's edges are flagged
        0,
        None,
        None,
    )
    assert now.trail.flags == [] and now.made == {} and now.buf.pending() == 0


def test_the_graph_of_a_gpt2_step_links_its_modules_and_has_no_dead_end() -> None:
    model = gpt2().train()
    with hs.Monitor(model, every=1) as mon:
        ids = token_ids()
        model(ids, labels=ids).loss.backward()
        state = step_state(mon)
        graph = state.graph()
        mon.step()
    assert ("transformer.h.0.ln_1", "transformer.h.0.attn.c_attn") in graph.edges
    assert ("transformer.h.1.mlp.c_fc", "transformer.h.1.mlp.act") in graph.edges
    assert state.dead_ends() == set() and graph.detached == frozenset()
    assert mon.graph == graph  # what step() kept for the diagnosis


def test_a_head_thrown_away_is_a_dead_end_and_one_without_backward_is_not() -> None:
    model = SpareHead()
    with hs.Monitor(model, every=1) as mon:
        model(images()).square().mean()  # no backward yet: nothing can be said
        assert step_state(mon).dead_ends() == set()
        mon.step()
        model(images()).square().mean().backward()
        state = step_state(mon)
        assert state.dead_ends() == {"spare"}
        assert ("net.fc", "spare") in state.graph().edges
        assert state.graph().detached == frozenset({"spare"})


def test_an_optimizer_that_did_not_step_is_a_skipped_step_event() -> None:
    model = ResNet()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with hs.Monitor(model, every=1, optimizer=opt) as mon:
        model(images()).square().mean().backward()
        state = step_state(mon)
        assert "optimizer.step() did not run" in state.skip_message(0, None, adopted=True)
        assert state.skip_message(0, None, adopted=False) is None  # no optimizer: no update due
        opt.step()
        assert state.skip_message(0, None, adopted=True) is None
        mon.step()
        model(images()).square().mean().backward()
        mon.step()  # the optimizer did not step
    events = [(r["kind"], r["step"]) for r in mon.records if r["type"] == "event"]
    assert events == [("skipped_step", 1)]
