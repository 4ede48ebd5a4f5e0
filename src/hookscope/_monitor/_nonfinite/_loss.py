"""The op that made a NaN/Inf loss between the model and the loss (the training code).

That code runs outside the model's hooks and outside a replay of the model, and by the time
the loss is known to be NaN (the step's one transfer) its backward pass has freed every saved
tensor. What is left is the structure of the loss's autograd graph, which the Monitor keeps
by reference until the step ends (``_step/_heard.py``), and where that graph enters the
model: the tape marks the node of each output copy it hands the caller (``OUTPUT_TAG``).

On the NaN step only, :func:`loss_origin` walks the graph from the loss down to those
marks, takes the model's outputs from a replay of its calls (bit for bit), and re-runs the
nodes between them op by op, from their kind and the arguments autograd keeps (dims,
exponents, shapes): the first node whose inputs are finite and whose result is not is the
op. Nodes that need a tensor autograd has freed (a target, a constant) cannot be re-run;
then the ops on the way that can make a NaN are named as the candidates. Autograd keeps no
source line without anomaly mode.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ._trace import OUTPUT_TAG

__all__ = ["LossOrigin", "loss_origin"]

# At most this many nodes are walked (the training code between the model and the loss is
# a few ops; a loss that reaches into the model some other way stops here)
MAX_NODES = 512

_UNARY: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    name: getattr(torch, name.lower())
    for name in (
        "Log",
        "Log2",
        "Log10",
        "Sqrt",
        "Rsqrt",
        "Reciprocal",
        "Exp",
        "Exp2",
        "Expm1",
        "Neg",
        "Abs",
        "Tanh",
        "Sigmoid",
        "Acos",
        "Asin",
        "Atanh",
        "Acosh",
        "Lgamma",
        "Digamma",
        "Erfinv",
        "Relu",
        "Clone",
        "Sin",
        "Cos",
        "Tan",
        "Sinh",
        "Cosh",
    )
}
_UNARY["Log1P"] = torch.log1p
# Ops that can make a NaN/Inf from finite inputs (candidates where nothing could be re-run)
_UNSAFE = {
    "Log",
    "Log2",
    "Log10",
    "Log1P",
    "Sqrt",
    "Rsqrt",
    "Reciprocal",
    "Exp",
    "Exp2",
    "Expm1",
    "Pow",
    "Div",
    "Acos",
    "Asin",
    "Atanh",
    "Acosh",
    "Lgamma",
    "Digamma",
    "Erfinv",
    "Mean",
    "Var",
    "Std",
    "Tan",
    "Sinh",
    "Cosh",
    "Logit",
    "Atan2",
    "Xlogy",
    "Cumprod",
    "Prod",
}


@dataclass(frozen=True)
class LossOrigin:
    """``op``: the op that made the NaN/Inf (``None``: not re-run); ``produced``: "NaN" or
    "Inf"; ``how``: what about its input made it (an empty input), or ""; ``candidates``: the
    ops between the model and the loss that can make a NaN, where none could be re-run."""

    op: str | None
    produced: str
    how: str = ""
    candidates: tuple[str, ...] = ()


def loss_origin(
    graph: list[Any], outputs: Callable[[int], list[torch.Tensor] | None]
) -> LossOrigin | None:
    """The op between the model's outputs and the loss that made it non-finite.

    ``graph``: the loss's autograd nodes; ``outputs(k)``: the tensors the model's ``k``-th
    call of the step returned (from a replay), in ``tensors`` order. ``None`` where the graph
    does not reach the model."""
    order = _post_order(graph)
    if not any(OUTPUT_TAG in n.metadata for n in order.values()):
        return None
    values: dict[int, torch.Tensor | None] = {}
    found: LossOrigin | None = None
    candidates: list[str] = []
    with torch.no_grad():
        for key, node in order.items():
            base = _base(node)
            value, inputs = _value(node, base, values, outputs)
            values[key] = value
            if found is not None or OUTPUT_TAG in node.metadata or inputs is None:
                continue
            if base in _UNSAFE and _reaches_model(node, order):
                candidates.append(_aten(base))
            if value is None or _finite(value):
                continue
            empty = base == "Mean" and getattr(node, "_saved_self_sym_numel", None) == 0
            if empty or all(t is not None and _finite(t) for t in inputs):
                found = LossOrigin(
                    _aten(base), _kind(value), " of an empty tensor" if empty else ""
                )
    if found is not None:
        return found
    return LossOrigin(None, "NaN", candidates=tuple(dict.fromkeys(candidates)))


def _post_order(roots: list[Any]) -> dict[int, Any]:
    """The graph's nodes, children before parents (by id), down to the model's marked
    output copies and the leaves; at most ``MAX_NODES``."""
    order: dict[int, Any] = {}
    seen: set[int] = set()
    stack: list[tuple[Any, bool]] = [(n, False) for n in reversed(roots)]
    while stack and len(order) < MAX_NODES:
        node, expanded = stack.pop()
        key = id(node)
        if expanded:
            order.setdefault(key, node)
            continue
        if key in seen:
            continue
        seen.add(key)
        stack.append((node, True))
        if OUTPUT_TAG in node.metadata:
            continue
        for child, _ in reversed(node.next_functions):
            if child is not None and id(child) not in seen:
                stack.append((child, False))
    return order


def _reaches_model(node: Any, order: dict[int, Any]) -> bool:
    todo, seen = [node], set()
    while todo:
        n = todo.pop()
        if OUTPUT_TAG in n.metadata:
            return True
        for child, _ in n.next_functions:
            if child is not None and id(child) not in seen and id(child) in order:
                seen.add(id(child))
                todo.append(child)
    return False


def _value(
    node: Any,
    base: str,
    values: dict[int, torch.Tensor | None],
    outputs: Callable[[int], list[torch.Tensor] | None],
) -> tuple[torch.Tensor | None, list[torch.Tensor | None] | None]:
    """The node's forward result re-run, and its inputs (``None``: not known)."""
    tag = node.metadata.get(OUTPUT_TAG)
    if tag is not None:
        outs = outputs(tag[0])
        return (outs[tag[1]] if outs is not None and tag[1] < len(outs) else None), None
    if base == "torch::autograd::AccumulateGrad":
        return node.variable.detach(), None
    inputs: list[torch.Tensor | None] = []
    for child, nr in node.next_functions:
        if child is None:
            inputs.append(None)  # a constant or an input without gradient: freed
        elif nr != 0:
            inputs.append(None)  # one of several outputs: not re-run
        else:
            inputs.append(values.get(id(child)))
    try:
        return _rerun(node, base, inputs), inputs
    except (RuntimeError, AttributeError, TypeError, IndexError, ValueError):
        return None, inputs


def _rerun(node: Any, base: str, x: list[torch.Tensor | None]) -> torch.Tensor | None:
    if base == "Mean" and getattr(node, "_saved_self_sym_numel", None) == 0:
        return torch.tensor(float("nan"))  # a mean over nothing, whatever the values
    if any(t is None for t in x):
        return None
    shape = list(node._input_metadata[0].shape)
    if base in _UNARY and len(x) == 1:
        return _UNARY[base](x[0])
    if base == "Pow" and len(x) == 1:
        return torch.pow(x[0], node._saved_exponent)
    if base == "Pow" and len(x) == 2:
        return torch.pow(x[0], x[1])
    if base in ("Add", "Sub") and len(x) == 2:
        alpha = getattr(node, "_saved_alpha", 1)
        return x[0] + alpha * x[1] if base == "Add" else x[0] - alpha * x[1]
    if base in ("Mul", "Div") and len(x) == 2:
        return x[0] * x[1] if base == "Mul" else x[0] / x[1]
    if base in ("Mean", "Sum"):
        dim = getattr(node, "_saved_dim", None)
        reduce = torch.mean if base == "Mean" else torch.sum
        if dim is None:
            return reduce(x[0])
        return reduce(x[0], dim=list(dim), keepdim=bool(node._saved_keepdim))
    if base in ("LogSoftmax", "Softmax"):
        fn = torch.log_softmax if base == "LogSoftmax" else torch.softmax
        return fn(x[0], node._saved_dim)
    if base in ("View", "UnsafeView", "Reshape", "Unsqueeze", "Squeeze"):
        return x[0].reshape(shape)
    if base == "Expand":
        return x[0].expand(shape)
    if base == "T":
        return x[0].t()
    if base == "Transpose":
        return x[0].transpose(node._saved_dim0, node._saved_dim1)
    if base == "Permute":
        return x[0].permute(node._saved_dims)
    if base == "Select":
        return x[0].select(node._saved_dim, node._saved_index)
    return None


def _base(node: Any) -> str:
    """``LogBackward0`` -> ``Log``."""
    return re.sub(r"Backward\d*$", "", node.name())


def _aten(base: str) -> str:
    special = {"Log1P": "log1p", "T": "t"}
    name = special.get(base) or re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", base).lower()
    return f"aten.{name}"


def _finite(t: torch.Tensor) -> bool:
    if not (t.is_floating_point() or t.is_complex()):
        return True
    return t.numel() == 0 or bool(torch.isfinite(t).all())


def _kind(t: torch.Tensor) -> str:
    return "NaN" if bool(torch.isnan(t).any()) else "Inf"
