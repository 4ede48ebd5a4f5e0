"""Properties that must hold on any model: checked with hypothesis over randomly built ones.

The models are random stacks of Linear / ReLU (in place or not) / Tanh / LayerNorm /
Dropout (in eval mode) / residual blocks / two-branch blocks, and the selection is a random
subset of their modules (the root included). For each:

- what capture keeps as a module's output equals calling that module again on what capture
  kept as its input;
- the model's outputs and parameter gradients are bit-identical with and without hookscope
  (capture of every point, an identity intervention, both at once);
- a captured gradient equals ``torch.autograd.grad`` of the module's output;
- extract gives the same features as capture;
- no hook is left behind.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import pytest
import torch
import torch.nn as nn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hookscope as hs
from hookscope._tree import map_tensors, tensors
from hookscope.testing import assert_no_hooks

ALL = ("input", "output", "grad_input", "grad_output")
WIDTH = 5

SETTINGS = settings(
    max_examples=int(os.environ.get("HOOKSCOPE_EXAMPLES", "25")),  # more: a longer bug hunt
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


# -- random models -----------------------------------------------------------------------------


class Residual(nn.Module):
    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


class Branch(nn.Module):
    """Two paths over the same input, merged by a sum or a concat + Linear."""

    def __init__(self, left: nn.Module, right: nn.Module, concat: bool) -> None:
        super().__init__()
        self.left, self.right = left, right
        self.merge = nn.Linear(2 * WIDTH, WIDTH) if concat else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.left(x), self.right(x)
        if self.merge is None:
            return a + b
        return self.merge(torch.cat([a, b], dim=-1))


# A layer spec is a tuple; ("seq", [...]) nests. ReLU(inplace=True) only right after a layer
# that made a fresh tensor nobody else needs (Linear, LayerNorm), as in real models: an
# in-place op on a value that autograd saved, or on the block's input, breaks the bare model.
LEAF = st.sampled_from(["linear", "relu", "tanh", "layernorm", "dropout"])


@st.composite
def sequence(draw: st.DrawFn, depth: int) -> list[Any]:
    n = draw(st.integers(1, 4))
    # A sequence starts with a Linear, a block over its input (a residual around a branch
    # makes one tensor feed three consumers), or an identity (Dropout in eval mode returns
    # its very input).
    firsts = ["linear", "linear", "res", "branch", "dropout"] if depth < 2 else ["linear"]
    first = draw(st.sampled_from(firsts))
    layers: list[Any] = [("linear",)] if first == "linear" else []
    if first != "linear":
        n += 1
    for i in range(n):
        kind = draw(LEAF if depth >= 2 else st.one_of(LEAF, st.sampled_from(["res", "branch"])))
        if i == 0 and first != "linear":
            kind = first
        if kind == "relu":
            fresh = layers[-1][0] in ("linear", "layernorm")
            layers.append(("relu", fresh and draw(st.booleans())))
        elif kind == "res":
            layers.append(("res", draw(sequence(depth + 1))))
        elif kind == "branch":
            layers.append(
                (
                    "branch",
                    draw(sequence(depth + 1)),
                    draw(sequence(depth + 1)),
                    draw(st.booleans()),
                )
            )
        else:
            layers.append((kind,))
    return layers


def build(spec: list[Any]) -> nn.Sequential:
    modules: list[nn.Module] = []
    for layer in spec:
        kind = layer[0]
        if kind == "linear":
            modules.append(nn.Linear(WIDTH, WIDTH))
        elif kind == "relu":
            modules.append(nn.ReLU(inplace=layer[1]))
        elif kind == "tanh":
            modules.append(nn.Tanh())
        elif kind == "layernorm":
            modules.append(nn.LayerNorm(WIDTH))
        elif kind == "dropout":
            modules.append(nn.Dropout(0.5))
        elif kind == "res":
            modules.append(Residual(build(layer[1])))
        else:
            modules.append(Branch(build(layer[1]), build(layer[2]), layer[3]))
    return nn.Sequential(*modules)


@st.composite
def model_and_selection(draw: st.DrawFn) -> tuple[nn.Module, list[str], int]:
    spec = draw(sequence(0))
    seed = draw(st.integers(0, 2**16))
    torch.manual_seed(seed)
    model = nn.Sequential(build(spec), nn.Linear(WIDTH, 2)).eval()  # eval: dropout is identity
    names = [name for name, _ in model.named_modules()]
    chosen = draw(st.lists(st.sampled_from(names), min_size=1, unique=True))
    return model, chosen, seed


def run(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Forward and backward; the output and every parameter gradient."""
    model.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    out = model(x)
    (out.tanh() * torch.arange(1.0, 3.0)).sum().backward()
    return out.detach(), [x.grad, *(p.grad for p in model.parameters())]


def clone_tree(value: Any) -> Any:
    return map_tensors(lambda t: t.clone(), value)


def assert_bit_identical(a: list[torch.Tensor | None], b: list[torch.Tensor | None]) -> None:
    assert len(a) == len(b)
    for i, (u, v) in enumerate(zip(a, b, strict=True)):
        assert (u is None) == (v is None), i
        if u is not None:
            assert torch.equal(u, v), (i, (u - v).abs().max())


# -- properties --------------------------------------------------------------------------------


@SETTINGS
@given(model_and_selection(), st.integers(1, 4))
def test_captured_output_equals_rerunning_the_module_on_the_captured_input(
    drawn: tuple[nn.Module, list[str], int], batch: int
) -> None:
    model, chosen, seed = drawn
    x = torch.randn(batch, WIDTH, generator=torch.Generator().manual_seed(seed))
    with hs.capture(model, chosen, what=("input", "output")) as cap, torch.no_grad():
        model(x)
    assert set(cap) == set(chosen) and cap.missing == []
    modules = dict(model.named_modules())
    with torch.no_grad():
        for name in chosen:
            record = cap[name]
            # a fresh copy: an in-place module would otherwise change the record
            again = modules[name](*clone_tree(record.input), **clone_tree(record.kwargs))
            assert torch.equal(record.output, again), name
    assert_no_hooks(model)


def _watch(
    model: nn.Module, chosen: list[str], how: str, what: tuple[str, ...], at: str, x: torch.Tensor
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    identity = {tuple(chosen): lambda value, site: None}
    with hs.capture(model, chosen if how != "intervene" else "**", what=what) as cap:
        if how == "capture":
            got = run(model, x)
        else:
            with hs.intervene(model, identity, at=at):
                got = run(model, x)
    assert len(cap) > 0
    assert_no_hooks(model)
    return got


@SETTINGS
@given(
    model_and_selection(),
    st.sampled_from(["capture", "intervene", "both"]),
    st.sampled_from(["input", "output"]),
)
def test_watching_values_leaves_outputs_and_gradients_bit_identical(
    drawn: tuple[nn.Module, list[str], int], how: str, at: str
) -> None:
    model, chosen, seed = drawn
    bare = copy.deepcopy(model)
    x = torch.randn(3, WIDTH, generator=torch.Generator().manual_seed(seed))
    got = _watch(model, chosen, how, ("input", "output"), at, x)
    want = run(bare, x)
    assert_bit_identical([got[0], *got[1]], [want[0], *want[1]])
    # and the model runs exactly as before, afterwards
    again = run(model, x)
    assert_bit_identical([again[0], *again[1]], [want[0], *want[1]])


@SETTINGS
@given(
    model_and_selection(),
    st.sampled_from(["capture", "intervene", "both"]),
    st.sampled_from(ALL),
)
def test_watching_gradients_leaves_outputs_identical_and_gradients_equal_up_to_rounding(
    drawn: tuple[nn.Module, list[str], int], how: str, at: str
) -> None:
    # Exactly identical gradients are not possible in general: to see the gradient of one
    # module's input (or of an output that is also an input), hookscope gives the module a
    # copy of its own, and where one tensor feeds three or more consumers autograd then sums
    # their gradients in another grouping (nested residuals: 3e-8 off). torch's own full
    # backward hooks do the same. The forward pass stays bit-identical.
    model, chosen, seed = drawn
    bare = copy.deepcopy(model)
    x = torch.randn(3, WIDTH, generator=torch.Generator().manual_seed(seed))
    got = _watch(model, chosen, how, ALL, at, x)
    want = run(bare, x)
    assert torch.equal(got[0], want[0])
    for i, (u, v) in enumerate(zip(got[1], want[1], strict=True)):
        torch.testing.assert_close(
            u, v, rtol=1e-4, atol=1e-5, msg=lambda m, i=i: f"gradient {i}: {m}"
        )


@SETTINGS
@given(model_and_selection())
def test_captured_gradients_equal_autograd_grad_of_each_module_output(
    drawn: tuple[nn.Module, list[str], int],
) -> None:
    model, chosen, seed = drawn
    x = torch.randn(3, WIDTH, generator=torch.Generator().manual_seed(seed))
    with hs.capture(model, chosen, what=("output", "grad_output", "grad_input")) as cap:
        run(model, x)

    # Oracle: keep a copy of each chosen module's output, let the model go on from a copy of
    # that copy (so later in-place ops touch neither), and ask autograd for its gradient.
    kept: dict[str, torch.Tensor] = {}
    handles = []
    for name, module in model.named_modules():
        if name in chosen:

            def hook(m: nn.Module, args: Any, out: torch.Tensor, name: str = name) -> Any:
                kept[name] = out.clone()
                return kept[name].clone()

            handles.append(module.register_forward_hook(hook))
    xr = x.clone().requires_grad_(True)
    loss = (model(xr).tanh() * torch.arange(1.0, 3.0)).sum()
    for handle in handles:
        handle.remove()
    grads = torch.autograd.grad(loss, [kept[n] for n in chosen], allow_unused=True)
    for name, grad in zip(chosen, grads, strict=True):
        (got,) = cap[name].grad_output
        torch.testing.assert_close(got, grad, rtol=1e-5, atol=1e-6, msg=name)
    if "" in chosen:  # the root's input is x itself
        (gx,) = cap[""].grad_input
        (want,) = torch.autograd.grad((model(xr).tanh() * torch.arange(1.0, 3.0)).sum(), xr)
        torch.testing.assert_close(gx, want, rtol=1e-5, atol=1e-6)
    assert_no_hooks(model)


@SETTINGS
@given(model_and_selection())
def test_extract_gives_what_capture_gives_and_leaves_the_model_as_it_was(
    drawn: tuple[nn.Module, list[str], int],
) -> None:
    model, chosen, seed = drawn
    chosen = [name for name in chosen if name] or ["1"]  # extract from inside, not the root
    model.train()
    x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(seed))
    feats = hs.extract(model, x, where=chosen)
    assert model.training and all(m.training for m in model.modules())
    model.eval()
    with hs.capture(model, chosen) as cap, torch.no_grad():
        model(x)
    assert list(feats) == [name for name, _ in model.named_modules() if name in chosen]
    for name in chosen:
        assert torch.equal(feats[name], cap[name].output), name
        assert feats[name].grad_fn is None
    assert_no_hooks(model)


@pytest.mark.parametrize("fail_at", ["forward", "body", "backward"])
@SETTINGS
@given(drawn=model_and_selection())
def test_no_hook_is_left_behind_when_something_raises(
    drawn: tuple[nn.Module, list[str], int], fail_at: str
) -> None:
    model, chosen, seed = drawn
    modules = dict(model.named_modules())
    victim = modules[chosen[-1]]

    def boom(*args: Any) -> None:
        raise RuntimeError("boom")

    handle = victim.register_forward_hook(boom) if fail_at == "forward" else None
    x = torch.randn(2, WIDTH, generator=torch.Generator().manual_seed(seed), requires_grad=True)
    with pytest.raises(RuntimeError, match="boom"):
        with hs.capture(model, chosen, what=ALL), hs.intervene(model, "**", lambda v, s: None):
            out = model(x)
            if fail_at == "backward":
                out.register_hook(boom)
            out.sum().backward()
            if fail_at == "body":
                raise RuntimeError("boom")
    if handle is not None:
        handle.remove()
    assert_no_hooks(model)
    # and a capture afterwards sees one clean pass
    with hs.capture(model, chosen, what=ALL) as cap:
        model(x).sum().backward()
    for name in chosen:
        assert [r.call for r in cap.all(name)] == [0]
        assert None not in cap[name].grad_output and tensors(cap[name].output)
    assert_no_hooks(model)
