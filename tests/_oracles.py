"""Oracles that use no hookscope, for the tests on real architectures.

``Outputs`` keeps what chosen modules return through forward hooks written by hand;
``assert_same`` and ``assert_same_grads`` compare bit for bit; ``lm_loss`` is a language
model's loss with labels = inputs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn


def flat(value: Any) -> list[torch.Tensor]:
    """Every tensor in a (nested) value, in hookscope's walking order."""
    from hookscope._tree import tensors

    return tensors(value)


def assert_same(a: Any, b: Any) -> None:
    """Same container type and bit-identical tensors; non-tensor leaves equal."""
    assert type(a) is type(b) or (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor))
    if isinstance(a, torch.Tensor):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert torch.equal(a, b), (a - b).abs().max()
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            assert_same(a[key], b[key])
    elif a is None or isinstance(a, (bool, int, float, str)):
        assert a == b


def clone_tree(value: Any) -> Any:
    from hookscope._tree import map_tensors

    return map_tensors(lambda t: t.clone(), value)


def lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(ids, labels=ids, use_cache=False).loss


def param_grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {name: p.grad for name, p in model.named_parameters()}


def assert_same_grads(a: nn.Module, b: nn.Module) -> None:
    ga, gb = param_grads(a), param_grads(b)
    assert list(ga) == list(gb)
    for name in ga:
        if ga[name] is None or gb[name] is None:
            assert ga[name] is None and gb[name] is None, name
        else:
            assert torch.equal(ga[name], gb[name]), name


class Outputs:
    """Hand-written oracle: keep (by reference, graph attached) what chosen modules return."""

    def __init__(self, model: nn.Module, names: list[str]) -> None:
        self.values: dict[str, Any] = {}
        self.inputs: dict[str, tuple] = {}
        modules = dict(model.named_modules())
        self.handles = [
            modules[name].register_forward_hook(self._hook(name), with_kwargs=True)
            for name in names
        ]

    def _hook(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            self.values[name] = output
            self.inputs[name] = args

        return hook

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
