"""steer(): add a vector to chosen modules' hidden states at chosen positions, also during
``generate()`` with or without the KV cache."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .._hooks import HookSet, Site
from .._intervene import Intervention, intervene
from .._select import Where
from ._values import first_tensor, replace_first, value_error

__all__ = ["Steering", "steer"]

Positions = int | slice | list[int] | tuple[int, ...] | range | None


def steer(
    model: nn.Module,
    where: Where,
    vector: torch.Tensor,
    positions: Positions = None,
    *,
    scale: float = 1.0,
) -> Steering:
    """Add ``scale * vector`` to the hidden states of the chosen modules while the block runs.

    The hidden states are each module's output (its first tensor, when it returns a tuple),
    ``[N, T, C]``; ``vector`` is ``[C]``. ``positions`` are positions in the whole
    sequence: the prompt's tokens are 0 to T - 1 and each generated token takes the next
    one, whether ``generate()`` runs with its KV cache (one new token per forward call) or
    without (the whole sequence each time), so both give the same tokens. With a cache,
    the position of a call's first token is the cache's length (any keyword input of the
    model with ``get_seq_length()``, as transformers' caches have); without one, 0.

    Args:
        model: The model (its root is called at each step of ``generate()``).
        where: Which modules (``"transformer.h.6"``).
        vector: The steering vector, broadcast over the batch and positions.
        positions: ``None``: every position (the prompt and every generated token); an int,
            a list or range of positions, or a ``slice`` (``slice(5, None)``: the generated
            tokens of a 5-token prompt). Not negative: the length is not known while
            generating.
        scale: Multiplies the vector.

    Returns:
        A :class:`Steering`, a context manager; ``close()`` removes its hooks.

    Example:
        >>> import torch, hookscope as hs, torch.nn as nn
        >>> model = nn.Sequential(nn.Linear(4, 4))
        >>> with hs.steer(model, "0", torch.ones(4), positions=[1]):
        ...     y = model(torch.zeros(1, 3, 4))
        >>> (y - model(torch.zeros(1, 3, 4)))[0, :, 0].tolist()
        [0.0, 1.0, 0.0]
    """
    return Steering(model, where, vector, positions, scale)


class Steering:
    """The hooks of one :func:`steer` call; a context manager."""

    def __init__(
        self,
        model: nn.Module,
        where: Where,
        vector: torch.Tensor,
        positions: Positions,
        scale: float,
    ) -> None:
        if not isinstance(vector, torch.Tensor):
            raise TypeError(f"steer: vector must be a tensor, got {type(vector).__name__}")
        self.vector = vector.detach() * scale
        self.positions = _check_positions(positions)
        self._offset: int | None = None  # the position of the running call's first token
        self._hooks = HookSet("steer")
        try:
            self._hooks.forward_pre(model, self._root_called, prepend=True)
            self._hooks.forward(model, self._root_returned, always_call=True)
            self._edits: Intervention = intervene(model, where, self._edit)
        except BaseException:
            self._hooks.remove()
            raise

    def _root_called(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self._offset = 0
        for value in kwargs.values():
            length = getattr(value, "get_seq_length", None)
            if callable(length):
                self._offset = int(length())
                break

    def _root_returned(self, *_: Any) -> None:
        self._offset = None

    def _edit(self, output: Any, site: Site) -> Any:
        hidden = first_tensor(output)
        if hidden is None:
            raise value_error(site.name, output, "steer: the output of")
        return replace_first(output, self._add)

    def _add(self, hidden: torch.Tensor) -> torch.Tensor:
        vector = self.vector.to(hidden.device, hidden.dtype)
        if self.positions is None:
            return hidden + vector
        if hidden.dim() < 2:
            raise ValueError(
                f"steer(positions=...): the hidden states are {tuple(hidden.shape)}, with no "
                "position dimension ([N, T, C]); pass positions=None"
            )
        at = (self._offset or 0) + torch.arange(hidden.shape[1], device=hidden.device)
        mask = self._mask(at).to(hidden.dtype)
        shape = [1, hidden.shape[1]] + [1] * (hidden.dim() - 2)
        return hidden + mask.view(shape) * vector

    def _mask(self, at: torch.Tensor) -> torch.Tensor:
        chosen = self.positions
        if isinstance(chosen, slice):
            start = chosen.start or 0
            stop = chosen.stop if chosen.stop is not None else torch.iinfo(torch.int64).max
            return (at >= start) & (at < stop) & ((at - start) % (chosen.step or 1) == 0)
        return torch.isin(at, torch.tensor(chosen, device=at.device))

    def close(self) -> None:
        """Remove every hook. Safe to call more than once."""
        self._edits.close()
        self._hooks.remove()

    def __enter__(self) -> Steering:
        return self

    def __exit__(self, *exc: object) -> None:
        self._edits.__exit__(*exc)
        self._hooks.remove()

    def __repr__(self) -> str:
        return f"Steering({', '.join(self._edits.names)}, positions={self.positions!r})"


def _check_positions(positions: Positions) -> slice | tuple[int, ...] | None:
    if positions is None or isinstance(positions, slice):
        chosen: Any = positions
        bad = (
            isinstance(positions, slice)
            and any(
                v is not None and (not isinstance(v, int) or v < 0)
                for v in (positions.start, positions.stop)
            )
        ) or (isinstance(positions, slice) and positions.step is not None and positions.step < 1)
    else:
        chosen = (positions,) if isinstance(positions, int) else tuple(positions)
        bad = any(not isinstance(p, int) or isinstance(p, bool) or p < 0 for p in chosen)
    if bad:
        raise ValueError(
            f"steer: positions={positions!r}: give positions >= 0 (an int, a list, a range or a "
            "slice): while generating, the sequence's length is not known, so negative "
            "positions mean nothing"
        )
    return chosen
