"""Ending a watched process by a signal without a lock in the handler.

A signal can land while a sink holds a lock (TensorBoard's writer): a handler that closed
the logs itself could wait forever. :class:`Closer` closes them from a thread of its own,
woken and waited for with plain system calls; :func:`die` then ends the process by the
signal, as if nothing had caught it.
"""

from __future__ import annotations

import os
import select
import signal
import threading
from collections.abc import Callable

__all__ = ["Closer", "die"]


class Closer:
    """A thread that closes the logs when a signal came, so that the signal handler can wait
    for it without taking a lock: it wakes the thread with ``os.write`` and waits with
    ``select``, both plain system calls. Started before any signal, from the main thread."""

    def __init__(self, close: Callable[[], None]) -> None:
        self._close = close
        self._wake_r, self._wake_w = os.pipe()
        self._done_r, self._done_w = os.pipe()
        threading.Thread(target=self._run, name="hookscope watch: close", daemon=True).start()

    def _run(self) -> None:
        os.read(self._wake_r, 1)
        try:
            self._close()
        except BaseException:  # nothing to tell: the process is ending
            pass
        finally:
            os.write(self._done_w, b"x")

    def close_within(self, seconds: float) -> None:
        """Close the logs; give up after ``seconds`` (a sink stuck on a lock)."""
        os.write(self._wake_w, b"x")
        select.select([self._done_r], [], [], seconds)


def die(signum: int) -> None:
    """End this process by ``signum``, as if nothing had caught it (status -N, 128 + N)."""
    signal.signal(signum, signal.SIG_DFL)
    signal.raise_signal(signum)  # delivered to this thread before it returns, unless blocked
    os._exit(128 + signum)
