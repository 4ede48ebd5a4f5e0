"""Output paths: a directory created for a log, a report, features or a bundle, or a clear
error saying why it cannot be (not a raw ``OSError`` from deep inside a writer)."""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path

from ._errors import HookscopeError

__all__ = ["check_writable", "make_dir", "unwritable"]


def make_dir(path: str | Path, what: str, option: str = "log_dir=") -> Path:
    """Create the directory ``path`` (and its parents) for ``what``; ``option`` names the
    argument that chose it, for the fix."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise HookscopeError(
            f"{option}{str(path)!r} is a file, not a directory, so {what} cannot be written "
            f"there.\nFix: pass a directory ({option}'runs/exp1'); it is created when missing."
        )
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise unwritable(path, what, exc, option) from None
    return path


def check_writable(path: str | Path, what: str, option: str = "log_dir=") -> None:
    """That ``path`` is, or can be made, a directory where files can be written, checked
    before any work starts and leaving nothing behind: the directories it had to make, and a
    probe file, are removed again."""
    path = Path(path).absolute()
    missing = []
    existing = path
    while not existing.exists() and existing != existing.parent:
        missing.append(existing)
        existing = existing.parent
    if not existing.is_dir():
        raise HookscopeError(
            f"cannot write {what} at {str(path)!r}: {str(existing)!r} is a file, not a "
            f"directory.\nFix: choose a directory path ({option}'runs/exp1'); it is created "
            "when missing."
        )
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise unwritable(path, what, exc, option) from None
    finally:
        for made in missing:  # deepest first
            with contextlib.suppress(OSError):
                made.rmdir()


def unwritable(
    path: str | Path, what: str, exc: OSError, option: str = "log_dir="
) -> HookscopeError:
    """The error for ``what`` that cannot be written at ``path`` (``exc``: why)."""
    reason = exc.strerror or str(exc) or type(exc).__name__
    return HookscopeError(
        f"cannot write {what} at {str(path)!r}: {reason}.\nFix: choose a path you can write "
        f"to ({option}...)."
    )
