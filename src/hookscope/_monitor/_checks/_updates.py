"""Checks on what an optimizer step did to the weights: ``not_updated`` and ``frozen_changed``.

Both compare a few elements of a weight, spread over it, before and after: no copy of the
weights, a few tiny gathers per step.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

import torch
from torch import nn

from ..._diagnose import Finding
from ..._log import StepRecord
from .._step._buffer import Host, StepBuffer
from .._step._dist import Entry, local
from ._common import Context, common_module, module_of, spread

__all__ = ["FrozenChanged", "NotUpdated"]

PROBED = 4  # weights watched per optimizer: its largest
ELEMENTS = 32  # elements compared per weight
MIN_EVIDENCE = 4  # elements that had to move, for an unchanged weight to count
# An element is expected to move when lr * |grad| is well above float32's resolution of it.
RESOLUTION = 1e-5
FROZEN_ELEMENTS = 64
# The elements are compared at an optimizer's first steps and then at every tenth: an update
# that never reaches the weights is a bug of the code, there at every step once it starts,
# and the ~20 small ops per weight would be a tenth of the Monitor's own ops per step.
FIRST_STEPS = 3
PROBE_EVERY = 10
NO_GRAD_STEPS = 2  # an optimizer's steps in a row with no gradient before it is a finding


def _names(names: list[str], limit: int = 3) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _lr(group: dict[str, Any]) -> float:
    lr = group.get("lr", 0.0)
    try:
        return float(lr)
    except (TypeError, ValueError):
        return 0.0


def _stacked(pending: list[tuple[str, _Probes, torch.Tensor]]) -> torch.Tensor:
    device = pending[0][2].device
    return torch.cat([flags.to(device) for _, _, flags in pending])


class _Probes:
    """Weights of one optimizer around one update (of one dtype, device and learning rate):
    a few elements of each before it, and whether they should move, in one vector for all
    of them (a few ops per update, not a few per weight)."""

    def __init__(
        self,
        chosen: list[tuple[str, torch.Tensor, torch.Tensor]],
        lr: float,
        segments: dict[tuple, torch.Tensor],
    ) -> None:
        self.names = [name for name, _, _ in chosen]
        self.lr = lr
        self._pairs = [(p, index) for _, p, index in chosen]
        sizes = [index.numel() for _, _, index in chosen]
        self._bounds = [0, *itertools.accumulate(sizes)]
        before = [torch.take(local(p.detach()), i) for p, i in self._pairs]
        grads = [torch.take(local(p.grad.detach()), i) for p, i in self._pairs]
        self.before = before[0] if len(before) == 1 else torch.cat(before)
        grad = (grads[0] if len(grads) == 1 else torch.cat(grads)).to(self.before.dtype)
        self.expect = (grad != 0) & (lr * grad.abs() > RESOLUTION * self.before.abs())
        self._seg = None
        if len(sizes) > 1:  # which weight each element is of, made once per layout: a
            # tensor from host data is a blocking copy on a GPU (tests/test_host_syncs.py)
            key = (tuple(sizes), self.before.device)
            self._seg = segments.get(key)
            if self._seg is None:
                seg = [k for k, n in enumerate(sizes) for _ in range(n)]
                self._seg = segments[key] = torch.tensor(seg, device=self.before.device)

    def stuck(self) -> torch.Tensor:
        """Per weight, 1 when enough of its elements should have moved and none did."""
        now = [torch.take(local(p.detach()), i) for p, i in self._pairs]
        moved = self.expect & ((now[0] if len(now) == 1 else torch.cat(now)) != self.before)
        if self._seg is None:
            return ((self.expect.sum() >= MIN_EVIDENCE) & (moved.sum() == 0)).float().reshape(1)
        both = torch.stack([self.expect, moved]).float()
        counts = both.new_zeros(2, len(self.names)).index_add_(1, self._seg, both)
        return ((counts[0] >= MIN_EVIDENCE) & (counts[1] == 0)).float()

    def expected(self, k: int) -> int:
        """How many sampled elements of weight ``k`` should have moved."""
        return int(self.expect[self._bounds[k] : self._bounds[k + 1]].sum())


class NotUpdated:
    """``not_updated``: an optimizer step left weights with a gradient unchanged, or stepped
    only parameters that cannot change; and an optimizer that steps every step, but never a
    parameter of the watched model (it holds another copy's).

    Not bugs, never reported: a zero learning rate (warm-up, a group frozen by ``lr=0``),
    updates skipped by GradScaler (``step()`` does not run) or by the Monitor, elements whose
    gradient is zero or too small to move them, and closure optimizers (LBFGS: gradients
    exist only inside ``step``).

    Weights are compared at an optimizer's first ``FIRST_STEPS`` steps and then at every
    ``PROBE_EVERY``-th; whether it steps anything at all, at every step.
    """

    kind = "not_updated"

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self._all = {id(p): n for n, p in ctx.model.named_parameters()}
        self._chosen: dict[int, tuple[weakref.ref, int, list[tuple[str, nn.Parameter, int]]]] = {}
        self._index: dict[int, torch.Tensor] = {}
        self._segments: dict[tuple, torch.Tensor] = {}  # see _Probes
        self._probes: dict[int, list[_Probes]] = {}
        self._pending: list[tuple[str, _Probes, torch.Tensor]] = []
        # An unsampled step's verdicts, read with the next step's first transfer (on a GPU,
        # one more at the step's end would be a second host sync; see ``begin``)
        self._late: list[tuple[str, _Probes, torch.Tensor]] = []
        self._late_step = -1
        self._now = False  # this step's verdicts move with its own transfer (sampled)
        self._found: list[Finding] = []
        self._steps: dict[int, int] = {}  # per optimizer: its steps so far
        self._foreign = self._ours = self._ever = False
        self._foreign_run = 0
        self._no_grad_steps: dict[int, int] = {}  # per optimizer: steps in a row, no gradient
        ctx.hooks.optimizer_step_pre_global(self._pre)
        ctx.hooks.optimizer_step_post_global(self._post)

    # -- around each optimizer step ----------------------------------------------------------
    def _pre(self, opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if self.ctx.paused():
            return
        chosen = self._choose(opt)
        if chosen is None:
            self._foreign = True
            return
        self._ours = self._ever = True
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if closure is not None or self.ctx.skipping():
            return
        if self._nothing_can_change(opt):
            return
        n = self._steps[id(opt)] = self._steps.get(id(opt), -1) + 1
        if n >= FIRST_STEPS and n % PROBE_EVERY:
            return
        # the weights to compare, in one batch per dtype, device and learning rate
        batches: dict[tuple, tuple[float, list[tuple[str, torch.Tensor, torch.Tensor]]]] = {}
        for name, p, g in chosen:
            lr = _lr(opt.param_groups[g])
            if p.grad is None or lr <= 0 or p.numel() == 0:
                continue
            index = self._index.get(id(p))
            if index is None:
                index = self._index[id(p)] = spread(local(p.detach()), ELEMENTS)
            key = (p.dtype, p.grad.dtype, p.device, lr)
            batches.setdefault(key, (lr, []))[1].append((name, p, index))
        self._probes[id(opt)] = [
            _Probes(members, lr, self._segments) for lr, members in batches.values()
        ]

    def _post(self, opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        for probes in self._probes.pop(id(opt), []):
            self._pending.append((type(opt).__name__, probes, probes.stuck()))

    def _choose(self, opt: torch.optim.Optimizer) -> list[tuple[str, nn.Parameter, int]] | None:
        """The largest trainable weights of the model that ``opt`` steps (``None``: it steps
        none of the model's parameters), cached per optimizer."""
        cached = self._chosen.get(id(opt))
        if cached is not None and cached[0]() is opt and cached[1] == len(opt.param_groups):
            return cached[2]
        ours = [
            (self._all[id(p)], p, g)
            for g, group in enumerate(opt.param_groups)
            for p in group["params"]
            if id(p) in self._all
        ]
        chosen = None
        if ours:
            trainable = [c for c in ours if c[1].requires_grad]
            chosen = sorted(trainable, key=lambda c: -c[1].numel())[:PROBED]
        self._chosen[id(opt)] = (weakref.ref(opt), len(opt.param_groups), chosen)
        return chosen

    def _nothing_can_change(self, opt: torch.optim.Optimizer) -> bool:
        """Whether ``opt`` steps only parameters that cannot change, reported when frozen
        ones only (``requires_grad=False``: at once), or when none had a gradient at
        ``NO_GRAD_STEPS`` of its steps in a row (one step without gradients can be meant: a
        step taken before the first backward, or a loop's deliberate extra one)."""
        frozen, no_grad = [], []
        for group in opt.param_groups:
            for p in group["params"]:
                if p.requires_grad and p.grad is not None:
                    self._no_grad_steps.pop(id(opt), None)
                    return False
                name = self._all.get(id(p), "(not in the model)")
                (no_grad if p.requires_grad else frozen).append(name)
        if not frozen and not no_grad:
            return False
        if no_grad:
            run = self._no_grad_steps[id(opt)] = self._no_grad_steps.get(id(opt), 0) + 1
            if run < NO_GRAD_STEPS:
                return True
        self._found.append(self._cannot_change(type(opt).__name__, frozen, no_grad))
        return True

    def _cannot_change(self, opt: str, frozen: list[str], no_grad: list[str]) -> Finding:
        names = frozen + no_grad
        if frozen and not no_grad:
            why = (
                f"all {len(frozen)} have requires_grad=False ({_names(frozen)}), so they never "
                "get a gradient. Fix: unfreeze what you mean to train (requires_grad_(True)) "
                "before building the optimizer, and build it from the trainable parameters: "
                "[p for p in model.parameters() if p.requires_grad]"
            )
        else:
            why = (
                f"{len(no_grad)} had no gradient (.grad is None: {_names(no_grad)}) at "
                f"{NO_GRAD_STEPS} of its steps in a row"
                + (f" and {len(frozen)} have requires_grad=False" if frozen else "")
                + ". Usually zero_grad() runs between backward() and step(), or the loss does "
                "not depend on these parameters (detached, or computed by another copy of the "
                "model). Fix: call zero_grad() before backward() (or after step())"
            )
        message = (
            f"{opt}.step() stepped {len(names)} parameters of the model and none of them can "
            f"change: {why}. The step did nothing (the learning rate is not the cause)"
        )
        return Finding(self.kind, common_module(names), -1, float(len(names)), message)

    # -- at the step's end ----------------------------------------------------------------
    def begin(self, buf: StepBuffer) -> None:
        """A step starts: the last step's verdicts, if it was unsampled, go with this step's
        first transfer (before its update, with an optimizer), and are read at its end."""
        if self._late:
            buf.set(("check", self.kind, "late"), _stacked(self._late))

    def collect(self, buf: StepBuffer, sampled: bool) -> None:
        self._now = sampled
        if self._pending and sampled:
            buf.set(("check", self.kind), _stacked(self._pending))

    def layout(self, rank: int) -> list[Entry]:
        return []

    def read(self, host: Host, record: StepRecord) -> list[Finding]:
        step = record.step
        found = [_at(f, step) for f in self._found]
        late = host.get(("check", self.kind, "late"), [])
        found += self._stuck(self._late, late, self._late_step)
        if self._now:
            found += self._stuck(self._pending, host.get(("check", self.kind), []), step)
            self._late = []
        else:
            self._late, self._late_step = self._pending, step
        found += self._foreign_only(step)
        self._pending, self._found, self._probes = [], [], {}
        self._foreign = self._ours = False
        return found

    def _stuck(
        self, pending: list[tuple[str, _Probes, torch.Tensor]], flags: list[float], step: int
    ) -> list[Finding]:
        found, k = [], 0
        for opt, probes, _ in pending:
            for j in range(len(probes.names)):
                if k < len(flags) and flags[k]:
                    found.append(self._unchanged(opt, probes, j, step))
                k += 1
        return found

    def _unchanged(self, opt: str, probes: _Probes, j: int, step: int) -> Finding:
        n, name = probes.expected(j), probes.names[j]
        return Finding(
            self.kind,
            module_of(name),
            step,
            0.0,
            f"{opt}.step() left {name!r} unchanged at step {step}: {n} of its sampled "
            f"elements had a gradient large enough to move them at lr {probes.lr:g}, and none "
            "moved. The update never reached this tensor: e.g. a custom optimizer that rebinds "
            "`p = p - lr * p.grad` (or updates p.data.clone()) instead of updating p in place, "
            "a compiled or captured step replaying other tensors, or weights restored right "
            "after the step. The learning rate is not the cause",
        )

    def _foreign_only(self, step: int) -> list[Finding]:
        """An optimizer stepped, none ever stepped this model, and its weights had
        gradients: for two steps in a row."""
        if not self._foreign or self._ever:
            self._foreign_run = 0
            return []
        if not any(p.grad is not None for p in self.ctx.params.values()):
            self._foreign_run = 0
            return []
        self._foreign_run += 1
        if self._foreign_run < 2:
            return []
        return [
            Finding(
                self.kind,
                "",
                step,
                0.0,
                f"an optimizer steps at every step, but none of the watched model's parameters "
                f"(for {self._foreign_run} steps), although backward gives them gradients: the "
                "optimizer holds another copy's tensors. Usually it was built before the model "
                "was re-created, copied (deepcopy) or loaded into a new instance. Fix: build the "
                "optimizer from this model's parameters, after the model is final",
            )
        ]


def _at(finding: Finding, step: int) -> Finding:
    return Finding(finding.kind, finding.module, step, finding.value, finding.message)


class FrozenChanged:
    """``frozen_changed``: a parameter or buffer of the modules ``Monitor(frozen=WHERE)``
    declares frozen differs from its value when the Monitor was built (checked on sampled
    steps, on a few elements spread over each tensor)."""

    kind = "frozen_changed"

    def __init__(self, ctx: Context, modules: dict[str, nn.Module]) -> None:
        self.tensors: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]] = {}
        seen: set[int] = set()
        for prefix, module in modules.items():
            named = [(n, t, True) for n, t in module.named_parameters(prefix=prefix)]
            named += [(n, t, False) for n, t in module.named_buffers(prefix=prefix)]
            for name, t, is_param in named:
                if id(t) in seen or not t.is_floating_point() or t.numel() == 0:
                    continue
                seen.add(id(t))
                w = local(t.detach())
                index = spread(w, FROZEN_ELEMENTS)
                self.tensors[name] = (t, index, torch.take(w, index).clone(), is_param)
        self._reported: set[str] = set()
        self._names: list[str] = []

    def collect(self, buf: StepBuffer, sampled: bool) -> None:
        self._names = [n for n in self.tensors if n not in self._reported] if sampled else []
        if self._names:
            counts = [
                (torch.take(local(t.detach()), index) != ref).sum()
                for t, index, ref, _ in (self.tensors[n] for n in self._names)
            ]
            buf.set(("check", self.kind), torch.stack(counts).float())

    def layout(self, rank: int) -> list[Entry]:
        return []

    def read(self, host: Host, record: StepRecord) -> list[Finding]:
        counts = host.get(("check", self.kind), [])
        found = []
        for name, count in zip(self._names, counts, strict=False):
            if count:
                self._reported.add(name)
                found.append(self._changed(name, int(count), record.step))
        self._names = []
        return found

    def _changed(self, name: str, count: int, step: int) -> Finding:
        t, index, _, is_param = self.tensors[name]
        seen = f"{count} of {index.numel()} sampled elements differ from their values when the Monitor was built"
        if not is_param:
            why = (
                "this buffer changes while the module runs in training mode (a BatchNorm "
                "updates its running statistics at every training forward). Fix: put the "
                "frozen part in eval mode after each model.train() (model.train(); "
                "frozen_part.eval())"
            )
        elif t.requires_grad:
            why = (
                "it still has requires_grad=True, so backward gives it a gradient and an "
                "optimizer updates it. Fix: call requires_grad_(False) on the frozen modules "
                "(by their real names) before building the optimizer, and build it from "
                "[p for p in model.parameters() if p.requires_grad]"
            )
        else:
            why = (
                "although it has requires_grad=False: something still writes to it, e.g. an "
                "optimizer that holds it with a .grad left from before it was frozen "
                "(zero_grad(set_to_none=False) keeps zeros there, and momentum or weight decay "
                "go on moving it), a load_state_dict, or in-place code. Fix: build the "
                "optimizer from the trainable parameters only, and set .grad = None on frozen ones"
            )
        return Finding(
            self.kind,
            module_of(name),
            step,
            float(count),
            f"{name!r} was declared frozen (Monitor(frozen=...)) but changed by step {step} "
            f"({seen}): {why}",
        )
