"""Several processes: one collective per step turns every rank's figures into global ones.

Under ``torch.distributed`` each rank's hooks see their own micro-batch: activations, output
gradients, non-finite flags and the loss are rank-local, while parameter gradients at the
optimizer step, weights and update ratios are the same on every rank (DDP) or sharded
(FSDP2). :class:`Collective` packs one step's :class:`StepBuffer` into a single float64
vector in a layout every rank derives from the same model, and runs **one**
``all_reduce(SUM)`` on it:

- ``"sum"`` values (sums, sums of squares, counts; a shard's part of a norm) add up;
- ``"min"``/``"max"`` values go to a per-rank block (each rank writes only its own slot, so
  the sum leaves every rank's value where it was) and are combined on the host;
- ``"none"`` values are not contributed by this rank (a replicated parameter is counted on
  rank 0 only, so that the sum counts it once);
- whatever is not in the layout (the non-finite flags) stays rank-local, but each rank's
  per-rank block says whether it saw a NaN/Inf in its forward pass, its backward pass or its
  parameters' gradients, so that every rank learns where a value first went bad.

Each key also carries a presence count, so a module that did not run on some rank (data-
dependent control flow) does not change the vector's size. The layout of the model (modules,
parameters, settings) is checked across ranks when the Monitor is built, with a timeout, so
that a Monitor built on some ranks only fails with a clear error instead of a hang.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..._errors import HookscopeError
from ._buffer import Host, StepBuffer

__all__ = [
    "FOUND_SCALARS",
    "Alone",
    "Collective",
    "Entry",
    "RankInfo",
    "digest",
    "from_rank0",
    "local",
    "sharded_contributes",
]

# Seconds to wait for every rank at the handshake before saying what is wrong.
HANDSHAKE_TIMEOUT = 300.0
PHASES = ("forward", "backward", "param")
# The tensor scalars a Monitor finds by itself (the loss of backward(), the norm
# clip_grad_norm_ measured): always in the layout, so that a rank without one (a clip run
# on some ranks only) sends a vector of the same size and gets a clear error.
FOUND_SCALARS = ("grad_norm", "loss")


@dataclass(frozen=True)
class Entry:
    """One key of the step's layout: its size and how ranks combine it."""

    key: Hashable
    size: int
    rule: str  # "sum", "min", "max", or "none" (this rank does not contribute)


@dataclass(frozen=True)
class RankInfo:
    """What the per-rank block told about every rank this step."""

    bad: list[tuple[bool, bool, bool]]  # per rank: NaN/Inf in (forward, backward, param grads)
    steps: list[int]

    def origin(self) -> int | None:
        """The rank where a NaN/Inf first appeared: a bad forward pass comes before a bad
        backward pass, which comes before gradients made bad by the all-reduce (DDP spreads
        one rank's NaN gradient to every rank); the lowest rank on a tie."""
        for p in range(len(PHASES)):
            for rank, bits in enumerate(self.bad):
                if bits[p]:
                    return rank
        return None


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: the local shard of a ``DTensor``, or the tensor."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None and _is_dtensor(t) else t


def _is_dtensor(t: torch.Tensor) -> bool:
    return type(t).__name__ == "DTensor" and hasattr(t, "placements")


def sharded_contributes(p: torch.Tensor) -> bool | None:
    """For a ``DTensor`` parameter: whether this rank's shard counts in a global sum (it is
    at coordinate 0 of every mesh dimension the parameter is replicated over); ``None`` for
    a plain (replicated) tensor."""
    if not _is_dtensor(p):
        return None
    mesh = p.device_mesh
    coordinate = mesh.get_coordinate() or []
    return all(
        coordinate[d] == 0 for d, placement in enumerate(p.placements) if placement.is_replicate()
    )


class Alone:
    """The collective of a Monitor that combines nothing with other ranks (one process, or
    ``sync=False``): every step's figures are this process's own."""

    synced = False
    world = 1
    rank: int | None = None  # no rank's figures are combined here

    def handshake(self, **description: Any) -> None:
        """Nothing to compare: no other rank."""


class Collective:
    """Combines a step's buffer across the ranks of the default process group."""

    synced = True

    def __init__(self) -> None:
        self.world = dist.get_world_size()
        self.rank = dist.get_rank()
        # Where the collective's vector lives: CUDA when NCCL serves the group (alone, or as
        # in "cpu:gloo,cuda:nccl"), else the CPU.
        if "nccl" in str(dist.get_backend()) and torch.cuda.is_available():
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")
        self._layouts: dict[tuple[bool, tuple[str, ...]], list[Entry]] = {}

    def handshake(self, **description: Any) -> None:
        """Check that every rank built a Monitor on the same model with the same settings
        (``description``: its modules, parameters, settings, in JSON); a clear error (not a
        hang) when they did not."""
        mine = digest(json.dumps(description, sort_keys=True, default=str))
        vector = self._slot(torch.tensor([mine], dtype=torch.float64, device=self.device))
        work = dist.all_reduce(vector, async_op=True)
        try:
            work.wait(timeout=datetime.timedelta(seconds=HANDSHAKE_TIMEOUT))
        except RuntimeError as e:
            raise HookscopeError(
                f"rank {self.rank}: the other ranks did not build a Monitor within "
                f"{HANDSHAKE_TIMEOUT:.0f} s. Under torch.distributed every rank must build the "
                "same Monitor (it combines statistics with one collective per step); pass "
                "sync=False for independent per-rank logs."
            ) from e
        others = [r for r, d in enumerate(vector.tolist()) if d != mine]
        if others:
            raise HookscopeError(
                f"rank {self.rank}: ranks {others} built a Monitor on a different model or with "
                "other settings (modules, parameters or options differ). Build the same "
                "Monitor on every rank, after wrapping the model the same way."
            )

    def layout(
        self, sampled: bool, scalars: Sequence[str], probes: Callable[[int], list[Entry]]
    ) -> list[Entry]:
        """What the step's collective carries, in an order every rank derives alike: the
        tensor scalars, ``FOUND_SCALARS`` always among them (a ``clip_grad_norm_`` run on
        some ranks only then gets a clear error, not collectives of two sizes), and on sampled
        steps ``probes(rank)``, the probes' entries. Made once per kind of step."""
        key = (sampled, tuple(scalars))
        layout = self._layouts.get(key)
        if layout is None:
            names = sorted({*scalars, *FOUND_SCALARS})
            layout = [Entry(("scalar", k), 1, "sum") for k in names]
            if sampled:
                layout += probes(self.rank)
            self._layouts[key] = layout
        return layout

    def bad_bits(self, buf: StepBuffer, phases: Sequence[tuple[Hashable, str]]) -> torch.Tensor:
        """This rank's (forward, backward, param) non-finite bits, on the device."""
        groups: dict[str, list[torch.Tensor]] = {p: [] for p in PHASES}
        for key, phase in phases:
            value = buf.value(key)
            if value is not None:
                groups["forward" if phase == "input" else phase].append(value.reshape(-1))
        bits = []
        for phase in PHASES:
            values = groups[phase]
            if values:
                total = torch.cat([v.to(self.device, torch.float64) for v in values]).sum()
                bits.append((~torch.isfinite(total)).to(torch.float64).reshape(1))
            else:
                bits.append(torch.zeros(1, dtype=torch.float64, device=self.device))
        return torch.cat(bits)

    def agree_bad(self, bits: torch.Tensor, step: int) -> RankInfo:
        """Only the non-finite bits (before an update that may have to be stopped)."""
        vector = self._slot(torch.cat([bits, bits.new_tensor([float(step)])]))
        dist.all_reduce(vector)
        return _info(vector.tolist(), self.world, 4)

    def exchange(
        self,
        buf: StepBuffer,
        layout: Sequence[Entry],
        bits: torch.Tensor,
        step: int,
        scalars_digest: float,
    ) -> tuple[Host, RankInfo]:
        """The whole step: the global values of ``layout`` plus this rank's own values of
        every other key, from one ``all_reduce`` and one device-to-host transfer."""
        f64 = dict(dtype=torch.float64, device=self.device)
        summed: list[torch.Tensor] = []
        presence: list[float] = []
        extremes: list[torch.Tensor] = []
        for entry in layout:
            value = buf.take(entry.key)
            has = value is not None and entry.rule != "none"
            presence.append(1.0 if has else 0.0)
            if entry.rule in ("min", "max"):
                fill = math.inf if entry.rule == "min" else -math.inf
                extremes.append(
                    value.reshape(-1).to(**f64) if has else torch.full((entry.size,), fill, **f64)
                )
            else:
                summed.append(
                    value.reshape(-1).to(**f64) if has else torch.zeros(entry.size, **f64)
                )
        head = [bits, torch.tensor([float(step), scalars_digest], **f64), *extremes]
        block = torch.cat(head)
        width = block.numel()
        vector = torch.cat([*summed, torch.tensor(presence, **f64), self._slot(block)])
        dist.all_reduce(vector)
        rest = buf.pending_keys()
        parts = [buf.take(k).reshape(-1) for k in rest]
        flat = torch.cat([vector, *(p.to(**f64) for p in parts)]).tolist()

        n_sum = sum(e.size for e in layout if e.rule not in ("min", "max"))
        sums, flat = flat[:n_sum], flat[n_sum:]
        counts, flat = flat[: len(layout)], flat[len(layout) :]
        blocks, own = flat[: self.world * width], flat[self.world * width :]
        info = _info(blocks, self.world, width)
        digests = {blocks[r * width + 4] for r in range(self.world)}
        if len(set(info.steps)) > 1:
            raise HookscopeError(
                f"the ranks are out of step: their Monitors are at steps {info.steps}. Call "
                "mon.step() once per training step on every rank, with the same scalars."
            )
        if len(digests) > 1:
            raise HookscopeError(self._uneven_scalars(layout, counts))
        host: Host = {}
        at_sum, at_ext = 0, 5
        for entry, count in zip(layout, counts, strict=True):
            if entry.rule in ("min", "max"):
                pick = min if entry.rule == "min" else max
                values = [
                    blocks[r * width + at_ext : r * width + at_ext + entry.size]
                    for r in range(self.world)
                ]
                at_ext += entry.size
                if count:
                    host[entry.key] = [pick(column) for column in zip(*values, strict=True)]
            else:
                if count:
                    host[entry.key] = sums[at_sum : at_sum + entry.size]
                at_sum += entry.size
        at = 0
        for key, part in zip(rest, parts, strict=True):
            host[key] = own[at : at + part.numel()]
            at += part.numel()
        buf.absorb(host)
        return buf.to_host(), info

    def _uneven_scalars(self, layout: Sequence[Entry], counts: list[float]) -> str:
        """Why the ranks' tensor scalars differ, naming the scalar and its likely cause."""
        uneven = [
            (entry.key[1], int(count))
            for entry, count in zip(layout, counts, strict=True)
            if isinstance(entry.key, tuple) and entry.key[0] == "scalar" and 0 < count < self.world
        ]
        if any(name == "grad_norm" for name, _ in uneven):
            n = dict(uneven)["grad_norm"]
            return (
                f"rank {self.rank}: clip_grad_norm_ ran on {n} of the {self.world} ranks this "
                "step (the Monitor logs the norm it measured as grad_norm): the ranks clip "
                "differently, so their replicas drift apart. Clip on every rank, with the "
                "same max_norm (or pass sync=False for independent per-rank logs)."
            )
        what = (
            ", ".join(f"{name!r} on {n} of {self.world} ranks" for name, n in uneven)
            if uneven
            else "tensor scalars of different names"
        )
        return (
            f"rank {self.rank}: the ranks are out of step: step() got {what}. Call mon.step() "
            "once per training step on every rank, with the same scalars."
        )

    def broadcast(self, obj: object, src: int) -> object:
        """``obj`` from rank ``src`` on every rank (only when a finding must be shared)."""
        box = [obj if self.rank == src else None]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def _slot(self, block: torch.Tensor) -> torch.Tensor:
        """``block`` in this rank's slot of a vector of ``world`` such blocks, zeros in the
        others: after a SUM every rank holds every rank's block."""
        width = block.numel()
        before, after = self.rank * width, (self.world - self.rank - 1) * width
        return torch.cat([block.new_zeros(before), block, block.new_zeros(after)])


def _info(blocks: list[float], world: int, width: int) -> RankInfo:
    bad = [tuple(bool(blocks[r * width + p]) for p in range(len(PHASES))) for r in range(world)]
    return RankInfo(bad=bad, steps=[int(blocks[r * width + 3]) for r in range(world)])


def digest(text: str) -> float:
    """A float64-exact digest of ``text`` (48 bits), to compare across ranks."""
    return float(int.from_bytes(hashlib.sha256(text.encode()).digest()[:6], "big"))


def from_rank0(rank: int) -> str:
    """The combining rule that keeps rank 0's value (a histogram, the top channels): summed
    from rank 0 alone, every other rank's slot left out."""
    return "sum" if rank == 0 else "none"
