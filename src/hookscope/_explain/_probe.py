"""``hs.Probe``: a fixed batch explained every N training steps by a Monitor
(``Monitor(explain=hs.Probe(...))``), into the run's log and its report.

The Monitor calls :meth:`ProbeRun.records` at ``mon.step()`` of the probe's steps, with its
own hooks paused. The explanation runs in eval mode through :func:`~._run.explain_batch`,
which puts the model back exactly as it was (every submodule's mode, buffers, the RNG
state; no ``.grad`` is touched), so the training run is the same, bit for bit, with and
without the probe.

Log records (kept small: maps at most 32 x 32, images at most 64 x 64, as uint8 lists):

- ``{"type": "explain_probe", "step", "method", "every", "modules", "images", "channels",
  "size"}``: once, before the first explanation: the probe images (``[N, H, W]`` grey or
  ``[N, H, W, 3]``; ``None`` when the input is not an image batch) and the input's size;
- ``{"type": "explain", "step", "module", "method", "grid", "maps", "low", "high",
  "target", "score"}``: per module and explained step: ``maps`` ``[N, h, w]`` uint8, each
  sample's map min-max scaled to 0..255 (``low`` and ``high`` its range before scaling, so
  ``low + maps / 255 * (high - low)`` is the map, averaged over 32 x 32 cells where larger),
  the explained class per sample (``None`` for a callable target) and its score.
"""

from __future__ import annotations

import numbers
import warnings
from dataclasses import asdict
from typing import Any

import torch
from torch import nn

from .._errors import ExplainError, HookscopeWarning
from .._log import Event
from .._select import Where, select
from ._inputs import Inputs
from ._png import to_rgb
from ._result import Explanation
from ._run import check_method, explain_batch
from ._target import check_target

__all__ = ["MAP_SIZE", "Probe", "ProbeRun", "quantize"]

MAP_SIZE = 32  # a logged map's side at most
IMAGE_SIZE = 64  # a logged probe image's side at most
_OPTIONS = ("layout", "batch_size", "steps", "baseline")


class Probe:
    """A fixed batch to explain during training: ``hs.Monitor(model, explain=hs.Probe(...))``.

    At ``mon.step()`` of every ``every``-th step (0, ``every``, ``2 * every``, ...) the
    Monitor explains ``inputs`` at ``where`` with :func:`hookscope.explain` (eval mode) and
    logs each image's map (``"explain"`` records, read with :func:`hookscope.read_log`); the
    report's *Explanations* part shows, per probe image, its heatmap over the steps. The
    model is left exactly as it was, so the run is bit-identical with and without a probe
    (loss, weights, optimizer state, RNG).

    Args:
        inputs: The probe batch: a tensor (``[N, C, H, W]`` images: heatmaps are shown on
            them), or a tuple of positional inputs. A few samples: each is explained at each
            probe step.
        where: Which modules (any *where*; a module that matches nothing is an error when
            the Monitor is built).
        method: Any method of :func:`hookscope.explain` (``"gradcam"`` by default).
        every: Explain every ``every`` steps.
        target: ``None`` (each sample's top class at that step), an int, one index per
            sample (the probe's labels, say), or a callable ``output -> [N]`` scores.
        forward_kwargs: Keyword inputs of the model.
        **options: ``layout``, ``batch_size``, ``steps``, ``baseline``, as for
            :func:`hookscope.explain`.

    Example:
        >>> import torch, torch.nn as nn, hookscope as hs
        >>> model = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(),
        ...                       nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> probe = hs.Probe(torch.randn(2, 1, 8, 8), where="0", every=2)
        >>> with hs.Monitor(model, explain=probe) as mon:
        ...     for _ in range(3):
        ...         model(torch.randn(4, 1, 8, 8)).sum().backward(); opt.step(); opt.zero_grad()
        ...         _ = mon.step()
        >>> [(r["step"], r["module"], r["grid"]) for r in mon.records if r["type"] == "explain"]
        [(0, '0', [8, 8]), (2, '0', [8, 8])]
    """

    def __init__(
        self,
        inputs: Any,
        where: Where,
        method: str = "gradcam",
        every: int = 100,
        target: Any = None,
        *,
        forward_kwargs: dict[str, Any] | None = None,
        **options: Any,
    ) -> None:
        check_method(method)
        check_target(target)
        if isinstance(every, bool) or not isinstance(every, numbers.Integral) or every < 1:
            raise ValueError(f"Probe(every=...) must be a positive number of steps, got {every!r}")
        unknown = [k for k in options if k not in _OPTIONS]
        if unknown:
            why = " (a probe always runs in eval mode)" if unknown[0] == "train" else ""
            raise TypeError(
                f"Probe() got an unexpected keyword argument {unknown[0]!r}{why}; its explain "
                f"options are {', '.join(_OPTIONS)}"
            )
        self.inputs = Inputs.of(inputs, forward_kwargs)
        self.where, self.method, self.every = where, method, int(every)
        self.target, self.options = target, options

    def due(self, step: int) -> bool:
        """Whether ``mon.step()`` of ``step`` explains the probe."""
        return step % self.every == 0

    def bind(self, model: nn.Module) -> ProbeRun:
        """The probe on ``model`` (its eager modules chosen now: a ``where`` that matches
        nothing is a ``SelectionError`` as the Monitor is built)."""
        return ProbeRun(self, model)

    def __repr__(self) -> str:
        return (
            f"Probe({self.inputs.n} samples, where={self.where!r}, method={self.method!r}, "
            f"every={self.every})"
        )


class ProbeRun:
    """A :class:`Probe` bound to a model: what the Monitor runs at the probe's steps."""

    def __init__(self, probe: Probe, model: nn.Module) -> None:
        self.probe, self.model = probe, model
        self.modules = select(model, probe.where)
        self._moved: tuple[torch.device, Inputs] | None = None
        self._told = False  # the explain_probe record is written before the first explain one
        self._warned = False

    def due(self, step: int) -> bool:
        return self.probe.due(step)

    def _inputs(self) -> Inputs:
        first = next(iter([*self.model.parameters(), *self.model.buffers()]), None)
        device = first.device if first is not None else torch.device("cpu")
        if self._moved is None or self._moved[0] != device:
            moved = self.probe.inputs.map(lambda t: t.detach().to(device))
            self._moved = (device, moved)
        return self._moved[1]

    def records(self, step: int) -> list[dict[str, Any]]:
        """Explain the probe now; its log records (``explain_probe`` the first time, then one
        ``explain`` per module). A probe that fails does not stop training (a watched run
        never fails where the bare one does not): an ``explain_failed`` event is logged, with
        a ``HookscopeWarning`` the first time."""
        try:
            return self._records(step)
        except Exception as exc:
            message = (
                f"hs.Probe: explaining the probe at step {step} failed ({type(exc).__name__}: "
                f"{exc}); training goes on, without this step's explanation"
            )
            if not self._warned:
                self._warned = True
                warnings.warn(message, HookscopeWarning, stacklevel=4)
            return [asdict(Event(step, "explain_failed", message))]

    def _records(self, step: int) -> list[dict[str, Any]]:
        p = self.probe
        inputs = self._inputs()
        explained = explain_batch(self.model, inputs, self.modules, p.method, p.target, **p.options)
        if not explained.maps:
            raise ExplainError(f"Probe: no module of where={p.where!r} ran on the probe inputs")
        exp = Explanation(explained, inputs, p.target)
        out: list[dict[str, Any]] = []
        if not self._told:
            out.append(self._probe_record(step, exp))
            self._told = True
        target = None if exp.target is None else exp.target.cpu().tolist()
        score = exp.score.cpu().tolist()
        for name in exp.names:
            maps, low, high = quantize(exp.grid(name))
            out.append(
                {
                    "type": "explain",
                    "step": step,
                    "module": name,
                    "method": p.method,
                    "grid": list(maps.shape[1:]),
                    "maps": maps.tolist(),
                    "low": low,
                    "high": high,
                    "target": target,
                    "score": score,
                }
            )
        return out

    def _probe_record(self, step: int, exp: Explanation) -> dict[str, Any]:
        images, channels = _images(self.probe.inputs)
        return {
            "type": "explain_probe",
            "step": step,
            "method": self.probe.method,
            "every": self.probe.every,
            "modules": exp.names,
            "images": images,
            "channels": channels,
            "size": None if exp.input_size is None else list(exp.input_size),
        }


def quantize(grid: torch.Tensor) -> tuple[torch.Tensor, list[float], list[float]]:
    """``[N, *grid]`` maps -> uint8 ``[N, h, w]`` (h, w <= 32: averaged over cells where
    larger; a 1-d grid is one row, a deeper one averaged over its leading axes), each sample
    min-max scaled, with each sample's range before scaling."""
    m = grid.detach().float().cpu()
    if m.dim() == 1:
        m = m.unsqueeze(1)
    if m.dim() == 2:
        m = m.unsqueeze(1)
    while m.dim() > 3:
        m = m.mean(1)
    h, w = m.shape[1:]
    if h > MAP_SIZE or w > MAP_SIZE:
        m = nn.functional.adaptive_avg_pool2d(m.unsqueeze(1), (min(h, MAP_SIZE), min(w, MAP_SIZE)))
        m = m.squeeze(1)
    finite = m.isfinite()
    flat, ok = m.flatten(1), finite.flatten(1)
    low = torch.where(ok, flat, torch.inf).amin(1)  # over the finite values (none: inf, -inf)
    high = torch.where(ok, flat, -torch.inf).amax(1)
    span = (high - low).view(-1, 1, 1)
    scaled = torch.where(finite & (span > 0), (m - low.view(-1, 1, 1)) / span.clamp_min(1e-30), 0)
    q = (scaled * 255).round().clamp(0, 255).to(torch.uint8)
    return q, low.tolist(), high.tolist()


def _images(inputs: Inputs) -> tuple[list[Any] | None, int | None]:
    """The probe images as uint8 lists, at most 64 x 64 (``None`` unless the primary input is
    a float ``[N, 1 or 3, H, W]`` batch)."""
    x = inputs.primary
    if not x.is_floating_point() or x.dim() != 4 or x.shape[1] not in (1, 3):
        return None, None
    h, w = x.shape[2:]
    scale = min(1.0, IMAGE_SIZE / max(h, w))
    size = (max(1, round(h * scale)), max(1, round(w * scale)))
    rgb = (to_rgb(x.detach().float().cpu(), size) * 255).round().to(torch.uint8)
    if x.shape[1] == 1:
        return rgb[..., 0].tolist(), 1
    return rgb.tolist(), 3
