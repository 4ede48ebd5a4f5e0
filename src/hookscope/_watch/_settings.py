"""The settings ``hookscope watch`` hands to every process of the command, as one variable.

The parent writes them (:func:`hookscope._watch.child_env`), the child's agent reads them
(:meth:`hookscope._watch._agent.Agent.from_env`): a JSON object in ``HOOKSCOPE_WATCH``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

__all__ = ["ENV", "Settings"]

ENV = "HOOKSCOPE_WATCH"  # the settings, for every process of the command


@dataclass(frozen=True)
class Settings:
    """What ``hookscope watch`` passes to every process of the command (``HOOKSCOPE_WATCH``)."""

    out: str
    every: int | None = 10
    where: list[str] | None = None
    on_nonfinite: str = "log"
    check: str = "edges"

    def to_env(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_env(cls, text: str) -> Settings:
        return cls(**json.loads(text))
