"""A batch into the model, and a chosen module's output out to host memory.

A batch is a tensor (``model(x)``), a tuple or list whose first item is the input (``(x, y)``
loaders), or a dict of keyword arguments (``model(**batch)``); its tensors go to the model's
device. An output's first tensor is cast and copied to host memory (pinned, from CUDA,
asynchronously), or kept without a copy when nothing else can change it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from .._errors import HookscopeError
from .._tree import describe, map_tensors, tensors

__all__ = ["device_of", "inputs", "to_host"]


def device_of(model: nn.Module) -> torch.device:
    for t in (*model.parameters(), *model.buffers()):
        return t.device
    return torch.device("cpu")


def inputs(batch: Any, device: torch.device) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` for the model: a tensor, ``(x, y, ...)``, or a dict of keywords."""
    if isinstance(batch, (tuple, list)):
        if not batch:
            raise ValueError("extract_dataset: the loader gave an empty tuple as a batch")
        batch = batch[0]

    def move(t: torch.Tensor) -> torch.Tensor:
        return t if t.device == device else t.to(device, non_blocking=True)

    if isinstance(batch, Mapping):
        return (), {k: map_tensors(move, v) for k, v in batch.items()}
    return (map_tensors(move, batch),), {}


def to_host(
    name: str,
    output: Any,
    dtype: torch.dtype | None,
    cuda: list[bool],
    last: bool,
    held: set[int],
) -> torch.Tensor:
    """The first tensor of ``output``, cast, copied to host memory (pinned, from CUDA).

    The output of the ``last`` chosen module is kept as it is, without a copy, when it owns its
    whole storage and that storage is not ``held`` elsewhere (a parameter, a buffer, the batch):
    the forward stops right after it, so nothing can change it.
    """
    t = output if isinstance(output, torch.Tensor) else next(iter(tensors(output)), None)
    if t is None:
        raise HookscopeError(
            f"extract_dataset: module {name!r} returned {describe(output)}, which holds no tensor"
        )
    t = t.detach()
    target = dtype if (dtype is not None and t.is_floating_point()) else t.dtype
    if t.device.type == "cuda":
        cuda.append(True)
        host = torch.empty(t.shape, dtype=target, pin_memory=True)
        return host.copy_(t.to(target), non_blocking=True)
    if t.device.type != "cpu":
        return t.to("cpu", dtype=target).contiguous()
    storage = t.untyped_storage()
    if (
        last
        and target == t.dtype
        and t.is_contiguous()
        and storage.nbytes() == t.nbytes
        and storage.data_ptr() not in held
    ):
        return t
    return torch.empty(t.shape, dtype=target).copy_(t)
