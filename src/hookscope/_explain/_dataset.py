"""``hs.explain_dataset``: every sample's map of a loader, on disk in the resumable store of
``extract_dataset`` (``_dataset.write_dataset``), read back as a ``FeatureStore``.

Each batch is explained by :func:`~._run.explain_batch` (the model left as it was, eval mode);
the store holds one column per module (the map of its last call, ``[N, *grid]`` for the CAM
methods, shaped like its output for the attribution methods), ``score`` (the explained score)
and, unless the target is a callable, ``target`` (the explained index).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from .._dataset import FeatureStore, write_dataset
from .._errors import ExplainError, TargetError
from .._hooks import uncompiled
from .._select import Where, select
from ._inputs import Inputs
from ._run import check_method, explain_batch
from ._target import check_target

__all__ = ["explain_dataset"]

COLUMNS = ("target", "score")  # stored beside the maps


def explain_dataset(
    model: nn.Module,
    loader: Iterable[Any],
    where: Where,
    out: str | os.PathLike[str],
    *,
    method: str = "gradcam",
    target: Any = None,
    shard_rows: int | None = None,
    progress: bool = True,
    **explain_kwargs: Any,
) -> FeatureStore:
    """Explain every sample of ``loader`` and store the maps in ``out``; resumable.

    The store and its guarantees are those of :func:`hookscope.extract_dataset`: memory
    bounded (maps go to a writer thread through a bounded buffer), a progress bar, a call
    stopped half-way resumes and ends with the same files as an uninterrupted one, and a
    call with another model, ``where``, data set, method, target or option is refused
    ``out`` before a file is touched. A batch is a tensor, an ``(x, y, ...)`` tuple or list,
    or a dict of keyword arguments; each is explained as :func:`hookscope.explain` would
    (eval mode, the model left exactly as it was).

    Args:
        model: The model (eager, or compiled: the eager maps).
        loader: A ``DataLoader`` or any iterable of batches (see ``extract_dataset`` for the
            rows ``store.index`` holds).
        where: Which modules; one column per module (a module called several times: the map
            of its last call).
        out: A directory: new, empty, or holding this same explanation (it resumes).
        method: Any method of :func:`hookscope.explain`.
        target: ``None`` (each sample's top class), an int (one class for every sample),
            ``"label"`` (the second item of each ``(x, y)`` batch: the true class), or a
            callable ``output -> [N]`` scores.
        shard_rows: Rows per shard file at most (default: about 64 MiB of maps per shard).
        progress: Show a progress bar (needs ``tqdm``; silent without it).
        **explain_kwargs: ``layout``, ``batch_size``, ``steps``, ``baseline``, ``train`` and
            ``buffer_bytes`` (bytes of maps held in memory before computing waits for the
            disk), as for :func:`hookscope.explain` and ``extract_dataset``.

    Returns:
        A :class:`FeatureStore`: ``store[module][i]`` is sample ``i``'s map, ``store["score"]``
        the explained scores, ``store["target"]`` the explained indices (not for a callable
        target), ``store.index`` the data-set rows.

    Raises:
        FeatureStoreError: If ``out`` holds another extraction or explanation, or other files.
        SelectionError: If ``where`` matches nothing. ``ExplainError``, ``TargetError``,
            ``LayoutError``: as :func:`hookscope.explain`.

    Example:
        >>> import torch, hookscope as hs, torch.nn as nn, tempfile
        >>> model = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(inplace=True),
        ...                       nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))
        >>> data = torch.utils.data.TensorDataset(torch.randn(10, 1, 8, 8), torch.arange(10) % 3)
        >>> loader = torch.utils.data.DataLoader(data, batch_size=4)
        >>> store = hs.explain_dataset(model, loader, "0", tempfile.mkdtemp(), progress=False)
        >>> store["0"][:3].shape, len(store["score"])
        (torch.Size([3, 8, 8]), 10)
    """
    check_method(method)
    _check_target(target)
    buffer_bytes = explain_kwargs.pop("buffer_bytes", None)
    options = _options(explain_kwargs)
    eager = uncompiled(model)
    chosen = select(eager, where)
    clash = [name for name in chosen if name in COLUMNS]
    if clash:
        raise ExplainError(
            f"explain_dataset stores the columns {', '.join(COLUMNS)} beside the maps, and the "
            f"model has a module named {clash[0]!r}: explain its parent or children instead."
        )
    maps = _Maps(eager, chosen, method, target, options)
    return write_dataset(
        eager,
        loader,
        out,
        maps,
        verb="explain_dataset",
        signature={
            "where": list(chosen),
            "dtype": None,
            "explain": {"method": method, "target": _describe(target), **_signed(options)},
        },
        shard_rows=shard_rows,
        progress=progress,
        **({} if buffer_bytes is None else {"buffer_bytes": buffer_bytes}),
    )


_OPTIONS = ("layout", "train", "batch_size", "steps", "baseline")


def _check_target(target: Any) -> None:
    if isinstance(target, str):
        if target != "label":
            raise TargetError(
                f"target={target!r}: the one text target is 'label' (each (x, y) batch's labels)"
            )
        return
    if target is None or callable(target):
        return
    check_target(target)  # the wrong kinds, with their message
    if isinstance(target, torch.Tensor) and target.dim() == 0:
        return
    if isinstance(target, (list, tuple, torch.Tensor)):
        raise TargetError(
            f"target={target!r}: one index per sample does not fit a loader's batches. Pass "
            "target='label' to explain each (x, y) batch's labels, an int, None, or a "
            "callable output -> [N] scores."
        )


def _options(kwargs: dict[str, Any]) -> dict[str, Any]:
    unknown = [k for k in kwargs if k not in _OPTIONS]
    if unknown:
        raise TypeError(
            f"explain_dataset() got an unexpected keyword argument {unknown[0]!r}; the explain "
            f"options are {', '.join(_OPTIONS)}, and buffer_bytes"
        )
    return dict(kwargs)


def _signed(options: dict[str, Any]) -> dict[str, Any]:
    """The options that change the maps, as JSON (a baseline tensor by a hash of its values);
    ``batch_size`` only bounds the rows per forward."""
    out: dict[str, Any] = {}
    for key, value in options.items():
        if key == "batch_size":
            continue
        if isinstance(value, torch.Tensor):
            t = value.detach().cpu().contiguous()
            digest = hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest()[:16]
            value = f"tensor {t.dtype} {list(t.shape)} {digest}"
        out[key] = value
    return out


def _describe(target: Any) -> Any:
    if callable(target):
        return f"callable {getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', type(target).__name__)}"
    return target


class _Maps:
    """explain_dataset's columns (``_dataset.Features``): each batch explained, its maps
    moved to host memory."""

    def __init__(
        self,
        model: nn.Module,
        chosen: dict[str, nn.Module],
        method: str,
        target: Any,
        options: dict[str, Any],
    ) -> None:
        self.model, self.chosen, self.method = model, chosen, method
        self.target, self.options = target, options
        self.names = [*chosen, *(["score"] if callable(target) else list(COLUMNS))]
        self.keys = [f"map:{n}" for n in chosen] + [n for n in self.names if n in COLUMNS]

    @contextlib.contextmanager
    def attached(self) -> Iterator[None]:
        yield  # explain_batch hooks and unhooks each batch, and puts the model back

    def __call__(
        self, batch: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[dict[str, torch.Tensor], bool]:
        inputs = Inputs.of(args, kwargs)
        target = _label(batch) if isinstance(self.target, str) else self.target
        explained = explain_batch(
            self.model, inputs, self.chosen, self.method, target, **self.options
        )
        found = {name: _host(maps[-1]) for name, maps in explained.maps.items()}
        found["score"] = _host(explained.score)
        if explained.target is not None:
            found["target"] = _host(explained.target.long())
        return found, False


def _host(t: torch.Tensor) -> torch.Tensor:
    """On the CPU, contiguous (a score is a column of the logits: a strided view)."""
    return t.detach().cpu().contiguous()


def _label(batch: Any) -> torch.Tensor:
    if isinstance(batch, (tuple, list)) and len(batch) > 1 and isinstance(batch[1], torch.Tensor):
        return batch[1]
    if isinstance(batch, Mapping):
        for key in ("labels", "label"):
            if isinstance(batch.get(key), torch.Tensor):
                return batch[key]
    raise TargetError(
        "target='label' explains each batch's labels: the second item of an (x, y) batch, or "
        "the 'labels' tensor of a dict batch; this loader's batch has neither. Pass target="
        "None (each sample's top class), an int, or a callable output -> [N] scores."
    )
