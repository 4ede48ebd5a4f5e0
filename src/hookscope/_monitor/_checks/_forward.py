"""Checks on forward passes: ``eval_randomness``, ``eval_mismatch``, ``autocast_skipped``.

Evaluation passes (the model in eval mode) are watched apart from training: the random
number generators are compared at every module boundary (so a draw is named to the module
whose own code made it, as ops between a container's children are), and each watched
module's output scale is kept for an ``eval`` record. In training mode the hooks return at
once. Autocast coverage is read from the output's dtype, a host attribute: no device work.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict

import torch
from torch import nn

from ..._diagnose import Finding
from ..._log import EvalRecord, StepRecord
from ..._tree import tensors
from .._step._buffer import Host, StepBuffer
from .._step._dist import Entry
from ._common import Context

__all__ = ["AutocastSkipped", "EvalMismatch", "EvalRandomness"]

EVAL_CALLS = 16  # calls of a module whose output scale counts, per evaluation (between steps)
EVAL_SCALE = 100.0  # eval / training RMS (or its inverse) that is a finding


def _rng_state() -> tuple[torch.Tensor, torch.Tensor | None]:
    """The CPU generator's state and, when CUDA is in use, the current device's."""
    cuda = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = torch.cuda.get_rng_state()
    return torch.default_generator.get_state(), cuda


def _same(a: tuple, b: tuple) -> bool:
    return torch.equal(a[0], b[0]) and (a[1] is None or b[1] is None or torch.equal(a[1], b[1]))


class EvalRandomness:
    """``eval_randomness``: a module drew random numbers while the model was in eval mode
    (dropout left on: ``F.dropout(x, p, training=True)``, an attention call given
    ``dropout_p=p`` whatever the mode)."""

    kind = "eval_randomness"

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self._stack: list[str] = []
        self._last: tuple | None = None
        self._drew: dict[str, str] = {}  # module -> its type, this step
        self._reported: set[str] = set()
        for name, module in ctx.model.named_modules():
            ctx.hooks.forward_pre(module, functools.partial(self._enter, name))
            ctx.hooks.forward(module, functools.partial(self._leave, name), always_call=True)

    def _enter(self, name: str, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self.ctx.model.training or self.ctx.paused():
            return
        self._mark()
        self._stack.append(name)

    def _leave(self, name: str, module: nn.Module, args: tuple, kwargs: dict, out: object) -> None:
        if not self._stack or self._stack[-1] != name:
            return
        self._mark()
        self._stack.pop()
        if not self._stack:
            self._last = None  # what runs between two calls of the model is not its own

    def _mark(self) -> None:
        """The generators changed since the last module boundary: the module on top of the
        stack drew, in its own code."""
        now = _rng_state()
        if self._last is not None and self._stack and not _same(now, self._last):
            top = self._stack[-1]
            if top not in self._reported:
                self._drew.setdefault(top, type(self.ctx.model.get_submodule(top)).__name__)
        self._last = now

    def collect(self, buf: StepBuffer, sampled: bool) -> None:
        pass

    def layout(self, rank: int) -> list[Entry]:
        return []

    def read(self, host: Host, record: StepRecord) -> list[Finding]:
        found = []
        for name, type_name in self._drew.items():
            self._reported.add(name)
            found.append(
                Finding(
                    self.kind,
                    name,
                    record.step,
                    1.0,
                    f"{name!r} ({type_name}) drew random numbers while the model was in eval "
                    "mode: its evaluation output is random (dropout left on). Usually its "
                    "forward calls F.dropout(x, p, training=True) or passes dropout_p=p to an "
                    "attention function whatever the mode. Fix: pass the module's mode, "
                    "training=self.training, or dropout_p=p if self.training else 0.0",
                )
            )
        self._drew = {}
        self._stack, self._last = [], None
        return found


class EvalMismatch:
    """``eval_mismatch``: a watched module's output RMS in evaluation passes and in training
    differ by ``EVAL_SCALE`` or more (a module whose state is only set by a training forward,
    such as spectral norm's power iteration, evaluated before it). Also writes each
    evaluation's statistics as an ``eval`` record."""

    kind = "eval_mismatch"

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self._calls: dict[str, int] = {}
        self._pending: dict[str, torch.Tensor] = {}  # module -> (sum of squares, n, absmax)
        self._names: list[str] = []  # modules with statistics in this step's buffer
        self._eval: dict[str, float] = {}  # module -> RMS in the evaluation just read
        self._train: dict[str, float] = {}  # module -> RMS on the last sampled training step
        self._next_step = 0
        self._crossed: set[str] = set()  # modules judged apart so far
        for name, module in ctx.modules.items():
            ctx.hooks.forward(module, functools.partial(self._on_forward, name))

    def _on_forward(
        self, name: str, module: nn.Module, args: tuple, kwargs: dict, out: object
    ) -> None:
        if self.ctx.model.training or self.ctx.paused():
            return
        calls = self._calls.get(name, 0)
        first = next((t for t in tensors(out) if t.is_floating_point()), None)
        if calls >= EVAL_CALLS or first is None or first.numel() == 0:
            return
        self._calls[name] = calls + 1
        x = self.ctx.sampler(first.detach()).float()
        sums = torch.stack([x.square().sum(), x.new_full((), float(x.numel())), x.abs().max()])
        old = self._pending.get(name)
        self._pending[name] = (
            sums
            if old is None
            else torch.cat([old[:2] + sums[:2], torch.maximum(old[2:], sums[2:])])
        )

    def collect(self, buf: StepBuffer, sampled: bool) -> None:
        self._names = list(self._pending)
        for name, sums in self._pending.items():
            buf.set(("eval", name), sums)
        self._pending = {}

    def layout(self, rank: int) -> list[Entry]:
        return []

    def read(self, host: Host, record: StepRecord) -> list[Finding]:
        """Each evaluation is judged once, when it is read, against the training statistics
        of the same step, or else of the latest sampled step before it: the weights it ran
        with, or the nearest before (never an old evaluation against training many updates
        later: an evaluation at step 0 is no measure of the model three large updates on)."""
        step = record.step
        self._next_step = step + 1
        if record.sampled and record.training:
            for name, s in record.act.items():
                rms = math.hypot(s["mean"], s["std"])
                if math.isfinite(rms):
                    self._train[name] = rms
        if not self._names:
            return []
        self._eval = {}
        self._write(step, {n: host[("eval", n)] for n in self._names if ("eval", n) in host})
        crossing = [f for name in self._eval if (f := self._judge(name, step)) is not None]
        new = [f for f in crossing if f.module not in self._crossed]
        self._crossed.update(f.module for f in crossing)
        # Only where the scales first part (in call order): what follows inherits it.
        return new[:1] if new and crossing[0] is new[0] else []

    def flush(self) -> None:
        """Statistics of an evaluation after the last step (written when the Monitor closes)."""
        if self._pending:
            values = {n: s.tolist() for n, s in self._pending.items()}
            self._write(self._next_step, values)
            self._pending = {}

    def _write(self, step: int, values: dict[str, list[float]]) -> None:
        modules = {}
        for name, (sumsq, n, absmax) in values.items():
            rms = math.sqrt(sumsq / max(n, 1.0))
            modules[name] = {"rms": rms, "absmax": absmax, "calls": self._calls.get(name, 0)}
            if math.isfinite(rms):
                self._eval[name] = rms
        self._calls = {}
        self.ctx.write(asdict(EvalRecord(step, modules)))

    def _judge(self, name: str, step: int) -> Finding | None:
        ev, tr = self._eval[name], self._train.get(name)
        if tr is None or ev <= 0 or tr <= 0:
            return None
        ratio = ev / tr
        if 1 / EVAL_SCALE < ratio < EVAL_SCALE:
            return None
        module = self.ctx.modules.get(name)
        what = "larger" if ratio > 1 else "smaller"
        return Finding(
            self.kind,
            name,
            step,
            ratio,
            f"{name!r} ({type(module).__name__}) outputs values {max(ratio, 1 / ratio):.3g}x "
            f"{what} in evaluation (RMS {ev:.3g}) than in training (RMS {tr:.3g}): its "
            "evaluation results are not those of the trained model. Usually the module keeps "
            "state that only a training forward sets (spectral norm's power iteration, "
            "BatchNorm running statistics never updated), or evaluation inputs are "
            "preprocessed differently (e.g. not normalised). Fix: run a training-mode forward "
            "before evaluating, or make evaluation see the same inputs as training",
        )


def _linear_like(module: nn.Module) -> bool:
    """Layers autocast runs in lower precision: Linear, Bilinear, convolutions and
    transformers' ``Conv1D`` (a Linear with transposed weights)."""
    return isinstance(module, (nn.Linear, nn.Bilinear, nn.modules.conv._ConvNd)) or (
        type(module).__name__ == "Conv1D"
    )


class AutocastSkipped:
    """``autocast_skipped``: inside an autocast region, a watched Linear/Conv-like layer
    returned another floating dtype than autocast's (it disabled autocast for itself, or
    computes outside autocast's ops). Norms, softmax and losses run in float32 on purpose
    and are not judged; neither is a layer its caller ran with autocast disabled."""

    kind = "autocast_skipped"

    def __init__(self, ctx: Context) -> None:
        self._seen: dict[str, tuple[str, torch.dtype, torch.dtype, str]] = {}
        self._reported: set[str] = set()
        for name, module in ctx.modules.items():
            if _linear_like(module):
                ctx.hooks.forward(module, functools.partial(self._on_forward, name))

    def _on_forward(
        self, name: str, module: nn.Module, args: tuple, kwargs: dict, out: object
    ) -> None:
        if not isinstance(out, torch.Tensor) or not out.is_floating_point():
            return
        device = out.device.type
        try:
            if not torch.is_autocast_enabled(device):
                return
            want = torch.get_autocast_dtype(device)
        except RuntimeError:  # a device type autocast does not know
            return
        if out.dtype != want and name not in self._reported:
            self._seen.setdefault(name, (type(module).__name__, out.dtype, want, device))

    def collect(self, buf: StepBuffer, sampled: bool) -> None:
        pass

    def layout(self, rank: int) -> list[Entry]:
        return []

    def read(self, host: Host, record: StepRecord) -> list[Finding]:
        found = []
        for name, (type_name, got, want, device) in self._seen.items():
            self._reported.add(name)
            found.append(
                Finding(
                    self.kind,
                    name,
                    record.step,
                    float(torch.finfo(got).bits),
                    f"{name!r} ({type_name}) ran inside an autocast region "
                    f"(torch.autocast({device!r}, dtype={want})) but returned {got}: autocast "
                    f"did not cover it, so it computes in {got} (slower, more memory, and its "
                    "output dtype differs from its neighbours'). Usually its forward disables "
                    "autocast (@torch.autocast(..., enabled=False), custom_fwd(cast_inputs="
                    "torch.float32)), casts its input or weights (.float(), .double()), or "
                    "is a custom autograd Function. Fix: let autocast run it; if it must run "
                    "in full precision, disable autocast around the call in its caller",
                )
            )
        self._seen = {}
        return found
