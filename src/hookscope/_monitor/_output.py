"""Where a Monitor's records and findings go.

Every record goes to every sink: an in-memory one always (``mon.records``), the user's own,
and under ``log_dir`` the JSON-lines log and TensorBoard's events (when tensorboard is
installed): rank 0's alone when the ranks' figures are combined, each rank's own under
``rank<N>`` otherwise. A finding is kept and logged when it is first seen
(``Diagnosis.first_time``); the first one of each kind in ``record_on`` has the flight
recorder write a replay bundle.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .._diagnose import Diagnosis, Finding, mark_cleared
from .._log import LOG_NAME, Cleared, Event, Header, run_number
from .._sinks import JsonlSink, MemorySink, Sink, TensorBoardSink
from .._version import __version__
from ._step._dist import Alone, Collective

__all__ = ["Output"]


class Output:
    """The Monitor's sinks and findings.

    ``rank``: this process's rank under ``torch.distributed`` (``None``: one process);
    ``coll``: the collective when the ranks' figures are combined. ``bundle(finding,
    before_update)`` writes a replay bundle for ``finding`` and returns its path."""

    def __init__(
        self,
        sinks: Sequence[Sink],
        diagnosis: Diagnosis,
        *,
        rank: int | None,
        coll: Alone | Collective,
        record_dir: Path | None,
        record_on: tuple[str, ...],
        bundle: Callable[[Finding, bool], Path],
    ) -> None:
        self.findings: list[Finding] = []
        self.memory = MemorySink()
        self.sinks: list[Sink] = [self.memory, *sinks]
        self._diagnosis, self._rank, self._coll = diagnosis, rank, coll
        self._record_dir, self._record_on, self._bundle = record_dir, record_on, bundle
        self._recorded: set[str] = set()  # the kinds a bundle was written for
        # one rank of several with its own log, findings and bundles (``sync=False``)
        self._alone_rank = rank is not None and not coll.synced
        self.log_path: Path | None = None  # the JSON-lines log this process writes

    def open(self, log_dir: str | Path | None) -> None:
        """The JSON-lines log and TensorBoard (when installed) under ``log_dir``. A log
        another run left (or writes) there is kept: this run's is ``hookscope-<n>.jsonl``,
        its TensorBoard events in ``tensorboard-<n>/`` (a run of their own in TensorBoard,
        whose steps would otherwise overwrite the first run's)."""
        if self._alone_rank and log_dir is not None:
            log_dir = Path(log_dir) / f"rank{self._rank}"
        if log_dir is not None and self._coll.rank in (None, 0):
            jsonl = JsonlSink(Path(log_dir) / LOG_NAME)
            self.sinks.append(jsonl)
            self.log_path = jsonl.path
            n = run_number(jsonl.path)
            events = Path(log_dir) if n == 1 else Path(log_dir) / f"tensorboard-{n}"
            with contextlib.suppress(ImportError):
                self.sinks.append(TensorBoardSink(events))

    def header(
        self,
        model: str,
        modules: dict[str, str],
        params: dict[str, list[int]],
        settings: dict[str, Any],
        world: int,
    ) -> None:
        """The log's first record: the model's class, the watched modules' classes, the
        parameters' shapes and the Monitor's settings, with the ranks'."""
        settings = {**settings, "world": world, "sync": self._coll.synced}
        if self._alone_rank:
            settings["rank"] = self._rank
        header = Header(
            hookscope=__version__,
            model=model,
            modules=modules,
            params=params,
            settings=settings,
            time=time.time(),
        )
        self.write(asdict(header))

    def write(self, record: dict[str, Any]) -> None:
        for sink in self.sinks:
            sink.write(record)

    def event(self, step: int, kind: str, message: str) -> None:
        self.write(asdict(Event(step, kind, message)))

    def report(
        self, found: list[Finding], step: int, *, before_update: bool, always: bool = False
    ) -> list[Finding]:
        """Keep and log the findings not seen before (``always``: all of them), record the
        first of each chosen kind; return them."""
        if self._alone_rank:  # sync=False: this rank's own
            found = [dataclasses.replace(f, rank=self._rank) for f in found]
        new = [f for f in found if self._diagnosis.first_time(f) or always]
        self.findings.extend(new)
        for finding in new:
            self.write({"type": "finding", **asdict(finding)})
            here = self._coll.rank in (None, finding.rank or 0)
            wanted = here and self._record_dir is not None and finding.kind in self._record_on
            if wanted and finding.kind not in self._recorded:
                self._recorded.add(finding.kind)
                path = self._bundle(finding, before_update)
                late = "" if finding.step == step else f" of step {finding.step}, read a step late"
                self.event(
                    step, "recorded", f"replay bundle for the {finding.kind} finding{late}: {path}"
                )
        return new

    def clear(self) -> None:
        """Mark the findings whose condition stopped holding (``Diagnosis.cleared``) and log
        that they did."""
        for done in self._diagnosis.cleared():
            self.findings = mark_cleared(self.findings, done)
            self.write(asdict(Cleared.of(done)))

    def close(self) -> None:
        """Close every sink but the in-memory one, which keeps the records."""
        sinks, self.sinks = self.sinks, [self.memory]
        for sink in sinks:
            if sink is not self.memory:
                sink.close()
