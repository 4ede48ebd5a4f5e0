"""The Monitor never makes the host wait for the device in a step, beyond the step's transfer.

On a GPU, a tensor made from host data (``torch.tensor(n, device=...)``, ``x.new_tensor(n)``)
is a blocking copy and a read of one value (``.item()``, ``float(t)``, ``bool(t)``) waits for
every kernel queued before it: one of either per module call turns a sampled step of GPT-2 on
an H200 into six bare steps (benchmarks/README.md, "CUDA"). The buffer's one transfer per
step is not an aten op, so what an op-level counter sees here is exactly what must not be
there. Counted on the CPU with a dispatch mode, as ``aten.lift_fresh`` (host data into a
tensor) and ``aten._local_scalar_dense`` (a value read), against the bare step.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import hookscope as hs
from models import ResNet, gpt2, token_ids

HOST_OPS = ("aten.lift_fresh.default", "aten._local_scalar_dense.default")


class HostOps(TorchDispatchMode):
    """Counts the ops that move data between host and device."""

    def __init__(self) -> None:
        super().__init__()
        self.count: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if str(func) in HOST_OPS:
            self.count[str(func)] += 1
        return func(*args, **(kwargs or {}))


def host_ops_per_step(
    make: Callable[[], nn.Module], data: Callable[[], Any], loss_of: Callable, **monitor: Any
) -> list[Counter[str]]:
    """Host ops of steps 2 to 5 (after two warm-up steps) of a training loop."""
    torch.manual_seed(0)
    model = make()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = hs.Monitor(model, **monitor) if monitor else None
    counts = []
    try:
        for step in range(6):
            x = data()
            with HostOps() as ops:
                loss = loss_of(model, x)
                loss.backward()
                opt.step()
                opt.zero_grad()
                if mon is not None:
                    mon.step(loss=loss)
            if step >= 2:
                counts.append(ops.count)
    finally:
        if mon is not None:
            mon.close()
    return counts


def gpt2_case() -> tuple[Callable, Callable, Callable]:
    return (
        lambda: gpt2(2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0).train(),
        token_ids,
        lambda m, ids: m(ids).logits.square().mean(),
    )


def resnet_case() -> tuple[Callable, Callable, Callable]:
    return (
        lambda: ResNet().train(),
        lambda: torch.randn(4, 3, 16, 16),
        lambda m, x: m(x).square().mean(),
    )


@pytest.mark.parametrize("case", [gpt2_case, resnet_case], ids=["gpt2", "resnet"])
@pytest.mark.parametrize("every", [None, 2, 1])
def test_a_monitored_step_reads_nothing_from_the_device_the_bare_step_does_not(
    case: Callable, every: int | None
) -> None:
    make, data, loss_of = case()
    bare = host_ops_per_step(make, data, loss_of)
    watched = host_ops_per_step(make, data, loss_of, every=every)
    assert watched == bare  # step by step, sampled (even) and unsampled (odd) alike


def transfers_per_step(
    every: int | None, given: Callable[[torch.Tensor], Any], clips: int = 1
) -> list[int]:
    """Device-to-host transfers of the Monitor's buffer in steps 2 to 5 of GPT-2 trained
    with AdamW and gradient clipping (``clips``: one call per part of the parameters),
    ``mon.step(loss=given(loss))``."""
    from hookscope._monitor._step import _buffer

    calls = []
    real = _buffer._to_lists

    def counted(values: list[torch.Tensor]) -> list[list[float]]:
        calls.append(len(values))
        return real(values)

    make, data, loss_of = gpt2_case()
    torch.manual_seed(0)
    model = make()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    counts = []
    with pytest.MonkeyPatch.context() as patch, hs.Monitor(model, every=every) as mon:
        patch.setattr(_buffer, "_to_lists", counted)
        for step in range(6):
            calls.clear()
            loss = loss_of(model, data())
            loss.backward()
            params = list(model.parameters())
            for part in range(clips):
                torch.nn.utils.clip_grad_norm_(params[part::clips], 1.0)
            opt.step()
            opt.zero_grad()
            mon.step(loss=given(loss))
            if step >= 2:
                counts.append(len(calls))
        assert [r["scalars"]["loss"] for r in mon.records if r.get("type") == "step"][-1] == (
            pytest.approx(loss.item())
        )
    return counts


@pytest.mark.parametrize("given", [lambda x: x, torch.Tensor.detach], ids=["loss", "loss.detach()"])
def test_an_unsampled_step_moves_its_values_once_before_the_update(given: Callable) -> None:
    # The flags, the loss and the clip's norm go to the host together just before the
    # optimizer's update; step() then has nothing left to move (one host sync, not two).
    assert transfers_per_step(None, given) == [1, 1, 1, 1]
    # Sampled steps (even) move again after the update, for the update ratios.
    assert transfers_per_step(2, given) == [2, 1, 2, 1]
    # Two clips (a model in parts): their total norm is made once and moves once too.
    assert transfers_per_step(None, given, clips=2) == [1, 1, 1, 1]
