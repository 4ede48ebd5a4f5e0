"""The non-finite trail: one flag per module output and per gradient, on every step.

A flag is the sum of a tensor's every element: NaN or Inf anywhere makes it non-finite, for
the price of one reduction. The trail remembers which flags fed which module, so that the
first module whose output turned non-finite *from finite inputs* can be named.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .._diagnose import Finding
from ._buffer import Host, StepBuffer

__all__ = ["Flag", "NonFiniteTrail"]


@dataclass(frozen=True)
class Flag:
    """One checked tensor: a module's input (``"input"``), output (``"forward"``) or the
    gradient of its output (``"backward"``); ``inputs`` are the flags that fed it."""

    phase: str
    module: str
    inputs: tuple[int, ...] = ()


class NonFiniteTrail:
    """Flags of the current step, in the order their hooks ran."""

    def __init__(self) -> None:
        self.flags: list[Flag] = []
        self._made_by: dict[int, int] = {}  # id(output tensor) -> its flag

    def reset(self) -> None:
        self.flags.clear()
        self._made_by.clear()

    def forward(
        self, buf: StepBuffer, name: str, inputs: list[torch.Tensor], outs: list[torch.Tensor]
    ) -> None:
        fed = []
        for t in inputs:
            known = self._made_by.get(id(t))
            if known is None and t.is_floating_point():
                known = self._add(buf, Flag("input", name), t.detach().sum())
                self._made_by[id(t)] = known
            if known is not None:
                fed.append(known)
        sums = [t.detach().sum() for t in outs]
        total = sums[0] if len(sums) == 1 else torch.stack(sums).sum()
        index = self._add(buf, Flag("forward", name, tuple(fed)), total)
        for t in outs:
            self._made_by[id(t)] = index

    def backward(self, buf: StepBuffer, name: str, grad: torch.Tensor) -> None:
        self._add(buf, Flag("backward", name), grad.detach().sum())

    def _add(self, buf: StepBuffer, flag: Flag, value: torch.Tensor) -> int:
        self.flags.append(flag)
        index = len(self.flags) - 1
        buf.set(("flag", index), value)
        return index

    def localise(self, host: Host, step: int) -> Finding | None:
        """The module where the first NaN/Inf of this step appeared, forward pass first."""
        bad = [not math.isfinite(host[("flag", i)][0]) for i in range(len(self.flags))]
        if not any(bad):
            return None
        value = lambda i: host[("flag", i)][0]  # noqa: E731
        forward = [i for i, f in enumerate(self.flags) if f.phase == "forward"]
        for i in forward:
            flag = self.flags[i]
            if bad[i] and not any(bad[j] for j in flag.inputs):
                return _finding(
                    flag.module,
                    step,
                    value(i),
                    "forward",
                    f"forward: the output of {flag.module!r} holds NaN/Inf (sum={value(i)}) "
                    f"while its inputs were finite, at step {step}; later modules inherit it",
                )
        first_bad = next((i for i in forward if bad[i]), None)
        if first_bad is not None:
            name = self.flags[first_bad].module
            return _finding(
                name,
                step,
                value(first_bad),
                "forward",
                f"forward: the inputs of {name!r} were already NaN/Inf at step {step} "
                "(check the data, or a module that runs outside the watched ones)",
            )
        backward = [i for i, f in enumerate(self.flags) if f.phase == "backward"]
        for k, i in enumerate(backward):
            if not bad[i]:
                continue
            name = self.flags[i].module
            if k == 0:
                return _finding(
                    name,
                    step,
                    value(i),
                    "backward",
                    f"backward: the gradient reaching {name!r} from the loss was already "
                    f"NaN/Inf at step {step}, with a finite forward pass",
                )
            culprit = self.flags[backward[k - 1]].module
            return _finding(
                culprit,
                step,
                value(i),
                "backward",
                f"backward: {culprit!r} turned a finite gradient into NaN/Inf (the gradient "
                f"of {name!r} became non-finite) at step {step}",
            )
        # Only module inputs (never a module's output) were bad: the data itself.
        first = next(i for i, b in enumerate(bad) if b)
        name = self.flags[first].module
        return _finding(
            name,
            step,
            value(first),
            "forward",
            f"forward: the inputs of {name!r} were NaN/Inf at step {step} (check the data)",
        )


def _finding(module: str, step: int, value: float, phase: str, message: str) -> Finding:
    return Finding("nonfinite", module, step, value, message, phase=phase)
