"""Tap: an identity module that turns any intermediate tensor into a named site."""

from __future__ import annotations

from typing import TypeVar

from torch import nn

__all__ = ["Tap"]

T = TypeVar("T")


class Tap(nn.Module):
    """Identity module that names an intermediate value, so hooks can reach it.

    Put one in a model's ``__init__`` and pass a value through it in ``forward``
    (``x = self.tap_scores(x)``). It returns its argument unchanged (the very same object),
    costs one module call, and holds no parameters, so adding it changes no result and no
    ``state_dict``. The tensor becomes a site that :func:`capture`, :func:`intervene` and
    :class:`Monitor` see like any module's output, gradients included. A model holding Taps
    saves and copies like any other (``torch.save(model, f)``, ``copy.deepcopy``; hooks
    hookscope attached are left out), but a whole-model pickle names the Tap class, as it
    names the model's own: loading it needs hookscope importable (a ``state_dict`` does not).

    Example:
        >>> import torch, hookscope as hs, torch.nn as nn
        >>> class Net(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.fc, self.tap_pre = nn.Linear(4, 4), hs.Tap()
        ...     def forward(self, x):
        ...         return self.tap_pre(self.fc(x) * 2).relu()
        >>> net = Net()
        >>> with hs.capture(net, "tap_pre") as cap:
        ...     _ = net(torch.randn(2, 4))
        >>> cap["tap_pre"].output.shape
        torch.Size([2, 4])
    """

    def forward(self, x: T) -> T:
        return x
