"""The Monitor finds the optimizers that step its model, and reads this step's gradients.

Oracles: gradient norms read by hand just before ``optimizer.step()``, and the real change
of the weights around it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.optim import optimizer as torch_optimizer

import hookscope as hs
from hookscope.testing import assert_no_hooks, internals


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def run(model, opt, steps=3, *, closure=False, **mon_kwargs):
    """Train with a Monitor attached *without* telling it the optimizer; return the Monitor
    and, per step, the true gradient norm of ``0.weight`` and its true update ratio."""
    x, y = torch.randn(32, 8), torch.randn(32, 4)
    truth = []
    with hs.Monitor(model, every=1, **mon_kwargs) as mon:
        for _ in range(steps):
            opt.zero_grad()
            w = model[0].weight
            if closure:

                def loss_fn():
                    opt.zero_grad()
                    loss = nn.functional.mse_loss(model(x), y)
                    loss.backward()
                    return loss

                before = w.detach().clone()
                grad = torch.autograd.grad(nn.functional.mse_loss(model(x), y), w)[0]
                opt.step(loss_fn)
            else:
                nn.functional.mse_loss(model(x), y).backward()
                grad, before = w.grad.clone(), w.detach().clone()
                opt.step()
            ratio = ((w.detach() - before).norm() / before.norm()).item()
            truth.append((grad.norm().item(), ratio))
            mon.step()
    assert_no_hooks(model)
    return mon, truth


def logged(mon, stat, name="0.weight"):
    return [r["param"][name].get(stat) for r in mon.records if r["type"] == "step"]


@pytest.mark.parametrize(
    "make",
    [
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
        lambda p: torch.optim.Adam(p, lr=1e-2),
        lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=False),
    ],
    ids=["sgd-momentum", "adam", "adamw-for-loop"],
)
def test_optimizer_created_after_the_monitor_is_found(make) -> None:
    model = mlp()
    mon_kwargs = {"sample": None}
    x, y = torch.randn(32, 8), torch.randn(32, 4)
    with hs.Monitor(model, every=1, **mon_kwargs) as mon:
        opt = make(model.parameters())  # created after the Monitor
        truth = []
        for _ in range(3):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            w = model[0].weight
            grad, before = w.grad.clone(), w.detach().clone()
            opt.step()
            truth.append((grad.norm().item(), ((w - before).norm() / before.norm()).item()))
            mon.step()
    assert logged(mon, "grad_norm") == pytest.approx([g for g, _ in truth], rel=1e-5)
    assert logged(mon, "update_ratio") == pytest.approx([r for _, r in truth], rel=1e-4)
    assert mon.records[1]["scalars"]["lr"] == opt.param_groups[0]["lr"]


def test_lbfgs_closure_logs_the_gradients_of_this_step_not_the_previous_one() -> None:
    model = mlp()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)
    mon, truth = run(model, opt, steps=3, closure=True, sample=None)
    assert logged(mon, "grad_norm") == pytest.approx([g for g, _ in truth], rel=1e-5)
    assert logged(mon, "update_ratio") == pytest.approx([r for _, r in truth], rel=1e-4)


def test_closure_passed_by_keyword_like_lightning() -> None:
    """Lightning calls ``optimizer.step(closure=closure)`` with forward+backward inside."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(32, 8), torch.randn(32, 4)
    truth = []
    with hs.Monitor(model, every=1) as mon:
        for _ in range(3):

            def closure():
                opt.zero_grad()
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
                truth.append(model[0].weight.grad.norm().item())
                return loss

            opt.step(closure=closure)
            mon.step()
    assert logged(mon, "grad_norm") == pytest.approx(truth, rel=1e-5)
    assert all(r["act"]["0"]["numel"] == 32 * 16 for r in mon.records if r["type"] == "step")


def test_two_optimizers_on_one_model_are_both_adopted() -> None:
    model = mlp()
    first = torch.optim.SGD(model[0].parameters(), lr=0.1)
    second = torch.optim.Adam(model[2].parameters(), lr=1e-3)
    with hs.Monitor(model, every=1) as mon:
        nn.functional.mse_loss(model(torch.randn(4, 8)), torch.randn(4, 4)).backward()
        first.step()
        second.step()
        mon.step()
    param = mon.records[1]["param"]
    assert {"grad_norm", "norm", "update_ratio"} <= set(param["0.weight"])
    assert {"grad_norm", "norm", "update_ratio"} <= set(param["2.weight"])
    assert set(mon.records[1]["scalars"]) == {"loss", "lr/0.0", "lr/1.0"}  # loss: found


def test_a_gans_other_optimizer_is_ignored() -> None:
    generator, discriminator = mlp(), nn.Sequential(nn.Linear(4, 1))
    g_opt = torch.optim.Adam(generator.parameters(), lr=1e-3)
    d_opt = torch.optim.SGD(discriminator.parameters(), lr=0.5)
    g_losses = []
    with hs.Monitor(generator, every=1) as mon:
        for _ in range(2):
            fake = generator(torch.randn(8, 8))
            d_opt.zero_grad()
            discriminator(fake.detach()).mean().backward()
            d_opt.step()
            g_opt.zero_grad()
            g_loss = -discriminator(fake).mean()
            g_loss.backward()
            g_losses.append(g_loss.item())
            g_opt.step()
            mon.step()
    assert internals(mon).optimizers == [g_opt]
    # The generator's loss is found; the discriminator's (on detached fakes) is not its own.
    assert set(mon.records[1]["scalars"]) == {"loss", "lr"}
    steps = [r for r in mon.records if r["type"] == "step"]
    assert [r["scalars"]["loss"] for r in steps] == pytest.approx(g_losses)
    assert mon.records[1]["scalars"]["lr"] == 1e-3
    assert not [r for r in mon.records if r["type"] == "event"]


def test_accelerate_wrapped_optimizer() -> None:
    import accelerate

    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    accelerator = accelerate.Accelerator(cpu=True)
    model, opt = accelerator.prepare(model, opt)
    assert type(opt).__name__ == "AcceleratedOptimizer"
    with hs.Monitor(model, every=1, optimizer=opt) as mon:  # passing the wrapper is fine too
        loss = nn.functional.mse_loss(model(torch.randn(4, 8)), torch.randn(4, 4))
        accelerator.backward(loss)
        expected = model[0].weight.grad.norm().item()
        opt.step()
        mon.step()
    assert mon.records[1]["param"]["0.weight"]["grad_norm"] == pytest.approx(expected, rel=1e-6)
    assert "update_ratio" in mon.records[1]["param"]["0.weight"]


def test_without_any_optimizer_gradient_and_weight_norms_are_still_logged() -> None:
    model = mlp()
    with hs.Monitor(model, every=1) as mon:
        model(torch.randn(4, 8)).sum().backward()
        mon.step()
    stats = mon.records[1]["param"]["0.weight"]
    assert stats["grad_norm"] == pytest.approx(model[0].weight.grad.norm().item(), rel=1e-6)
    assert stats["norm"] == pytest.approx(model[0].weight.norm().item(), rel=1e-6)
    assert "update_ratio" not in stats


def test_update_ratio_from_a_sample_is_close_to_the_exact_one_without_copying_weights() -> None:
    model = nn.Sequential(nn.Linear(512, 512))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with hs.Monitor(model, every=1, sample=1024) as mon:
        for _ in range(3):
            model(torch.randn(16, 512)).pow(2).mean().backward()
            before = model[0].weight.detach().clone()
            opt.step()
            opt.zero_grad()
            exact = ((model[0].weight - before).norm() / before.norm()).item()
            mon.step()
            assert internals(mon).update_samples == {}  # the sampled copy is dropped after the step
            got = mon.records[-1]["param"]["0.weight"]["update_ratio"]
            assert got == pytest.approx(exact, rel=0.1)


def test_close_restores_the_global_optimizer_hook_dicts() -> None:
    pre = dict(torch_optimizer._global_optimizer_pre_hooks)
    post = dict(torch_optimizer._global_optimizer_post_hooks)
    model = mlp()
    mon = hs.Monitor(model)
    # the optimizer watch and the checks that judge each update (not_updated, stale_gradients)
    assert len(torch_optimizer._global_optimizer_pre_hooks) > len(pre)
    with pytest.raises(AssertionError, match="_global_optimizer_pre_hooks"):
        assert_no_hooks(model, only_hookscope=True)
    mon.close()
    assert dict(torch_optimizer._global_optimizer_pre_hooks) == pre
    assert dict(torch_optimizer._global_optimizer_post_hooks) == post
    assert_no_hooks(model)


def test_not_an_optimizer_is_refused_with_the_fix() -> None:
    model = mlp()
    with pytest.raises(TypeError, match="pass nothing"):
        hs.Monitor(model, optimizer=object())
    assert_no_hooks(model)


@pytest.mark.parametrize("pass_optimizer", [False, True])
def test_read_gradients_before_clipping_logs_the_unclipped_gradients(pass_optimizer):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(32, 8), torch.randn(32, 4) * 100
    with hs.Monitor(model, every=1) as mon:
        for _ in range(3):
            nn.functional.mse_loss(model(x), y).backward()
            mon.read_gradients(opt if pass_optimizer else None)
            total = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1).item()
            opt.step()
            opt.zero_grad()
            mon.step()
            norms = [s["grad_norm"] for s in mon.records[-1]["param"].values()]
            assert total > 1  # clipping changed the gradients a lot
            assert sum(n**2 for n in norms) ** 0.5 == pytest.approx(total, rel=1e-5)
    assert_no_hooks(model)


def test_step_returns_a_finding_made_before_the_update():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with hs.Monitor(model, every=None) as mon:
        model(torch.full((4, 8), float("nan"))).sum().backward()
        opt.step()  # the non-finite check runs here, before the update
        # the NaN found before the update; then, since "log" lets the update go ahead, that
        # this update made the weights non-finite (said once: nothing new at the next step)
        found = [(f.kind, f.phase) for f in mon.step()]
        assert found == [("nonfinite", "forward"), ("nonfinite", "update")]
        opt.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        assert mon.step() == []


class ClippingAdamW(torch.optim.AdamW):
    """A research-code optimizer: clip, then AdamW's own step through ``super().step()``.
    Once any plain AdamW exists in the process, both step methods carry torch's hook
    wrapper, so the global hooks fire twice for one update."""

    def step(self, closure=None):
        for group in self.param_groups:
            torch.nn.utils.clip_grad_norm_(group["params"], 1.0)
        return super().step(closure)


def test_a_subclass_step_calling_super_is_one_update() -> None:
    torch.optim.AdamW(mlp().parameters())  # wraps AdamW.step itself, as any script's would
    assert getattr(torch.optim.AdamW.step, "hooked", False)
    torch.manual_seed(0)
    model = mlp()
    opt = ClippingAdamW(model.parameters(), lr=1e-2)
    assert getattr(ClippingAdamW.step, "hooked", False)
    x = torch.randn(8, 8)
    with hs.Monitor(model, every=1, on_nonfinite="skip") as mon:
        model(x).pow(2).sum().backward()
        opt.step()
        mon.step()
        opt.zero_grad()
        model(x.masked_fill(x > 1.5, float("nan"))).pow(2).sum().backward()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        grads = {n: p.grad for n, p in model.named_parameters()}
        opt.step()
        # skipped once, and the gradients it hid from the optimizer are given back
        assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
        assert all(p.grad is grads[n] for n, p in model.named_parameters())
        mon.step()
    skipped = [r for r in mon.records if r["type"] == "event" and r["kind"] == "skipped_step"]
    assert [r["step"] for r in skipped] == [1]
    assert mon.records[1]["param"]["0.weight"]["update_ratio"] > 0


class ClosureSAM(torch.optim.Optimizer):
    """Sharpness-aware minimisation, the closure form: ``step(closure)`` moves the weights
    by the gradients of a backward pass run *before* it, re-evaluates the closure there, puts
    the weights back and steps a base SGD with the new gradients."""

    def __init__(self, params, rho: float = 0.05, lr: float = 0.1) -> None:
        super().__init__(params, {"rho": rho, "lr": lr})
        self.base = torch.optim.SGD(self.param_groups, lr=lr)

    @torch.no_grad()
    def step(self, closure=None):
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        scale = self.param_groups[0]["rho"] / (
            torch.stack([g.norm() for g in grads]).norm() + 1e-12
        )
        moved = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    moved.append((p, p.detach().clone()))
                    p.add_(p.grad * scale)
        self.zero_grad()
        with torch.enable_grad():
            closure()
        for p, old in moved:
            p.copy_(old)
        self.base.step()


class Poisonable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net, self.poisoned = mlp(), False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.net(x)
        return torch.log(h - 100.0) if self.poisoned else h  # NaN from finite values


def sam_steps(model, opt, mon, poisoned_at=None, steps=3):
    x, y = torch.randn(32, 8), torch.randn(32, 4)

    def closure():
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    for _ in range(steps):
        model.poisoned = mon.step_count == poisoned_at
        nn.functional.mse_loss(model(x), y).backward()  # the first pass, before step()
        opt.step(closure)
        opt.zero_grad()
        mon.step()


def test_a_closure_optimizer_that_moves_the_weights_is_checked_before_it_does() -> None:
    torch.manual_seed(0)
    model = Poisonable()
    opt = ClosureSAM(model.parameters())
    with hs.Monitor(model, every=1) as mon:
        sam_steps(model, opt, mon)
    assert mon.findings == []
    ratios = [
        r["param"]["net.0.weight"]["update_ratio"] for r in mon.records if r["type"] == "step"
    ]
    assert len(ratios) == 3 and all(r > 0 for r in ratios)
    with hs.Monitor(model, every=10, on_nonfinite="raise") as mon:
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        with pytest.raises(hs.NonFiniteError) as info:
            sam_steps(model, opt, mon, poisoned_at=0)
        # raised before step() moved any weight, naming the op of the first pass
        assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
        assert (info.value.step, info.value.phase, info.value.op) == (0, "forward", "aten.log")
