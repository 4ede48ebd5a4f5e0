"""Monitor: layer-by-layer training health at near-zero cost, and the findings it draws.

Hooks put small device tensors in a per-step buffer; ``step()`` moves the buffer to the host
in one transfer, writes one record to every sink and runs the diagnosis (``_diagnose.py``).
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ._diagnose import Diagnosis, Finding, Thresholds
from ._errors import NonFiniteError
from ._hooks import HookSet, check_not_compiled, in_backward_recompute
from ._select import Where, select
from ._sinks import JsonlSink, MemorySink, Sink, TensorBoardSink
from ._stats import ACT_FIELDS, activation, bounded, histogram, merge_activation, relu_like
from ._tree import tensors

__all__ = ["Monitor"]


class Monitor:
    """Watch a training run layer by layer; log statistics and report what goes wrong.

    Per watched module and sampled step: activation statistics of its output (mean, std, min,
    max, absmax, fraction of zeros, fraction saturated for bounded activations, NaN and Inf
    counts, optionally a histogram), the norm of the gradient of its output; per parameter:
    norm, gradient norm (read at the optimizer step, after accumulation and unscaling) and
    update-to-weight ratio ``||ΔW|| / ||W||`` measured around ``optimizer.step()``; BatchNorm
    running statistics and their drift; learning rates. Non-finite values are checked on
    every step at the cost of one reduction per module output.

    Args:
        model: The model. Hooks are removed by ``close()`` or at the end of a ``with`` block.
        where: Modules to watch; by default every leaf module (``hs.Tap`` included).
        every: Sample statistics every ``every`` steps (step 0 is sampled).
        log_dir: Directory for ``hookscope.jsonl`` (and TensorBoard events when tensorboard
            is installed); ``None`` keeps records in memory only (``mon.records``).
        optimizer: Read learning rates, gradients and updates around its ``step()``.
        on_nonfinite: ``"log"`` (a finding) or ``"raise"``: ``step()`` raises
            :class:`hs.NonFiniteError` naming the module where the NaN/Inf first appeared.
        histograms: Also keep a ``bins``-bin histogram of each activation.
        sinks: More sinks (objects with ``write(record)`` and ``close()``).
        thresholds: Diagnosis thresholds (see :class:`hs.Thresholds` for the defaults and
            where they come from); keyword arguments override single fields.

    Steps count from 0: a finding's ``step`` is the number of ``step()`` calls completed
    before it. Statistics are collected from modules in training mode; evaluation passes
    (``model.eval()``) are only checked for NaN/Inf, and each record says whether the model
    was training.
    ``on_nonfinite="raise"`` raises at ``step()``, not inside the forward pass: raising
    inside a hook would need a host sync per module.
    """

    def __init__(
        self,
        model: nn.Module,
        where: Where | None = None,
        *,
        every: int = 10,
        log_dir: str | Path | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        on_nonfinite: str = "log",
        histograms: bool = False,
        bins: int = 32,
        sinks: Sequence[Sink] = (),
        thresholds: Thresholds | None = None,
        **threshold_overrides: float,
    ) -> None:
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        if on_nonfinite not in ("log", "raise"):
            raise ValueError(f"on_nonfinite must be 'log' or 'raise', got {on_nonfinite!r}")
        check_not_compiled(model, "Monitor")
        self.every, self.on_nonfinite, self.histograms, self.bins = (
            every,
            on_nonfinite,
            histograms,
            bins,
        )
        self.thresholds = Thresholds(
            **{**asdict(thresholds or Thresholds()), **threshold_overrides}
        )
        chosen = select(model, where if where is not None else _is_leaf)
        self.modules: dict[str, nn.Module] = chosen
        self.findings: list[Finding] = []
        self.step_count = 0
        self._memory = MemorySink()
        self._sinks: list[Sink] = [self._memory, *sinks]
        if log_dir is not None:
            self._sinks.append(JsonlSink(Path(log_dir) / "hookscope.jsonl"))
            with contextlib.suppress(ImportError):
                self._sinks.append(TensorBoardSink(log_dir))
        self._diagnosis = Diagnosis(self.thresholds)
        self._model_ref = model
        self._params = _unique_params(model)
        self._bn = {
            n: m for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
        }
        self._bn_prev: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._optimizers: list[torch.optim.Optimizer] = []
        self._reset_buffers()
        self._hooks = HookSet("Monitor")
        try:
            for name, module in chosen.items():
                self._hooks.forward(module, functools.partial(self._on_forward, name))
            if optimizer is not None:
                self.attach_optimizer(optimizer)
        except BaseException:
            self._hooks.remove()
            raise
        self.log(
            "header",
            format="hookscope-log",
            version=1,
            hookscope=_version(),
            model=type(model).__name__,
            modules={n: type(m).__name__ for n, m in chosen.items()},
            params={n: list(p.shape) for n, p in self._params.items()},
            settings={
                "every": every,
                "on_nonfinite": on_nonfinite,
                "histograms": histograms,
                "thresholds": asdict(self.thresholds),
            },
            time=time.time(),
        )

    # -- wiring ----------------------------------------------------------------------------
    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Read learning rates, final gradients and real updates around ``optimizer.step()``."""
        self._optimizers.append(optimizer)
        self._hooks.optimizer_step_pre(optimizer, self._before_update)
        self._hooks.optimizer_step_post(optimizer, self._after_update)

    @property
    def sampled(self) -> bool:
        """Whether the current step collects statistics."""
        return self.step_count % self.every == 0

    def _reset_buffers(self) -> None:
        self._flags: list[tuple[str, str, torch.Tensor, list[int]]] = []  # (phase, name, sum, ins)
        self._seen: dict[int, int] = {}  # id(output tensor) -> index in _flags
        self._act: dict[str, torch.Tensor] = {}
        self._hist: dict[str, torch.Tensor] = {}
        self._grad: dict[str, torch.Tensor] = {}
        self._grad_order: list[str] = []
        self._param: dict[str, torch.Tensor] = {}
        self._before: dict[str, torch.Tensor] = {}
        self._updates = 0
        self._no_grad_names: set[str] = set()

    # -- hooks -----------------------------------------------------------------------------
    def _on_forward(
        self, name: str, module: nn.Module, args: Any, kwargs: Any, output: Any
    ) -> None:
        outs = [t for t in tensors(output) if t.is_floating_point()]
        if in_backward_recompute():
            # Activation checkpointing re-runs forward during backward: never count it again.
            # A reentrant checkpoint ran the first pass without autograd; the gradients flow
            # through this re-run, so hook them here.
            if name in self._no_grad_names:
                self._hook_grads(name, outs)
            return
        if not outs:
            return
        ins = [self._seen[id(t)] for t in tensors(args) if id(t) in self._seen]
        for t in tensors(args):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and id(t) not in self._seen:
                self._flags.append(("input", name, t.detach().sum(), []))
                ins.append(len(self._flags) - 1)
        sums = [t.detach().sum() for t in outs]
        total = sums[0] if len(sums) == 1 else torch.stack(sums).sum()
        self._flags.append(("forward", name, total, ins))
        for t in outs:
            self._seen[id(t)] = len(self._flags) - 1
        if torch.is_grad_enabled():
            self._hook_grads(name, outs)
        else:
            self._no_grad_names.add(name)
        if not (self.sampled and module.training):
            return
        vector = torch.stack(
            [
                activation(
                    t,
                    bounds=bounded(module),
                    dead=relu_like(module),
                    dead_at=self.thresholds.dead_unit,
                    total=total_t,
                )
                for t, total_t in zip(outs, sums, strict=True)
            ]
        )
        merged = vector[0]
        for row in vector[1:]:
            merged = merge_activation(merged, row)
        self._act[name] = merge_activation(self._act[name], merged) if name in self._act else merged
        if self.histograms:
            self._hist[name] = histogram(outs[0], self.bins)

    def _hook_grads(self, name: str, outs: list[torch.Tensor]) -> None:
        for t in outs:
            if t.requires_grad:
                self._hooks.tensor(t, functools.partial(self._on_grad, name))

    def _on_grad(self, name: str, grad: torch.Tensor) -> None:
        g = grad.detach()
        self._flags.append(("backward", name, g.sum(), []))
        if not self.sampled:
            return
        sq = torch.linalg.vector_norm(g.float()).square()
        if name in self._grad:
            self._grad[name] = self._grad[name] + sq
        else:
            self._grad[name] = sq
            self._grad_order.append(name)

    def _before_update(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
        self._updates += 1
        if not self.sampled:
            return
        ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for name, p in self._params.items():
            if id(p) in ids and p.grad is not None:
                self._param[f"{name}/grad_norm"] = torch.linalg.vector_norm(p.grad.detach().float())
                if p.dim() >= 2:  # update ratios concern weight matrices and kernels
                    self._before[name] = p.detach().clone()

    def _after_update(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
        for name, before in self._before.items():
            p = self._params[name].detach()
            self._param[f"{name}/norm"] = torch.linalg.vector_norm(p.float())
            self._param[f"{name}/update_ratio"] = torch.linalg.vector_norm((p - before).float()) / (
                torch.linalg.vector_norm(before.float()) + 1e-12
            )
        self._before.clear()

    # -- the step boundary: one host transfer ------------------------------------------------
    def step(self, **scalars: Any) -> list[Finding]:
        """Close a training step: log the scalars given (``loss=loss``) and the statistics.

        Everything the hooks gathered moves to the host in one transfer. Returns the findings
        first seen at this step.
        """
        step, sampled = self.step_count, self.sampled
        keys: list[tuple[str, Any]] = []
        values: list[torch.Tensor] = []
        plain = {}
        for key, value in scalars.items():
            if isinstance(value, torch.Tensor):
                keys.append(("scalar", key))
                values.append(value.detach().float().reshape(-1)[:1])
            else:
                plain[key] = float(value)
        for i, (_, _, flag, _) in enumerate(self._flags):
            keys.append(("flag", i))
            values.append(flag)
        if sampled:
            self._collect_sampled(keys, values)
        host = _to_host(keys, values)
        record = self._record(step, sampled, host, plain)
        new = self._diagnose(step, record)
        for sink in self._sinks:
            sink.write(record)
        for finding in new:
            self.log("finding", **asdict(finding))
        if self._optimizers and self._updates == 0 and self._flags:
            self.log(
                "event",
                kind="skipped_step",
                message=f"step {step}: optimizer.step() did not run (e.g. GradScaler skipped "
                "it after finding Inf/NaN gradients)",
            )
        self._reset_buffers()
        self.step_count += 1
        if self.on_nonfinite == "raise":
            for finding in new:
                if finding.kind == "nonfinite":
                    raise NonFiniteError(
                        finding.message,
                        module=finding.module,
                        step=step,
                        phase="backward" if "backward" in finding.message else "forward",
                    )
        return new

    def _collect_sampled(self, keys: list, values: list) -> None:
        for kind, table in (("act", self._act), ("hist", self._hist), ("param", self._param)):
            for name, value in table.items():
                keys.append((kind, name))
                values.append(value)
        for name, sq in self._grad.items():
            keys.append(("grad", name))
            values.append(sq.sqrt())
        for name, bn in self._bn.items():
            if bn.running_mean is None or bn.running_var is None:
                continue
            mean, var = bn.running_mean.detach().float(), bn.running_var.detach().float()
            prev = self._bn_prev.get(name)
            if prev is None:
                drift = mean.new_full((2,), math.nan)
            else:
                drift = torch.stack([_rel(mean, prev[0]), _rel(var, prev[1])])
            self._bn_prev[name] = (mean.clone(), var.clone())
            keys.append(("bn", name))
            values.append(torch.cat([mean.mean().reshape(1), var.mean().reshape(1), drift]))

    def _record(self, step: int, sampled: bool, host: dict, plain: dict) -> dict[str, Any]:
        scalars = {key: value[0] for (kind, key), value in host.items() if kind == "scalar"}
        scalars.update(plain)
        for i, opt in enumerate(self._optimizers):
            for j, group in enumerate(opt.param_groups):
                tag = (
                    "lr"
                    if len(self._optimizers) == 1 and len(opt.param_groups) == 1
                    else f"lr/{i}.{j}"
                )
                scalars[tag] = float(group["lr"])
        record: dict[str, Any] = {
            "type": "step",
            "step": step,
            "time": time.time(),
            "sampled": sampled,
            "training": self._model_ref.training,
            "scalars": scalars,
        }
        self._last_flags = [host[("flag", i)][0] for i in range(len(self._flags))]
        if not sampled:
            return record
        act, grad, param, bn = {}, {}, {}, {}
        for (kind, key), value in host.items():
            if kind == "act":
                act[key] = _act_stats(value)
            elif kind == "hist":
                act.setdefault(key, {})["hist"] = {
                    "lo": value[0],
                    "hi": value[1],
                    "counts": value[2:],
                }
            elif kind == "grad":
                grad[key] = {"norm": value[0]}
            elif kind == "param":
                name, stat = key.rsplit("/", 1)
                param.setdefault(name, {})[stat] = value[0]
            elif kind == "bn":
                bn[key] = dict(
                    zip(
                        ("running_mean", "running_var", "mean_drift", "var_drift"),
                        value,
                        strict=True,
                    )
                )
        record.update(act=act, grad=grad, param=param, bn=bn, grad_order=list(self._grad_order))
        return record

    def _diagnose(self, step: int, record: dict[str, Any]) -> list[Finding]:
        found = self._diagnosis.nonfinite(step, self._flags, self._last_flags)
        if record["sampled"]:
            found += self._diagnosis.sampled(step, record, self.modules)
        new = [f for f in found if self._diagnosis.first_time(f)]
        self.findings.extend(new)
        return new

    # -- records and lifetime ----------------------------------------------------------------
    def log(self, type: str, **fields: Any) -> None:
        """Write one record of any ``type`` (e.g. ``"feature_maps"``, ``"summary"``) to the sinks."""
        record = (
            {"type": type, "step": self.step_count, **fields}
            if type != "header"
            else {"type": type, **fields}
        )
        for sink in self._sinks:
            sink.write(record)

    @property
    def records(self) -> list[dict[str, Any]]:
        """Every record written so far (also without ``log_dir``)."""
        return self._memory.records

    def close(self) -> None:
        """Remove every hook and close the sinks. Safe to call more than once."""
        self._hooks.remove()
        sinks, self._sinks = self._sinks, [self._memory]
        for sink in sinks:
            if sink is not self._memory:
                sink.close()

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"Monitor({len(self.modules)} modules, every={self.every}, step={self.step_count}, "
            f"{len(self.findings)} findings)"
        )


def _to_host(keys: list, values: list[torch.Tensor]) -> dict[Any, list[float]]:
    """One device-to-host transfer for everything: concatenate, ``tolist()``, split."""
    if not values:
        return {}
    device = values[0].device
    flat = torch.cat([v.detach().reshape(-1).float().to(device) for v in values]).tolist()
    out, at = {}, 0
    for key, v in zip(keys, values, strict=True):
        out[key] = flat[at : at + v.numel()]
        at += v.numel()
    return out


def _rel(now: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(now - before) / (torch.linalg.vector_norm(before) + 1e-12)


def _act_stats(v: list[float]) -> dict[str, float]:
    f = dict(zip(ACT_FIELDS, v, strict=True))
    n = max(f["numel"], 1.0)
    mean = f["sum"] / n
    var = max(f["sumsq"] / n - mean * mean, 0.0) if math.isfinite(mean) else math.nan
    return {
        "mean": mean,
        "std": math.sqrt(var) if math.isfinite(var) else math.nan,
        "min": f["min"],
        "max": f["max"],
        "absmax": max(abs(f["min"]), abs(f["max"])),
        "zero_frac": f["zeros"] / n,
        "sat_frac": f["sat"] / n,
        "dead_frac": f["dead"],
        "nan": int(f["nan"]),
        "inf": int(f["inf"]),
        "numel": int(f["numel"]),
    }


def _is_leaf(name: str, module: nn.Module) -> bool:
    return bool(name) and next(iter(module.children()), None) is None


def _unique_params(model: nn.Module) -> dict[str, nn.Parameter]:
    """Parameters by first name; tied weights appear once (``named_parameters`` dedups)."""
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def _version() -> str:
    from . import __version__

    return __version__
