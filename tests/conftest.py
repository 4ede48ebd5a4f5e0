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


# Dynamo 2.9 (seen on 2.9.1; not on 2.13 or 2.14) lets out a UserWarning of its own while it
# wraps a non-leaf tensor (safe_has_grad reads .grad under hide_warnings, which misses it), and
# -W error makes that an internal Dynamo error. Not hookscope's: from 2.10 on it stays an error.
_DYNAMO_GRAD_WARNING = "ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if release("2.10") > TORCH:
        for item in items:
            item.add_marker(pytest.mark.filterwarnings(_DYNAMO_GRAD_WARNING))


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


@pytest.fixture(autouse=True)
def _no_compiled_code_from_earlier_tests():
    """Each test starts without the compiled code of earlier tests: Dynamo caches a class's
    compiled ``forward`` for every instance of it, and an attach to a model of a class another
    test compiled rightly warns that it traces it again (a user's process would too)."""
    yield
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:
        dynamo.reset()
