"""hookscope on compiled models: attached before or after ``torch.compile``, never silent.

Compiled with the ``aot_eager`` backend: TorchDynamo traces the hooks and AOTAutograd builds
the graphs exactly as with the default backend, without Inductor's C++ build (a cold
Inductor compile takes some 20 s on a CPU here).
"""

from __future__ import annotations

import contextlib
import math
import re
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch._dynamo
from torch import nn
from torch._dynamo.utils import counters

import hookscope as hs
from hookscope._hooks import in_backward_recompute
from hookscope._stats import Sampler
from models import gpt2, token_ids

BACKEND = "aot_eager"  # values compared with eager
TRACE = "eager"  # only whether the hooks run
RESET = "dropped and traced again with the hooks"

pytestmark = [
    # Dynamo hides an internal ".grad of a non-leaf" warning by swapping warnings.showwarning,
    # which an "error" filter (ours, in pyproject) bypasses: torch's quirk, not ours.
    pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor:UserWarning"),
    # Dynamo makes the context of every autograd.Function it traces (the Monitor's gradient
    # probe) by instantiating Function inside catch_warnings(record=True), which keeps an
    # "error" filter: torch's quirk again.
    pytest.mark.filterwarnings("ignore:.*should not be instantiated:DeprecationWarning"),
]


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    """Each test starts and ends with nothing compiled in the process."""
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


class CNN(nn.Module):
    """Conv-BatchNorm-ReLU blocks, pooled, then a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            *(
                nn.Sequential(nn.Conv2d(cin, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
                for cin in (3, 8)
            )
        )
        self.head = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean(dim=(2, 3)))


def images(step: int) -> torch.Tensor:
    return torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(step))


def cnn_loss(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def tiny_gpt2(n_layer: int = 2) -> nn.Module:
    """The tests' GPT-2, training, without dropout (compiled and eager RNGs differ)."""
    return gpt2(n_layer, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0).train()


def gpt2_ids(step: int) -> torch.Tensor:
    torch.manual_seed(step)
    return token_ids()


def gpt2_loss(out: Any) -> torch.Tensor:
    return out.logits.float().square().mean()  # outside the model: labels= warns in HF


def train(
    mon: hs.Monitor,
    call: Callable[[Any], Any],
    params: nn.Module,
    data: Callable[[int], Any],
    loss_of: Callable[[Any], torch.Tensor],
    steps: int = 2,
) -> list[dict[str, Any]]:
    """``steps`` SGD steps through ``call``; the Monitor's step records."""
    opt = torch.optim.SGD(params.parameters(), lr=1e-2)
    for step in range(steps):
        loss_of(call(data(step))).backward()
        opt.step()
        opt.zero_grad()
        mon.step()
    return [r for r in mon.records if r["type"] == "step"]


def hookscope_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, hs.HookscopeWarning)]


def numbers(record: dict[str, Any], kinds: tuple[str, ...]) -> dict[tuple[str, ...], float]:
    """Every number of ``record``'s ``kinds`` sections, by (kind, module, statistic)."""
    found = {}
    for kind in kinds:
        for module, stats in record.get(kind, {}).items():
            for stat, value in stats.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    found[kind, module, stat] = float(value)
    return found


def assert_close(compiled: dict[tuple, float], eager: dict[tuple, float]) -> None:
    """Every statistic eager logs, the compiled run logs too, equal at rtol 1e-4 (means,
    which sum to nearly zero, also within 1e-6 absolute)."""
    assert eager and set(eager) <= set(compiled), sorted(set(eager) - set(compiled))[:5]
    off = {
        key: (compiled[key], value)
        for key, value in eager.items()
        if not math.isclose(compiled[key], value, rel_tol=1e-4, abs_tol=1e-6)
    }
    assert off == {}


# -- attached before compiling: the graph has the hooks, the numbers are eager's --------------


@pytest.mark.parametrize(
    "make, data, loss_of",
    [(CNN, images, cnn_loss), (tiny_gpt2, gpt2_ids, gpt2_loss)],
    ids=["cnn", "gpt2"],
)
def test_a_monitor_attached_before_compiling_logs_what_eager_logs(
    make: Callable[[], nn.Module], data: Callable, loss_of: Callable
) -> None:
    torch.manual_seed(0)
    eager_model = make()
    model = make()
    model.load_state_dict(eager_model.state_dict())
    with hs.Monitor(eager_model, every=1, sample=None) as mon:
        eager = train(mon, eager_model, eager_model, data, loss_of)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with hs.Monitor(model, every=1, sample=None) as mon:
            compiled = train(mon, torch.compile(model, backend=BACKEND), model, data, loss_of)
    assert hookscope_warnings(caught) == []
    for got, want in zip(compiled, eager, strict=True):
        assert_close(
            numbers(got, ("act", "grad", "param")), numbers(want, ("act", "grad", "param"))
        )
    # hookscope's own cheap breaks are gone: the graph task id and math.gcd in the Sampler
    reasons = " ".join(counters["graph_break"])
    assert "_current_graph_task_id" not in reasons and "gcd" not in reasons


# -- attached after compiling: watched, at the cost of one recompile -------------------------


def test_a_monitor_on_a_compiled_wrapper_not_run_yet_needs_no_recompile() -> None:
    model = CNN()
    compiled = torch.compile(model, backend=TRACE)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with hs.Monitor(compiled, every=1) as mon:
            steps = train(mon, compiled, model, images, cnn_loss)
    assert hookscope_warnings(caught) == []  # nothing was compiled without the hooks
    assert set(mon.modules) == {n for n, m in model.named_modules() if not list(m.children())}
    assert all(sorted(s["act"]) == sorted(mon.modules) for s in steps)
    assert all(sorted(s["grad"]) == sorted(mon.modules) for s in steps)


@pytest.mark.parametrize("how", ["wrapper", "in place"])
def test_a_monitor_attached_after_the_compiled_model_ran_recompiles_once_and_says_so(
    how: str,
) -> None:
    model = CNN()
    if how == "wrapper":
        call: nn.Module = torch.compile(model, backend=TRACE)
    else:
        model.compile(backend=TRACE)
        call = model
    cnn_loss(call(images(99))).backward()
    with pytest.warns(hs.HookscopeWarning, match=r"traced again with the hooks.*one recompile"):
        mon = hs.Monitor(call, every=1)
    with mon, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        steps = train(mon, call, model, images, cnn_loss)
    assert hookscope_warnings(caught) == []  # once, when attaching
    assert "_orig_mod" not in " ".join(mon.modules)  # named as the eager model
    assert all(sorted(s["act"]) == sorted(mon.modules) for s in steps)
    assert all(s["grad"]["head"]["norm"] > 0 for s in steps)


def test_an_earlier_instance_of_the_class_compiled_is_not_reused_without_the_hooks() -> None:
    other = CNN()
    torch.compile(other, backend=TRACE)(images(99))
    model = CNN()
    with pytest.warns(hs.HookscopeWarning, match="CNN"):
        mon = hs.Monitor(model, every=1)
    with mon:
        steps = train(mon, torch.compile(model, backend=TRACE), model, images, cnn_loss)
    assert all(sorted(s["act"]) == sorted(mon.modules) for s in steps)


def test_gpt2_compiled_and_run_then_watched_logs_every_block() -> None:
    model = tiny_gpt2(n_layer=1)
    compiled = torch.compile(model, backend=TRACE)
    gpt2_loss(compiled(gpt2_ids(99))).backward()
    with pytest.warns(hs.HookscopeWarning, match=RESET):
        mon = hs.Monitor(compiled, every=1)
    with mon:
        steps = train(mon, compiled, model, gpt2_ids, gpt2_loss, steps=1)
    for s in steps:
        assert {"transformer.h.0.mlp.c_fc", "transformer.h.0.attn.c_attn", "lm_head"} <= set(
            s["act"]
        )


# -- never silent ------------------------------------------------------------------------------


def test_a_compiled_function_that_runs_the_model_without_the_hooks_is_a_warning() -> None:
    model = CNN()
    forward = torch.compile(lambda x: model(x), backend=TRACE)  # not the model's own code
    forward(images(99))
    with hs.Monitor(model, every=1) as mon:
        with pytest.warns(hs.HookscopeWarning, match="none of the Monitor's hooks") as caught:
            steps = train(mon, forward, model, images, cnn_loss, steps=3)
    assert len(hookscope_warnings(caught.list)) == 1
    assert all(s["act"] == {} and s["param"] for s in steps)  # what the warning is about


def test_an_eager_step_with_activations_does_not_warn() -> None:
    model = CNN()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with hs.Monitor(model, every=1) as mon:
            steps = train(mon, model, model, images, cnn_loss)
    assert all(s["act"] for s in steps)


# -- capture, intervene, extract on a compiled model -------------------------------------------


def test_capture_on_a_compiled_model_that_ran_records_its_outputs() -> None:
    model = CNN().eval()
    compiled = torch.compile(model, backend=TRACE)
    x = images(0)
    compiled(x)
    with pytest.warns(hs.HookscopeWarning, match="capture"):
        cap = hs.capture(compiled, ["head", "features.0.2"], what=("output", "grad_output"))
    with cap:
        compiled(x).sum().backward()
    with torch.no_grad():
        want = model(x)
    torch.testing.assert_close(cap["head"].output, want, rtol=1e-4, atol=1e-6)
    assert cap["features.0.2"].output.shape == (4, 8, 8, 8)
    assert cap["head"].grad_output[0].shape == (4, 10)


def test_intervene_on_a_compiled_model_that_ran_edits_its_output_then_stops() -> None:
    model = CNN().eval()
    compiled = torch.compile(model, backend=TRACE)
    x = images(0)
    before = compiled(x)
    with pytest.warns(hs.HookscopeWarning, match="intervene"):
        edit = hs.intervene(compiled, {"head": lambda out, site: out * 0})
    with edit:
        assert torch.equal(compiled(x), torch.zeros(4, 10))
    torch.testing.assert_close(compiled(x), before)


def test_extract_from_a_compiled_model_runs_it_eagerly_without_recompiling() -> None:
    model = CNN().eval()
    compiled = torch.compile(model, backend=TRACE)
    x = images(0)
    compiled(x)
    graphs = counters["stats"]["unique_graphs"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", hs.HookscopeWarning)
        feats = hs.extract(compiled, x, where="features.0")
    assert counters["stats"]["unique_graphs"] == graphs
    with torch.no_grad():
        torch.testing.assert_close(feats["features.0"], model.features[0](x))


# -- the cheap graph breaks --------------------------------------------------------------------


def test_the_checkpoint_test_and_the_sampler_trace_without_a_graph_break() -> None:
    sampler = Sampler(16)

    def hook_body(x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        return sampler(y).sum() + (0.0 if in_backward_recompute() else 1.0)

    compiled = torch.compile(hook_body, backend=TRACE, dynamic=True)
    for shape in [(6, 7, 5), (9, 7, 5)]:
        x = torch.randn(shape)
        torch.testing.assert_close(compiled(x), hook_body(x))
    assert dict(counters["graph_break"]) == {}


# -- fullgraph=True: the compiled branch of the hooks (src/hookscope/_monitor/_probes/_compiled.py) ----


def compiled_steps(
    make: Callable[[], nn.Module],
    data: Callable[[int], Any],
    loss_of: Callable[[Any], torch.Tensor],
    *,
    how: str | None,
    monitored: bool = True,
    steps: int = 2,
    micro: int = 1,
    **options: Any,
) -> tuple[list[dict[str, Any]], nn.Module]:
    """``steps`` SGD steps of a fresh model (seed 0), compiled ``how`` (``"whole"``: the
    model with ``fullgraph=True``; ``"blocks"``: each GPT-2 block on its own; ``None``:
    eager), the Monitor attached before; its step records."""
    torch.manual_seed(0)
    model = make()
    mon = hs.Monitor(model, **options) if monitored else None
    call: Any = model
    if how == "whole":
        call = torch.compile(model, backend=BACKEND, fullgraph=True)
    elif how == "blocks":
        for block in model.transformer.h:
            block.compile(backend=BACKEND, fullgraph=True)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    for step in range(steps):
        for i in range(micro):
            loss_of(call(data(micro * step + i))).backward()
        opt.step()
        opt.zero_grad()
        if mon is not None:
            mon.step()
    if mon is None:
        return [], model
    mon.close()
    return [r for r in mon.records if r["type"] == "step"], model


def assert_equal_to_eager(compiled: list[dict], eager: list[dict]) -> None:
    """The same step records (sampled or not), every activation, output-gradient and
    parameter statistic equal at rtol 1e-3, over the same modules."""
    kinds = ("act", "grad", "param")
    assert [r["sampled"] for r in compiled] == [r["sampled"] for r in eager]
    for got, want in zip(compiled, eager, strict=True):
        got_numbers, want_numbers = numbers(got, kinds), numbers(want, kinds)
        assert set(got_numbers) == set(want_numbers)
        off = {
            key: (got_numbers[key], value)
            for key, value in want_numbers.items()
            if not math.isclose(got_numbers[key], value, rel_tol=1e-3, abs_tol=1e-6)
        }
        assert off == {}
        assert math.isclose(got["scalars"]["loss"], want["scalars"]["loss"], rel_tol=1e-5)


def gpt2_blocks() -> nn.Module:
    model = tiny_gpt2(n_layer=4)
    model.config.use_cache = False  # transformers' cache recompiles each block by itself
    return model


CASES = {
    "cnn": (CNN, images, cnn_loss),
    "gpt2": (tiny_gpt2, gpt2_ids, gpt2_loss),
}


@pytest.mark.parametrize("sample", [None, 64], ids=["every-element", "sampled"])
@pytest.mark.parametrize("case", list(CASES))
def test_fullgraph_compiles_with_no_graph_break_and_logs_what_eager_logs(
    case: str, sample: int | None
) -> None:
    make, data, loss_of = CASES[case]
    eager, _ = compiled_steps(make, data, loss_of, how=None, every=1, sample=sample)
    compiled_steps(make, data, loss_of, how="whole", monitored=False)
    bare_graphs = counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    counters.clear()
    compiled, _ = compiled_steps(make, data, loss_of, how="whole", every=1, sample=sample)
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] == bare_graphs
    assert_equal_to_eager(compiled, eager)
    assert all(r["act"] and r["grad"] for r in compiled)


@pytest.mark.requires_torch(
    "2.10",
    reason="Dynamo 2.9 guards on the arguments bound in each block's forward hooks (module "
    "names), so identical blocks compiled one by one compile once per block (same results)",
)
def test_identical_blocks_compiled_one_by_one_compile_once_as_without_the_monitor() -> None:
    def frames(model: nn.Module) -> int:
        code = type(model.transformer.h[0]).forward.__code__
        return len(torch._dynamo.eval_frame._debug_get_cache_entry_list(code))

    eager, _ = compiled_steps(gpt2_blocks, gpt2_ids, gpt2_loss, how=None, every=1)
    _, bare = compiled_steps(gpt2_blocks, gpt2_ids, gpt2_loss, how="blocks", monitored=False)
    bare_frames = frames(bare)
    torch._dynamo.reset()
    counters.clear()
    compiled, model = compiled_steps(gpt2_blocks, gpt2_ids, gpt2_loss, how="blocks", every=1)
    assert frames(model) == bare_frames == 1
    assert dict(counters["graph_break"]) == {}
    assert_equal_to_eager(compiled, eager)
    assert {f"transformer.h.{i}.mlp.c_fc" for i in range(4)} <= set(compiled[0]["grad"])


def test_every_10_compiles_a_sampled_and_an_unsampled_graph() -> None:
    eager, _ = compiled_steps(CNN, images, cnn_loss, how=None, every=10, steps=12)
    compiled_steps(CNN, images, cnn_loss, how="whole", monitored=False, steps=12)
    bare_graphs = counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    counters.clear()
    compiled, _ = compiled_steps(CNN, images, cnn_loss, how="whole", every=10, steps=12)
    assert counters["stats"]["unique_graphs"] <= bare_graphs + 1
    assert dict(counters["graph_break"]) == {}
    assert [r["step"] for r in compiled if r.get("act")] == [0, 10]
    assert_equal_to_eager(compiled, eager)


def test_micro_batches_combine_as_in_eager_without_a_recompile() -> None:
    eager, _ = compiled_steps(CNN, images, cnn_loss, how=None, every=1, micro=3)
    compiled, _ = compiled_steps(CNN, images, cnn_loss, how="whole", every=1, micro=3)
    assert counters["stats"]["unique_graphs"] == 1
    assert_equal_to_eager(compiled, eager)
    assert compiled[0]["act"]["head"]["numel"] == 3 * 4 * 10  # three calls of the head


@pytest.mark.parametrize("every", [1, 10])
def test_an_overflow_in_a_compiled_model_is_named_to_its_module_and_op(every: int) -> None:
    def overflowing(how: str | None) -> hs.Finding:
        torch.manual_seed(0)
        model = CNN()
        mon = hs.Monitor(model, every=every)
        call = torch.compile(model, backend=BACKEND, fullgraph=True) if how else model
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        with mon:
            for step in range(3):
                if step == 1:
                    with torch.no_grad():
                        model.features[1][0].weight.fill_(1e38)
                cnn_loss(call(images(step))).backward()
                opt.step()
                opt.zero_grad()
                found = [f for f in mon.step() if f.kind == "nonfinite"]
                if found:
                    return found[0]
        raise AssertionError("no nonfinite finding")

    eager = overflowing(None)
    compiled = overflowing("whole")
    assert dict(counters["graph_break"]) == {}
    assert (compiled.module, compiled.step, compiled.phase) == ("features.1.0", 1, "forward")
    assert (compiled.module, compiled.step, compiled.phase, compiled.op, compiled.source) == (
        eager.module,
        eager.step,
        eager.phase,
        eager.op,
        eager.source,
    )
    assert compiled.op == "aten.convolution"


def test_an_nn_sequential_compiled_whole_is_taped_through_its_wrapper() -> None:
    """A ``torch.nn`` container compiled whole runs its own hooks inside the graph: the
    Monitor tapes the ``torch.compile`` wrapper instead, so a NaN found at an unsampled step
    still gets its op and line from the eager replay, and unsampled steps flag the edges."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with hs.Monitor(model, every=10) as mon:
        call = torch.compile(model, backend=BACKEND, fullgraph=True)
        for step in range(4):
            if step == 2:
                with torch.no_grad():
                    model[2].weight.fill_(1e38)
            call(torch.randn(8, 4)).square().sum().backward()
            opt.step()
            opt.zero_grad()
            mon.step()
    finding = next(f for f in mon.findings if f.kind == "nonfinite")
    assert (finding.module, finding.step, finding.op) == ("2", 2, "aten.addmm")
    assert finding.source.startswith(f"{__file__}:")
    assert dict(counters["graph_break"]) == {}


def test_an_evaluation_pass_through_the_compiled_model_adds_no_graph_break() -> None:
    torch.manual_seed(0)
    model = CNN()
    call = torch.compile(model, backend=BACKEND, fullgraph=True)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with hs.Monitor(model, every=1) as mon:
        for step in range(2):
            cnn_loss(call(images(step))).backward()
            opt.step()
            opt.zero_grad()
            model.eval()
            with torch.no_grad():
                call(images(99))
            model.train()
            mon.step()
    assert dict(counters["graph_break"]) == {}
    steps = [r for r in mon.records if r["type"] == "step"]
    assert all(sorted(s["act"]) == sorted(mon.modules) for s in steps)


# -- the gradient probe: a traced autograd.Function, or a custom op where one cannot trace ----


def probe_ops(under_error_filter: bool) -> tuple[list[str], list[dict], list[dict]]:
    """The ops of the graphs Dynamo hands the backend for a compiled CNN step under the
    Monitor (``every=1``), and the compiled and eager step records."""
    graphs: list[str] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        graphs.extend(str(node.target) for node in gm.graph.nodes)
        return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)

    eager, _ = compiled_steps(CNN, images, cnn_loss, how=None, every=1)
    torch.manual_seed(0)
    model = CNN()
    with warnings.catch_warnings():
        if under_error_filter:  # a test suite's -W error
            warnings.filterwarnings(
                "error", message=".*should not be instantiated", category=DeprecationWarning
            )
        with hs.Monitor(model, every=1) as mon:
            call = torch.compile(model, backend=backend, fullgraph=True)
            train(mon, call, model, images, cnn_loss)
    compiled = [r for r in mon.records if r["type"] == "step"]
    return graphs, compiled, eager


@pytest.mark.parametrize("under_error_filter", [False, True], ids=["function", "custom-op"])
def test_the_gradient_probe_is_traced_through_unless_warnings_are_errors(
    under_error_filter: bool,
) -> None:
    graphs, compiled, eager = probe_ops(under_error_filter)
    custom_op = [op for op in graphs if "grad_probe" in op]
    function = [op for op in graphs if "autograd_function_apply" in op]
    if under_error_filter:  # Dynamo could not make the Function's context: the custom op
        assert custom_op and not function
    else:  # traced through: Inductor can fuse its copy away
        assert function and not custom_op
    assert dict(counters["graph_break"]) == {}
    assert_equal_to_eager(compiled, eager)
    assert all(r["grad"] for r in compiled)


def test_the_compiled_probes_place_values_without_stack_or_cat() -> None:
    """Inductor makes a kernel of each scalar that ``torch.stack``/``torch.cat`` places: with
    them the probes made a sampled GPT-2 6x768 step launch 3,258 kernels on an H200, 1,608
    without (benchmarks/README.md). The graphs Dynamo hands on, forward and the gradient
    probe's backward, hold none that the bare model's do not."""

    def ops(monitored: bool) -> list[str]:
        found: list[str] = []

        def backend(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
            for module in gm.modules():  # the Function's forward and backward are submodules
                if isinstance(module, torch.fx.GraphModule):
                    found.extend(str(n.target) for n in module.graph.nodes)
            return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)

        torch._dynamo.reset()
        torch.manual_seed(0)
        model = CNN()
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        with hs.Monitor(model, every=1) if monitored else contextlib.nullcontext() as mon:
            call = torch.compile(model, backend=backend, fullgraph=True)
            for step in range(2):
                cnn_loss(call(images(step))).backward()
                opt.step()
                opt.zero_grad()
                if mon is not None:
                    mon.step()
        return found

    def placing(ops: list[str]) -> list[str]:
        return [op for op in ops if re.search(r"\b(stack|cat)\b", op)]

    monitored = ops(True)
    assert any("autograd_function_apply" in op for op in monitored)  # the probes are there
    assert placing(monitored) == placing(ops(False))


def test_the_probe_choice_is_marked_constant_as_torch_marks_one() -> None:
    from hookscope._monitor._probes import _compiled

    def marked() -> bool:
        return True

    torch.compiler.assume_constant_result(marked)
    marks = vars(marked)
    assert marks
    assert all(getattr(_compiled._functions_trace, k, None) == v for k, v in marks.items())


@pytest.mark.parametrize("shape", [(4, 6, 5, 7), (8, 6, 9), (40, 6)])
def test_a_batch_norm_sample_from_its_input_is_the_sample_of_its_output(
    shape: tuple[int, ...],
) -> None:
    from hookscope._monitor._probes._compiled import _batch_norm_sample

    bn = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d}[len(shape)](6).train()
    with torch.no_grad():
        bn.weight.uniform_(0.5, 2.0)
        bn.bias.uniform_(-1.0, 1.0)
    x = torch.randn(shape) * 3 + 1
    out = bn(x).detach()
    got = _batch_norm_sample(bn, out, [x], 64)
    assert got is not None
    torch.testing.assert_close(got, Sampler(64)(out), rtol=1e-5, atol=1e-5)
    assert _batch_norm_sample(bn.eval(), out, [x], 64) is None  # running statistics
