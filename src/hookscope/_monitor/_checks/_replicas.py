"""``replica_divergence``: parameters that should be identical on every rank are not.

Data parallelism keeps one replica of each parameter per rank, equal after every update
(DDP averages the gradients). A replica that drifts (a model moved after wrapping, which
unhooks the averaging; a wrapper rebuilt; ranks that clip differently) trains another model,
silently. On sampled steps each rank puts a fingerprint of every replicated parameter (a
weighted sum of a few elements spread over it, float64) into the per-rank block of the step's
one collective, with a ``min`` and a ``max`` rule: where they differ, the replicas do; a
fingerprint of all of them per rank says which ranks differ from rank 0.

Replicated: with ``Monitor(replicated=WHERE)``, the parameters of those modules; otherwise
every plain-tensor parameter (as under DDP) not marked ``tensor_model_parallel=True``
(Megatron-style tensor-parallel shards), and ``DTensor`` parameters replicated on every mesh
dimension.
"""

from __future__ import annotations

import torch
from torch import nn

from ..._diagnose import Finding
from ..._log import StepRecord
from .._step._buffer import Host, StepBuffer
from .._step._dist import Entry, local
from ._common import Context, module_of, spread

__all__ = ["ReplicaDivergence", "replicated_params"]

ELEMENTS = 16


def replicated_params(
    params: dict[str, nn.Parameter], picked: dict[str, nn.Module] | None
) -> dict[str, nn.Parameter]:
    """The parameters that every rank holds whole and equal (see the module's docstring)."""
    if picked is not None:
        ids = {id(p) for m in picked.values() for p in m.parameters()}
        return {n: p for n, p in params.items() if id(p) in ids}
    out = {}
    for name, p in params.items():
        placements = getattr(p, "placements", None)
        if placements is not None and type(p).__name__ == "DTensor":
            if all(pl.is_replicate() for pl in placements):
                out[name] = p
        elif not getattr(p, "tensor_model_parallel", False):
            out[name] = p
    return out


class ReplicaDivergence:
    """Replicated parameters that differ across ranks, at the first sampled step they do."""

    kind = "replica_divergence"

    def __init__(self, ctx: Context, picked: dict[str, nn.Module] | None) -> None:
        self.rank, self.world = ctx.rank or 0, ctx.world
        self.params = replicated_params(ctx.params, picked)
        self._index = {n: spread(local(p.detach()), ELEMENTS) for n, p in self.params.items()}
        self._weights: dict[tuple, torch.Tensor] = {}
        self._reported: set[str] = set()

    def _fingerprint(self, name: str) -> torch.Tensor:
        w = local(self.params[name].detach())
        x = torch.take(w, self._index[name]).to(torch.float64)
        key = (x.numel(), x.device)
        weights = self._weights.get(key)
        if weights is None:
            weights = self._weights[key] = 1.0 + torch.arange(
                x.numel(), dtype=torch.float64, device=x.device
            ) / max(x.numel(), 1)
        return torch.nan_to_num((x * weights).sum(), nan=0.0, posinf=1e300, neginf=-1e300)

    def collect(self, buf: StepBuffer, sampled: bool) -> None:
        if not sampled or not self.params:
            return
        prints = torch.stack([self._fingerprint(n) for n in self.params])
        buf.set(("replica", "min"), prints, "min")
        buf.set(("replica", "max"), prints, "max")
        mine = torch.full((self.world,), -torch.inf, dtype=torch.float64, device=prints.device)
        mine[self.rank] = prints.sum()
        buf.set(("replica", "ranks"), mine, "max")

    def layout(self, rank: int) -> list[Entry]:
        n = len(self.params)
        if not n:
            return []
        return [
            Entry(("replica", "min"), n, "min"),
            Entry(("replica", "max"), n, "max"),
            Entry(("replica", "ranks"), self.world, "max"),
        ]

    def read(self, host: Host, record: StepRecord) -> list[Finding]:
        lo, hi = host.get(("replica", "min")), host.get(("replica", "max"))
        if lo is None or hi is None:
            return []
        ranks = host.get(("replica", "ranks"), [])
        others = [r for r, d in enumerate(ranks) if r and d != ranks[0]]
        found = []
        for name, a, b in zip(self.params, lo, hi, strict=True):
            if a != b and name not in self._reported:
                self._reported.add(name)
                found.append(self._finding(name, others, record.step))
        return found

    def _finding(self, name: str, others: list[int], step: int) -> Finding:
        where = (
            f"ranks {others} hold other values than rank 0"
            if others
            else f"its values differ across the {self.world} ranks"
        )
        return Finding(
            self.kind,
            module_of(name),
            step,
            float(len(others)),
            f"{name!r} should be the same on every data-parallel rank, but at step {step} "
            f"{where} (compared on {ELEMENTS} elements spread over it): the replicas train "
            "different models. Usually the gradients are not averaged for it (the model was "
            "moved or changed after DistributedDataParallel wrapped it, or the wrapper was "
            "rebuilt), or ranks update it differently (rank-dependent clipping, learning rate "
            "or random state, a weight loaded on one rank only). Fix: wrap the final model "
            "once, after .to(device), and keep every update identical across ranks",
        )
