"""Text and console helpers shared by the summary, the report, the demo and extract_dataset:
no torch here."""

from __future__ import annotations

from typing import Any

__all__ = ["format_bytes", "format_shapes", "progress_bar"]


def format_shapes(shapes: list[list[int]] | None) -> str:
    """``[[2, 8]]`` -> ``[2, 8]``; several tensors are joined; nothing is ``-``."""
    if not shapes:
        return "-"
    return ", ".join("[" + ", ".join(str(s) for s in shape) + "]" for shape in shapes)


def format_bytes(n: float) -> str:
    """``1536`` -> ``1.5 KiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError  # pragma: no cover


def progress_bar(enabled: bool, **options: Any) -> Any:
    """A tqdm bar with ``options``, or ``None`` when disabled or tqdm is not installed."""
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(**options)
