"""Which watched module fed which, and the walks along that graph that place a finding.

The rules on gradients read the RMS output gradient of each module along these edges: which
side of the model is starved, where the backward amplifies, which modules are near the input.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Graph", "chain", "is_norm", "largest_jump", "module_of", "near", "side_ratio"]


@dataclass(frozen=True)
class Graph:
    """Which watched module's output fed which module's input in the last forward pass.

    ``edges`` are ``(producer, consumer)`` pairs; a module that returned its input unchanged
    (``nn.Identity``, a view) is not a point of its own. ``detached`` are modules whose
    output reached the loss only detached from autograd, or not at all.
    """

    edges: frozenset[tuple[str, str]]
    detached: frozenset[str] = frozenset()

    def inputs_side(self, have: set[str]) -> list[str]:
        """Modules in ``have`` that no other module in ``have`` feeds."""
        fed = {c for p, c in self.edges if p in have and c in have and p != c}
        return sorted(have - fed)

    def loss_side(self, have: set[str]) -> list[str]:
        """Modules in ``have`` that feed no other module in ``have``."""
        feeding = {p for p, c in self.edges if p in have and c in have and p != c}
        return sorted(have - feeding)


def is_norm(type_name: str) -> bool:
    return "Norm" in type_name  # BatchNorm2d, LayerNorm, GroupNorm, RMSNorm, LlamaRMSNorm...


def module_of(param: str) -> str:
    return param.rsplit(".", 1)[0] if "." in param else ""


def side_ratio(graph: Graph, rms: dict[str, float]) -> tuple[float, str, str]:
    """RMS gradient of the input side over the loss side: ``(ratio, input module, loss
    module)``, each side's best-fed module (attention's query and key projections get
    small gradients in healthy transformers: one starved branch is not the input side)."""
    have = {n for n, r in rms.items() if r >= 0}
    inputs, losses = graph.inputs_side(have), graph.loss_side(have)
    losses = [n for n in losses if rms[n] > 0]
    if not inputs or not losses or not graph.edges:
        return 1.0, "", ""
    bottom = max(inputs, key=rms.__getitem__)
    top = max(losses, key=rms.__getitem__)
    if bottom == top:
        return 1.0, bottom, top
    return rms[bottom] / rms[top], bottom, top


def largest_jump(graph: Graph, rms: dict[str, float]) -> tuple[float, str, str] | None:
    """``(gain, producer, consumer)``: the edge whose consumer's backward scales the gradient
    up the most."""
    gains = [
        (rms[p] / rms[c], p, c)
        for p, c in graph.edges
        if p != c and rms.get(p, 0) > 0 and rms.get(c, 0) > 0
    ]
    return max(gains, default=None)


def near(graph: Graph, start: str, have: set[str], hops: int = 2) -> set[str]:
    """``start`` and the modules up to ``hops`` edges downstream of it."""
    near, frontier = {start}, {start}
    for _ in range(hops):
        frontier = {c for p, c in graph.edges if p in frontier and c in have} - near
        near |= frontier
    return near


def chain(graph: Graph, rms: dict[str, float], bottom: str, top: str) -> list[tuple[float, str]]:
    """Drops ``(gain, consumer)`` along the path from the loss side down to ``bottom``,
    smallest first."""
    consumers: dict[str, list[str]] = {}
    for p, c in graph.edges:
        consumers.setdefault(p, []).append(c)
    path, seen, node = [], {bottom}, bottom
    while node != top:
        nxt = [c for c in consumers.get(node, []) if c not in seen and c in rms]
        if not nxt:
            break
        nxt_node = max(nxt, key=rms.__getitem__)
        if rms[nxt_node] > 0:
            path.append((rms[node] / rms[nxt_node], nxt_node))
        seen.add(nxt_node)
        node = nxt_node
    return sorted(path)
