"""What a Monitor measures of the model's parameters and BatchNorm statistics.

Like the probes of module outputs (``_probes/_outputs.py``), each puts device tensors into the step's
:class:`StepBuffer` under its own keys while the step runs (from optimizer hooks, or in
:meth:`collect` at the step's end) and, after the one host transfer, fills its part of the
:class:`StepRecord` in :meth:`read`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from ..._log import StepRecord
from ..._stats import (
    Rows,
    Sampler,
    norms,
    squared_norms,
)
from .._step._buffer import Host, StepBuffer
from .._step._dist import Entry, from_rank0, local, sharded_contributes

__all__ = ["BatchNorms", "Params"]


class Params:
    """Gradient norm, weight norm and update ratio ``||W_after - W_before|| / ||W_before||``.

    Around an optimizer step, gradient norms are read just before the update (so they are the
    accumulated, unscaled gradients the optimizer uses), weight norms just after it, and the
    update ratio compares the same ``sample`` elements before and after: never a full copy of
    the weights (``sample=None`` copies them whole, for an exact ratio). Parameters no
    optimizer stepped this step get their gradient and weight norms at the step's end.
    """

    def __init__(self, model: nn.Module, sampler: Sampler) -> None:
        # Tied weights appear once: named_parameters() deduplicates.
        self.params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        self._name = {id(p): n for n, p in self.params.items()}
        self.sampler = sampler
        # Across ranks: a sharded (FSDP2) parameter's figures add up over its shards; a
        # replicated one (DDP) is the same everywhere and counted once.
        self.sharded = {n: sharded_contributes(p) for n, p in self.params.items()}
        self._before: dict[str, torch.Tensor] = {}
        self._done: set[str] = set()

    def owned(self, optimizer: torch.optim.Optimizer) -> list[str]:
        """Names of this model's parameters that ``optimizer`` steps."""
        return [
            self._name[id(p)]
            for group in optimizer.param_groups
            for p in group["params"]
            if id(p) in self._name
        ]

    def owns_any(self, params: Iterable[torch.Tensor]) -> bool:
        """Whether any of ``params`` is one of this model's trainable parameters."""
        return any(id(p) in self._name for p in params)

    def read_grads(
        self,
        buf: StepBuffer,
        names: Iterable[str],
        *,
        stepped: bool = False,
        known: tuple[list[str], torch.Tensor | list[torch.Tensor]] | None = None,
    ) -> None:
        """Gradient norms (``known``: the names and L2 norms already measured, used as they
        are when they are those of the parameters with a gradient, in order); with
        ``stepped`` (an optimizer steps these), a parameter without a gradient is noted as
        such."""
        names = list(names)
        if stepped:
            for name in names:
                if self.params[name].grad is None:
                    buf.set(("param", name, "no_grad"), torch.ones(()))
        names = [n for n in names if self.params[n].grad is not None]
        if not names:
            return
        keys = [("param", name, "grad_norm") for name in names]
        if known is not None and known[0] == names:
            values = known[1]
            stacked = values if isinstance(values, torch.Tensor) else torch.stack(values)
            buf.set_rows(keys, stacked.float().square())
        else:
            _set_squares(buf, keys, [local(self.params[n].grad) for n in names])

    def before_update(self, names: list[str]) -> None:
        for name in names:
            p = self.params[name]
            if p.dim() >= 2:  # update ratios concern weight matrices and kernels
                w = local(p.detach())
                x = self.sampler(w)
                # a sample taken is a tensor of its own; the whole weight is a view: copy it
                self._before[name] = x.clone() if x.numel() == w.numel() else x

    def after_update(self, buf: StepBuffer, names: list[str]) -> None:
        kept = []
        for name in names:
            before = self._before.pop(name, None)
            if before is not None and self.params[name].grad is not None:
                kept.append((name, before))
        if kept:
            with torch.no_grad():
                befores = [before for _, before in kept]
                nows = [self.sampler(local(self.params[name])) for name, _ in kept]
                deltas = torch._foreach_sub(nows, befores)
            for stat, values in (("delta", deltas), ("before", befores)):
                _set_squares(buf, [("param", name, stat) for name, _ in kept], values)
        self._weightnorms(buf, names)
        self._done.update(names)

    def collect(self, buf: StepBuffer) -> None:
        rest = [n for n in self.params if n not in self._done]
        self.read_grads(buf, rest)
        self._weightnorms(buf, rest)

    def _weightnorms(self, buf: StepBuffer, names: list[str]) -> None:
        weights = [local(self.params[n]) for n in names]
        _set_squares(buf, [("param", n, "norm") for n in names], weights)

    def layout(self, rank: int) -> list[Entry]:
        entries = []
        for name, sharded in self.sharded.items():
            rule = from_rank0(rank) if sharded is None else ("sum" if sharded else "none")
            for stat in ("grad_norm", "norm", "delta", "before", "no_grad"):
                entries.append(Entry(("param", name, stat), 1, rule))
        return entries

    def read(self, host: Host, record: StepRecord) -> None:
        for name in self.params:
            stats: dict[str, float | None] = {
                stat: math.sqrt(host[key][0])
                for stat in ("norm", "grad_norm")
                if (key := ("param", name, stat)) in host
            }
            if ("param", name, "no_grad") in host:
                stats["grad_norm"] = None
            delta = host.get(("param", name, "delta"))
            if delta is not None:
                before = host[("param", name, "before")][0]
                stats["update_ratio"] = math.sqrt(delta[0]) / (math.sqrt(before) + 1e-12)
            if stats:
                record.param[name] = stats

    def reset(self) -> None:
        self._before.clear()
        self._done.clear()


def _set_squares(buf: StepBuffer, keys: list[tuple], tensors: list[torch.Tensor]) -> None:
    """The squared L2 norm of each of ``tensors`` under its key: one vector where they share
    a device and dtype (squares add up over calls and ranks, as norms do not)."""
    if not tensors:
        return
    squares = squared_norms(tensors)
    if squares is None:
        buf.set_many(keys, norms(tensors, squared=True))
    else:
        buf.set_rows(keys, squares)


class BatchNorms:
    """Running mean and variance of every BatchNorm (means over channels) and their drift
    since the last sampled step."""

    def __init__(self, model: nn.Module) -> None:
        self.modules = {
            n: m for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
        }
        # the last sampled step's running statistics, one vector, and what they were of
        self._prev: tuple[tuple, torch.Tensor] | None = None
        self._saved: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._rows = Rows()

    def save_running(self) -> None:
        """Before the step's first forward, for ``on_nonfinite="skip"``: skipping a step also
        undoes what its forward did to the running statistics (a NaN there would poison every
        evaluation after)."""
        self._saved = [
            (b, b.detach().clone())
            for bn in self.modules.values()
            for b in (bn.running_mean, bn.running_var, bn.num_batches_tracked)
            if b is not None
        ]

    def restore_running(self) -> None:
        with torch.no_grad():
            for b, saved in self._saved:
                b.copy_(saved)

    def collect(self, buf: StepBuffer) -> None:
        """Every BatchNorm's figures from one vector of all their running statistics (each
        one's mean, and its drift, ``||now - before|| / (||before|| + 1e-12)``, as sums over
        its segment): a dozen ops for all of them, not a dozen per BatchNorm. The drifts
        are NaN at the first sampled step, and at one whose BatchNorms or sizes changed."""
        names, stats = [], []
        for name, bn in self.modules.items():
            if bn.running_mean is None or bn.running_var is None:
                continue
            names.append(name)
            stats += (bn.running_mean, bn.running_var)
        if not names:
            return
        device = stats[0].device
        lengths = tuple(t.numel() for t in stats)
        layout = (tuple(names), lengths)
        segment = self._rows.cached(
            ("bn_segments", lengths, device),
            lambda: torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).to(
                device
            ),
        )
        with torch.no_grad():
            now = torch.cat([t.to(device, torch.float32).reshape(-1) for t in stats])

            def sums(x: torch.Tensor) -> torch.Tensor:  # each statistic's sum
                return x.new_zeros(len(lengths)).index_add_(0, segment, x)

            avg = sums(now) / self._rows.const(tuple(map(float, lengths)), device)
            prev = self._prev if self._prev is not None and self._prev[0] == layout else None
            if prev is None:
                drift = torch.full_like(avg, math.nan)
            else:
                before = prev[1]
                moved = sums((now - before).square_()).sqrt_()
                drift = moved / sums(before.square()).sqrt_().add_(1e-12)
        self._prev = (layout, now)  # a copy: the cat's
        rows = torch.cat([avg.view(-1, 2), drift.view(-1, 2)], 1)
        buf.set_rows([("bn", name) for name in names], rows)

    def layout(self, rank: int) -> list[Entry]:
        """Running statistics: rank 0's (DDP broadcasts rank 0's buffers at each forward)."""
        return [Entry(("bn", name), 4, from_rank0(rank)) for name in self.modules]

    def read(self, host: Host, record: StepRecord) -> None:
        for name in self.modules:
            values = host.get(("bn", name))
            if values is not None:
                record.bn[name] = dict(
                    zip(
                        ("running_mean", "running_var", "mean_drift", "var_drift"),
                        values,
                        strict=True,
                    )
                )
