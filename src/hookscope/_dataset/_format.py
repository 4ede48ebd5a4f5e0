"""The on-disk format of a feature store: file names, safetensors written by hand, the ledger.

Both sides read this module: the writer (``_writer``, ``_run``) and the reader (``_store``).
Every file is written to a temporary name, fsynced and renamed, so a kill leaves either the
old file or the new one; the ledger is appended line by line, and a line cut short by a kill
is not committed.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import struct
from pathlib import Path
from typing import Any

import torch

from .._errors import FeatureStoreError

__all__ = [
    "CODES",
    "FORMAT",
    "OURS",
    "VERSION",
    "FeatureStoreError",  # defined in _errors; also importable from here
    "dtype_name",
    "files",
    "read_ledger",
    "replace",
    "shard_name",
    "write_json",
    "write_safetensors",
]

FORMAT = "hookscope.features"
VERSION = 1
OURS = re.compile(r"^\.?rank\d+[.-]")  # every file extract_dataset writes


def files(rank: int) -> dict[str, str]:
    return {
        "manifest": f"rank{rank}.manifest.json",
        "order": f"rank{rank}.order.safetensors",
        "ledger": f"rank{rank}.ledger.jsonl",
    }


def shard_name(rank: int, i: int) -> str:
    return f"rank{rank}-{i:06d}.safetensors"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# -- safetensors, written by hand: streamed from per-batch tensors, no concatenation -----------

CODES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}  # fmt: skip
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2")):
    if hasattr(torch, _name):
        CODES[getattr(torch, _name)] = _code


def write_safetensors(
    path: Path, items: list[tuple[str, list[torch.Tensor]]], metadata: dict[str, str]
) -> None:
    """Write ``{key: torch.cat(chunks)}`` as a safetensors file, then fsync it.

    Tensors are laid out by decreasing item size (as safetensors does) so each stays aligned.
    """
    items = sorted(items, key=lambda kv: -kv[1][0].element_size())
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for key, chunks in items:
        first = chunks[0]
        size = sum(c.numel() for c in chunks) * first.element_size()
        shape = [sum(c.shape[0] for c in chunks), *first.shape[1:]]
        header[key] = {
            "dtype": CODES[first.dtype],
            "shape": shape,
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(len(raw) + 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for _, chunks in items:
            for chunk in chunks:
                if chunk.numel():
                    f.write(chunk.reshape(-1).view(torch.uint8).numpy())
        f.flush()
        os.fsync(f.fileno())


def replace(tmp: Path, final: Path) -> None:
    """Atomically move ``tmp`` to ``final`` and make the rename durable."""
    os.replace(tmp, final)
    with contextlib.suppress(OSError):  # directories cannot be fsynced on every platform
        fd = os.open(final.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name("." + path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    replace(tmp, path)


def read_ledger(path: Path) -> tuple[list[dict[str, Any]], dict[str, Any] | None, int]:
    """Committed shards, the "done" line (or None), and the length of the valid prefix.

    A line cut short by a kill (no newline yet) is not committed.
    """
    data = path.read_bytes() if path.exists() else b""
    end = data.rfind(b"\n") + 1
    entries = [json.loads(line) for line in data[:end].splitlines() if line.strip()]
    done = next((e for e in entries if e.get("done")), None)
    return [e for e in entries if "shard" in e], done, end
