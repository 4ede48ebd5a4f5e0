"""A sampled step of a closure optimizer reads the closure's first evaluation: ``LBFGS``
evaluates the closure of one batch up to ``max_iter`` times in one ``step()``, and the
evaluations after the first are checked as an unsampled step's calls are (the modules' hooks
off where the edges are checked), so a step of 20 evaluations pays for one read, not 20.
Micro-batches of an accumulated step are all read, as before (``test_probes.py``)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import hookscope as hs
from hookscope.testing import hooks_on, step_state


class Normalize(nn.Module):
    """Each series scaled to unit RMS: 0 x inf = NaN on an all-zero series."""

    def forward(self, x):
        return x * torch.rsqrt(x.square().mean(1, keepdim=True))


class Sequence(nn.Module):
    """A time-series model in the shape of pytorch/examples' ``time_sequence_prediction``:
    an ``LSTMCell`` unrolled over the series, a ``Linear`` head at every position."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = Normalize()
        self.cell = nn.LSTMCell(1, 16)
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = c = x.new_zeros(x.shape[0], 16)
        outs = []
        for x_t in self.norm(x).split(1, dim=1):
            h, c = self.cell(x_t, (h, c))
            outs.append(self.head(h))
        return torch.cat(outs, dim=1)


def waves() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    t = torch.arange(0, 41, dtype=torch.float32)
    wave = torch.sin((t[None, :] + torch.randint(-8, 8, (6, 1), generator=g)) / 4)
    return wave[:, :-1], wave[:, 1:]


def lbfgs(model: nn.Module) -> torch.optim.LBFGS:
    return torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=5)


def closure_of(model: nn.Module, opt: torch.optim.Optimizer, x, y, seen: list | None = None):
    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        if seen is not None:
            seen.append(loss)
        return loss

    return closure


def test_an_lbfgs_step_reads_its_first_closure_evaluation() -> None:
    """Every step sampled: a step's output statistics are those of the closure's first
    evaluation (the weights before the step: one evaluation's 40 calls of the head, not
    five's), and the updates are the optimizer's own (the same weights as a bare copy's)."""
    torch.manual_seed(0)
    x, y = waves()
    model = Sequence()
    bare = copy.deepcopy(model)
    opt, bare_opt = lbfgs(model), lbfgs(bare)
    evaluations: list[torch.Tensor] = []
    with hs.Monitor(model, every=1, sample=None) as mon:
        for _ in range(2):
            first = copy.deepcopy(model)
            opt.step(closure_of(model, opt, x, y, evaluations))
            bare_opt.step(closure_of(bare, bare_opt, x, y))
            mon.step()
    assert len(evaluations) == 10  # five a step: four read as unsampled
    for p, q in zip(model.parameters(), bare.parameters(), strict=True):
        assert torch.equal(p, q)
    (last,) = [r for r in mon.records if r["type"] == "step" and r["step"] == 1]
    with torch.no_grad():
        head = torch.cat([first.head(h) for h in hidden_states(first, x)])
    assert last["act"]["head"]["numel"] == head.numel()
    assert last["act"]["head"]["mean"] == pytest.approx(head.mean().item(), rel=1e-4)
    assert last["act"]["head"]["absmax"] == pytest.approx(head.abs().max().item(), rel=1e-5)


def hidden_states(model: Sequence, x: torch.Tensor) -> list[torch.Tensor]:
    h = c = x.new_zeros(x.shape[0], 16)
    states = []
    for x_t in model.norm(x).split(1, dim=1):
        h, c = model.cell(x_t, (h, c))
        states.append(h)
    return states


def test_a_closure_evaluated_again_runs_with_no_hook_on_any_module_but_the_model() -> None:
    """Every step sampled: each step's first evaluation runs every module's hooks, the later
    ones only the model's own, from the first step on (the optimizer is adopted as its
    ``step()`` starts, before the closure runs)."""
    torch.manual_seed(0)
    x, y = waves()
    model = Sequence()
    opt = lbfgs(model)
    seen: list[tuple[int, bool, bool, set[str]]] = []
    with hs.Monitor(model, every=1) as mon:

        def closure() -> torch.Tensor:
            state = step_state(mon)
            where = {line.split(":")[0] for line in hooks_on(model, only_hookscope=True)}
            where -= {"torch.optim.optimizer"}
            seen.append((mon.step_count, state.reading, state.light, where))
            return closure_of(model, opt, x, y)()

        for _ in range(3):
            opt.step(closure)
            mon.step()
    assert all(r["sampled"] for r in mon.records if r["type"] == "step")
    for step in range(3):
        evaluations = [(reading, light, where) for s, reading, light, where in seen if s == step]
        assert len(evaluations) == 5
        reading, light, where = evaluations[0]
        assert reading and light == (step > 0) and where == {"<root>", "norm", "cell", "head"}
        assert evaluations[1:] == [(False, True, {"<root>"})] * 4


def nonfinite_in_third_evaluation(every: int | None, check: str) -> list[tuple]:
    """Three LBFGS steps; the closure's third evaluation of step 2 feeds an all-zero batch,
    of which the model's first module makes a NaN (0 x inf). The nonfinite findings."""
    torch.manual_seed(0)
    x, y = waves()
    model = Sequence()
    opt = lbfgs(model)
    evaluations = [0]

    def closure() -> torch.Tensor:
        evaluations[0] += 1
        bad = mon.step_count == 2 and evaluations[0] == 3
        return closure_of(model, opt, torch.zeros_like(x) if bad else x, y)()

    with hs.Monitor(model, every=every, check=check) as mon:
        for _ in range(3):
            evaluations[0] = 0
            opt.step(closure)
            mon.step()
    return [f for f in mon.findings if f.kind == "nonfinite"]


@pytest.mark.parametrize("every", [1, None])
@pytest.mark.parametrize("check", ["edges", "modules"])
def test_a_nan_made_in_a_later_evaluation_is_found_where_it_was_made(
    check: str, every: int | None
) -> None:
    """Found at that step in the module that made it, sampled or not, whether every module
    or only the model's edges are checked (then localised right after that evaluation, by a
    replay with the weights it ran with: at the step's end LBFGS has moved them, and they
    are NaN); LBFGS then updates with the NaN, which is found too."""
    found = nonfinite_in_third_evaluation(every, check)
    assert [(f.step, f.module, f.phase) for f in found] == [
        (2, "norm", "forward"),
        (2, "cell", "update"),
    ]
    if check == "edges":  # the replay names the op and the line
        line = Normalize.forward.__code__.co_firstlineno + 1  # its return: 0 x rsqrt(0)
        assert found[0].op == "aten.rsqrt"
        assert found[0].source.endswith(f"test_closure_steps.py:{line}")
