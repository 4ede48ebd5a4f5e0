"""The Monitor inside a ``torch.compile`` graph: the measurements a compiled graph carries.

When Dynamo traces a model the Monitor watches (attached before compiling: the whole model,
in place, or block by block), each watched module's forward hook takes this branch instead of
the eager one (``torch.compiler.is_compiling()``: the eager path keeps its code and its cost)
and becomes a few device ops in the graph: no graph break, so ``fullgraph=True`` compiles,
and nothing the graph would guard on per module, so identical blocks compiled one by one share
one graph.

- **Which module.** One hook function for every module; the module comes as a one-element
  index tensor. A Python int or string read there would be guarded on: one graph per layer.
- **Activations.** The eager statistics over the same sample (one reduction for the moments
  and extremes) go into a per-Monitor device table, one row per module, by one dense write
  per call (a ``where`` on row and column numbers; an ``index_add_`` or ``scatter_reduce_``
  there costs a compiled CNN 0.3x its bare step): sums add and extremes combine over any
  number of calls, with no Python container whose length the graph would guard on. Values
  are placed by column number, never by ``torch.stack``/``torch.cat`` of scalars: Inductor
  makes a kernel of each scalar there, and a sampled GPT-2 6x768 step launched 3,258
  kernels on an H200 (1,608 now; 564 bare).
- **BatchNorm.** Anything the forward graph reads from a BatchNorm's output besides one
  reduction (a sample and its moments) makes Inductor split the BatchNorm-ReLU kernels and
  recompute in the backward pass: a compiled CNN at ``every=1`` took 1.47x its bare step,
  1.08x with the sample of a training BatchNorm computed from its input at the same
  positions (:func:`_batch_norm_sample`, equal up to rounding).
- **Output gradients.** The hook returns its output through :class:`_GradProbe`, an identity
  (a copy, which Inductor fuses away) whose backward hands the gradient on and gives the
  gradient's statistics to a small leaf tensor as *its* gradient (in the call's row, by a
  one-hot product that Inductor sums over all calls in one kernel): tensor hooks, module
  backward hooks and multi-grad hooks do not trace under ``fullgraph=True``. Where warnings
  are errors, Dynamo cannot trace an ``autograd.Function``: the probe is then a custom op
  (:func:`_grad_probe`), the same function as an opaque kernel. Each call of a
  module (up to :data:`SLOTS` per step) has its own row, so that largest magnitudes combine
  as a max; later calls share the last row.
- **Non-finite values.** A flag of every output and gradient (0, or NaN where one of its
  elements is not finite: ``finite_flag``), per module, and the order in
  which the modules first ran: the first module whose output is NaN/Inf in that order is
  named; the op and source line come from the eager replay of the step (the tape of the
  root's calls runs outside the graph).
- **Sampling.** ``sampled`` is a Python bool: a sampled and an unsampled graph, one
  recompile. Unsampled steps where the tape can replay add nothing to the graph.

At the step's end :meth:`CompiledProbes.drain` puts all of it into the step's buffer as one
tensor (moved with the step's one transfer) and :meth:`CompiledProbes.unpack` spreads it into
the entries and non-finite flags the eager hooks would have written, so every probe reads its
record as usual.

Eager-only (they need ``id()``, ``data_ptr()``, versions, Python sets or modes that a graph
cannot hold): producer-to-consumer edges, detached outputs and dead ends (a sampled step's
``graph`` has no compiled module), an output that aliases an input (here: an output that *is*
an input, or a dropout that cannot drop), activation-checkpoint recompute detection,
histograms (``bincount`` has a data-dependent shape), the top outlier channels, the
attention-logit probe (it swaps torch functions while a module runs), ``precision=``, the
checks' forward hooks (``eval`` records, ``eval_randomness``, ``eval_mismatch``: a compiled
evaluation pass is only checked for NaN/Inf), and per-rank statistics combined across ranks.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
from torch import nn

from ..._compat import custom_op
from ..._stats import (
    MIN_POSITIONS,
    MOMENTS,
    SAT_MARGIN,
    channel_dim,
    dead_fraction,
    finite_flag,
    plan_for,
    strided_index,
)
from ..._tree import map_tensors, tensors
from .._step._buffer import Host, StepBuffer, combine
from .._step._trail import Flag

__all__ = ["SLOTS", "CompiledProbes"]

SLOTS = 8  # calls per module and step whose output gradients are kept apart
KEY = ("compiled",)

# One row per module; its columns combine over a step's calls by a sum, a min or a max.
_SUM_COLS = (*(f"m_{m}" for m in MOMENTS), "numel", "measured", "flag", "calls")
_MIN_COLS = ("min", "order")  # order: the sequence number of the module's first call
_MAX_COLS = ("max", "dead")
_COLS = (*_SUM_COLS, *_MIN_COLS, *_MAX_COLS)
_COL = {c: i for i, c in enumerate(_COLS)}
# Per gradient row: summed, except "absmax" (a max).
_GRAD = ("flag", "sumsq", "n", "numel", "absmax", "calls")

_DROPOUT = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout)


class CompiledProbes:
    """Device tensors that compiled graphs write a Monitor's measurements into."""

    def __init__(
        self,
        names: list[str],
        sample: int | None,
        *,
        dead_at: float,
        dead_min: tuple[int, int],
        device: torch.device,
    ) -> None:
        self.names = list(names)
        self.sample, self.dead_at = sample, dead_at
        self.min_units, self.min_samples = dead_min
        self.ran = False  # a compiled graph wrote here since the last drain
        self.index = {n: torch.tensor([i], device=device) for i, n in enumerate(self.names)}
        n = len(self.names)
        # The modules' rows, and a last row whose first column counts the step's calls.
        self._empty = torch.zeros(n + 1, len(_COLS), device=device)
        self._empty[:n, len(_SUM_COLS) : len(_SUM_COLS) + len(_MIN_COLS)] = math.inf
        self._empty[:n, len(_SUM_COLS) + len(_MIN_COLS) :] = -math.inf
        self.acc = self._empty.clone()
        # The leaf whose gradient holds the output gradients' statistics, SLOTS rows a module.
        self.probe = torch.zeros(n * SLOTS, len(_GRAD), device=device, requires_grad=True)

    # -- inside the graph --------------------------------------------------------------------
    # Each call ends in one dense write of the module's row: every value goes in by a
    # ``where`` on column numbers, never ``torch.stack``/``torch.cat`` of scalars (Inductor
    # makes a kernel of each element: a GPT-2 block then launched hundreds of kernels).
    def forward(
        self, index: torch.Tensor, module: nn.Module, args: Any, output: Any, *, sampled: bool
    ) -> Any:
        """The compiled branch of the Monitor's forward hook: flag and measure ``module``'s
        output, and return it through a gradient probe (``None``: the output unchanged)."""
        self.ran = True
        inputs = tensors(args)
        outs = [t for t in tensors(output) if t.is_floating_point()]
        outs = [t for t in outs if not _alias(module, t, inputs)]
        if not outs:
            return None
        with torch.no_grad():
            acc = self.acc
            values = {"flag": sum(finite_flag(t) for t in outs), "calls": 1.0}
            values["order"] = acc[-1, 0]
            slot = acc[index, _COL["calls"]].clamp(max=SLOTS - 1)
            if sampled and module.training:
                values.update(self._measure(module, [t.detach() for t in outs], inputs))
            # Rebound, not changed in place: a backward pass may recompute this call's probe
            # row from ``acc`` after later calls (the next block's graph) wrote theirs.
            self.acc = _combine(acc, index, values)
        if not torch.is_grad_enabled() or not any(t.requires_grad for t in outs):
            return None

        grad_probe = _GradProbe.apply if _functions_trace() else _grad_probe
        rows = torch.arange(self.probe.shape[0], device=index.device)
        row = (rows == index * SLOTS + slot).float()  # this call's row of the probe, one-hot

        def probe(t: torch.Tensor) -> torch.Tensor:
            if not any(t is o for o in outs) or not t.requires_grad:
                return t
            return grad_probe(t, self.probe, row, sampled, self.sample)

        return map_tensors(probe, output)

    def _measure(
        self, module: nn.Module, outs: list[torch.Tensor], inputs: list[torch.Tensor]
    ) -> dict[str, Any]:
        """The eager statistics of the outputs' samples, by column (NaN wins in ``min``/
        ``max``, as in the eager combination of calls)."""
        plan = plan_for(module)
        found: dict[str, Any] = {"measured": float(len(outs))}
        for t in outs:
            x = _batch_norm_sample(module, t, inputs, self.sample)
            x = _sample(t, self.sample) if x is None else x
            one = _sample_stats(x, plan.bounds)
            one["numel"] = float(t.numel())
            if plan.dead and t.dim() >= 2:
                units = _units(t, self.sample)
                if units.shape[1] >= self.min_units and units.shape[0] >= self.min_samples:
                    one["dead"] = dead_fraction(units, self.dead_at)
            for key, value in one.items():
                old = found.get(key)
                found[key] = value if old is None else _COMBINE[_kind(key)](old, value)
        return found

    # -- at the step's end, eagerly ----------------------------------------------------------
    def drain(self, buf: StepBuffer) -> None:
        """Put what the graphs wrote since the last drain into ``buf`` (one tensor, moved
        with the step's transfer), and start over. (Nothing to do, and no ``no_grad`` to
        enter, where no graph ran: every eager step, twice.)"""
        if self.ran:
            self._drain(buf)

    @torch.no_grad()
    def _drain(self, buf: StepBuffer) -> None:
        self.ran = False
        grad = self.probe.grad if self.probe.grad is not None else torch.zeros_like(self.probe)
        buf.set(KEY, torch.cat([self.acc[:-1].reshape(-1), grad.reshape(-1).float()]))
        self.acc = self._empty.clone()
        self.probe.grad = None

    def unpack(self, host: Host, flags: list[Flag], grad_order: list[str]) -> None:
        """Spread a drained tensor, now on the host, into the entries the eager hooks would
        have written: ``("act", name)`` and the rest of the activations, ``("grad", name)``,
        and one non-finite flag per module output (in call order) and per output gradient
        (in the reverse order), appended to ``flags``."""
        values = host.pop(KEY, None)
        if values is None:
            return
        n = len(self.names)
        at = 0

        def take(width: int) -> list[list[float]]:
            nonlocal at
            rows = [values[at + i * width : at + (i + 1) * width] for i in range(n)]
            at += n * width
            return rows

        table = take(len(_COLS))
        grads = take(SLOTS * len(_GRAD))
        order = [r[_COL["order"]] for r in table]
        ran = sorted((o, i) for i, o in enumerate(order) if math.isfinite(o))
        for _, i in ran:
            _put(host, flags, Flag("forward", self.names[i]), table[i][_COL["flag"]])
            if table[i][_COL["measured"]] > 0:
                self._activations(host, self.names[i], table[i])
        for _, i in reversed(ran):
            rows = [grads[i][s * len(_GRAD) : (s + 1) * len(_GRAD)] for s in range(SLOTS)]
            if sum(r[-1] for r in rows) > 0:
                self._gradient(host, flags, grad_order, self.names[i], rows)

    def _activations(self, host: Host, name: str, row: list[float]) -> None:
        _merge(host, ("act", name), row[: len(MOMENTS)], "sum")
        _merge(host, ("act_min", name), [row[_COL["min"]]], "min")
        _merge(host, ("act_max", name), [row[_COL["max"]]], "max")
        _merge(host, ("act_numel", name), [row[_COL["numel"]]], "sum")
        if row[_COL["dead"]] >= 0:  # -inf: no dead-unit estimate was made
            _merge(host, ("act_dead", name), [row[_COL["dead"]]], "max")

    def _gradient(
        self,
        host: Host,
        flags: list[Flag],
        grad_order: list[str],
        name: str,
        rows: list[list[float]],
    ) -> None:
        col = {c: [r[i] for r in rows if r[-1] > 0] for i, c in enumerate(_GRAD)}
        _put(host, flags, Flag("backward", name), sum(col["flag"]))
        if sum(col["n"]) + sum(col["numel"]) > 0:  # a sampled step
            _merge(host, ("grad", name), [sum(col["sumsq"]), sum(col["n"]), sum(col["numel"])])
            _merge(host, ("grad_absmax", name), [max(col["absmax"])], "max")
            if name not in grad_order:
                grad_order.append(name)


class _GradProbe(torch.autograd.Function):
    """The identity, as a copy (an in-place op after it, ``ReLU(inplace=True)``, may not
    change a view a Function returned), whose backward also gives the statistics of the
    gradient to ``probe``: as *its* gradient, in the row where ``row`` (one-hot) is 1.
    Traced through, so Inductor fuses the copy into the ops around it (a compiled CNN at
    ``every=1``: 1.4x the compiled bare step, 2.3x with the custom op)."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        probe: torch.Tensor,
        row: torch.Tensor,
        sampled: bool,
        k: int | None,
    ) -> Any:
        ctx.save_for_backward(row)
        ctx.sampled, ctx.k = sampled, k
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple:
        return _probe_backward(ctx, g)


def _functions_trace() -> bool:
    """Whether Dynamo can trace an ``autograd.Function`` under the warnings filters in force
    (asked once per trace). It makes the Function's context by instantiating
    ``autograd.Function`` inside ``catch_warnings(record=True)``, which keeps a filter that
    turns its DeprecationWarning into an error (a test suite's ``-W error``): the compile
    would fail, so the probe is then the custom op below."""
    try:
        with warnings.catch_warnings(record=True):
            torch.autograd.Function()
    except DeprecationWarning:
        return False
    return True


# What torch.compiler.assume_constant_result(_functions_trace) does (Dynamo calls it while
# tracing and keeps the result), without importing Dynamo at ``import hookscope`` (1.3 s);
# tests/test_compile.py checks that torch still marks a function so.
_functions_trace._dynamo_marked_constant = True  # type: ignore[attr-defined]


@custom_op("hookscope::grad_probe", mutates_args=())
def _grad_probe(
    x: torch.Tensor, probe: torch.Tensor, row: torch.Tensor, sampled: bool, k: int | None
) -> torch.Tensor:
    """:class:`_GradProbe` as a custom op, where an ``autograd.Function`` cannot be traced
    (:func:`_functions_trace`). Opaque to Inductor: its copy is a kernel of its own."""
    return x.clone()


@_grad_probe.register_fake
def _(
    x: torch.Tensor, probe: torch.Tensor, row: torch.Tensor, sampled: bool, k: int | None
) -> torch.Tensor:
    return torch.empty_like(x)


def _probe_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    ctx.save_for_backward(inputs[2])
    ctx.sampled, ctx.k = inputs[3], inputs[4]


def _probe_backward(ctx: Any, g: torch.Tensor) -> tuple:
    (row,) = ctx.saved_tensors
    return g, row[:, None] * _grad_row(g, ctx.sampled, ctx.k), None, None, None


_grad_probe.register_autograd(_probe_backward, setup_context=_probe_context)


@torch.no_grad()
def _grad_row(g: torch.Tensor, sampled: bool, k: int | None) -> torch.Tensor:
    """The ``_GRAD`` columns for one gradient, ``(1, len(_GRAD))``: its flag (the non-finite
    check) and, on a sampled step, what :class:`OutputGrads` computes from the same sample."""
    values: dict[str, Any] = {"flag": finite_flag(g), "calls": 1.0}
    if sampled:
        x = _sample(g.detach(), k)
        if x.dtype not in (torch.float32, torch.float64):
            x = x.float()
        values["n"], values["numel"] = float(x.numel()), float(g.numel())
        if x.numel():
            values["sumsq"] = x.square().sum().float()
            values["absmax"] = x.abs().amax().float()
    return _by_column(values, _GRAD, g.device)[None]


def _by_column(values: dict[str, Any], columns: tuple[str, ...], device: torch.device) -> Any:
    """``values`` (scalars: tensors or floats) as a vector over ``columns``, zero elsewhere:
    a chain of ``where``s that Inductor fuses into whatever reads it (``torch.stack`` of
    scalars would be a kernel per scalar)."""
    c = torch.arange(len(columns), device=device)
    out: Any = torch.zeros(len(columns), device=device)
    for key, value in values.items():
        out = torch.where(c == columns.index(key), value, out)
    return out


def _kind(column: str) -> str:
    return "min" if column in _MIN_COLS else "max" if column in _MAX_COLS else "sum"


_COMBINE = {"sum": torch.add, "min": torch.minimum, "max": torch.maximum}


def _combine(acc: torch.Tensor, index: torch.Tensor, values: dict[str, Any]) -> torch.Tensor:
    """``acc`` with ``values`` (by column) combined into row ``index``, each column by its
    kind, and the call counter in the last row advanced: one pointwise kernel."""
    value = _by_column(values, _COLS, acc.device)
    columns = torch.arange(len(_COLS), device=acc.device)
    written = torch.zeros(len(_COLS), dtype=torch.bool, device=acc.device)
    for key in values:
        written = written | (columns == _COL[key])
    n_sum, n_min = len(_SUM_COLS), len(_MIN_COLS)
    rows = torch.arange(acc.shape[0], device=acc.device)[:, None]
    hit = (rows == index) & written
    new = torch.where(hit & (columns < n_sum), acc + value, acc)
    new = torch.where(hit & (columns >= n_sum) & (columns < n_sum + n_min), acc.minimum(value), new)
    new = torch.where(hit & (columns >= n_sum + n_min), acc.maximum(value), new)
    return torch.where((rows == acc.shape[0] - 1) & (columns == 0), acc + 1, new)


def _sample_stats(x: torch.Tensor, bounds: tuple[float, float] | None) -> dict[str, Any]:
    """:func:`~hookscope._stats.moments` and the extremes of a 1-D sample, by column:
    reductions over one range, which Inductor makes one kernel."""
    if x.dtype not in (torch.float32, torch.float64):
        x = x.float()
    if not x.numel():
        return {"min": 0.0, "max": 0.0}
    square = x * x
    sat = (x <= bounds[0] + SAT_MARGIN) | (x >= bounds[1] - SAT_MARGIN) if bounds else None
    terms = [x, square, square * x, square * square, x == 0, sat, x.isnan(), x.isinf()]
    found: dict[str, Any] = {
        f"m_{MOMENTS[i]}": t.sum(dtype=x.dtype).float()
        # by index, not zip(MOMENTS, terms, strict=False) (terms has no "n"): Dynamo 2.7-2.9
        # reads that strict=False as strict=True and fails the trace
        for i, t in enumerate(terms)
        if t is not None
    }
    found["m_n"] = float(x.numel())
    found["min"], found["max"] = x.amin().float(), x.amax().float()
    return found


def _sample(t: torch.Tensor, k: int | None) -> torch.Tensor:
    """What :class:`~hookscope._stats.Sampler` takes, with the index built in the graph
    (from static sizes: the eager sampler's cache is a dict the graph would guard on)."""
    n = t.numel()
    if k is None or n <= k:
        return t.reshape(-1)
    return torch.take(t, strided_index(n, k, t.shape, t.device))


def _batch_norm_sample(
    module: nn.Module, t: torch.Tensor, inputs: list[torch.Tensor], k: int | None
) -> torch.Tensor | None:
    """``_sample(t, k)`` of a training BatchNorm's output ``t``, computed from its input
    (the batch statistics and the affine map at the sampled positions: equal to the output
    up to rounding); ``None`` for any other module or where the output is the sample. Read
    from the output itself, it costs a compiled CNN 0.4x its bare step (module docstring)."""
    if not isinstance(module, nn.modules.batchnorm._BatchNorm) or k is None or t.numel() <= k:
        return None
    if isinstance(module, nn.SyncBatchNorm):  # statistics across ranks
        return None
    if not module.training or not inputs or inputs[0].shape != t.shape or t.dim() < 2:
        return None
    x = inputs[0].detach()
    dims = [0, *range(2, x.dim())]
    var, mean = torch.var_mean(x.float(), dim=dims, correction=0)
    flat = strided_index(t.numel(), k, t.shape, t.device)
    c = flat // math.prod(t.shape[2:]) % t.shape[1]
    y = (_sample(x, k).float() - mean[c]) * torch.rsqrt(var[c] + module.eps)
    if module.affine:
        y = y * module.weight.detach()[c].float() + module.bias.detach()[c].float()
    return y.to(t.dtype)


def _units(t: torch.Tensor, k: int | None) -> torch.Tensor:
    """What :meth:`~hookscope._stats.Sampler.units` takes, without its cache."""
    unit_dim = channel_dim(t)
    c = t.shape[unit_dim]
    positions = t.numel() // max(c, 1)
    want = positions if k is None else max(MIN_POSITIONS, k // max(c, 1))
    if want >= positions:
        return t.movedim(unit_dim, -1).reshape(-1, c)
    inner = math.prod(t.shape[unit_dim + 1 :])
    q = torch.arange(want, device=t.device) * positions // want
    start = (q // inner) * (c * inner) + q % inner
    index = start[:, None] + torch.arange(c, device=t.device)[None, :] * inner
    return torch.take(t, index)


def _alias(module: nn.Module, t: torch.Tensor, inputs: list[torch.Tensor]) -> bool:
    """Whether ``t`` is an input handed on unchanged (the eager trail's alias rule, as far
    as a graph can tell): the input itself, unless the module works in place, or the
    output of a dropout that cannot drop (eager dropout then returns its input)."""
    if isinstance(module, _DROPOUT) and (module.p == 0 or not module.training):
        return True
    return any(t is x for x in inputs) and not getattr(module, "inplace", False)


def _put(host: Host, flags: list[Flag], flag: Flag, value: float) -> None:
    flags.append(flag)
    host[("flag", len(flags) - 1)] = [value]


def _merge(host: Host, key: tuple, values: list[float], reduce: str = "sum") -> None:
    old = host.get(key)
    host[key] = values if old is None else combine(reduce, old, values)  # type: ignore[arg-type]
