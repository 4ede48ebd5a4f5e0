"""The non-finite trail: one flag per module output and per gradient, on every step.

A flag is 0 when every element of a tensor is finite and NaN when one is not, for the price
of one reduction (``finite_flag``: a largest magnitude, which no large finite tensor
overflows, as its sum would). The trail remembers which flags fed which module, so that the
first module whose output turned non-finite *from finite inputs* can be named.
"""

from __future__ import annotations

import functools
import math
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from ..._diagnose import Finding
from ..._record import version
from ..._stats import finite_flag, norms
from ._buffer import Host, StepBuffer
from ._dist import local
from ._norms import Norms

__all__ = ["PASS_THROUGH", "Flag", "NonFiniteTrail"]

# Modules that cannot make a NaN/Inf from finite values, forward or backward (they select,
# scale by at most a constant, bound or reshape): on unsampled steps their output is flagged
# by its input's flag, with no reduction of their own, and their gradient is not flagged (the
# module whose backward computed it is the next flag's). Sampled steps read them as any other.
PASS_THROUGH = (
    torch.nn.ReLU,
    torch.nn.ReLU6,
    torch.nn.LeakyReLU,
    torch.nn.Hardtanh,
    torch.nn.Tanh,
    torch.nn.Sigmoid,
    torch.nn.Softsign,
    torch.nn.Dropout,
    torch.nn.Dropout1d,
    torch.nn.Dropout2d,
    torch.nn.Dropout3d,
    torch.nn.MaxPool1d,
    torch.nn.MaxPool2d,
    torch.nn.MaxPool3d,
    torch.nn.AdaptiveMaxPool1d,
    torch.nn.AdaptiveMaxPool2d,
    torch.nn.AdaptiveMaxPool3d,
    torch.nn.Flatten,
    torch.nn.Unflatten,
    torch.nn.Identity,
)


@dataclass(frozen=True)
class Flag:
    """One checked tensor: a module's input (``"input"``), output (``"forward"``) or the
    gradient of its output (``"backward"``); ``inputs`` are the flags that fed it.
    ``checked=False``: a module output only placed in the trail (who fed whom, aliases),
    not read: where the model's edges are checked and a replay localises."""

    phase: str
    module: str
    inputs: tuple[int, ...] = ()
    param: str | None = None  # for "param" flags: the parameter whose gradient it is
    edge: bool = False  # at an outermost call into the model (an unsampled step's flags)
    checked: bool = True
    # the value is the tensor's largest element (``_nan_flag``): bad only where it is NaN
    nan_only: bool = False


class NonFiniteTrail:
    """Flags of one step, in the order their hooks ran (a new trail each step)."""

    def __init__(self) -> None:
        self.flags: list[Flag] = []
        # id(tensor) -> (its flag, its version then): who made each tensor seen this step
        # (an id is only trusted while the weak reference says it is the same tensor: a freed
        # tensor's id is reused)
        self._made_by: dict[int, tuple[int, int | None, weakref.ref]] = {}
        self.edges: set[tuple[str, str]] = set()  # (producer, consumer) modules
        self.detached: set[str] = set()  # producers whose output a consumer got detached
        self._storage: dict[int, str] = {}  # data_ptr of each output -> module that made it
        self._params: dict[str, torch.nn.Parameter] = {}  # by name, for their gradients' flags
        # (first, count) of the flags put in the buffer as one block (``StepBuffer.set_block``)
        self.blocks: list[tuple[int, int]] = []
        # The outermost calls whose outputs' gradients are flagged late, read where the tape
        # keeps them (no hook of their own; with the parameters' gradients, in one fused
        # norm): (the call's name, its ``Call``); per (call, output) the gradient flagged
        self._later: list[tuple[str, Any]] = []
        self._flagged: dict[tuple[int, int], torch.Tensor] = {}
        self._late_grads: dict[int, torch.Tensor] = {}  # flag index -> the gradient it flags

    def forward(
        self,
        buf: StepBuffer,
        name: str,
        inputs: list[torch.Tensor],
        outs: list[torch.Tensor],
        *,
        pass_through: bool = False,
        nan_inputs: bool = False,
        check: bool = True,
    ) -> list[torch.Tensor]:
        """Flag the output of ``name``; return its outputs that are new tensors (an output
        that is one of its inputs, unchanged, is an alias: one point, not two). With
        ``pass_through`` (a module in :data:`PASS_THROUGH`) and one input flag, the output's
        flag is that input's value: finite in, finite out. With ``nan_inputs``, inputs seen
        for the first time are flagged for NaN only (the model's own inputs: an attention
        mask holds -inf on purpose). ``check=False``: the output is placed in the trail but
        not read (``Flag.checked``), and inputs seen for the first time are left to the call
        that checks them (the model's outermost one)."""
        fed = []
        passed: dict[int, int | None] = {}  # id -> version of each input seen before
        for t in inputs:
            known = self._known(t)
            if known is None and t.is_floating_point():
                maker = self._storage.get(t.data_ptr()) if not t.requires_grad else None
                if maker is not None:  # another module's output, cut from autograd
                    self.detached.add(maker)
                if not check:  # not flagged; an output that is this input is still an alias
                    passed[id(t)] = version(t)
                    continue
                if nan_inputs:
                    flag, value = Flag("input", name, nan_only=True), _nan_flag(t)
                else:
                    flag, value = Flag("input", name), finite_flag(t)
                index = self._add(buf, flag, value)
                known = self._made_by[id(t)] = (index, version(t), weakref.ref(t))
            if known is not None:
                passed[id(t)] = known[1]
                fed.append(known[0])
                producer = self.flags[known[0]]
                if producer.phase == "forward":
                    self.edges.add((producer.module, name))
        # (an inference tensor keeps no version: the same tensor out may have changed in place)
        new = [t for t in outs if id(t) not in passed or _changed(passed[id(t)], t)]
        if not new:
            return []
        if check:
            total = None
            if pass_through and len(fed) == 1 and not self.flags[fed[0]].nan_only:
                total = buf.value(("flag", fed[0]))
            if total is None:
                flags = [finite_flag(t) for t in new]
                total = flags[0] if len(flags) == 1 else torch.stack(flags).sum()
            index = self._add(buf, Flag("forward", name, tuple(fed)), total)
        else:
            index = self._add(buf, Flag("forward", name, tuple(fed), checked=False), None)
        for t in new:
            self._made_by[id(t)] = (index, version(t), weakref.ref(t))
            if t.requires_grad:
                self._storage[t.data_ptr()] = name
        return new

    def _known(self, t: torch.Tensor) -> tuple[int, int | None, weakref.ref] | None:
        entry = self._made_by.get(id(t))
        return entry if entry is not None and entry[2]() is t else None

    def backward(
        self, buf: StepBuffer, name: str, grad: torch.Tensor, *, edge: bool = False
    ) -> None:
        self._add(buf, Flag("backward", name, edge=edge), finite_flag(grad))

    def backward_later(self, buf: StepBuffer, name: str, call: Any) -> None:
        """The gradients that reach the outputs of ``call`` (an outermost call the tape
        keeps: ``Call.grads``) are flagged as the model's edges (``Flag.edge``) when the step's
        gradients are read (:meth:`parameters`, fused with theirs), or else before the
        buffer's next transfer (``StepBuffer.keep``: it settles first): no hook of their own."""
        self._later.append((name, call))
        buf.keep(self._settle_later, None)

    def _settle_later(self, buf: StepBuffer, items: list[Any]) -> None:
        self.flush(buf)

    def _pending(self) -> tuple[list[Flag], list[torch.Tensor]]:
        """The flags and gradients of :meth:`backward_later` calls not flagged yet (a
        gradient summed again since, by a second backward pass, is flagged again)."""
        flags: list[Flag] = []
        grads: list[torch.Tensor] = []
        for name, call in self._later:
            for i, grad in call.grads.items():
                key = (id(call), i)
                if self._flagged.get(key) is not grad:
                    self._flagged[key] = grad
                    flags.append(_edge_flag(name))
                    grads.append(grad)
        return flags, grads

    def flush(self, buf: StepBuffer) -> None:
        """Flag what :meth:`backward_later` left to flag (before a transfer)."""
        if self._later:
            flags, grads = self._pending()
            if grads:
                start = len(self.flags)
                self.flags.extend(flags)
                self._by_norms(buf, start, [], grads)

    def parameters(
        self,
        buf: StepBuffer,
        params: dict,
        names: list[str],
        plist: list[torch.nn.Parameter] | None = None,
    ) -> tuple[int, list[str], torch.Tensor | list[torch.Tensor]]:
        """Flag the gradients an optimizer is about to apply, by their L2 norms (one fused
        kernel; torch's L2 norm reads 3x faster than its L1 on a CPU): a NaN/Inf can arise in
        a weight's gradient alone (an overflowing recurrent matmul). The gradients at the
        model's edges left to flag (:meth:`backward_later`) are flagged right after them, in
        the same kernel. ``plist``: the parameters ``names``, where the caller has them.
        Returns the index of the first parameter's flag, the names of those that have a
        gradient and their norms, in that order (one vector where they are on one device and
        of one dtype, in the buffer as one block: ``StepBuffer.set_block``; else a list;
        either may go on with the edges' norms)."""
        grads = [p.grad for p in (plist or [params[n] for n in names])]
        if any(g is None for g in grads):
            names = [n for n, g in zip(names, grads, strict=True) if g is not None]
            grads = [g for g in grads if g is not None]
        self._params = params
        if not all(type(g) is torch.Tensor for g in grads):
            grads = [local(g) for g in grads]
        start = len(self.flags)
        self.flags.extend(_param_flags(tuple(names)))
        if self._later:
            edge_flags, edge_grads = self._pending()
            if edge_grads and not _fusable(edge_grads, grads):  # two fused norms
                values = self._by_norms(buf, start, grads, [])
                self.flags.extend(edge_flags)
                self._by_norms(buf, start + len(grads), [], edge_grads)
                return start, names, values
            self.flags.extend(edge_flags)
            return start, names, self._by_norms(buf, start, grads, edge_grads)
        return start, names, self._by_norms(buf, start, grads, [])

    def _by_norms(
        self, buf: StepBuffer, start: int, grads: list[torch.Tensor], late: list[torch.Tensor]
    ) -> torch.Tensor | list[torch.Tensor]:
        """Put the L2 norms of ``grads`` and then of ``late`` (gradients of
        :meth:`backward_later`, kept for :meth:`_overflowed`) in the buffer as the flags from
        ``start`` on, as one block where they stack; return them."""
        if late:
            for k, grad in enumerate(late, start + len(grads)):
                self._late_grads[k] = grad
            grads = grads + [g.detach() if g.requires_grad else g for g in late]
        try:
            stacked = _GRAD_NORMS(grads)
        except RuntimeError:  # on several devices
            stacked = None
        if stacked is not None:
            buf.set_block("flag", start, stacked)
            self.blocks.append((start, len(grads)))
            return stacked
        values = norms(grads, 2)
        buf.set_many([("flag", i) for i in range(start, start + len(grads))], values)
        return values

    def _overflowed(self, index: int, flag: Flag, value: float) -> bool:
        """Whether an infinite L2 norm of a gradient is only its float32 sum of squares
        overflowing (an element past 1.8e19) while every element is finite: asked of the
        gradient itself, on the rare step where a norm is infinite."""
        if value != math.inf:
            return False
        late = self._late_grads.get(index)
        if late is not None:
            return finite_flag(late).item() == 0
        param = self._params.get(flag.param) if flag.phase == "param" else None
        if param is None or param.grad is None:
            return False
        return finite_flag(local(param.grad)).item() == 0

    def _add(self, buf: StepBuffer, flag: Flag, value: torch.Tensor | None) -> int:
        self.flags.append(flag)
        index = len(self.flags) - 1
        if value is not None:
            buf.set(("flag", index), value)
        return index

    def _sum(self, host: Host) -> float:
        """The sum of every checked flag's value: finite when every flag is. A block moved
        whole is summed from its one list."""
        flags, total, whole = self.flags, 0.0, {}
        for start, n in self.blocks:
            values = host.get(("block", "flag", start))
            if values is not None:
                total += sum(values)
                whole[start] = n
        i, count = 0, len(flags)
        while i < count:
            if i in whole:
                i += whole[i]
                continue
            if flags[i].checked:
                total += host[("flag", i)][0]
            i += 1
        return total

    def localise(self, host: Host, step: int) -> Finding | None:
        """The module where the first NaN/Inf of this step appeared, forward pass first."""
        if math.isfinite(self._sum(host)):  # every flag finite (a sum of finite norms may
            return None  # overflow to Inf: then each flag is looked at)
        bad = [
            f.checked
            and not math.isfinite(v := host[("flag", i)][0])
            and (math.isnan(v) if f.nan_only else not self._overflowed(i, f, v))
            for i, f in enumerate(self.flags)
        ]
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
                    f"forward: the output of {_who(flag.module)} holds NaN/Inf while its "
                    f"inputs were finite, at step {step}; later modules inherit it",
                )
        first_bad = next((i for i in forward if bad[i]), None)
        if first_bad is not None:
            name = self.flags[first_bad].module
            return _finding(
                name,
                step,
                value(first_bad),
                "forward",
                f"forward: the inputs of {_who(name)} were already NaN/Inf at step {step} "
                "(check the data, or a module that runs outside the watched ones)",
            )
        backward = [i for i, f in enumerate(self.flags) if f.phase == "backward"]
        for k, i in enumerate(backward):
            if not bad[i]:
                continue
            name = self.flags[i].module
            if k == 0 or self.flags[i].edge:  # what reached the model from outside
                return _finding(
                    name,
                    step,
                    value(i),
                    "backward",
                    f"backward: the gradient reaching {_who(name)} from the loss was already "
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
        # Only the model's own outputs had their gradient flagged (an unsampled step): the
        # value arose somewhere inside the model's backward pass.
        edges_only = all(self.flags[i].edge for i in backward)
        # A NaN made in the backward reaches every parameter before its origin (in forward
        # order): the origin is the last parameter whose gradient is bad.
        for i in reversed(range(len(self.flags))):
            flag = self.flags[i]
            if bad[i] and flag.phase == "param":
                where = (
                    "while the gradient reaching the model's outputs was finite: it arose in "
                    "the model's backward pass"
                    if edges_only
                    else "while every module's output gradient was finite: it arose computing "
                    "the weight's own gradient (an overflow?)"
                )
                return _finding(
                    flag.module,
                    step,
                    value(i),
                    "backward",
                    f"backward: the gradient of {flag.param!r} is NaN/Inf (L2 norm "
                    f"{value(i)}) {where}, at step {step}",
                )
        # Only module inputs (never a module's output) were bad: the data itself.
        first = next(i for i, b in enumerate(bad) if b)
        name = self.flags[first].module
        return _finding(
            name,
            step,
            value(first),
            "forward",
            f"forward: the inputs of {_who(name)} were NaN/Inf at step {step} (check the data)",
        )


# The gradients' L2 norms in few ops (``_step/_norms.py``); its plans are per list of shapes
_GRAD_NORMS = Norms(2)


@functools.lru_cache(maxsize=64)
def _param_flags(names: tuple[str, ...]) -> tuple[Flag, ...]:
    """The "param" flags of gradients ``names``, built once per set of names (an optimizer
    steps the same parameters every step)."""
    return tuple(Flag("param", n.rsplit(".", 1)[0] if "." in n else "", (), n) for n in names)


@functools.lru_cache(maxsize=256)
def _edge_flag(name: str) -> Flag:
    """The flag of the gradient reaching the outputs of the outermost call ``name``."""
    return Flag("backward", name, edge=True)


def _fusable(extra: list[torch.Tensor], grads: list[torch.Tensor]) -> bool:
    """Whether ``extra`` can join ``grads`` in one fused norm: plain tensors of the
    first gradient's device and dtype."""
    if not grads:
        return True
    first = grads[0]
    return all(
        type(g) is torch.Tensor and g.dtype == first.dtype and g.device == first.device
        for g in extra
    )


def _nan_flag(t: torch.Tensor) -> torch.Tensor:
    """The largest element of ``t`` (float32): NaN where ``t`` holds a NaN (``amax``
    propagates it), else a number or an infinity, which pass (``Flag.nan_only``). One
    reduction: a NaN test and ``any`` are two boolean passes, each slower on a CPU."""
    t = t.detach()
    if t.numel() == 0:
        return torch.zeros((), device=t.device)
    peak = torch.amax(t)
    return peak if peak.dtype is torch.float32 else peak.float()


def _who(module: str) -> str:
    return "the model" if module == "" else repr(module)


def _finding(module: str, step: int, value: float, phase: str, message: str) -> Finding:
    return Finding("nonfinite", module, step, value, message, phase=phase)


def _changed(old: int | None, t: torch.Tensor) -> bool:
    """Whether ``t``, at version ``old`` when it went in, came out changed in place (an
    inference tensor, with no version, may have been)."""
    return old is None or version(t) != old
