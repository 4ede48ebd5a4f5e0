"""What a Monitor is given: its options checked, threshold overrides, the ranks it runs on,
the scalars and batch indices a step is given; each mistake an error that names the fix."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .._diagnose import Thresholds
from .._errors import HookscopeError, did_you_mean
from ._step._dist import Alone, Collective

__all__ = [
    "batch_list",
    "check_batch_indices",
    "check_explain",
    "check_options",
    "check_record_dir",
    "device_of",
    "is_leaf",
    "ranks",
    "settings",
    "thresholds_from",
]


def check_options(every: int | None, on_nonfinite: str, log_dir: str | Path | None) -> None:
    if every is not None and (not isinstance(every, int) or every < 1):
        raise ValueError(
            f"every must be a positive number of steps, or None for the non-finite check "
            f"only; got {every!r}"
        )
    if on_nonfinite not in ("log", "raise", "skip"):
        raise ValueError(f"on_nonfinite must be 'log', 'raise' or 'skip', got {on_nonfinite!r}")
    if log_dir is not None and Path(log_dir).exists() and not Path(log_dir).is_dir():
        raise HookscopeError(
            f"log_dir={str(log_dir)!r} is a file, not a directory.\nFix: pass a directory "
            "for the run's log (it is created when missing), e.g. log_dir='runs/exp1'."
        )


def check_mode(check: Any) -> str:
    """``check=``: ``"edges"`` or ``"modules"`` (where the non-finite check looks)."""
    if check not in ("edges", "modules"):
        raise ValueError(
            f"check must be 'edges' (the model's edges, a replay names the module) or "
            f"'modules' (every module's output and gradient on every step), got {check!r}"
        )
    return check


def check_explain(explain: Any) -> Any:
    """``explain=`` is an ``hs.Probe`` (imported here, only when one is given)."""
    from .._explain._probe import Probe

    if not isinstance(explain, Probe):
        raise TypeError(
            f"Monitor(explain=...) takes an hs.Probe, got {type(explain).__name__}. Fix: "
            "explain=hs.Probe(images, where='layer4', every=100)."
        )
    return explain


def check_record_dir(record_dir: str | Path | None, sharded: bool) -> None:
    """The flight recorder needs the whole model's state: no sharded parameters."""
    if sharded and record_dir is not None:
        raise ValueError(
            "record_dir= does not support sharded (FSDP2) parameters yet: the replay "
            "bundle holds the whole model's state. Leave record_dir unset."
        )


def thresholds_from(
    base: Thresholds | None, overrides: dict[str, float], options: Callable[[], list[str]]
) -> Thresholds:
    """``base`` with single fields overridden; a misspelt keyword gets a did-you-mean among
    the threshold fields and the Monitor's ``options()``."""
    names = [f.name for f in fields(Thresholds)]
    for key in overrides:
        if key not in names:
            known = options()
            raise TypeError(
                f"Monitor() got an unexpected keyword argument {key!r}"
                f"{did_you_mean(key, [*known, *names])}. Monitor options: {', '.join(known)}; "
                f"threshold fields (see hs.Thresholds): {', '.join(names)}."
            )
    return Thresholds(**{**asdict(base or Thresholds()), **overrides})


def settings(
    every: int | None,
    sample: int | None,
    on_nonfinite: str,
    histograms: bool,
    bins: int,
    thresholds: Thresholds,
    precision: list[str],
) -> dict[str, Any]:
    """The Monitor's settings, as the log's header records them and the ranks' handshake
    compares them."""
    return {
        "every": every,
        "sample": sample,
        "on_nonfinite": on_nonfinite,
        "histograms": histograms,
        "bins": bins,
        "thresholds": asdict(thresholds),
        "precision": precision,
    }


def ranks(sync: bool | None) -> tuple[int | None, int, Alone | Collective]:
    """Under ``torch.distributed`` with several ranks, this process's rank (``None``: one
    process), the number of ranks, and the collective that combines their figures (``Alone``:
    one process, or ``sync=False``)."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return None, 1, Alone()
    return dist.get_rank(), dist.get_world_size(), Collective() if sync is not False else Alone()


def is_leaf(name: str, module: nn.Module) -> bool:
    """A module without children (the model itself, when it has none: ``nn.Linear``)."""
    return next(iter(module.children()), None) is None


def device_of(model: nn.Module) -> torch.device:
    """Where the model's first parameter or buffer lives (the CPU when it has none)."""
    first = next(model.parameters(), None)
    first = first if first is not None else next(model.buffers(), None)
    return first.device if first is not None else torch.device("cpu")


def check_batch_indices(batch: Any) -> None:
    if batch is not None and not isinstance(batch, torch.Tensor) and not hasattr(batch, "__iter__"):
        raise TypeError(
            f"batch_indices must be a sequence or tensor of ints (the data-set indices of the "
            f"step's batch), got {type(batch).__name__}"
        )


def batch_list(batch: Any) -> list[int] | None:
    """``batch_indices`` as a list of ints, read only at a spike (a tensor's ``tolist()``
    waits for the device)."""
    if batch is None:
        return None
    if isinstance(batch, torch.Tensor):
        return [int(i) for i in batch.reshape(-1).tolist()]
    return [int(i) for i in batch]
