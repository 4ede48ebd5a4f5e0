"""A hooked model can be saved whole and copied: the copy carries no hookscope hook.

``torch.save(model, f)``, ``pickle.dumps(model)`` and ``copy.deepcopy(model)`` under a Monitor
(with and without ``log_dir``), ``capture``, ``intervene`` and a model holding ``hs.Tap``s, and
in a script run under ``hookscope watch``. The copy trains and is clean, the original stays
watched, and a checkpoint loads in a process that cannot import hookscope.
"""

from __future__ import annotations

import copy
import io
import pickle
import subprocess
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import hookscope as hs
from hookscope.testing import assert_no_hooks, hooks_on

TESTS = Path(__file__).parent
sys.path.insert(0, str(TESTS))
import models  # noqa: E402  (tests/models.py: plain torch, knows nothing of hookscope)


class TappedNet(nn.Module):
    """An MLP that names an intermediate value with a Tap."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.tap_pre, self.fc2 = nn.Linear(8, 16), hs.Tap(), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.tap_pre(self.fc1(x) * 2).relu())


def user_hook(module: nn.Module, args: Any, output: Any) -> None:
    """A picklable hook of the user's own: it must travel with the model."""


# -- models and what is attached to them -------------------------------------------------------


def gpt2() -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor], str]:
    model = models.gpt2().train()
    ids = models.token_ids(batch=2, length=8)
    return model, lambda m: m(ids, labels=ids).loss, "transformer.h.*"


def cnn() -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor], str]:
    model = models.ResNet(width=4, inplace=True).train()  # ReLU(inplace=True), out += identity
    x, y = models.images(batch=4, size=8), torch.tensor([0, 1, 2, 3])
    return model, lambda m: nn.functional.cross_entropy(m(x), y), "layer1.*"


def tapped() -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor], str]:
    x = torch.randn(6, 8)
    return TappedNet().train(), lambda m: m(x).square().mean(), "tap_pre"


MODELS = {"gpt2": gpt2, "cnn": cnn, "tap": tapped}


class Attached:
    """One way of attaching hookscope, and how to tell that the original is still watched."""

    def __init__(self, kind: str, model: nn.Module, where: str, log_dir: Path) -> None:
        self.kind = kind
        if kind == "monitor":
            self.obj: Any = hs.Monitor(model, every=1)
        elif kind == "monitor_log_dir":
            self.obj = hs.Monitor(model, every=1, log_dir=log_dir)
        elif kind == "capture":
            self.obj = hs.capture(model, where, what=("output", "grad_output"), keep="all")
        else:  # "intervene": counts its calls and changes nothing
            self.calls = 0

            def count(out: torch.Tensor, site: hs.Site) -> torch.Tensor:
                self.calls += 1
                return out

            self.obj = hs.intervene(model, where, count)

    def context(self) -> AbstractContextManager[Any]:
        return self.obj

    def records(self) -> int:
        """How much the attachment has seen so far."""
        if self.kind.startswith("monitor"):
            self.obj.step()
            return len([r for r in self.obj.records if r["type"] == "step" and r["act"]])
        if self.kind == "capture":
            records = [r for name in self.obj for r in self.obj.all(name)]
            return sum(r.output is not None and r.grad_output is not None for r in records)
        return self.calls


KINDS = ["monitor", "monitor_log_dir", "capture", "intervene"]


def train_one_step(model: nn.Module, loss_of: Callable[[nn.Module], torch.Tensor]) -> float:
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    opt.zero_grad()
    loss = loss_of(model)
    loss.backward()
    opt.step()
    return loss.item()


def refers_to_hookscope(data: bytes, model: nn.Module) -> bool:
    """Does the pickle name anything of hookscope's, beyond the model's own Tap modules?"""
    taps = sum(isinstance(m, hs.Tap) for m in model.modules())
    return data.count(b"hookscope") > (1 if taps else 0)  # the class, memoised once


def torch_roundtrip(model: nn.Module) -> nn.Module:
    buf = io.BytesIO()
    torch.save(model, buf)
    assert not refers_to_hookscope(buf.getvalue(), model)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def pickle_roundtrip(model: nn.Module) -> nn.Module:
    data = pickle.dumps(model)
    assert not refers_to_hookscope(data, model)
    return pickle.loads(data)


COPIES: dict[str, Callable[[nn.Module], nn.Module]] = {
    "torch.save": torch_roundtrip,
    "pickle": pickle_roundtrip,
    "deepcopy": copy.deepcopy,
}


def torch_getstate_in_place() -> bool:
    return nn.Module.__getstate__.__module__.startswith("torch.")


# -- the contract ------------------------------------------------------------------------------


@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("kind", KINDS)
def test_a_hooked_model_saves_and_copies_without_hookscope_hooks(
    model_name: str, kind: str, tmp_path: Path
) -> None:
    torch.manual_seed(0)
    model, loss_of, where = MODELS[model_name]()
    attached = Attached(kind, model, where, tmp_path / "log")
    with attached.context():
        train_one_step(model, loss_of)
        seen = attached.records()
        assert seen > 0
        for how, make_copy in COPIES.items():
            clone = make_copy(model)
            assert_no_hooks(clone)  # no hookscope hook, and (the user added none) no other
            before = [p.detach().clone() for p in clone.parameters()]
            assert torch.isfinite(torch.tensor(train_one_step(clone, loss_of))), how
            assert any(
                not torch.equal(a, b) for a, b in zip(before, clone.parameters(), strict=True)
            )
            assert hooks_on(model, only_hookscope=True), how  # the original keeps its hooks
        train_one_step(model, loss_of)
        assert attached.records() > seen  # and is still watched
    assert_no_hooks(model)
    assert torch_getstate_in_place()


@pytest.mark.parametrize("model_name", ["gpt2", "cnn"])
def test_the_users_own_hooks_travel_and_only_hookscopes_stay_behind(
    model_name: str, tmp_path: Path
) -> None:
    model, loss_of, where = MODELS[model_name]()
    first = next(m for n, m in model.named_modules() if n)
    handle = first.register_forward_hook(user_hook)
    user_only = hooks_on(model)
    with hs.Monitor(model, every=1, log_dir=tmp_path), hs.capture(model, where):
        train_one_step(model, loss_of)
        for make_copy in COPIES.values():
            clone = make_copy(model)
            assert hooks_on(clone) == user_only
            assert hooks_on(clone, only_hookscope=True) == []
            clone_first = next(m for n, m in clone.named_modules() if n)
            assert list(clone_first._forward_hooks.values()) == [user_hook]
    assert hooks_on(model) == user_only
    handle.remove()
    assert torch_getstate_in_place()


def test_getstate_is_torchs_own_for_unhooked_modules_and_after_every_exit() -> None:
    model, _, where = cnn()
    plain = nn.Linear(2, 2)
    with hs.capture(model, where):
        assert not torch_getstate_in_place()
        # a module never hooked: its state is exactly what torch gives
        assert plain.__getstate__().keys() == plain.__dict__.keys() - {"_compiled_call_impl"}
        with pytest.raises(RuntimeError, match="boom"), hs.Monitor(model):
            raise RuntimeError("boom")
        assert not torch_getstate_in_place()  # the capture still holds hooks
    assert torch_getstate_in_place()


# -- a checkpoint loads where hookscope cannot be imported -------------------------------------

LOAD_WITHOUT_HOOKSCOPE = """
import sys
sys.modules["hookscope"] = None  # any import of hookscope now raises ImportError
sys.path.insert(0, {tests!r})
import torch
model = torch.load({path!r}, weights_only=False)
hooks = [
    (name, attr)
    for name, m in model.named_modules()
    for attr in ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
    if getattr(m, attr)
]
assert hooks == [], hooks
model(torch.randn(2, 3, 8, 8)).sum().backward()
assert not any(name.startswith("hookscope") for name in sys.modules if sys.modules[name])
print("loaded", type(model).__name__)
"""


def load_in_fresh_process(path: Path) -> subprocess.CompletedProcess[str]:
    code = LOAD_WITHOUT_HOOKSCOPE.format(tests=str(TESTS), path=str(path))
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )


def test_a_checkpoint_saved_with_every_hook_attached_loads_without_hookscope(
    tmp_path: Path,
) -> None:
    model, loss_of, where = cnn()
    path = tmp_path / "model.pt"
    with (
        hs.Monitor(model, every=1, log_dir=tmp_path / "log"),
        hs.capture(model, where, what=("input", "output", "grad_input", "grad_output")),
        hs.intervene(model, where, lambda out, site: out),
    ):
        train_one_step(model, loss_of)
        torch.save(model, path)
    proc = load_in_fresh_process(path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "loaded ResNet\n"


WATCHED_SCRIPT = """
import copy, sys
sys.path.insert(0, {tests!r})
import torch, torch.nn as nn
import models

torch.manual_seed(0)
model = models.ResNet(width=4, inplace=True)
opt = torch.optim.SGD(model.parameters(), lr=1e-2)
x, y = models.images(batch=4, size=8), torch.tensor([0, 1, 2, 3])
for step in range(4):
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step == 2:  # watched by now: the Monitor attached at the first step
        assert any(m._forward_hooks for m in model.modules()), "not watched"
        torch.save(model, {path!r})
        clone = copy.deepcopy(model)
        assert not any(m._forward_hooks or m._forward_pre_hooks for m in clone.modules())
        clone(x).sum().backward()
print("saved")
"""


def test_a_script_under_watch_saves_its_whole_model(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    from hookscope._cli import main

    path = tmp_path / "model.pt"
    script = tmp_path / "train.py"
    script.write_text(WATCHED_SCRIPT.format(tests=str(TESTS), path=str(path)), encoding="utf-8")
    out_dir = tmp_path / "out"
    code = main(["watch", "--out", str(out_dir), "--every", "1", "--", sys.executable, str(script)])
    out, err = capfd.readouterr()
    assert code == 0, err
    assert out == "saved\n"
    assert (out_dir / "hookscope.jsonl").is_file()
    proc = load_in_fresh_process(path)
    assert proc.returncode == 0, proc.stderr
