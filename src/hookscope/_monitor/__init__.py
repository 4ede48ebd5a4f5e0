"""Monitor: layer-by-layer training health at the cost of a bare training step.

The Monitor only orchestrates. Its probes (``_wiring/_probeset.py``) and checks (``_checks/``) are
hooked onto the model once (``_wiring/_build.py``). While a step runs, the hooks write the step's
state (``_step/_state.py``): the probes and the non-finite trail (``_step/_trail.py``) put small device
tensors into the step's :class:`StepBuffer`, and around each optimizer update the final
gradients are read and checked (``_wiring/_update.py``). ``step()`` moves the buffer to the host in
one transfer (``_wiring/_transfer.py``), has each probe and check fill its part of a typed
:class:`StepRecord` (``_log.py``), has the non-finite decision (``_nonfinite/_decide.py``) and the
diagnosis judge the step, and writes the records and findings out (``_output.py``).
"""

from __future__ import annotations

import inspect
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .._compat import require
from .._diagnose import Diagnosis, Finding, Graph, Thresholds
from .._errors import HookscopeError, HookscopeWarning
from .._hooks import eager_model
from .._log import StepRecord
from .._select import Where, select
from .._sinks import Sink
from ._lifetime import Lifetime, check_materialized, idle_message
from ._nonfinite._decide import nonfinite_error
from ._nonfinite._replay import (
    write_bundle,  # safetensors itself is imported when a bundle is written
)
from ._options import (
    batch_list,
    check_batch_indices,
    check_explain,
    check_mode,
    check_options,
    check_record_dir,
    is_leaf,
    ranks,
    settings,
    thresholds_from,
)
from ._output import Output
from ._probes._signals import SkipList
from ._step._buffer import Host
from ._step._dist import RankInfo
from ._step._state import StepState
from ._warnings import Warnings
from ._wiring._build import Wiring
from ._wiring._probeset import ProbeSet

if TYPE_CHECKING:
    from .._explain._probe import Probe, ProbeRun

__all__ = ["Monitor"]

DEFAULT_SAMPLE = 4096


class Monitor:
    """Watch a training run layer by layer; log statistics and report what goes wrong.

    Per watched module and sampled step: activation statistics of its output (mean, std,
    min, max, fraction of zeros, fraction saturated for bounded activations, fraction of dead
    units for ReLUs, NaN and Inf counts, optionally a histogram) and the norm of the gradient
    of its output; per parameter: norm, gradient norm (read just before the optimizer step,
    after accumulation and unscaling) and update-to-weight ratio ``||ΔW|| / ||W||`` around
    ``optimizer.step()``; BatchNorm running statistics and their drift; learning rates.
    Non-finite values are checked on every step, in every element, where every NaN/Inf that
    matters passes: the model's inputs and outputs, the gradient reaching its outputs and
    every parameter's gradient (one fused pass); a replay of the failing step under an
    op-level tracer names the first module and op. Where no replay can run (several ranks,
    sharded parameters), every module output and gradient is checked instead.

    The optimizer is found, not passed: every optimizer that steps a parameter of ``model``
    is adopted when it first steps (created before or after the Monitor, several of them,
    wrapped ones such as Accelerate's), through torch's global optimizer step hooks.

    Args:
        model: The model. Hooks are removed by ``close()`` or at the end of a ``with`` block.
            One Monitor per model: a new one on a model that has one open (a notebook cell
            run again) closes the earlier one.
        where: Modules to watch; by default every leaf module (``hs.Tap`` included; the
            model itself when it has no children).
        every: Sample statistics every ``every`` steps (step 0 is sampled); ``None``: only
            the non-finite check, on every step. A closure optimizer's sampled step
            (``LBFGS``, which evaluates one batch's closure many times) reads the first
            evaluation; the others are checked as an unsampled step's calls are, each
            right after it runs (a NaN it makes is traced with the weights it ran with).
        sample: On sampled steps, compute each tensor's statistics from at most this many of
            its elements, spread over all of it; ``None`` reads every element (and copies the
            weights whole around the optimizer step, for exact update ratios). The
            non-finite check always reads every element.
        log_dir: Directory for ``hookscope.jsonl`` (and TensorBoard events when tensorboard
            is installed); ``None`` keeps records in memory only (``mon.records``). A log
            an earlier run left there is kept: this run writes ``hookscope-2.jsonl`` (and
            ``tensorboard-2/``), the next ``-3``, ...; ``mon.log_path`` says which, and
            ``hs.report(log_dir)`` reads the newest.
        optimizer: An optimizer to adopt now (optional: optimizers are found by themselves).
        check: Where the non-finite check looks on every step. ``"edges"`` (default): what
            every NaN/Inf must reach (the model's inputs and outputs, the gradient reaching
            them, every parameter's gradient); a replay of the failing step names the module
            and op. ``"modules"``: every watched module's output and output gradient, so the
            module is named from the step itself, also where a replay cannot reproduce it (a
            module with its own state, a nondeterministic kernel), at a measured cost
            (``benchmarks/README.md``).
        on_nonfinite: What to do when a NaN/Inf appears. ``"log"``: a finding, training
            goes on. ``"raise"``: :class:`hs.NonFiniteError`, naming the module where it
            first appeared, from ``optimizer.step()`` *before* the update (weights and
            optimizer state are those from before the failing step), or from ``step()``
            when no optimizer stepped the model. ``"skip"``: that update is skipped (as
            ``GradScaler`` does; a ``skipped_step`` event) and training goes on.
        histograms: Also keep a ``bins``-bin histogram of each activation.
        sinks: More sinks (objects with ``write(record)`` and ``close()``).
        thresholds: Diagnosis thresholds (see :class:`hs.Thresholds` for the defaults and
            where they come from); keyword arguments named after its fields override one.
        record_dir: The flight recorder: when a finding of a kind in ``record_on`` first
            fires, write a replay bundle under this directory (the step's root inputs, RNG
            states, the gradient that reached the model's outputs, the model's and the
            optimizers' state; for ``nonfinite`` with an optimizer, from before the update).
            Replay it with :func:`hs.replay`, or ``hookscope replay BUNDLE --model M:F``.
        record_on: Finding kinds that write a bundle (default: ``("nonfinite",)``).
        skip_list: A JSON file that lists the batches of the steps where a ``loss_spike``
            started (their step numbers, and the data-set indices given to
            ``step(batch_indices=...)``), for a trainer that resumes from an earlier
            checkpoint to skip them (``_monitor/_probes/_signals.py``, :class:`SkipList`).
        sync: Under ``torch.distributed`` with several ranks (every rank builds the same
            Monitor): ``None`` (default) or ``True`` combine the ranks' figures with one
            collective per step into what one process would compute on the whole batch
            (activations over every rank's micro-batch, output gradients of the averaged
            loss, parameter norms and update ratios of the whole, unsharded model, tensor
            scalars averaged); findings are then the same on every rank, a ``nonfinite`` one
            names the rank where it started, and rank 0 alone writes ``log_dir``. With
            ``on_nonfinite="raise"`` or ``"skip"``, a second, tiny collective before each
            update lets every rank take the same decision there.
            ``False``: per-rank statistics, each rank's log in ``log_dir/rank{k}``.
        frozen: Modules declared frozen (same forms as ``where``): a ``frozen_changed``
            finding when one of their parameters or buffers differs from its value when the
            Monitor was built (checked on sampled steps), naming the cause.
        replicated: Under ``torch.distributed`` with ``sync``, the modules whose parameters
            every rank holds whole and equal; by default every plain-tensor parameter (DDP)
            not marked ``tensor_model_parallel=True``, and ``DTensor`` parameters replicated
            on every mesh dimension. A ``replica_divergence`` finding when they differ.
        precision: Lower-precision dtypes to judge the watched modules' values against, any
            of ``"bf16"``, ``"fp16"``, ``"fp8_e4m3"``, ``"fp8_e5m2"``: on sampled steps, per
            module, for its output and its output's gradient (as backpropagated: scaled
            under a GradScaler), the fraction of the sampled values that would round to zero
            in each (``underflow``) and that would exceed its largest finite value
            (``overflow``), ``amax`` and ``dynamic_range`` (``log2`` of the largest over the
            smallest non-zero magnitude), in the step record's ``precision`` group; findings
            ``precision_underflow`` and ``precision_overflow`` (``_probes/_precision.py``).
        explain: A :class:`hs.Probe`: a fixed batch explained (``hs.explain``) at
            ``step()`` of every ``probe.every``-th step, in eval mode with the model put back
            exactly as it was (the run is bit-identical without it), logged as ``explain``
            records and shown in the report's *Explanations* part.

    Checks of invariants run on every Monitor (``_checks/``): ``not_updated``,
    ``stale_gradients``, ``eval_randomness``, ``eval_mismatch``, ``autocast_skipped``, and
    with the arguments above ``frozen_changed`` and ``replica_divergence``.

    Large-model signals (``_probes/_signals.py``): on every step a rolling window keeps the loss,
    ``grad_norm``, the learning rates and per parameter group (a transformer block, an
    embedding) its gradients' L2 norm, reused from the non-finite check, and the L1 norm of
    a fixed sample of its weights; a ``loss_spike`` finding names the group whose gradient
    norm or weights left their own range first, with the window in the log (``record_on=("loss_spike",)`` records the step). Sampled steps add
    each module's ``kurtosis`` and ``absmax_over_rms``, and ``massive_activations`` when the
    latter stays high, and each attention module's largest pre-softmax logit
    (``_probes/_attention.py``), with ``attention_logit_growth`` when it grows. ``precision=`` adds
    what lower-precision dtypes would lose; a GradScaler's scale is logged as the scalar
    ``grad_scale``, the steps it skips as ``skipped_step`` events.

    Steps count from 0: a finding's ``step`` is the number of ``step()`` calls completed
    before it. Step statistics are collected from modules in training mode; evaluation passes
    (``model.eval()``) are checked for NaN/Inf and logged apart, as ``eval`` records (their
    scale per module, for ``eval_mismatch``); each step record says whether the model was
    training.

    Example:
        >>> import torch, torch.nn as nn, hookscope as hs
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> with hs.Monitor(model, every=1) as mon:
        ...     loss = model(torch.randn(16, 4)).pow(2).mean()
        ...     loss.backward(); opt.step(); opt.zero_grad()
        ...     _ = mon.step(loss=loss)
        >>> sorted(mon.records[1]["param"]["0.weight"])
        ['grad_norm', 'norm', 'update_ratio']
    """

    def __init__(
        self,
        model: nn.Module,
        where: Where | None = None,
        *,
        every: int | None = 10,
        sample: int | None = DEFAULT_SAMPLE,
        log_dir: str | Path | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        on_nonfinite: str = "log",
        check: str = "edges",
        histograms: bool = False,
        bins: int = 32,
        sinks: Sequence[Sink] = (),
        thresholds: Thresholds | None = None,
        record_dir: str | Path | None = None,
        record_on: Sequence[str] = ("nonfinite",),
        sync: bool | None = None,
        frozen: Where | None = None,
        replicated: Where | None = None,
        precision: Sequence[str] = (),
        skip_list: str | Path | None = None,
        explain: Probe | None = None,
        **threshold_overrides: float,
    ) -> None:
        require("hs.Monitor")  # torch>=2.7, with a message that says so
        check_options(every, on_nonfinite, log_dir)
        self.check = check_mode(check)
        self.thresholds = thresholds_from(thresholds, threshold_overrides, monitor_options)
        # DDP, torch.compile: name modules as the model they wrap (no "module.", "_orig_mod.");
        # a model compiled already is traced again, with a warning.
        model = eager_model(model, "Monitor")
        check_materialized(model)  # a meta-device model holds no values to measure
        self._lifetime = Lifetime(model)  # one open Monitor per model (``_lifetime.py``)
        self.rank, world, self._coll = ranks(sync)
        self._world = self._coll.world  # combined ranks
        self.every, self.sample, self.on_nonfinite = every, sample, on_nonfinite
        self.modules: dict[str, nn.Module] = select(model, where if where is not None else is_leaf)
        self._explain = None if explain is None else check_explain(explain).bind(model)
        self.step_count = 0
        self._model = model
        self.graph = Graph(frozenset())  # which watched module fed which, last sampled step
        self._probes = ProbeSet(  # what it measures (``_wiring/_probeset.py``)
            model,
            self.modules,
            self.thresholds,
            sample=sample,
            bins=bins if histograms else None,
            precision=precision,
            world=self._world,
        )
        check_record_dir(record_dir, self._probes.sharded)
        shapes = self._probes.shapes
        types = {n: type(m).__name__ for n, m in model.named_modules()}
        self._diagnosis = Diagnosis(self.thresholds, shapes, types)
        self.record_dir = None if record_dir is None else Path(record_dir)
        self.record_on = tuple(record_on)
        self._skip = None if skip_list is None else SkipList(skip_list, self.rank or 0, world)
        self._out = Output(  # the sinks and the findings (``_output.py``)
            sinks,
            self._diagnosis,
            rank=self.rank,
            coll=self._coll,
            record_dir=self.record_dir,
            record_on=self.record_on,
            bundle=self._bundle,
        )
        self._warnings = Warnings()
        self._wiring: Wiring | None = None
        watched = {n: type(m).__name__ for n, m in self.modules.items()}
        try:
            self._wire(model, optimizer, frozen=frozen, replicated=replicated)
            self._out.open(log_dir)
            names = self._probes.precision.names if self._probes.precision is not None else []
            config = settings(every, sample, on_nonfinite, histograms, bins, self.thresholds, names)
            bns = list(self._probes.bns.modules)  # every rank built the same Monitor
            self._coll.handshake(modules=watched, params=shapes, bn=bns, settings=config)
        except BaseException:
            self.close()
            raise
        self._out.header(type(model).__name__, watched, shapes, config, world)
        self._lifetime.take(self)  # a Monitor still open on this model is closed

    def _wire(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        *,
        frozen: Where | None,
        replicated: Where | None,
    ) -> None:
        """Every hook on the model, its optimizers and the script's calls, with the parts
        that read what they gather (``_wiring/_build.py``)."""
        w = self._wiring = Wiring(
            model,
            self.modules,
            self._probes,
            self._diagnosis,
            self._out,
            coll=self._coll,
            world=self._world,
            warnings=self._warnings,
            on_nonfinite=self.on_nonfinite,
            light=self._light,
            keep_outputs=self.record_dir is not None,
            step=lambda: self.step_count,
            frozen=frozen,
            replicated=replicated,
        )
        self._module_hooks, self._tape, self._decision = w.module_hooks, w.tape, w.decision
        self._transfer, self._updates, self._checks = w.transfer, w.updates, w.checks
        self._optim = w.updates.optim
        if optimizer is not None:
            self._optim.adopt(optimizer)
        self._module_hooks.now = self._new_state()  # what the hooks write (``_step/_state.py``)

    @property
    def _now(self) -> StepState:
        """What the hooks write this step (``_step/_state.py``)."""
        return self._module_hooks.now

    @property
    def sampled(self) -> bool:
        """Whether the current step collects statistics."""
        return self.every is not None and self.step_count % self.every == 0

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Adopt ``optimizer`` now (optimizers that step the model are found by themselves)."""
        self._optim.adopt(optimizer)

    def read_gradients(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """This step's gradients are final now (accumulated, unscaled): read them here
        instead of just before the update. Call it before ``clip_grad_norm_`` to log the
        gradients clipping would hide (the trainer integrations do). ``optimizer`` defaults
        to every adopted one; before any optimizer has stepped the model (its first step),
        the gradients of all the model's parameters are read."""
        self._updates.read_gradients(optimizer)

    def check_hand_update(self) -> None:
        """For a model its script updates by hand, with no optimizer (``hookscope watch``
        calls it after each backward of such a model): read the step's gradients and run now
        the non-finite check run before an optimizer's update (``_wiring/_update.py``), while
        the weights are still the step's own. Internal to hookscope, not documented API."""
        self._updates.read_gradients()
        self._updates.check(None, [])  # type: ignore[arg-type]  # no optimizer: none to skip

    # -- the step boundary: one host transfer ------------------------------------------------
    def step(self, *, batch_indices: Any = None, **scalars: Any) -> list[Finding]:
        """Close a training step: log the scalars given and the statistics.

        ``loss`` need not be given: it is the scalar the step's ``backward()`` started from
        (summed over the backward passes of an accumulated step, unscaled behind
        ``GradScaler``), and ``grad_norm`` is the total norm ``clip_grad_norm_`` measured
        before clipping, when the step clipped; ``grad_scale`` is the scale of a GradScaler
        that scaled the loss (the output gradients are logged divided by it). Scalars given
        here win.

        What the hooks gathered moves to the host in one transfer (with an optimizer, the
        non-finite flags already moved just before its update; this carries the rest).
        ``batch_indices`` (a sequence or tensor of ints): the data-set indices of the step's
        batch, written to ``skip_list`` when the loss spikes at this step.

        Returns the findings first seen at this step.
        """
        if self._lifetime.closed:
            raise HookscopeError(self._lifetime.closed_message(self.step_count))
        check_batch_indices(batch_indices)
        s, step = self._now, self.step_count
        if not scalars and self._idle(s):
            warnings.warn(idle_message(step, type(self._model).__name__), HookscopeWarning, 2)
        record, host, info = self._measure(s, scalars)
        scale = record.scalars.get("grad_scale")
        found, poisoned = self._decision.at_step(s, host, info, step, self.findings, scale)
        found += self._decision.loss_after_model(s, step, record.scalars.get("loss"), self.findings)
        found += self._diagnosis.training_step(
            step,
            record.scalars,
            updates=s.updates - s.skipped,
            grad_total=self._probes.spikes.total(host),
        )
        if s.sampled:
            self.graph = s.graph()
            found += self._diagnosis.sampled(step, record, self.graph)
        self._out.write(record.to_dict())
        if s.sampled:
            self._warnings.unhooked(s, step, type(self._model).__name__)
        found += self._spiked(record, host, batch_indices)
        found += self._checks.read(host, record)  # after the step: its eval record follows
        new = self._out.report(found, step, before_update=s.updates == 0)
        self._out.clear()
        if poisoned is not None:  # its own finding, also where its cause named the same module
            new += self._out.report([poisoned], step, before_update=False, always=True)
        skipped = s.skip_message(step, scale, adopted=bool(self._optim.adopted))
        if skipped is not None:
            self._out.event(step, "skipped_step", skipped)
        if self._explain is not None and self._explain.due(step):
            self._explained(self._explain, step)
        self._end_step()
        if self.on_nonfinite == "raise" and s.nonfinite is not None and s.nonfinite in new:
            raise nonfinite_error(s.nonfinite)
        return s.early + new

    def _idle(self, s: StepState) -> bool:
        """Nothing of the model ran this step (said once per Monitor)."""
        if s.hooks_ran or s.backward_ran or s.updates or self._lifetime.told_idle:
            return False
        if any(p.grad is not None for p in self._model.parameters()):
            return False
        self._lifetime.told_idle = True
        return True

    def _measure(
        self, s: StepState, scalars: dict[str, Any]
    ) -> tuple[StepRecord, Host, RankInfo | None]:
        """The step's record: the scalars heard and given, and what every probe measured,
        from the step's one transfer (also its host values and what it told of the ranks)."""
        tensor_scalars, plain = s.put_scalars(scalars)
        if s.sampled:
            self._probes.collect(s.buf)
        self._checks.collect(s.buf, s.sampled)
        host, info = self._transfer.step(s, tensor_scalars, self.step_count)
        record = StepRecord(self.step_count, time.time(), s.sampled, self._model.training)
        record.scalars = {k: host[("scalar", k)][0] / self._world for k in tensor_scalars}
        record.scalars.update(plain)
        record.scalars.update(self._optim.learning_rates())
        if s.sampled:
            self._probes.read(host, record)
        return record, host, info

    def _spiked(self, record: StepRecord, host: Host, batch_indices: Any) -> list[Finding]:
        """The ``loss_spike`` finding, when the rolling window (``_probes/_signals.py``) sees one:
        its window goes to the log and its batch to ``skip_list``."""
        spike = self._probes.spikes.observe(record.step, record.scalars, host)
        if spike is None:
            return []
        self._out.write(asdict(spike.window))
        if self._skip is not None:
            self._skip.add(record.step, spike.finding.value, batch_list(batch_indices))
        return [spike.finding]

    def _explained(self, probe: ProbeRun, step: int) -> None:
        """The probe's explanations (``hs.Probe``), run with the Monitor's hooks paused (no
        statistic, check or tape sees them) and written after the step's record."""
        self._tape.paused = True
        try:
            records = probe.records(step)
        finally:
            self._tape.paused = False
        for record in records:
            self._out.write(record)

    def _bundle(self, finding: Finding, before_update: bool) -> Path:
        """The flight recorder's replay bundle for ``finding`` (``_nonfinite/_replay.py``)."""
        return write_bundle(
            self.record_dir,
            finding,
            self._model,
            self._tape.calls,
            self._optim.optimizers,
            step=self.step_count,
            before_update=before_update,
        )

    def _new_state(self) -> StepState:
        """The next step's state. Only the model's edges are checked where a replay can
        localise (``_nonfinite/_decide.py``), once an optimizer is adopted: its check runs before the
        update, where a replay meets the step's own weights. Before that (a hand-written
        update runs before ``step()``), every module's output and gradient is checked."""
        return StepState(sampled=self.sampled, light=self._light())

    def _light(self) -> bool:
        """Whether a step starting now checks only the model's edges (:meth:`_new_state`)."""
        return self.check == "edges" and self._decision.light and bool(self._optim.adopted)

    def _end_step(self) -> None:
        self._tape.reset()
        self._probes.reset()
        self._optim.reset()
        self.step_count += 1
        self._module_hooks.now = self._new_state()
        self._checks.begin(self._now.buf)

    # -- records and lifetime ----------------------------------------------------------------
    def log(self, type: str, **fields: Any) -> None:
        """Write one record of any ``type`` (e.g. ``"feature_maps"``, ``"summary"``) to the sinks."""
        self._out.write({"type": type, "step": self.step_count, **fields})

    @property
    def log_path(self) -> Path | None:
        """The JSON-lines log this Monitor writes: ``log_dir/hookscope.jsonl``, or
        ``hookscope-<n>.jsonl`` where ``log_dir`` already held a run's log (``None``
        without ``log_dir``)."""
        return self._out.log_path

    @property
    def records(self) -> list[dict[str, Any]]:
        """Every record written so far (also without ``log_dir``)."""
        return self._out.memory.records

    @property
    def findings(self) -> list[Finding]:
        """Every finding so far, in the order they were found (``cleared_at`` set on those
        whose condition stopped holding)."""
        return self._out.findings

    def close(self) -> None:
        """Remove every hook (global optimizer hooks included) and close the sinks. Safe to
        call more than once."""
        self._lifetime.release(self)
        if self._wiring is not None:
            self._wiring.close()
        self._out.close()

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"Monitor({len(self.modules)} modules, every={self.every}, step={self.step_count}, "
            f"{len(self.findings)} findings)"
        )

    def _repr_html_(self) -> str:
        from .._notebook import monitor_html

        return monitor_html(self)


def monitor_options() -> list[str]:
    """The options ``hs.Monitor`` takes besides the model and threshold fields, read from its
    signature (one list for the did-you-mean here and the trainer callbacks' checks)."""
    return [
        name
        for name, p in inspect.signature(Monitor).parameters.items()
        if name != "model" and p.kind is not p.VAR_KEYWORD
    ]
