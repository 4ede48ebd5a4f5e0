"""Where a Monitor's records go: a JSON-lines file, TensorBoard, memory, or your own ``Sink``.

A record is a plain dict (see docs/log-format.md); a sink never sees the model.
"""

from __future__ import annotations

import math
import threading
import warnings
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from ._errors import HookscopeWarning, missing_extra
from ._log import LOG_NAME, numbered, run_logs, run_number, to_line
from ._paths import make_dir, unwritable

__all__ = ["JsonlSink", "MemorySink", "Sink", "TensorBoardSink"]

_CLOSE_WITHIN = 3.0  # seconds TensorBoardSink.close() waits for its writer


@runtime_checkable
class Sink(Protocol):
    """Anything with ``write(record)`` and ``close()`` can receive a Monitor's records."""

    def write(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class MemorySink:
    """Keeps every record in ``self.records`` (for notebooks and tests)."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def write(self, record: dict[str, Any]) -> None:
        self.records.append(record)

    def close(self) -> None:
        pass


class JsonlSink:
    """One JSON object per line, flushed as written: a crash leaves every finished step readable.

    NaN and infinities are written as the strings ``"nan"``, ``"inf"``, ``"-inf"``.

    ``path``: a directory (the log is ``hookscope.jsonl`` in it) or a ``.jsonl`` file. A file
    another run wrote (or is writing) there is never truncated or shared: this run's log is
    then the next free name, ``hookscope-2.jsonl``, ``hookscope-3.jsonl``, ... (``self.path``),
    which :func:`hookscope.read_log` and :func:`hookscope.report` read for the directory.
    """

    def __init__(self, path: str | Path) -> None:
        first = Path(path)
        if first.suffix != ".jsonl":
            first = first / LOG_NAME
        make_dir(first.parent, "the log")
        taken = [run_number(p) for p in run_logs(first.parent, first.name)]
        n = max(taken, default=0) + 1
        while True:  # created here, never opened over another run's file (nor a racing one's)
            self.path = numbered(first, n)
            try:
                self._file = self.path.open("x", encoding="utf-8")
                break
            except FileExistsError:
                n += 1
            except OSError as exc:
                raise unwritable(self.path, "the log", exc) from None

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(to_line(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __repr__(self) -> str:
        return f"JsonlSink({str(self.path)!r})"


class TensorBoardSink:
    """Scalars (and histograms) for TensorBoard; needs ``pip install 'hookscope[tensorboard]'``.

    Tags: ``loss``, ``lr``, ``act/<module>/<stat>``, ``grad/<module>/norm``,
    ``param/<name>/<stat>``, ``nonfinite/<module>/nan`` (counts are their own scalars, so a NaN
    is never silently dropped), histograms under ``hist/<module>``; the largest attention
    logit as ``attn/<module>/logit_max``; with ``Monitor(precision=...)``,
    ``precision/<module>/<act|grad>/<amax|dynamic_range>`` and
    ``precision/<module>/<act|grad>/<underflow|overflow>/<dtype>``.
    """

    def __init__(self, log_dir: str | Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise missing_extra("tensorboard", "tensorboard") from None
        self._writer = SummaryWriter(str(log_dir))

    def write(self, record: dict[str, Any]) -> None:
        if record.get("type") != "step":
            return
        step, add = record["step"], self._writer.add_scalar
        for name, value in record.get("scalars", {}).items():
            add(name, value, step)
        for group in ("act", "grad", "param", "bn"):
            for name, stats in record.get(group, {}).items():
                for stat, value in stats.items():
                    if stat == "hist":
                        self._histogram(f"hist/{name}", value, step)
                    elif stat in ("nan", "inf"):
                        add(f"nonfinite/{name}/{group}_{stat}", value, step)
                    elif isinstance(value, (int, float)):
                        add(f"{group}/{name}/{stat}", value, step)
        for name, stats in record.get("attn", {}).items():
            for stat, value in stats.items():
                add(f"attn/{name}/{stat}", value, step)
        for name, sides in record.get("precision", {}).items():
            for side, stats in sides.items():
                for stat, value in stats.items():
                    tag = f"precision/{name}/{side}/{stat}"
                    if isinstance(value, dict):  # {dtype: fraction}
                        for dtype, fraction in value.items():
                            add(f"{tag}/{dtype}", fraction, step)
                    else:
                        add(tag, value, step)

    def _histogram(self, tag: str, hist: dict[str, Any], step: int) -> None:
        counts, lo, hi = hist["counts"], hist["lo"], hist["hi"]
        if not (math.isfinite(lo) and math.isfinite(hi)) or not sum(counts):
            return
        width = (hi - lo) / len(counts) or 1.0
        limits = [lo + width * (i + 1) for i in range(len(counts))]
        centers = [lo + width * (i + 0.5) for i in range(len(counts))]
        total = sum(counts)
        self._writer.add_histogram_raw(
            tag,
            min=lo,
            max=hi,
            num=total,
            sum=sum(c * x for c, x in zip(counts, centers, strict=True)),
            sum_squares=sum(c * x * x for c, x in zip(counts, centers, strict=True)),
            bucket_limits=limits,
            bucket_counts=counts,
            global_step=step,
        )

    def close(self) -> None:
        """Flush and close the event file, waiting at most ``_CLOSE_WITHIN`` seconds.

        The writer's flush takes a lock that ``add_scalar`` holds while its queue is full: a
        signal handler that closes the Monitor in the middle of a write would wait for ever.
        The close runs in a thread of its own, abandoned (with a warning) if it is stuck.
        """
        closing = threading.Thread(
            target=self._writer.close, name="hookscope: close TensorBoard", daemon=True
        )
        try:
            closing.start()
        except RuntimeError:  # no new thread at interpreter shutdown: close here
            self._writer.close()
            return
        closing.join(_CLOSE_WITHIN)
        if closing.is_alive():
            warnings.warn(
                f"TensorBoard's writer did not close within {_CLOSE_WITHIN:g} s (it was "
                "interrupted mid-write); the last events may be missing from "
                f"{self._writer.log_dir}.",
                HookscopeWarning,
                stacklevel=2,
            )
