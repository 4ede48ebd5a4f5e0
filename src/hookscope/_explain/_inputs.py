"""The model's inputs for one explanation: positional and keyword, and the one that is masked
(Score-CAM), replaced by a baseline (integrated gradients) or shown under a heatmap.

That *primary* input is the first tensor among the positional inputs, else among the keyword
ones (``pixel_values=``). The batch size N is its first dimension; every input tensor with N
rows is a per-sample input, taken, repeated or masked along with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .._errors import ExplainError
from .._tree import map_tensors

__all__ = ["Inputs"]


@dataclass(frozen=True)
class Inputs:
    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    @classmethod
    def of(cls, x: Any, forward_kwargs: dict[str, Any] | None) -> Inputs:
        args = x if isinstance(x, tuple) else (x,)
        inputs = cls(args, dict(forward_kwargs or {}))
        if inputs._primary_key() is None:
            raise ExplainError(
                "explain needs at least one input tensor (x, or a tensor in forward_kwargs): "
                "its first dimension is the batch."
            )
        with torch.inference_mode(False):  # tensors of inference mode cannot be saved
            inputs = inputs.map(lambda t: t.clone() if t.is_inference() else t)
        return inputs

    def _primary_key(self) -> int | str | None:
        for i, a in enumerate(self.args):
            if isinstance(a, torch.Tensor):
                return i
        for key, value in self.kwargs.items():
            if isinstance(value, torch.Tensor):
                return key
        return None

    @property
    def primary(self) -> torch.Tensor:
        key = self._primary_key()
        return self.args[key] if isinstance(key, int) else self.kwargs[key]  # type: ignore[index]

    @property
    def n(self) -> int:
        return self.primary.shape[0] if self.primary.dim() else 1

    @property
    def image_size(self) -> tuple[int, ...] | None:
        """The spatial size of a floating ``[N, C, *spatial]`` primary input, else ``None``."""
        x = self.primary
        return tuple(x.shape[2:]) if x.is_floating_point() and x.dim() >= 3 else None

    def call(self, model: torch.nn.Module) -> Any:
        return model(*self.args, **self.kwargs)

    def map(self, fn: Any) -> Inputs:
        return Inputs(map_tensors(fn, self.args), map_tensors(fn, self.kwargs))

    def with_primary(self, value: torch.Tensor) -> Inputs:
        key = self._primary_key()
        if isinstance(key, int):
            return Inputs((*self.args[:key], value, *self.args[key + 1 :]), self.kwargs)
        return Inputs(self.args, {**self.kwargs, key: value})  # type: ignore[dict-item]

    def rows(self, index: torch.Tensor) -> Inputs:
        """Every per-sample input at rows ``index`` (repeats allowed)."""
        n = self.n
        return self.map(lambda t: t[index.to(t.device)] if t.dim() and t.shape[0] == n else t)

    def repeat(self, times: int) -> Inputs:
        """Every per-sample input stacked ``times`` over: ``[x; x; ...]``."""
        return self.rows(torch.arange(self.n).repeat(times))
