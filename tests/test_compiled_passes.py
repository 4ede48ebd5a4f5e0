"""A capture or an intervention on a compiled model compiles once, not at every pass.

A hook traced into a graph runs its Python once, while the graph is traced: a pass or call
counter read there is a constant the graph guards on, and a counter that moves at each pass
compiled a new graph at each pass (8 graphs in 12 passes, then eager; under
``fullgraph=True``, a hard failure at the 9th). The passes must be counted when the graph
runs, and the values must still be each pass's own. Counted with a backend that counts the
graphs Dynamo hands it and runs them as they are, and checked on ``aot_eager`` (the
backward traced too) under ``fullgraph=True``.
"""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch import nn

import hookscope as hs
from hookscope.testing import assert_no_hooks, assert_torch_untouched
from models import Counting, gpt2, token_ids

pytestmark = [
    pytest.mark.filterwarnings("ignore:hookscope.*traced again:hookscope.HookscopeWarning"),
    pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor:UserWarning"),
]

PASSES = 12  # past Dynamo's recompile limit (8)


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(inplace=True), nn.Linear(8, 2))


WHAT = ("input", "output", "grad_output")


@pytest.mark.parametrize("keep", ["all", "last"])
@pytest.mark.parametrize("backend", ["counting", "aot_eager"])
def test_a_capture_of_a_compiled_model_compiles_once_and_keeps_each_pass(
    keep: str, backend: str
) -> None:
    model = mlp()
    twin = copy.deepcopy(model)
    counting = Counting()
    compiled = torch.compile(
        model, backend=counting if backend == "counting" else backend, fullgraph=True
    )
    per_pass: list[int] = []
    xs = [torch.randn(3, 4, generator=torch.Generator().manual_seed(i)) for i in range(PASSES)]
    with (
        hs.capture(model, "*", WHAT, keep=keep) as cap,
        hs.capture(twin, "*", WHAT, keep=keep) as ref,
    ):
        for x in xs:
            compiled(x).square().sum().backward()
            twin(x).square().sum().backward()
            per_pass.append(counting.graphs)
    if backend == "counting":
        assert per_pass[-1] == per_pass[0] >= 1  # all compiled in the first pass
    for name in ("0", "1", "2"):
        got, want = cap.all(name), ref.all(name)
        assert len(got) == len(want) == (PASSES if keep == "all" else 1)
        for a, b in zip(got, want, strict=True):
            assert (a.call, a._pass) == (b.call, b._pass)
            torch.testing.assert_close(a.input, b.input)
            torch.testing.assert_close(a.output, b.output)
            torch.testing.assert_close(a.grad_output, b.grad_output)
    # the first Linear's output as it left the module, before the in-place ReLU changed it
    torch.testing.assert_close(cap["0"].output, F.linear(xs[-1], model[0].weight, model[0].bias))
    assert bool((cap["0"].output < 0).any())
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)
    assert_no_hooks(model)
    assert_torch_untouched()


class Twice(nn.Module):
    """One Linear called twice per pass, with a ReLU between."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.out = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.a(torch.relu(self.a(x)))))


def test_an_intervention_on_a_compiled_model_compiles_once_and_numbers_each_call() -> None:
    torch.manual_seed(0)
    model, counting = Twice(), Counting()
    compiled = torch.compile(model, backend=counting, fullgraph=True)

    def scale(value: torch.Tensor, site: hs.Site) -> torch.Tensor:
        return value * (site.call + 2)  # call 0 doubled, call 1 tripled

    def by_hand(x: torch.Tensor) -> torch.Tensor:
        a = lambda t: F.linear(t, model.a.weight, model.a.bias)  # noqa: E731
        return F.linear(torch.relu(3 * a(torch.relu(2 * a(x)))), model.out.weight, model.out.bias)

    per_pass: list[int] = []
    with hs.intervene(model, {"a": scale}):
        for i in range(PASSES):
            x = torch.randn(3, 4, generator=torch.Generator().manual_seed(i))
            torch.testing.assert_close(compiled(x), by_hand(x))
            per_pass.append(counting.graphs)
    assert per_pass[-1] == per_pass[0] >= 1  # all compiled in the first pass
    torch.testing.assert_close(compiled(x), model.out(torch.relu(model.a(torch.relu(model.a(x))))))
    assert_no_hooks(model)


def test_a_capture_of_a_compiled_gpt2_called_with_keywords_keeps_its_structures() -> None:
    """Hugging Face's way: ``model(input_ids=...)`` (the pass starts on a keyword argument),
    blocks that return tuples, and a ``ModelOutput``, rebuilt around the kept tensors."""
    torch.manual_seed(0)
    model = gpt2(n_head=4, attn_implementation="eager").eval()
    twin = copy.deepcopy(model)
    counting = Counting()
    compiled = torch.compile(model, backend=counting, fullgraph=True)
    where = ["transformer.h.*", "transformer"]
    per_pass: list[int] = []
    with (
        hs.capture(model, where, ("input", "output")) as cap,
        hs.capture(twin, where, ("input", "output")) as ref,
        torch.no_grad(),
    ):
        for i in range(3):
            ids = token_ids(length=8) if i < 2 else token_ids(length=8).flip(1)
            compiled(input_ids=ids, use_cache=False)
            twin(input_ids=ids, use_cache=False)
            per_pass.append(counting.graphs)
    assert per_pass[-1] == per_pass[0] >= 1  # all compiled in the first pass
    for name in ("transformer.h.0", "transformer.h.1", "transformer"):
        got, want = cap[name], ref[name]
        assert type(got.output) is type(want.output)
        torch.testing.assert_close(got.output, want.output)
        torch.testing.assert_close(got.input, want.input)
        torch.testing.assert_close(got.kwargs, want.kwargs)
        assert got._pass == want._pass == 3
    assert isinstance(cap["transformer"].output.last_hidden_state, torch.Tensor)
    assert_no_hooks(model)


@pytest.mark.requires_torch(
    "2.10",
    reason="Dynamo 2.9 raises IndexError building its guards on two verbs' hooks on one root "
    "(seen on 2.9.1, on the tree before the tap too; passes on 2.13 and 2.14)",
)
@pytest.mark.parametrize("capture_first", [True, False])
def test_a_capture_in_a_compiled_graph_sees_the_edit_whatever_the_order(
    capture_first: bool,
) -> None:
    model = mlp()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    x = torch.randn(3, 4)
    verbs = [
        lambda: hs.capture(model, "0", ("output", "grad_output")),
        lambda: hs.intervene(model, {"0": lambda value, site: value * 3}),
    ]
    first, second = verbs if capture_first else verbs[::-1]
    with first() as a, second() as b:
        cap = a if capture_first else b
        for _ in range(3):
            compiled(x).sum().backward()
    torch.testing.assert_close(cap["0"].output, 3 * F.linear(x, model[0].weight, model[0].bias))
    assert cap["0"].grad_output[0] is not None
    assert len(cap.all("0")) == 1


def test_output_gradients_asked_of_a_compiled_pass_under_no_grad_warn_as_eager() -> None:
    model = mlp()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with pytest.warns(hs.NoGradWarning, match=r"torch.no_grad\(\)"):
        with hs.capture(model, "*", ("output", "grad_output")) as cap, torch.no_grad():
            compiled(torch.randn(3, 4))
    assert cap["2"].output.shape == (3, 2)
    assert cap["2"].grad_output is None


@pytest.mark.requires_torch("2.9", reason="the cudagraph_unsafe tag")
def test_the_tap_ops_are_kept_out_of_cuda_graphs() -> None:
    """A CUDA graph replays kernels without the Python the taps call: Inductor's
    ``reduce-overhead`` must leave them out (they are tagged)."""
    model = mlp()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with hs.capture(model, "0", ("output", "grad_output")):
        compiled(torch.randn(3, 4)).sum().backward()
    for op in (torch.ops.hookscope.tap.default, torch.ops.hookscope.tap_grads.default):
        assert torch.Tag.cudagraph_unsafe in op.tags


def test_an_unclosed_capture_of_a_dropped_compiled_model_is_not_kept_by_the_taps() -> None:
    """The taps' registry is the process's: it holds a verb's callbacks weakly, so a capture
    never closed goes with its model (once Dynamo's cache lets the compiled code go)."""
    model = mlp()
    compiled = torch.compile(model, backend="aot_eager")
    cap = hs.capture(model, "*", ("input", "output", "grad_output"))
    compiled(torch.randn(3, 4)).sum().backward()
    assert len(cap) == 3
    model_ref, cap_ref = weakref.ref(model), weakref.ref(cap)
    del model, compiled, cap
    torch._dynamo.reset()
    gc.collect()
    assert model_ref() is None
    assert cap_ref() is None
