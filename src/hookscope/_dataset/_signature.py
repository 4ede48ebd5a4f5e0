"""What a resumed extract_dataset compares before touching ``out``: model, sites, data.

The signature is hashes and sizes, stored in the manifest: the architecture (module classes,
parameter and buffer names, shapes, dtypes), a sample of the weights, and the data set's
first batch. A resume that differs in any of them is refused with the list of differences.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .._tree import describe, tensors

__all__ = ["DATA_DIFFERS", "differences", "fingerprint", "model_signature", "refusal"]

DATA_DIFFERS = (
    "the data set differs: its first batch is not the one extracted before (with random "
    "transforms, make them deterministic to resume)"
)


def _sample_bytes(t: torch.Tensor, k: int) -> bytes:
    """Up to ``k`` evenly spaced values of ``t``, as bytes (exact, whatever the device)."""
    t = t.detach()
    if t.device.type == "meta" or t.numel() == 0:
        return b""
    flat = t.reshape(-1)
    n = flat.numel()
    if n > k:
        flat = flat[torch.arange(k, device=flat.device) * (n - 1) // (k - 1)]
    return flat.cpu().contiguous().view(torch.uint8).numpy().tobytes()


def model_signature(model: nn.Module) -> dict[str, str]:
    arch = hashlib.sha256()
    weights = hashlib.sha256()
    for name, module in model.named_modules():
        arch.update(f"{name}:{type(module).__qualname__};".encode())
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        arch.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
        weights.update(_sample_bytes(t, 4096))
    return {"architecture": arch.hexdigest(), "weights": weights.hexdigest()}


def fingerprint(batch: Any) -> str:
    h = hashlib.sha256(describe(batch).encode())
    for t in tensors(batch):
        h.update(_sample_bytes(t, 1 << 16))
    return h.hexdigest()


def differences(stored: dict[str, Any], now: dict[str, Any]) -> list[str]:
    out = []
    if stored["model"]["architecture"] != now["model"]["architecture"]:
        out.append("the model differs (class, parameter or buffer names, shapes or dtypes)")
    elif stored["model"]["weights"] != now["model"]["weights"]:
        out.append("the model's weights differ (same architecture)")
    if stored["where"] != now["where"]:
        out.append(f"where: the store has {stored['where']}, this call chose {now['where']}")
    # dtype, world_size, and what another verb stores besides (explain_dataset's method)
    for key in sorted((set(stored) | set(now)) - {"model", "where", "data"}):
        a, b = stored.get(key), now.get(key)
        if isinstance(a, (dict, type(None))) and isinstance(b, (dict, type(None))):
            a, b = a or {}, b or {}  # explain: {method, target, ...} (none: an extraction)
            for k in sorted(set(a) | set(b)):
                if a.get(k) != b.get(k):
                    out.append(f"{k}: the store has {a.get(k)!r}, this call has {b.get(k)!r}")
        elif a != b:
            out.append(f"{key}: the store has {a}, this call has {b}")
    for key in ("rows", "batches", "dataset_len"):
        a, b = stored["data"].get(key), now["data"].get(key)
        if a is not None and b is not None and a != b:
            out.append(f"the data set differs: {key} {a} in the store, {b} now")
    return out


def refusal(out: Path, problems: list[str], verb: str = "extract_dataset") -> str:
    return (
        f"{verb}: {str(out)!r} holds features of another extraction, so it was left "
        "untouched:\n  - " + "\n  - ".join(problems) + "\n"
        f"Fix: pass a new `out`, or delete {str(out)!r} to start over."
    )
