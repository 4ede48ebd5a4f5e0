"""hs.compare and `hookscope diff`: the first module and step where two real runs part."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import hookscope as hs
from hookscope._cli import main

STEPS = 8


class Net(nn.Module):
    """Linear-Tanh-Linear-Act-Linear; ``act`` can switch its op, as a code change would;
    with ``branch`` set, ``extra`` runs after it (a code path that runs in one run only)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 16)
        self.tanh = nn.Tanh()
        self.mid = nn.Linear(16, 16)
        self.act = Switch()
        self.extra = nn.Hardtanh(-1e3, 1e3)  # the identity on these values
        self.branch = False
        self.out = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.mid(self.tanh(self.inp(x))))
        return self.out(self.extra(h) if self.branch else h)


class Switch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gelu = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.gelu(x) if self.gelu else torch.relu(x)


def train(
    log_dir: Path,
    change: Callable[[Any, int], None] | None = None,
    *,
    autocast: torch.dtype | None = None,
    compiled: bool = False,
    steps: int = STEPS,
    model: nn.Module | None = None,
    **monitor: object,
) -> Path:
    """The same seeded run each time; ``change(model, step)`` runs before each step's forward.
    ``autocast``: the forward under CPU autocast to that dtype; ``compiled``: the forward
    through ``torch.compile(backend="aot_eager")``, the Monitor attached before compiling;
    ``steps``: how many of the STEPS batches it trains on; ``model``: another model than Net
    (taking 6 features, giving 3 logits)."""
    torch.manual_seed(0)
    model = Net() if model is None else model
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.randn(STEPS, 8, 6, generator=torch.Generator().manual_seed(1))
    target = torch.randint(0, 3, (STEPS, 8), generator=torch.Generator().manual_seed(2))
    if compiled:
        torch._dynamo.reset()  # Net's code compiled by an earlier test is not this model's graph
    with hs.Monitor(model, every=1, log_dir=log_dir, **monitor) as mon:  # type: ignore[arg-type]
        forward = torch.compile(model, backend="aot_eager") if compiled else model
        for step in range(steps):
            if change is not None:
                change(model, step)
            region = torch.autocast("cpu", dtype=autocast) if autocast else contextlib.nullcontext()
            with region:
                out = forward(data[step])
            loss = nn.functional.cross_entropy(out.float(), target[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
            mon.step(loss=loss)
    return log_dir


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train(tmp_path_factory.mktemp("base"))


def perturb_mid_at(k: int) -> Callable[[Net, int], None]:
    def change(model: Net, step: int) -> None:
        if step == k:
            with torch.no_grad():
                model.mid.weight[0, 0] += 0.5

    return change


def gelu_from(k: int) -> Callable[[Net, int], None]:
    def change(model: Net, step: int) -> None:
        model.act.gelu = step >= k

    return change


def test_identical_runs_compare_equal(base: Path, tmp_path: Path) -> None:
    assert hs.compare(base, train(tmp_path / "again")) is None
    assert hs.compare(base, base, rtol=0, atol=0) is None


@pytest.mark.parametrize("k", [0, 5])
def test_a_weight_perturbed_at_step_k_parts_the_runs_at_that_module_and_step(
    base: Path, tmp_path: Path, k: int
) -> None:
    found = hs.compare(base, train(tmp_path / "perturbed", perturb_mid_at(k)))
    assert found is not None
    assert (found.module, found.step) == ("mid", k)
    assert found.stat.startswith("act.") and found.a != found.b
    # Reversed, the same place, with the values swapped.
    back = hs.compare(tmp_path / "perturbed", base)
    assert back is not None and (back.module, back.step, back.stat) == ("mid", k, found.stat)
    assert (back.a, back.b) == (found.b, found.a)


def test_a_changed_op_parts_the_runs_at_the_module_that_runs_it(base: Path, tmp_path: Path) -> None:
    found = hs.compare(base, train(tmp_path / "gelu", gelu_from(3)))
    assert found is not None and (found.module, found.step) == ("act", 3)
    assert "step 3" in str(found) and "'act'" in str(found)


def test_a_difference_under_the_tolerance_is_not_a_divergence(base: Path, tmp_path: Path) -> None:
    def tiny(model: Net, step: int) -> None:
        if step == 2:
            with torch.no_grad():
                model.mid.weight.mul_(1 + 1e-7)

    other = train(tmp_path / "tiny", tiny)
    assert hs.compare(base, other, rtol=1e-3) is None
    strict = hs.compare(base, other, rtol=0, atol=0)
    assert strict is not None and strict.step == 2 and strict.module == "mid"


def test_runs_without_a_common_sampled_step_are_an_error(base: Path, tmp_path: Path) -> None:
    header = (base / "hookscope.jsonl").read_text().splitlines()[0]  # the same model, no step
    (tmp_path / "hookscope.jsonl").write_text(header + "\n")
    with pytest.raises(hs.HookscopeError, match="share no step"):
        hs.compare(base, tmp_path)


def test_diff_command_prints_the_divergence_and_exits_1(
    base: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other = train(tmp_path / "perturbed", perturb_mid_at(4))
    assert main(["diff", str(base), str(other)]) == 1
    out = capsys.readouterr().out
    assert "step 4" in out and "module 'mid'" in out and "act." in out
    assert main(["diff", str(base), str(base), "--rtol", "0"]) == 0
    assert "the runs agree" in capsys.readouterr().out
    assert main(["diff", str(base), str(tmp_path / "missing")]) == 2  # cannot compare
    assert "no hookscope log at" in capsys.readouterr().err


def test_runs_of_different_models_are_an_error_naming_what_differs(
    base: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Not "act.numel is 512 in the first run and absent in the second": the parameters
    that only one model has, and the shapes that differ."""
    mlp = train(
        tmp_path / "mlp", model=nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    )
    with pytest.raises(hs.HookscopeError, match="runs of different models") as err:
        hs.compare(base, mlp)
    text = str(err.value)
    assert "Net and Sequential" in text
    assert "parameters only in the first run: 'inp.weight', 'inp.bias', 'mid.weight'" in text
    assert "and 2 more" in text and "only in the second run: '0.weight'" in text
    assert "hs.report([a, b])" in text
    wider = Net()
    wider.mid = nn.Linear(16, 16, bias=False)  # one parameter fewer, the rest alike
    wider.out = nn.Linear(16, 3)
    with pytest.raises(hs.HookscopeError, match="parameters only in the first run: 'mid.bias'"):
        hs.compare(base, train(tmp_path / "nobias", model=wider))
    wide = Net()
    wide.mid, wide.out = nn.Linear(16, 32), nn.Linear(32, 3)
    with pytest.raises(hs.HookscopeError) as err:
        hs.compare(base, train(tmp_path / "wide", model=wide))
    assert "parameters of other shapes: mid.weight [16, 16] against [32, 16]" in str(err.value)
    # The command: diff(1)'s "trouble" status, 2, with the reason on stderr and no traceback.
    assert main(["diff", str(base), str(mlp)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("Error: ")
    assert "runs of different models" in captured.err and "Traceback" not in captured.err


def test_a_module_that_runs_in_one_run_only_is_named_as_such(base: Path, tmp_path: Path) -> None:
    def branch_from(model: Net, step: int) -> None:
        model.branch = step >= 2

    found = hs.compare(base, train(tmp_path / "branch", branch_from))
    assert found is not None and (found.module, found.step) == ("extra", 2)
    assert (found.a, found.b) == (None, 8 * 16)  # its output's numel, in the second run
    assert "module 'extra' ran (in training mode) in the second run only" in str(found)


def test_the_same_model_watched_in_other_parts_agrees(base: Path, tmp_path: Path) -> None:
    """Modules one run did not watch have no statistics: that is not a difference."""
    part = train(tmp_path / "part", where=["inp", "mid"])
    assert hs.compare(base, part) is None
    assert hs.compare(part, base) is None


def test_a_shorter_run_parts_where_it_ended(
    base: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A 4-step run does not "agree" with an 8-step run of the same loop, although the four
    steps both logged are equal: they part at step 4, where the shorter one ended."""
    short = train(tmp_path / "short", steps=4)
    found = hs.compare(base, short)
    assert found is not None
    assert (found.module, found.step, found.stat, found.a, found.b) == ("", 4, "steps", 8, 4)
    assert str(found) == (
        "the runs part at step 4: the second run ended at step 3 (8 steps logged in the first "
        "run, 4 in the second); the 4 steps before it agree"
    )
    back = hs.compare(short, base)
    assert back is not None and (back.step, back.a, back.b) == (4, 4, 8)
    assert "the first run ended at step 3" in str(back)
    # A difference before the shorter run ended comes first.
    early = hs.compare(base, train(tmp_path / "early", perturb_mid_at(1), steps=4))
    assert early is not None and (early.module, early.step) == ("mid", 1)
    assert main(["diff", str(base), str(short)]) == 1
    assert "the second run ended at step 3" in capsys.readouterr().out


@pytest.mark.parametrize("bad", [-1, -1e-9, math.nan, math.inf, "0.1", True])
def test_a_negative_or_non_numeric_tolerance_is_refused(base: Path, bad: object) -> None:
    with pytest.raises(ValueError, match="rtol must be a finite number >= 0"):
        hs.compare(base, base, rtol=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="atol must be a finite number >= 0"):
        hs.compare(base, base, atol=bad)  # type: ignore[arg-type]


def test_diff_refuses_a_negative_tolerance_as_a_usage_error(
    base: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for option, value in (("--rtol", "-1"), ("--atol", "-0.5"), ("--rtol", "nan")):
        with pytest.raises(SystemExit) as exit_:
            main(["diff", str(base), str(base), option, value])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert f"argument {option}: expected a finite number >= 0" in err and value in err
    assert main(["diff", str(base), str(base), "--rtol", "0", "--atol", "0"]) == 0


def test_float32_and_bfloat16_autocast_part_at_the_first_layer_autocast_runs_lower(
    base: Path, tmp_path: Path
) -> None:
    bf16 = train(tmp_path / "bf16", autocast=torch.bfloat16)
    found = hs.compare(base, bf16)
    # The first Linear's matmul runs in bfloat16 (8 bits of mantissa): its output differs
    # beyond 1e-3 at once, before anything downstream could inherit a difference.
    assert found is not None and (found.module, found.step) == ("inp", 0)
    assert found.stat.startswith("act.")
    # A tolerance at bfloat16's own precision (2**-8 ~ 4e-3) lets the first steps agree;
    # the rounding accumulates over the updates until the runs part later.
    loose = hs.compare(base, bf16, rtol=1e-2)
    assert loose is not None and loose.step > found.step
    assert hs.compare(base, bf16, rtol=0.2) is None


@pytest.fixture(scope="module")
def eager_exact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train(tmp_path_factory.mktemp("eager"), sample=None)


# Dynamo hides an internal ".grad of a non-leaf" warning by swapping warnings.showwarning,
# which an "error" filter (ours, in pyproject) bypasses: torch's quirk, not ours.
dynamo_quirk = pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor:UserWarning")


@dynamo_quirk
def test_eager_and_compiled_runs_agree(eager_exact: Path, tmp_path: Path) -> None:
    compiled = train(tmp_path / "compiled", compiled=True, sample=None)
    assert hs.compare(eager_exact, compiled) is None
    assert hs.compare(compiled, eager_exact) is None


@dynamo_quirk
def test_a_compiled_run_perturbed_at_step_k_parts_from_eager_there(
    eager_exact: Path, tmp_path: Path
) -> None:
    perturbed = train(tmp_path / "compiled", perturb_mid_at(3), compiled=True, sample=None)
    found = hs.compare(eager_exact, perturbed)
    assert found is not None and (found.module, found.step) == ("mid", 3)
    assert found.stat.startswith("act.")
