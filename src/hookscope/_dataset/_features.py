"""What a data-set pass stores for each batch: the columns of a store and how a batch fills them.

:func:`~._run.write_dataset` runs any :class:`Features` over a loader into the resumable store;
:class:`ModuleOutputs` is ``extract_dataset``'s (the chosen modules' outputs). Another verb
(``hs.explain_dataset``: each sample's map) gives its own.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any, Protocol

import torch
from torch import nn

from .._errors import StopForward
from .._hooks import HookSet, training_mode
from .._tree import tensors
from ._batch import to_host

__all__ = ["Features", "ModuleOutputs"]


class Features(Protocol):
    """The columns of a store (``names``, each stored under ``keys``) and how one batch fills
    them: ``features(batch, args, kwargs)`` runs the model on the batch's ``(args, kwargs)``
    (already on the model's device) and returns ``({name: tensor [rows, ...]}, pending)``,
    one row per data-set row (a name left out: that module never ran); ``pending`` when the
    tensors are host copies from CUDA still under way. Batches run inside ``attached()``."""

    names: list[str]
    keys: list[str]

    def attached(self) -> contextlib.AbstractContextManager[None]: ...

    def __call__(
        self, batch: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[dict[str, torch.Tensor], bool]: ...


class ModuleOutputs:
    """``extract_dataset``'s columns: the chosen modules' outputs (their first tensor, cast to
    ``dtype``), from one forward without gradients in eval mode, stopped right after the last
    chosen module."""

    def __init__(
        self, model: nn.Module, chosen: dict[str, nn.Module], dtype: torch.dtype | None
    ) -> None:
        self.model, self.chosen, self.dtype = model, chosen, dtype
        self.names = list(chosen)
        self.keys = [f"output:{n}" for n in self.names]
        self._found: dict[str, torch.Tensor] = {}
        self._cuda: list[bool] = []
        self._state: set[int] = set()
        self._held: set[int] = set()

    @contextlib.contextmanager
    def attached(self) -> Iterator[None]:
        self._state = {t.untyped_storage().data_ptr() for t in self.model.state_dict().values()}
        with HookSet("extract_dataset") as hooks, training_mode(self.model, False):
            for name, module in self.chosen.items():
                hooks.forward(module, functools.partial(self._keep, name))
            yield

    def _keep(self, name: str, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if name in self._found:
            return
        last = len(self._found) + 1 == len(self.names)
        self._found[name] = to_host(name, output, self.dtype, self._cuda, last, self._held)
        if len(self._found) == len(self.names):
            raise StopForward

    def __call__(
        self, batch: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[dict[str, torch.Tensor], bool]:
        self._found, self._cuda = {}, []
        held = self._state | {t.untyped_storage().data_ptr() for t in tensors(batch)}
        self._held = held | {t.untyped_storage().data_ptr() for t in tensors((args, kwargs))}
        with torch.no_grad(), contextlib.suppress(StopForward):
            self.model(*args, **kwargs)
        return self._found, any(self._cuda)
