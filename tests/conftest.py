"""Shared fixtures: seeded RNG, offline Hugging Face, small thread count; the
``requires_torch`` marker."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from hookscope._compat import TORCH, release

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
torch.set_num_threads(2)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """``@pytest.mark.requires_torch("2.10", reason=...)``: the test needs a capability the
    running torch release lacks (the reason says which), so it is skipped on older ones. Never
    for a hookscope bug: that is a failing test."""
    for mark in item.iter_markers("requires_torch"):
        if not mark.kwargs.get("reason"):
            raise pytest.UsageError(f"{item.nodeid}: requires_torch needs a reason=")
        if release(mark.args[0]) > TORCH:
            pytest.skip(f"needs torch>={mark.args[0]}: {mark.kwargs['reason']}")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    """Accelerate keeps process-wide singletons: a Trainer run (the integration tests) leaves
    gradient-accumulation state behind that would make a later test's optimizer skip steps."""
    yield
    if "accelerate" in sys.modules:
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
