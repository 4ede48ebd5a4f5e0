"""``stale_gradients``: a step's backward started on the gradients of the previous step.

After an optimizer steps, its parameters' gradients must be reset (``zero_grad()``: set to
``None``, or to zeros) before the backward pass of its next step, or every update applies the
sum of all past gradients. Several backward passes before one step (gradient accumulation)
are fine: only whether a reset came at all between two steps of the same optimizer counts.
A reset to ``None`` is seen on the host for free; a reset to zeros by a few elements of a
few gradients, compared on the device and read with the step's one transfer.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from ..._diagnose import Finding
from ..._log import StepRecord
from .._step._buffer import Host, StepBuffer
from .._step._dist import Entry, local
from ._common import Context, module_of, spread

__all__ = ["StaleGradients"]

WATCHED = 4  # gradients watched per optimizer
ELEMENTS = 16  # elements read per gradient


class _Since:
    """One optimizer, since its last step: its watched parameters and what happened to their
    gradients at each backward pass."""

    def __init__(self, params: list[tuple[str, nn.Parameter]], index: list[torch.Tensor]) -> None:
        self.params, self.index = params, index
        self.backwards = 0
        self.reset = False  # seen on the host: every watched gradient was None
        self.zeroed: list[torch.Tensor] = []  # per backward, on the device: all were zeros
        self._counted = False  # the last backward pass added to ``zeroed``

    def before_backward(self) -> None:
        self._counted = False
        if self.reset:
            return
        grads = [(p.grad, i) for (_, p), i in zip(self.params, self.index, strict=True)]
        live = [(g, i) for g, i in grads if g is not None]
        self.backwards += 1
        if not live:
            self.reset = True
            return
        nonzero = [torch.count_nonzero(torch.take(local(g), i)) for g, i in live]
        self.zeroed.append(torch.stack([n.to(nonzero[0].device) for n in nonzero]).sum() == 0)
        self._counted = True

    def missed(self) -> None:
        """The backward pass just counted never reached the model (another model's): it
        says nothing of these gradients (a reset seen before it still stands)."""
        if self._counted:
            self.backwards -= 1
            self.zeroed.pop()
            self._counted = False

    def stale(self) -> torch.Tensor | None:
        """On the device, 1 when no backward pass since that step found the gradients reset;
        ``None`` when that is known not to be so."""
        if self.reset or self.backwards == 0 or not self.zeroed:
            return None
        return (~torch.stack(self.zeroed).any()).float()


class StaleGradients:
    """Gradients never reset between two steps of an optimizer that ran a backward pass in
    between (``zero_grad`` missing, or placed where it never runs)."""

    kind = "stale_gradients"

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self._name = {id(p): n for n, p in ctx.params.items()}
        self._since: dict[int, _Since] = {}
        # per optimizer: its parameters of the model, largest first (while its groups stay)
        self._largest: dict[int, tuple[weakref.ref, int, list[tuple[str, nn.Parameter]]]] = {}
        self._index: dict[tuple, torch.Tensor] = {}  # (param id, numel, device) -> index
        self._pending: list[tuple[str, _Since, torch.Tensor]] = []
        ctx.hooks.optimizer_step_pre_global(self._pre)
        ctx.hooks.optimizer_step_post_global(self._post)

    def before_backward(self) -> None:
        for since in self._since.values():
            since.before_backward()

    def backward_missed(self) -> None:
        for since in self._since.values():
            since.missed()

    def _pre(self, opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        since = self._since.pop(id(opt), None)
        if since is None or self.ctx.paused():
            return
        stale = since.stale()
        if stale is not None:
            self._pending.append((type(opt).__name__, since, stale))

    def _post(self, opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if self.ctx.paused():
            return
        ours = []
        for name, p in self._largest_of(opt):
            if p.grad is not None and p.grad.numel():
                ours.append((name, p))
                if len(ours) == WATCHED:
                    break
        if ours:
            self._since[id(opt)] = _Since(ours, [self._index_of(p) for _, p in ours])

    def _largest_of(self, opt: torch.optim.Optimizer) -> list[tuple[str, nn.Parameter]]:
        cached = self._largest.get(id(opt))
        if cached is not None and cached[0]() is opt and cached[1] == len(opt.param_groups):
            return cached[2]
        ours = [
            (self._name[id(p)], p)
            for group in opt.param_groups
            for p in group["params"]
            if id(p) in self._name
        ]
        ours.sort(key=lambda c: -c[1].numel())
        self._largest[id(opt)] = (weakref.ref(opt), len(opt.param_groups), ours)
        return ours

    def _index_of(self, p: nn.Parameter) -> torch.Tensor:
        grad = p.grad if type(p.grad) is torch.Tensor else local(p.grad)
        # (``get_device``: an int, no device object made per step)
        key = (id(p), grad.numel(), grad.get_device(), grad.is_cuda)
        index = self._index.get(key)
        if index is None:
            index = self._index[key] = spread(grad, ELEMENTS)
        return index

    def collect(self, buf: StepBuffer, sampled: bool) -> None:
        if self._pending:
            device = self._pending[0][2].device
            buf.set(("check", self.kind), torch.stack([s.to(device) for _, _, s in self._pending]))

    def layout(self, rank: int) -> list[Entry]:
        return []

    def read(self, host: Host, record: StepRecord) -> list[Finding]:
        flags = host.get(("check", self.kind), [])
        found = [
            self._finding(opt, since, record.step)
            for (opt, since, _), stale in zip(self._pending, flags, strict=False)
            if stale
        ]
        self._pending = []
        return found

    def _finding(self, opt: str, since: _Since, step: int) -> Finding:
        name = since.params[0][0]
        return Finding(
            self.kind,
            module_of(name),
            step,
            float(since.backwards),
            f"the gradients {opt} used at step {step} still held those of its previous step: "
            f"the {since.backwards} backward pass(es) since then added to the gradients left "
            f"from the last update (checked on {name!r} and up to {WATCHED - 1} more "
            "parameters; none was set to None or to zero in between), so each update applies "
            "the sum of all past gradients. zero_grad() is missing or never runs. Fix: call "
            "optimizer.zero_grad() once per optimizer step, before the backward pass (with "
            "gradient accumulation, right after optimizer.step())",
        )
