"""Output gradients captured inside a ``torch.compile(fullgraph=True)`` graph: no graph break
(fullgraph would refuse one), the values eager capture keeps, the model's gradients unchanged,
nothing kept once the capture closed; what still needs a gradient hook is refused."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from torch import nn

import hookscope as hs
from hookscope.testing import assert_no_hooks, assert_torch_untouched
from models import gpt2, token_ids

pytestmark = [
    pytest.mark.filterwarnings("ignore:hookscope.*traced again:hookscope.HookscopeWarning"),
    # Inductor's CPU backend imports torch.utils.mkldnn, which warns (torch's, not ours)
    pytest.mark.filterwarnings("ignore:.torch.jit.script_method. is deprecated:DeprecationWarning"),
]


class Net(nn.Module):
    """A small CNN: BatchNorm then in-place ReLU, and one ReLU module called twice."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.relu(self.bn2(self.conv2(x)))
        return self.head(x.mean((2, 3)))


WHERE = ["bn1", "relu", "conv2", "head"]


def run(model: nn.Module, x: torch.Tensor) -> None:
    model(x).square().sum().backward()


@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
def test_a_full_graph_cnn_gives_the_output_gradients_eager_capture_gives(backend: str) -> None:
    torch.manual_seed(0)
    net = Net()
    twin = copy.deepcopy(net)
    compiled = torch.compile(net, fullgraph=True, backend=backend)
    x = torch.randn(2, 3, 8, 8)
    what = ("output", "grad_output")
    with (
        hs.capture(compiled, WHERE, what, keep="all") as cap,
        hs.capture(twin, WHERE, what, keep="all") as ref,
    ):
        for _ in range(2):
            run(compiled, x)
            run(twin, x)
        late, twin_late = compiled(x), twin(x)  # their backward runs after the block
    late.sum().backward()  # keeps nothing: the capture is closed
    twin_late.sum().backward()
    for name in WHERE:
        got, want = cap.all(name), ref.all(name)
        assert [r.call for r in got] == [r.call for r in want]
        assert len(got) == (6 if name == "relu" else 3)  # the ReLU twice in each pass
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert (a.grad_output[0] is None) == (i >= len(got) - len(got) // 3)
            torch.testing.assert_close(a.grad_output, b.grad_output)
            torch.testing.assert_close(a.output, b.output)  # before the in-place ReLU
    for p, q in zip(net.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)
    gone = weakref.ref(cap)
    del cap
    gc.collect()
    assert gone() is None
    assert_no_hooks(net)
    assert_torch_untouched()


def test_a_full_graph_gpt2_gives_the_output_gradients_eager_capture_gives() -> None:
    torch.manual_seed(0)
    model = gpt2(n_head=4, attn_implementation="eager")
    twin = copy.deepcopy(model)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    ids = token_ids()
    where = ["transformer.h.0", "transformer.h.1.attn", "transformer.h.1.mlp", "lm_head"]
    with (
        hs.capture(compiled, where, "grad_output") as cap,
        hs.capture(twin, where, "grad_output") as ref,
    ):
        compiled(ids).logits.square().mean().backward()
        twin(ids).logits.square().mean().backward()
    for name in where:
        assert cap[name].grad_output[0] is not None
        torch.testing.assert_close(cap[name].grad_output, ref[name].grad_output)
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)
    assert_torch_untouched()


@pytest.mark.parametrize("verb", ["grad_input", "intervene"])
def test_what_needs_a_gradient_hook_is_still_refused_under_fullgraph(verb: str) -> None:
    import torch._dynamo

    net = Net()
    compiled = torch.compile(net, fullgraph=True, backend="aot_eager")
    if verb == "grad_input":
        attached = hs.capture(compiled, "conv2", ("grad_input", "grad_output"))
    else:
        attached = hs.intervene(compiled, "conv2", lambda g, site: g * 2, at="grad_output")
    with pytest.raises(torch._dynamo.exc.Unsupported, match="hookscope: .* fullgraph=True"):
        with attached:
            run(compiled, torch.randn(2, 3, 8, 8))
    assert_no_hooks(net)
    assert_torch_untouched()
