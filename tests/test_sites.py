"""The sites' shared rules: which call a hook fires for, copies that keep a gradient's path.

``CallClock`` numbers the calls of each module within a forward pass and maps the re-runs of
activation checkpointing back to the call they repeat; ``alias_grad_inputs`` and
``same_layout_copy`` give a hook the gradient through one module, also when the module
changes its input in place; ``forward_failed`` tells an ``always_call`` hook that the
forward raised. Checked on a GPT-2 from a config and on the ResNet of tests/models.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import hookscope as hs
from hookscope._hooks import (
    CallClock,
    HookSet,
    alias_grad_inputs,
    forward_failed,
    in_backward_recompute,
    same_layout_copy,
)
from models import Twice, gpt2, images, resnet_pair, token_ids


def test_checkpoint_re_runs_map_to_the_call_they_repeat_on_gpt2() -> None:
    model = gpt2(n_layer=3)
    model.activation_checkpointing_enable({"use_reentrant": False})
    for m in model.modules():
        m.train()
        if isinstance(m, nn.Dropout):
            m.p = 0.0  # HF checkpoints only in training mode; no randomness wanted
    ids = token_ids()
    seen: list[tuple] = []
    with HookSet("test") as hooks:
        clock = CallClock(hooks, model)
        for i, block in enumerate(model.transformer.h):
            name = f"transformer.h.{i}.ln_1"  # the first module of each checkpoint segment

            def pre(module: nn.Module, args: Any, kwargs: Any, name: str = name) -> None:
                if in_backward_recompute():
                    seen.append(("re-run", name, clock.original(name, args)))
                else:
                    seen.append(("call", name, (clock.pass_, clock.next(name, args))))

            hooks.forward_pre(block.ln_1, pre)
        for _ in range(2):
            model(ids, labels=ids, use_cache=False).loss.backward()
    names = [f"transformer.h.{i}.ln_1" for i in range(3)]
    for p in (1, 2):  # per pass: the calls in order, then the re-runs, last segment first
        assert seen[6 * (p - 1) : 6 * p] == [
            *(("call", n, (p, 0)) for n in names),
            *(("re-run", n, (p, 0)) for n in reversed(names)),
        ]


def test_a_copied_input_carries_the_gradient_through_an_in_place_relu() -> None:
    model, plain = resnet_pair()
    model.train(), plain.train()
    x = images()
    grads: list[torch.Tensor] = []

    def pre(module: nn.Module, args: tuple) -> tuple:
        args, hooked = alias_grad_inputs(args, module)
        assert list(hooked) == [0] and hooked[0] is args[0]
        args[0].register_hook(grads.append)
        return args

    model.relu.register_forward_pre_hook(pre)  # ReLU(inplace=True) after bn1
    model(x).logsumexp(-1).sum().backward()
    kept: list[torch.Tensor] = []
    plain.bn1.register_forward_hook(lambda m, a, out: kept.append(out))
    loss = plain(x).logsumexp(-1).sum()
    (want,) = torch.autograd.grad(loss, kept[0])
    assert len(grads) == 1  # the hook survived the in-place op
    torch.testing.assert_close(grads[0], want, rtol=1e-5, atol=1e-7)
    with torch.no_grad():
        args = (x,)
        assert alias_grad_inputs(args, model.relu) == (args, {})  # nothing to copy


def test_an_always_call_hook_knows_the_forward_raised() -> None:
    model = gpt2()
    failed: list[bool] = []
    with HookSet("test") as hooks:
        hooks.forward(
            model.transformer.wte,
            lambda m, a, k, out: failed.append(forward_failed(out)),
            always_call=True,
        )
        with pytest.raises(IndexError):
            model(torch.full((2, 8), 1000))  # out of the vocabulary: the embedding raises
        model(token_ids())
    assert failed == [True, False]


def test_copy_for_the_gradient_keeps_strides_offset_and_survives_in_place_ops() -> None:
    base = torch.randn(6, 8, requires_grad=True)
    for view in (base.t()[1:], base[:, 3:5], base[2:, :1].expand(4, 5), base[1:]):
        copy = same_layout_copy(view)
        assert copy.shape == view.shape and torch.equal(copy, view)
        assert (copy.stride(), copy.storage_offset()) == (view.stride(), view.storage_offset())
        assert copy._base is None and copy.untyped_storage().data_ptr() != base.data_ptr()
    seen = []
    copy = same_layout_copy(base[:, 2:6])
    copy.register_hook(seen.append)
    torch.relu_(copy).sum().backward()  # a view would refuse the in-place op or drop the hook
    relu_grad = (base[:, 2:6] > 0).float()  # the gradient of the value before the ReLU
    assert torch.equal(seen[0], relu_grad) and torch.equal(base.grad[:, 2:6], relu_grad)


def test_site_tells_name_call_and_index() -> None:
    seen = []
    model = Twice()
    with hs.intervene(model, "fc", lambda out, site: seen.append((site.name, site.call))):
        model(torch.ones(1, 2))
        model(torch.ones(1, 2))
    assert seen == [("fc", 0), ("fc", 1), ("fc", 0), ("fc", 1)]
    seen.clear()
    with hs.intervene(
        model, "fc", lambda g, site: seen.append((site.call, site.index)), at="grad_output"
    ):
        model(torch.ones(1, 2)).sum().backward()
    assert sorted(seen) == [(0, 0), (1, 0)]
