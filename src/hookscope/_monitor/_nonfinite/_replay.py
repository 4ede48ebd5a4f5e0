"""The flight recorder: a failing step written to disk, and replayed later, op by op.

A bundle is a directory holding ``tensors.safetensors`` (the model's state, the inputs of the
step's outermost calls into the model, RNG states, the gradients that reached the model's
outputs, the recorded outputs and the optimizer's tensors) and ``bundle.json`` (the finding,
the step whose state it holds, the module each call called, by qualified name, the structure
of the inputs and the optimizer's other state). Nothing in it needs the user's code to
unpickle: the model is built by the user, the same way, and the bundle's state is loaded into
it.

It sits next to its tracer (``_nonfinite/_trace.py``) and below the Monitor, which writes a bundle
through :func:`write_bundle`; ``hs.replay`` and the ``hookscope replay`` command read one.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..._diagnose import Finding
from ..._errors import HookscopeError, missing_extra
from ..._tree import tensors
from ..._version import __version__
from ._trace import Call, Origin, trace

__all__ = ["Replay", "check_bundle", "replay", "write_bundle"]

BUNDLE_JSON = "bundle.json"
TENSORS = "tensors.safetensors"


@dataclass
class Replay:
    """What :func:`replay` found.

    Attributes:
        findings: The traced finding(s): ``module``, ``op``, ``source``, ``phase``.
        loss_matches: The replayed outputs equal the recorded ones, bit for bit (a NaN
            matching a NaN in the same place); ``None`` when the outputs were not recorded.
        recorded: The finding as the Monitor recorded it.
    """

    findings: list[Finding]
    loss_matches: bool | None
    recorded: Finding
    origin: Origin | None = field(default=None, repr=False)

    def __str__(self) -> str:
        lines = [f"recorded: {self.recorded}"]
        lines += [f"replayed: {f}" for f in self.findings] or ["replayed: no NaN/Inf made by an op"]
        if self.origin is not None:
            lines.append(f"op: {self.origin.op} ({self.origin.phase})")
            lines.append(f"module: {self.origin.module}")
            lines.append(f"source: {self.origin.source}")
        lines.append(f"outputs match the recording: {self.loss_matches}")
        return "\n".join(lines)


def _safetensors() -> Any:
    try:
        import safetensors.torch
    except ImportError:
        raise missing_extra("safetensors", "dataset") from None
    return safetensors.torch


# -- writing -----------------------------------------------------------------------------------
def write_bundle(
    directory: str | Path,
    finding: Finding,
    model: nn.Module,
    calls: list[Call],
    optimizers: list[torch.optim.Optimizer],
    *,
    step: int,
    before_update: bool,
) -> Path:
    """Write one replay bundle of step ``step`` for ``finding`` under ``directory``; return
    its path. ``step`` is the step whose state is written: the finding's own, or a later one
    for a finding read a step late (an unsampled step's ``not_updated``)."""
    st = _safetensors()
    path = Path(directory) / f"step{step:06d}-{finding.kind}"
    path.mkdir(parents=True, exist_ok=True)
    store: dict[str, torch.Tensor] = {}

    def put(key: str, t: torch.Tensor) -> str:
        store[key] = t.detach().to("cpu").contiguous().clone()
        return key

    for name, value in model.state_dict().items():
        put(f"model/{name}", value)
    names = {id(m): n for n, m in model.named_modules()}
    call_specs = []
    for i, call in enumerate(calls):
        outputs = _unchanged(call)
        call_specs.append(
            {
                "module": "" if call.module is None else names[id(call.module)],
                "args": [_spec(a, f"call{i}/arg{j}", put) for j, a in enumerate(call.args)],
                "kwargs": {k: _spec(v, f"call{i}/kw/{k}", put) for k, v in call.kwargs.items()},
                "rng": {
                    "cpu": put(f"call{i}/rng/cpu", call.rng["cpu"]),
                    "cuda": [
                        put(f"call{i}/rng/cuda{d}", s)
                        for d, s in enumerate(call.rng.get("cuda", []))
                    ],
                },
                "grads": {str(k): put(f"call{i}/grad{k}", g) for k, g in call.grads.items()},
                "outputs": {str(k): put(f"call{i}/out{k}", t) for k, t in outputs.items()},
            }
        )
    optim_specs = [_optimizer_spec(opt, f"optim{i}", put) for i, opt in enumerate(optimizers)]
    st.save_file(store, str(path / TENSORS))
    meta = {
        "format": "hookscope-bundle",
        "version": 1,
        "hookscope": __version__,
        "torch": torch.__version__,
        "time": time.time(),
        "model": type(model).__name__,
        "finding": asdict(finding),
        "step": step,
        "state_before_update": before_update,
        "calls": call_specs,
        "optimizers": optim_specs,
    }
    (path / BUNDLE_JSON).write_text(json.dumps(meta, indent=1, default=_json_default))
    return path


def _unchanged(call: Call) -> dict[int, torch.Tensor]:
    """The call's recorded outputs, by position, that still hold what the model returned:
    an output the training code changed in place afterwards (one the tape handed on as it
    is: no gradient) is left out, not compared with its replay."""
    outputs = call.outputs or []
    versions = call.versions or [None] * len(outputs)
    return {
        k: t
        for k, (t, v) in enumerate(zip(outputs, versions, strict=False))
        if isinstance(t, torch.Tensor) and (v is None or t.is_inference() or t._version == v)
    }


def _spec(value: Any, key: str, put: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return {"tensor": put(key, value), "requires_grad": value.requires_grad}
    if isinstance(value, (list, tuple)):
        items = [_spec(v, f"{key}/{i}", put) for i, v in enumerate(value)]
        return {"list": items, "tuple": isinstance(value, tuple)}
    if isinstance(value, dict):
        return {"dict": {k: _spec(v, f"{key}/{k}", put) for k, v in value.items()}}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"value": value}
    raise HookscopeError(
        f"cannot record an input of type {type(value).__name__} in a replay bundle; "
        "bundles hold tensors, numbers, strings and lists or dicts of them"
    )


def _optimizer_spec(opt: torch.optim.Optimizer, key: str, put: Any) -> dict[str, Any]:
    state = opt.state_dict()
    tensors_, plain = {}, {}
    for pid, values in state["state"].items():
        for name, value in values.items():
            if isinstance(value, torch.Tensor):
                tensors_[f"{pid}/{name}"] = put(f"{key}/{pid}/{name}", value)
            else:
                plain[f"{pid}/{name}"] = value
    return {
        "type": type(opt).__name__,
        "groups": state["param_groups"],
        "tensors": tensors_,
        "plain": plain,
    }


def _json_default(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, (set, tuple)):
        return list(value)
    return repr(value)


# -- reading and replaying ------------------------------------------------------------------
def replay(
    bundle: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> Replay:
    """Load a flight-recorder bundle into ``model`` (built the same way) and re-run its step
    under the op-level tracer.

    Args:
        bundle: A bundle directory written by ``hs.Monitor(..., record_dir=DIR)``.
        model: The model, built by the user's own code; the bundle's state is loaded into it.
        optimizer: Optionally, the optimizer, whose state is loaded too (same parameters).

    Returns:
        A :class:`Replay` with the traced findings and whether the outputs match.
    """
    path, meta = check_bundle(bundle)
    store = _safetensors().load_file(str(path / TENSORS))
    state = {k.removeprefix("model/"): v for k, v in store.items() if k.startswith("model/")}
    try:
        model.load_state_dict(state)
    except RuntimeError as exc:
        raise HookscopeError(
            f"the bundle's state does not fit this model ({type(model).__name__}; the bundle "
            f"was recorded from a {meta['model']}): {exc}. Build the model exactly as in the "
            "recorded run."
        ) from None
    if optimizer is not None and meta["optimizers"]:
        _load_optimizer(optimizer, meta["optimizers"][0], store)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    calls = [_call(spec, store, device, model) for spec in meta["calls"]]
    recorded = Finding(**meta["finding"])
    origin, outputs = trace(model, calls, suspect=recorded.module, keep_outputs=True)
    matches = _outputs_match(meta["calls"], store, outputs)
    findings = [] if origin is None else [origin.refine(recorded, cheap_check=False)]
    return Replay(findings, matches, recorded, origin)


def check_bundle(bundle: str | Path) -> tuple[Path, dict[str, Any]]:
    """The bundle's directory and its metadata, or an error saying what is missing: checked
    before anything is built for it (``hookscope replay`` builds the model after this)."""
    path = Path(bundle)
    meta_file = path / BUNDLE_JSON
    expected = (
        f"expected a directory holding {BUNDLE_JSON} and {TENSORS}, as written by "
        "hs.Monitor(model, record_dir=DIR)"
    )
    if not meta_file.is_file():
        raise HookscopeError(f"no replay bundle at {str(path)!r}: {expected}")
    if not (path / TENSORS).is_file():
        raise HookscopeError(f"the replay bundle at {str(path)!r} has no {TENSORS}: {expected}")
    try:
        meta = json.loads(meta_file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise HookscopeError(f"{str(meta_file)!r} is not a replay bundle's JSON ({exc})") from None
    if not isinstance(meta, dict) or not {"calls", "finding", "model"} <= set(meta):
        raise HookscopeError(f"{str(meta_file)!r} is not a replay bundle's metadata: {expected}")
    return path, meta


def _call(
    spec: dict[str, Any], store: dict[str, torch.Tensor], device: torch.device, model: nn.Module
) -> Call:
    def value(s: dict[str, Any]) -> Any:
        if "tensor" in s:
            t = store[s["tensor"]].to(device)
            return t.requires_grad_(True) if s.get("requires_grad") else t
        if "list" in s:
            items = [value(i) for i in s["list"]]
            return tuple(items) if s["tuple"] else items
        if "dict" in s:
            return {k: value(v) for k, v in s["dict"].items()}
        return s["value"]

    rng: dict[str, Any] = {"cpu": store[spec["rng"]["cpu"]]}
    if spec["rng"]["cuda"] and torch.cuda.is_available():
        rng["cuda"] = [store[k] for k in spec["rng"]["cuda"]]
    grads = {int(k): store[key].to(device) for k, key in spec["grads"].items()}
    return Call(
        tuple(value(a) for a in spec["args"]),
        {k: value(v) for k, v in spec["kwargs"].items()},
        rng,
        grads,
        [store[key] for key in spec["outputs"].values()],
        module=_called(model, spec.get("module", "")),
    )


def _called(model: nn.Module, name: str) -> nn.Module | None:
    """The module a recorded call called: ``None`` for the model itself."""
    if not name:
        return None
    try:
        return model.get_submodule(name)
    except AttributeError:
        raise HookscopeError(
            f"the bundle replays a call of module {name!r}, which this "
            f"{type(model).__name__} does not have. Build the model exactly as in the "
            "recorded run."
        ) from None


def _load_optimizer(opt: torch.optim.Optimizer, spec: dict[str, Any], store: dict) -> None:
    state: dict[int, dict[str, Any]] = {}
    for key, tensor_key in spec["tensors"].items():
        pid, name = key.split("/", 1)
        state.setdefault(int(pid), {})[name] = store[tensor_key]
    for key, value in spec["plain"].items():
        pid, name = key.split("/", 1)
        state.setdefault(int(pid), {})[name] = value
    opt.load_state_dict({"state": state, "param_groups": spec["groups"]})


def _outputs_match(specs: list[dict], store: dict, replayed: list[Any]) -> bool | None:
    pairs = []
    for spec, output in zip(specs, replayed, strict=False):
        outs = tensors(output)
        for k, key in spec["outputs"].items():
            if int(k) < len(outs):
                pairs.append((store[key], outs[int(k)].detach().cpu()))
    if not pairs:
        return None
    return all(_same_bits(a, b) for a, b in pairs)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    return bool(torch.equal(nan_a, nan_b) and torch.equal(a[~nan_a], b[~nan_b]))
