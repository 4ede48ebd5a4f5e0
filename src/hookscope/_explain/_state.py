"""The model left exactly as it was: its mode, buffers and the random number generators.

Parameters and their ``.grad`` need no saving: explain differentiates with
``torch.autograd.grad`` down to the explained module only, which writes no ``.grad`` and
leaves ``requires_grad`` alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from .._hooks import training_mode
from .._record import version

__all__ = ["untouched"]


@contextlib.contextmanager
def untouched(model: nn.Module, train: bool) -> Iterator[None]:
    """Run the block with ``model.train(train)``; then put back every submodule's mode, every
    buffer (the same tensor object, with its values: BatchNorm statistics a training-mode
    pass updated) and the RNG state of the CPU and of the devices the model is on."""
    rng = _rng_state(model)
    buffers = [
        (module, name, buf, None if buf is None else buf.detach().clone(), _version(buf))
        for module in model.modules()
        for name, buf in module._buffers.items()
    ]
    try:
        with training_mode(model, train):
            yield
    finally:
        for module, name, buf, saved, seen in buffers:
            if module._buffers.get(name) is not buf:
                module._buffers[name] = buf
            # BatchNorm updates its statistics without counting a version: compare values.
            # Put back through .data, counting none either (a graph that saved the buffer,
            # the user's forward pass waiting for backward, stays valid: same values).
            if buf is not None and (_version(buf) != seen or not torch.equal(buf, saved)):
                buf.data.copy_(saved)
        _set_rng_state(rng)


def _version(buf: torch.Tensor | None) -> int | None:
    return None if buf is None else version(buf)


def _rng_state(model: nn.Module) -> dict[Any, torch.Tensor]:
    states: dict[Any, torch.Tensor] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        devices = {t.device for t in [*model.parameters(), *model.buffers()] if t.is_cuda}
        for device in devices:
            states[device] = torch.cuda.get_rng_state(device)
    return states


def _set_rng_state(states: dict[Any, torch.Tensor]) -> None:
    for device, state in states.items():
        if device == "cpu":
            torch.set_rng_state(state)
        else:
            torch.cuda.set_rng_state(state, device)
