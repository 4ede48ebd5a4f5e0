"""The Monitor's warnings (``_monitor/_warnings.py``): each once per Monitor, at the line of
the script that called ``step()``, and none where the step was watched."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
from torch import nn

import hookscope as hs
from hookscope._monitor._warnings import Warnings
from models import ResNet, images


def train(model: nn.Module, mon: hs.Monitor, call, steps: int = 3) -> list[int]:
    """``steps`` training steps, the model run through ``call``; the lines of mon.step()."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    lines = []
    for _ in range(steps):
        out = call(images().flatten(1) if isinstance(model, nn.Linear) else images())
        nn.functional.cross_entropy(out, torch.arange(4) % 10).backward()
        opt.step()
        opt.zero_grad()
        lines.append(inspect.currentframe().f_lineno + 1)
        mon.step()
    return lines


def test_a_model_trained_through_forward_is_said_unhooked_once_at_the_scripts_line() -> None:
    model = nn.Linear(3 * 16 * 16, 10)  # no children: .forward skips every hook
    with hs.Monitor(model, every=1) as mon:
        with pytest.warns(hs.HookscopeWarning, match="none of the Monitor's hooks") as caught:
            lines = train(model, mon, model.forward)
    unhooked = [w for w in caught if "none of the Monitor's hooks" in str(w.message)]
    assert len(unhooked) == 1
    assert (unhooked[0].filename, unhooked[0].lineno) == (__file__, lines[0])
    assert "at step 0, Linear was trained" in str(unhooked[0].message)
    assert [w for w in caught if issubclass(w.category, hs.HookscopeWarning)] == unhooked


@pytest.mark.parametrize("every", [1, None])
def test_a_watched_step_or_one_never_sampled_says_nothing(every: int | None) -> None:
    model, linear = ResNet(), nn.Linear(3 * 16 * 16, 10)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with hs.Monitor(model, every=every) as watched:
            train(model, watched, model)
        with hs.Monitor(linear, every=None) as unsampled:
            train(linear, unsampled, linear.forward)  # unsampled steps do not look
    assert [str(w.message) for w in caught] == []


def test_a_step_without_an_update_is_not_said_unhooked() -> None:
    model = nn.Linear(3 * 16 * 16, 10)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with hs.Monitor(model, every=1) as mon:
            model.forward(images().flatten(1)).square().mean().backward()  # no update
            mon.step()
    assert [str(w.message) for w in caught] == []


def test_compiled_per_rank_is_said_once() -> None:
    said = Warnings()
    with pytest.warns(hs.HookscopeWarning, match="this rank's own") as caught:
        said.compiled_per_rank()
        said.compiled_per_rank()
    assert len(caught) == 1
    assert said.given == {"compiled_per_rank"}
