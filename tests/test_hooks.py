"""HookSet, the one place hooks are registered: it removes exactly what it added, always.

On a GPT-2 (from a config) and a CNN with in-place ReLUs (the ResNet of tests/models.py):
whatever fails while a verb attaches its hooks, the model is left with the hooks it had
before (its own and other libraries'), and runs as a copy that was never hooked. Then the
registry's cost: tensor hooks are pruned in amortised O(1).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import hookscope as hs
from hookscope._hooks import HookSet
from hookscope.testing import assert_no_hooks, hooks_on
from models import gpt2, images, resnet_pair, token_ids


def _gpt2() -> tuple[nn.Module, torch.Tensor]:
    return gpt2(), token_ids()


def _cnn() -> tuple[nn.Module, torch.Tensor]:
    return resnet_pair()[0].train(), images()


MODELS = [pytest.param(_gpt2, id="gpt2"), pytest.param(_cnn, id="cnn_inplace_relu")]


def _output(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    return out if isinstance(out, torch.Tensor) else out.logits


def _refuse_registration(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    """From now on, the ``n``-th module hook registered raises, as torch does for a hook it
    cannot take: the verb attaching it fails after it attached ``n - 1`` hooks."""
    count = [0]
    for attr in ("register_forward_pre_hook", "register_forward_hook"):
        real = getattr(nn.Module, attr)

        def register(module: nn.Module, *args: Any, _real: Any = real, **kwargs: Any) -> Any:
            count[0] += 1
            if count[0] == n:
                raise RuntimeError("cannot register this hook")
            return _real(module, *args, **kwargs)

        monkeypatch.setattr(nn.Module, attr, register)


ATTACH: dict[str, Callable[[nn.Module, torch.Tensor], Any]] = {
    "capture": lambda m, x: hs.capture(m, "**", what=("input", "output", "grad_output")),
    "intervene": lambda m, x: hs.intervene(m, "**", lambda out, site: None),
    "Monitor": lambda m, x: hs.Monitor(m, every=1),
    "extract": lambda m, x: hs.extract(m, x, where="**"),
}


@pytest.mark.parametrize("verb", list(ATTACH))
@pytest.mark.parametrize("make", MODELS)
def test_a_verb_that_fails_while_attaching_leaves_only_the_hooks_that_were_there(
    make: Callable[[], tuple[nn.Module, torch.Tensor]],
    verb: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model, x = make()
    bare = copy.deepcopy(model)
    fired: list[str] = []
    model.get_submodule("").register_forward_hook(lambda *a: fired.append("fwd"))
    next(model.parameters()).register_hook(lambda g: fired.append("param") or None)
    before = hooks_on(model)
    with monkeypatch.context() as patch:
        _refuse_registration(patch, 5)
        with pytest.raises(RuntimeError, match="cannot register"):
            ATTACH[verb](model, x)
    assert hooks_on(model) == before
    assert_no_hooks(model, only_hookscope=True)
    out = _output(model, x)
    assert torch.equal(out, _output(bare, x))
    out.float().logsumexp(-1).sum().backward()
    assert fired == ["fwd", "param"]  # the model's own hooks still fire, once each


@pytest.mark.parametrize("make", MODELS)
def test_a_hookset_removes_every_kind_of_hook_it_added_when_its_body_raises(
    make: Callable[[], tuple[nn.Module, torch.Tensor]],
) -> None:
    model, x = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = hooks_on(model)
    called: list[str] = []
    with pytest.raises(KeyboardInterrupt):
        with HookSet("test") as hooks:
            for module in model.modules():
                hooks.forward_pre(module, lambda *a: called.append("pre"))
                hooks.forward(module, lambda *a: called.append("fwd"))
            for p in model.parameters():
                hooks.tensor(p, lambda g: called.append("grad") or None)
            hooks.optimizer_step_pre(opt, lambda *a: called.append("opt"))
            hooks.optimizer_step_post_global(lambda *a: called.append("opt"))
            assert len(hooks) == 2 * len(list(model.modules())) + len(list(model.parameters())) + 2
            raise KeyboardInterrupt
    assert len(hooks) == 0 and hooks_on(model) == before
    hooks.remove()  # a second removal is harmless
    _output(model, x).float().sum().backward()
    opt.step()
    assert called == []
    assert_no_hooks(model, only_hookscope=True)


# -- the registry: O(1) registration, right counts --------------------------------------------


def test_registering_many_live_tensor_hooks_costs_linear_work(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """20,000 gradient hooks alive at once (an LSTMCell unrolled over thousands of steps):
    the registry checks each handle a bounded number of times, not once per registration."""
    from hookscope._hooks import _set as _hooks

    checks = [0]
    alive = _hooks._alive

    def counted(handle: Any) -> bool:
        checks[0] += 1
        return alive(handle)

    monkeypatch.setattr(_hooks, "_alive", counted)
    outputs = [torch.ones(1, requires_grad=True) * 1 for _ in range(20_000)]
    with _hooks.HookSet("test") as hooks:
        for t in outputs:
            hooks.tensor(t, lambda g: None)
        assert checks[0] <= 2 * len(outputs)  # pruned at 4,096, 8,192 and 16,384 hooks
        assert len(hooks) == len(outputs)
        del t
        outputs.clear()  # the outputs die, their hooks with them
        assert len(hooks) == 0
        keep = torch.ones(1, requires_grad=True) * 1
        hooks.tensor(keep, lambda g: None)
        assert len(hooks) == 1 and len(keep._backward_hooks) == 1
    assert len(hooks) == 0 and len(keep._backward_hooks) == 0


def test_dead_tensor_hooks_are_dropped_at_the_next_prune(monkeypatch: pytest.MonkeyPatch) -> None:
    from hookscope._hooks import _set as _hooks

    monkeypatch.setattr(_hooks, "_PRUNE_AT", 8)
    with _hooks.HookSet("test") as hooks:
        outputs = [torch.ones(1, requires_grad=True) * 1 for _ in range(40)]
        for t in outputs:
            hooks.tensor(t, lambda g: None)
        del t
        # 40 live hooks: pruned at 8, 16 and 32 (three passes, not one per registration)
        assert len(hooks._tensor_handles) == 40 and hooks._prune_at == 64
        outputs.clear()
        for _ in range(24):  # temporaries, dead at once after their registration
            hooks.tensor(torch.ones(1, requires_grad=True) * 1, lambda g: None)
        # the 64th registration pruned all but its own (alive while it registers)
        assert len(hooks._tensor_handles) == 1 and hooks._prune_at == 8
        assert len(hooks) == 0


def test_a_switched_group_comes_back_in_its_place_among_other_hooks() -> None:
    """Hooks of a group taken off and put back run where they ran, between the user's
    hooks registered before and after them, over many switches; a hook the user adds while
    the group is off runs after all of those."""
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    ran: list[str] = []

    def hook(tag: str) -> Callable[..., None]:
        return lambda *args: ran.append(tag)

    users = [m.register_forward_hook(hook(f"user before {i}")) for i, m in enumerate(model)]
    hooks = HookSet(model)
    with hooks.grouped("g"):
        for i, m in enumerate(model):
            hooks.forward(m, hook(f"ours {i}"))
    users += [m.register_forward_hook(hook(f"user after {i}")) for i, m in enumerate(model)]
    want = [f"{who} {i}" for i in range(3) for who in ("user before", "ours", "user after")]
    x = torch.randn(2, 4)
    for _ in range(3):
        hooks.switch("g", False)
        ran.clear()
        model(x)
        assert ran == [t for t in want if not t.startswith("ours")]
        hooks.switch("g", True)
        ran.clear()
        model(x)
        assert ran == want
    hooks.switch("g", False)
    users.append(model[1].register_forward_hook(hook("user late 1")))
    hooks.switch("g", True)
    ran.clear()
    model(x)
    assert ran == [*want[:6], "user late 1", *want[6:]]
    hooks.remove()
    for handle in users:
        handle.remove()
    assert_no_hooks(model)
