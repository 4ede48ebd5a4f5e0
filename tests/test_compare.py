"""hs.compare and `hookscope diff`: the first module and step where two real runs part."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

import hookscope as hs
from hookscope._cli import main

STEPS = 8


class Net(nn.Module):
    """Linear-Tanh-Linear-Act-Linear; ``act`` can switch its op, as a code change would."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 16)
        self.tanh = nn.Tanh()
        self.mid = nn.Linear(16, 16)
        self.act = Switch()
        self.out = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.act(self.mid(self.tanh(self.inp(x)))))


class Switch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gelu = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.gelu(x) if self.gelu else torch.relu(x)


def train(
    log_dir: Path,
    change: Callable[[Net, int], None] | None = None,
    *,
    autocast: torch.dtype | None = None,
    compiled: bool = False,
    **monitor: object,
) -> Path:
    """The same seeded run each time; ``change(model, step)`` runs before each step's forward.
    ``autocast``: the forward under CPU autocast to that dtype; ``compiled``: the forward
    through ``torch.compile(backend="aot_eager")``, the Monitor attached before compiling."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.randn(STEPS, 8, 6, generator=torch.Generator().manual_seed(1))
    target = torch.randint(0, 3, (STEPS, 8), generator=torch.Generator().manual_seed(2))
    if compiled:
        torch._dynamo.reset()  # Net's code compiled by an earlier test is not this model's graph
    with hs.Monitor(model, every=1, log_dir=log_dir, **monitor) as mon:  # type: ignore[arg-type]
        forward = torch.compile(model, backend="aot_eager") if compiled else model
        for step in range(STEPS):
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
    (tmp_path / "hookscope.jsonl").write_text(
        '{"type": "header", "model": "M", "modules": {}, "params": {}}\n'
    )
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
    assert main(["diff", str(base), str(tmp_path / "missing")]) == 1
    assert "no hookscope log at" in capsys.readouterr().err


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
