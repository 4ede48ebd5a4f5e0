"""Every probe of a Monitor as one collection: what it measures, built, hooked, read together.

The probes (``_probes/_outputs.py``, ``_probes/_params.py``, ``_probes/_compiled.py``, ``_probes/_precision.py``,
``_probes/_attention.py``, ``_probes/_signals.py``) each put device tensors into the step's buffer under
their own keys and fill their part of the step's record from the host values. The Monitor
talks to them as one: :meth:`ProbeSet.attach` hooks them onto the model, :meth:`collect`
adds what a sampled step reads at its end, :meth:`layout` is their part of a step's
collective, :meth:`read` fills the record and :meth:`reset` readies the next step.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from ..._diagnose import Thresholds
from ..._hooks import HookSet
from ..._log import StepRecord
from ..._stats import Sampler
from .._options import device_of
from .._probes._attention import Attention
from .._probes._compiled import CompiledProbes
from .._probes._outputs import Activations, OutputGrads
from .._probes._params import BatchNorms, Params
from .._probes._precision import PrecisionProbe
from .._probes._signals import SpikeWatch
from .._step._buffer import Host, StepBuffer
from .._step._dist import Entry
from ._modules import MODULES, ModuleHooks

__all__ = ["ProbeSet"]


class ProbeSet:
    """What a Monitor measures of ``modules`` (the watched ones) and of ``model``.

    ``sample``: each tensor's statistics from at most this many elements (``None``: all);
    ``bins``: a histogram of each activation; ``precision``: the lower-precision dtypes to
    judge values against; ``world``: the ranks whose figures are combined."""

    def __init__(
        self,
        model: nn.Module,
        modules: dict[str, nn.Module],
        thresholds: Thresholds,
        *,
        sample: int | None,
        bins: int | None,
        precision: Sequence[str],
        world: int,
    ) -> None:
        self.sampler, self.sample = Sampler(sample), sample
        dead_min = (thresholds.dead_min_units, thresholds.dead_min_samples)
        dead_at = thresholds.dead_unit
        self.acts = Activations(
            modules, self.sampler, dead_at=dead_at, dead_min=dead_min, bins=bins
        )
        self.grads = OutputGrads(self.sampler, modules, world=world)
        self.compiled = CompiledProbes(  # what compiled graphs measure
            list(modules), sample, dead_at=dead_at, dead_min=dead_min, device=device_of(model)
        )
        self.precision = PrecisionProbe(precision, self.sampler, modules) if precision else None
        self.params = Params(model, self.sampler)
        self.spikes = SpikeWatch(self.params.params, thresholds)  # the rolling window
        self.bns = BatchNorms(model)
        self.attention: Attention | None = None  # once attached
        self._modules = modules

    @property
    def sharded(self) -> bool:
        """Some parameters are sharded (FSDP2)."""
        return any(v is not None for v in self.params.sharded.values())

    @property
    def shapes(self) -> dict[str, list[int]]:
        """The trainable parameters' shapes, by name."""
        return {n: list(p.shape) for n, p in self.params.params.items()}

    def attach(
        self, hooks: HookSet, model: nn.Module, *, keep_outputs: bool, skip: bool
    ) -> ModuleHooks:
        """Hook the probes onto ``model``, in ``hooks``: the hooks on its modules, which write
        into the step's state (``_wiring/_modules.py``), and the attention probe's. ``keep_outputs``:
        the tape keeps the outermost calls' outputs (for a replay bundle); ``skip``: a step
        whose update is skipped also undoes its forward's BatchNorm running statistics."""
        module_hooks = ModuleHooks(
            hooks,
            model,
            self._modules,
            acts=self.acts,
            grads=self.grads,
            precision=self.precision,
            compiled=self.compiled,
            keep_outputs=keep_outputs,
            on_first_call=self.bns.save_running if skip else None,
        )
        with hooks.grouped(MODULES, besides=model):  # it measures on sampled steps only
            self.attention = Attention(
                model,
                hooks,
                self.sample,
                active=module_hooks.measures,
                buffer=lambda: module_hooks.now.buf,
            )
        return module_hooks

    def collect(self, buf: StepBuffer) -> None:
        """At a sampled step's end: the parameters' figures not read around an update, and
        the BatchNorm running statistics."""
        self.params.collect(buf)
        self.bns.collect(buf)

    def layout(self, rank: int) -> list[Entry]:
        """What the probes put in a sampled step's collective."""
        layout = self.acts.layout(rank) + self.grads.layout()
        layout += self.params.layout(rank) + self.bns.layout(rank)
        if self.precision is not None:
            layout += self.precision.layout()
        return layout + (self.attention.layout() if self.attention is not None else [])

    def read(self, host: Host, record: StepRecord) -> None:
        """Fill a sampled step's record (its scalars already in it: the output gradients are
        logged divided by its ``grad_scale``)."""
        self.grads.unscale(record.scalars.get("grad_scale"))
        probes = (self.acts, self.grads, self.params, self.bns, self.precision, self.attention)
        for probe in probes:
            if probe is not None:
                probe.read(host, record)

    def reset(self) -> None:
        """A new step: the output gradients seen and the parameters read are the last one's."""
        self.grads.reset()
        self.params.reset()
