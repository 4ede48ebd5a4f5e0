"""hookscope._compat on the running torch release: every version-bound call answers as torch
itself would, and a feature older torch cannot run is refused with a message that says so.

ci/torch-matrix.sh runs this file on every release of the matrix."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hookscope as hs
from hookscope import _compat
from hookscope._compat import (
    EAGER_FLOOR,
    MONITOR_FLOOR,
    TORCH,
    autocast_dtype,
    custom_op,
    force_eager,
    is_compiling,
    release,
    require,
    skip_frame,
)


def _no_hooks(model: nn.Module) -> bool:
    return not any(
        m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
        for m in model.modules()
    )


@pytest.mark.parametrize(
    ("version", "want"),
    [
        ("2.9.1+cu128", (2, 9)),
        ("2.13.0+cpu", (2, 13)),
        ("2.10.0a0+git1234", (2, 10)),
        ("2.4", (2, 4)),
    ],
)
def test_release_reads_major_and_minor(version: str, want: tuple[int, int]) -> None:
    assert release(version) == want


def test_the_running_torch_is_at_least_the_eager_floor() -> None:
    assert release(torch.__version__) == TORCH >= EAGER_FLOOR
    require("hs.capture")  # the eager verbs' floor: passes on every release CI runs


def test_a_feature_newer_than_this_torch_is_refused_naming_both_versions_and_the_way_out() -> None:
    newer = (TORCH[0], TORCH[1] + 1)
    with pytest.raises(hs.HookscopeError) as err:
        require("hs.Thing", newer)
    msg = str(err.value)
    assert f"hs.Thing needs torch>={newer[0]}.{newer[1]} (this is {torch.__version__})" in msg
    assert "upgrade torch" in msg and "capture/intervene" in msg
    require("hs.Thing", TORCH)  # its own release is enough


def test_the_monitor_is_built_exactly_where_torch_is_at_least_its_floor() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    if TORCH >= MONITOR_FLOOR:
        with hs.Monitor(model, every=1) as mon:
            model(torch.randn(2, 4)).sum().backward()
            mon.step()
        assert sorted(mon.records[-1]["act"]) == ["0", "1", "2"]
    else:
        with pytest.raises(hs.HookscopeError, match=r"hs\.Monitor needs torch>=2\.7"):
            hs.Monitor(model)
    assert _no_hooks(model)


def test_an_older_torch_gets_the_monitor_refused_and_the_model_left_as_it_was(monkeypatch) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    monkeypatch.setattr(_compat, "TORCH", (2, 6))
    with pytest.raises(hs.HookscopeError) as err:
        hs.Monitor(model)
    assert str(err.value) == (
        f"hs.Monitor needs torch>=2.7 (this is {torch.__version__}): upgrade torch, or use "
        "capture/intervene/extract, which work on 2.4+."
    )
    assert _no_hooks(model)
    with hs.capture(model, "0") as cap:  # the eager verbs still run there
        model(torch.randn(2, 4))
    assert cap["0"].output.shape == (2, 4)


def _which() -> torch.Tensor:
    return torch.ones(1) if is_compiling() else torch.zeros(1)


def test_is_compiling_is_false_eagerly_and_true_inside_a_full_graph() -> None:
    assert not is_compiling()
    assert _which().item() == 0
    assert torch.compile(_which, fullgraph=True, backend="eager")().item() == 1


def test_a_skipped_frame_runs_eagerly_under_torch_compile() -> None:
    def compiled() -> torch.Tensor:
        return _which()

    def skipped() -> torch.Tensor:
        return torch.ones(1) if is_compiling() else torch.zeros(1)

    skip_frame(skipped.__code__)
    assert torch.compile(compiled, backend="eager")().item() == 1  # the control: traced
    assert torch.compile(skipped, backend="eager")().item() == 0


@pytest.mark.requires_torch("2.6", reason="torch.compiler.set_stance is new in 2.6")
def test_force_eager_runs_compiled_code_eagerly() -> None:
    fn = torch.compile(_which, backend="eager")
    assert fn().item() == 1
    with force_eager():
        assert fn().item() == 0
    assert fn().item() == 1


@custom_op("hookscope_test::scaled", mutates_args=())
def _scaled(x: torch.Tensor, k: int | None, twice: bool) -> torch.Tensor:
    return x * (k or 1) * (2 if twice else 1)


def test_a_custom_op_with_string_annotations_is_defined_and_runs() -> None:
    x = torch.arange(3.0)
    assert torch.equal(_scaled(x, 3, True), x * 6)
    assert torch.equal(torch.ops.hookscope_test.scaled(x, None, False), x)
    schema = str(torch.ops.hookscope_test.scaled.default._schema)
    assert "Tensor x" in schema and "bool twice" in schema and "?" in schema


def test_autocast_dtype_follows_torch_autocast_on_the_cpu() -> None:
    assert autocast_dtype("cpu") is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert autocast_dtype("cpu") is torch.bfloat16
    assert autocast_dtype("cpu") is None
