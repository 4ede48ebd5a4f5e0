"""Diagnosis benchmark: does ``hs.Monitor`` find injected training bugs, at the right module,
and stay silent on healthy runs?

Each *bug run* is a small training run (a few CPU seconds at most) with exactly one injected
bug, and declares the finding it expects: a kind and the set of module names that are an
acceptable answer (the module where the bug is; a comment on each case says why). Each
*healthy run* is a sane training run: small MLP/CNN/RNN/LSTM models and real architectures
built from small ``transformers`` configs (random weights, nothing downloaded), >= 5 steps of
AdamW at lr 1e-4..1e-3 or SGD at a sane lr. Every run is trained twice from the same seed:

1. ``prove()``: plain torch, no hookscope (``register_forward_hook`` and tensor hooks
   only), measuring the evidence that the pathology is present (the loss grows, a gradient
   norm ratio, the fraction of dead units, the update ratio measured by hand...) and
   *asserting* it, so that a case that is not really buggy fails loudly. Healthy runs prove
   that they are healthy (finite everywhere, the loss goes down on their fixed batch).
2. Monitored: ``hs.Monitor(model, every=1)`` attached, no optimizer passed (the Monitor finds
   it), ``mon.step(loss=loss)`` after ``optimizer.step()``. Same loop, same seed, same batches.

Scores:

- **recall** = bug runs with at least one finding of the expected kind / bug runs;
- **right module** = bug runs with a finding of the expected kind at an acceptable module /
  bug runs;
- **precision** = correct findings / all findings of all runs. A finding is correct when it
  is in a bug run and its kind is the expected kind (at any module: the module is scored by
  the right-module rate), or one of the *consequence* kinds that case declares: the
  pathologies the injected bug causes in turn, each justified where it is declared (a
  ``nonfinite`` overflow after an exploding gradient, ``update_ratio`` "too large" when the
  gradient explodes, ``vanishing_gradient`` below a layer whose ReLUs all died...).
  Consequences never count toward recall. Every finding in a healthy run is false.
  ``update_ratio`` is scored with its side: a case expecting updates that are too small (or
  no gradient at all, ``update_ratio<``) is not found by an "updates too large" finding, and
  the other way round (``update_ratio>``); the side is read from the finding's value against
  the 1e-3 rule of thumb. The findings counted are ``mon.findings`` as the Monitor reports them.
  When the Monitor raises, the run is scored with the findings made until then and flagged.

    python benchmarks/diagnosis.py [--only NAME] [--verbose]

``--only`` keeps the runs whose name contains NAME; ``--verbose`` prints, per run, the
evidence of ``prove()`` and a line of diagnostics from ``mon.records`` for tuning rules: the
loss trajectory, the largest ``grad_norm / norm`` over 2-D parameters, the smallest over the
first layer's parameters (the module nearest the input that owns parameters), the ratio of
the RMS gradient of the last module in ``grad_order`` (input side) to the first's (loss
side), and the range of update ratios, each with where (parameter or modules, step) it was
seen, over all steps; and every finding, marked ``+`` (correct) or ``-`` (false). The exit
status is 1 when a ``prove()`` fails.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import platform
import sys
import time
import traceback
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch
import torch.nn.functional as F
from torch import nn

import hookscope as hs

Tensor = torch.Tensor

# -- the training loop shared by the proof and the monitored run -------------------------------


@dataclass
class Setup:
    """One training run: a model, its optimizer, the loss of step ``i``, how to backward."""

    model: nn.Module
    opt: torch.optim.Optimizer
    loss: Callable[[int], Tensor]
    steps: int = 6
    backward: Callable[[Tensor], None] = field(default=lambda loss: loss.backward())


def train(
    s: Setup,
    after_backward: Callable[[int], None] | None = None,
    after_step: Callable[[int, Tensor], None] | None = None,
) -> None:
    """The loop every run uses: no guard against non-finite losses (as many loops have none)."""
    s.model.train()
    for step in range(s.steps):
        loss = s.loss(step)
        s.opt.zero_grad(set_to_none=True)
        s.backward(loss)
        if after_backward is not None:
            after_backward(step)
        s.opt.step()
        if after_step is not None:
            after_step(step, loss)


@dataclass
class Trace:
    """What a plain-torch run measured, per step (steps count from 0)."""

    loss: list[float] = field(default_factory=list)
    grad: list[dict[str, float]] = field(default_factory=list)  # param -> grad norm (if any)
    norm: list[dict[str, float]] = field(default_factory=list)  # param -> norm before update
    update: list[dict[str, float]] = field(default_factory=list)  # param -> ||dW|| / ||W||
    inp: list[dict[str, Tensor]] = field(default_factory=list)  # module -> first input
    out: list[dict[str, Tensor]] = field(default_factory=list)  # module -> first output
    gout: list[dict[str, Tensor]] = field(default_factory=list)  # module -> grad of output
    in_opt: set[str] = field(default_factory=set)  # parameters some optimizer steps


def first_tensor(value: Any) -> Tensor | None:
    if isinstance(value, Tensor):
        return value
    if isinstance(value, (tuple, list)):
        for v in value:
            if (t := first_tensor(v)) is not None:
                return t
    return None


def fresh(build: Callable[[], Setup]) -> Setup:
    """The run as both trainings start it: the same seed, so the same weights and batches."""
    torch.manual_seed(0)
    return build()


def plain(s: Setup | Callable[[], Setup], watch: Iterable[str] = ()) -> Trace:
    """Train ``s`` (a Setup, or a build function: seeded) without hookscope, measuring what
    ``prove()`` needs."""
    if not isinstance(s, Setup):
        s = fresh(s)
    tr = Trace()
    params = dict(s.model.named_parameters())
    owned = {id(p) for g in s.opt.param_groups for p in g["params"]}
    tr.in_opt = {n for n, p in params.items() if id(p) in owned}
    modules = dict(s.model.named_modules())
    current: dict[str, int] = {"step": 0}

    def on_forward(name: str, module: nn.Module, args: Any, output: Any) -> None:
        step = current["step"]
        while len(tr.out) <= step:
            tr.inp.append({})
            tr.out.append({})
            tr.gout.append({})
        x, y = first_tensor(args), first_tensor(output)
        if x is not None:
            tr.inp[step][name] = x.detach().clone()
        if y is not None:
            tr.out[step][name] = y.detach().clone()
            if y.requires_grad:
                y.register_hook(lambda g: tr.gout[step].__setitem__(name, g.detach().clone()))

    handles = [
        modules[name].register_forward_hook(lambda m, a, o, name=name: on_forward(name, m, a, o))
        for name in watch
    ]
    before: dict[str, Tensor] = {}

    def after_backward(step: int) -> None:
        tr.grad.append(
            {n: p.grad.detach().norm().item() for n, p in params.items() if p.grad is not None}
        )
        tr.norm.append({n: p.detach().norm().item() for n, p in params.items()})
        before.clear()
        before.update({n: p.detach().clone() for n, p in params.items()})

    def after_step(step: int, loss: Tensor) -> None:
        tr.loss.append(loss.item())
        tr.update.append(
            {
                n: ((p.detach() - before[n]).norm() / (before[n].norm() + 1e-12)).item()
                for n, p in params.items()
            }
        )
        current["step"] = step + 1

    try:
        train(s, after_backward, after_step)
    finally:
        for h in handles:
            h.remove()
    return tr


def finite(t: Tensor) -> bool:
    return bool(torch.isfinite(t).all())


def rms(t: Tensor) -> float:
    return t.detach().float().pow(2).mean().sqrt().item()


def dead_fraction(t: Tensor) -> float:
    """Fraction of units (dim 1) that are <= 0 on every row (batch, and space for convs)."""
    units = t.detach().movedim(1, -1).reshape(-1, t.shape[1])
    return (units <= 0).all(0).float().mean().item()


def saturated_fraction(t: Tensor, lo: float, hi: float) -> float:
    return ((t <= lo + 1e-3) | (t >= hi - 1e-3)).float().mean().item()


# -- models and data ---------------------------------------------------------------------------


def mlp(sizes: list[int], act: type[nn.Module] = nn.ReLU) -> nn.Sequential:
    """``fc1, act1, fc2, act2, ..., fcN`` (named, so that findings name them)."""
    layers: OrderedDict[str, nn.Module] = OrderedDict()
    for i, (a, b) in enumerate(itertools.pairwise(sizes), 1):
        layers[f"fc{i}"] = nn.Linear(a, b)
        if i < len(sizes) - 1:
            layers[f"act{i}"] = act()
    return nn.Sequential(layers)


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def classes(n: int = 64, d: int = 16, k: int = 4, seed: int = 0) -> tuple[Tensor, Tensor]:
    """A learnable classification batch: labels from a random linear teacher."""
    g = gen(seed)
    x = torch.randn(n, d, generator=g)
    return x, (x @ torch.randn(d, k, generator=g)).argmax(1)


def regression(n: int = 64, d: int = 16, seed: int = 0) -> tuple[Tensor, Tensor]:
    g = gen(seed)
    x = torch.randn(n, d, generator=g)
    return x, torch.tanh(x @ torch.randn(d, 1, generator=g) / 4)


def ce(model: nn.Module, x: Tensor, y: Tensor) -> Callable[[int], Tensor]:
    return lambda step: F.cross_entropy(model(x), y)


def mse(model: nn.Module, x: Tensor, y: Tensor) -> Callable[[int], Tensor]:
    return lambda step: F.mse_loss(model(x), y)


# -- cases -----------------------------------------------------------------------------------


@dataclass
class Case:
    name: str
    form: str  # what was injected, in a few words
    build: Callable[[], Setup]
    prove: Callable[[Callable[[], Setup]], str]
    kind: str | None = None  # None: a healthy run
    modules: frozenset[str] = frozenset()
    consequences: frozenset[str] = frozenset()
    hf: bool = False  # needs transformers


CASES: list[Case] = []


def bug(
    kind: str,
    modules: Iterable[str],
    form: str,
    consequences: Iterable[str] = (),
) -> Callable[[Callable[[], Setup]], Callable[[], Setup]]:
    """Register ``build`` (and its ``prove_<name>``, defined right after it) as a bug run."""

    def register(build: Callable[[], Setup]) -> Callable[[], Setup]:
        CASES.append(
            Case(
                build.__name__,
                form,
                build,
                prove=lambda b, name=build.__name__: PROOFS[name](b),
                kind=kind,
                modules=frozenset(modules),
                consequences=frozenset(consequences),
            )
        )
        return build

    return register


PROOFS: dict[str, Callable[[Callable[[], Setup]], str]] = {}


def proof(name: str) -> Callable[[Callable[[Callable[[], Setup]], str]], Any]:
    def register(fn: Callable[[Callable[[], Setup]], str]) -> Any:
        PROOFS[name] = fn
        return fn

    return register


# Kinds that follow from a gradient explosion: the updates it makes are too large
# (update_ratio), they overflow to Inf/NaN (nonfinite), and an oversized update kills ReLUs or
# drives bounded activations into their bounds (dead_units, saturated_units).
AFTER_EXPLOSION = ("nonfinite", "update_ratio>", "dead_units", "saturated_units")

# == nonfinite ==================================================================================


class Log(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return torch.log(x)


@bug("nonfinite", {"log"}, "log(relu(h)): log(0) = -inf on the units that are off")
def nan_log() -> Setup:
    # "log features" of a ReLU layer: every unit that is off gives log(0) = -inf in the forward
    # pass of `log`, from finite inputs. The right module is `log`, the op that made it.
    model = nn.Sequential(
        OrderedDict(fc1=nn.Linear(16, 32), relu=nn.ReLU(), log=Log(), fc2=nn.Linear(32, 4))
    )
    x, y = classes()
    return Setup(model, torch.optim.SGD(model.parameters(), lr=0.05), ce(model, x, y))


@proof("nan_log")
def prove_nan_log(build: Callable[[], Setup]) -> str:
    tr = plain(build, watch=["log"])
    x, y = tr.inp[0]["log"], tr.out[0]["log"]
    assert finite(x) and not finite(y), "log's output should turn -inf from finite inputs"
    return f"step 0: log input finite (min {x.min():.3g}), output has {(~torch.isfinite(y)).sum()} -inf"


class PairDistance(nn.Module):
    """Euclidean distance between the first and second half of a batch of embeddings."""

    def forward(self, z: Tensor) -> Tensor:
        a, b = z.chunk(2)
        return ((a - b) ** 2).sum(-1).sqrt()


@bug("nonfinite", {"dist"}, "sqrt at 0 in backward only: distance of identical pairs")
def nan_sqrt_backward() -> Setup:
    # A siamese regression on pair distances, where a quarter of the pairs are the same item
    # twice: the forward sqrt(0) = 0 is fine, its backward 0.5/sqrt(0) * 0 = NaN. The right
    # module is `dist`, whose backward turned a finite gradient into NaN.
    model = nn.Sequential(
        OrderedDict(
            fc1=nn.Linear(16, 32), act1=nn.ReLU(), fc2=nn.Linear(32, 8), dist=PairDistance()
        )
    )
    g = gen()
    a = torch.randn(32, 16, generator=g)
    b = torch.randn(32, 16, generator=g)
    b[:8] = a[:8]  # identical pairs
    x = torch.cat([a, b])
    target = torch.rand(32, generator=g)
    target[:8] = 0
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    return Setup(model, opt, lambda step: F.mse_loss(model(x), target))


@proof("nan_sqrt_backward")
def prove_nan_sqrt_backward(build: Callable[[], Setup]) -> str:
    tr = plain(build, watch=["dist", "fc2"])
    d, gd, g2 = tr.out[0]["dist"], tr.gout[0]["dist"], tr.gout[0]["fc2"]
    assert finite(d) and math.isfinite(tr.loss[0]), "the forward pass should be finite"
    assert finite(gd) and not finite(g2), "dist's backward should turn a finite gradient NaN"
    return (
        f"step 0: loss {tr.loss[0]:.3g} finite, {int((d == 0).sum())} zero distances, "
        f"grad into dist finite, grad out of dist has {int(torch.isnan(g2).sum())} NaN"
    )


class Normalize(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x / x.norm(dim=-1, keepdim=True)


@bug("nonfinite", {"normalize"}, "x / ||x|| on zero rows (zero-padded batch)")
def nan_div_zero_norm() -> Setup:
    # A batch padded with zero rows goes through a bias-free projection, so the padded rows stay
    # exactly zero, and a hand-written L2 normalisation divides 0 by 0. The right module is
    # `normalize`: its output is NaN while its input is finite.
    model = nn.Sequential(
        OrderedDict(
            proj=nn.Linear(16, 32, bias=False), normalize=Normalize(), head=nn.Linear(32, 4)
        )
    )
    x, y = classes()
    x[-8:] = 0  # padding
    return Setup(model, torch.optim.SGD(model.parameters(), lr=0.05), ce(model, x, y))


@proof("nan_div_zero_norm")
def prove_nan_div_zero_norm(build: Callable[[], Setup]) -> str:
    tr = plain(build, watch=["normalize"])
    x, y = tr.inp[0]["normalize"], tr.out[0]["normalize"]
    zero = int((x.norm(dim=-1) == 0).sum())
    assert finite(x) and zero > 0 and not finite(y)
    return f"step 0: {zero} rows of normalize's input have norm 0, its output has NaN"


@bug("nonfinite", {"fc1"}, "one corrupted batch (a NaN feature) at step 3")
def nan_bad_batch() -> Setup:
    # The data itself: batch 3 holds a NaN (a missing value parsed as NaN). No module made
    # it; the right answer is the first module that received it, `fc1`.
    model = mlp([16, 32, 32, 4])
    batches = [classes(seed=i) for i in range(6)]
    batches[3][0][5, 7] = math.nan
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    return Setup(
        model, opt, lambda step: F.cross_entropy(model(batches[step][0]), batches[step][1])
    )


@proof("nan_bad_batch")
def prove_nan_bad_batch(build: Callable[[], Setup]) -> str:
    tr = plain(build, watch=["fc1"])
    ok = [finite(tr.inp[i]["fc1"]) for i in range(6)]
    assert ok[:3] == [True] * 3 and not ok[3] and not math.isfinite(tr.loss[3])
    return f"input of fc1 finite at steps 0-2, NaN at step 3; loss {tr.loss[:4]}"


class NaiveSoftmax(nn.Module):
    """softmax(x / T) written by hand, without subtracting the max first."""

    def __init__(self, temperature: float) -> None:
        super().__init__()
        self.temperature = temperature

    def forward(self, x: Tensor) -> Tensor:
        e = torch.exp(x / self.temperature)
        return e / e.sum(-1, keepdim=True)


@bug("nonfinite", {"softmax"}, "hand-written softmax(x / 0.01) without max subtraction")
def nan_softmax_overflow() -> Setup:
    # Sharpened probabilities with temperature 0.01: exp(logit / 0.01) overflows to inf for
    # logits above 0.89, and inf / inf = NaN. The right module is `softmax`.
    model = nn.Sequential(
        OrderedDict(
            fc1=nn.Linear(16, 32), act1=nn.ReLU(), fc2=nn.Linear(32, 4), softmax=NaiveSoftmax(0.01)
        )
    )
    x, y = classes()
    x = x * 3
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    return Setup(model, opt, lambda step: F.nll_loss(torch.log(model(x) + 1e-9), y))


@proof("nan_softmax_overflow")
def prove_nan_softmax_overflow(build: Callable[[], Setup]) -> str:
    tr = plain(build, watch=["softmax"])
    x, y = tr.inp[0]["softmax"], tr.out[0]["softmax"]
    assert finite(x) and not finite(y)
    return (
        f"step 0: softmax input finite, max logit/T {x.max().item() / 0.01:.3g} > 88.7, output NaN"
    )


# == exploding gradients ========================================================================


@bug(
    "exploding_gradient",
    {"fc1", "act1", "fc2", "act2", "fc3"},
    "SGD learning rate 2 on an MLP regression (converges at 0.05)",
    AFTER_EXPLOSION,
)
def explode_lr() -> Setup:
    # The learning rate is global: no module is more at fault than another, every module of
    # the model is an acceptable answer (scored for the kind).
    model = mlp([16, 64, 64, 1])
    x, y = regression()
    return Setup(model, torch.optim.SGD(model.parameters(), lr=2.0), mse(model, x, y), steps=8)


@proof("explode_lr")
def prove_explode_lr(build: Callable[[], Setup]) -> str:
    tr = plain(build)
    finite_losses = [v for v in tr.loss if math.isfinite(v)]
    grows = finite_losses[-1] / tr.loss[0]
    g = [d["fc1.weight"] for d in tr.grad if math.isfinite(d.get("fc1.weight", math.nan))]
    assert grows > 1e3 and g[-1] / g[0] > 1e2, (tr.loss, g)
    # the same run at lr 0.05 converges: the learning rate is the bug
    ok = fresh(build)
    ok.opt.param_groups[0]["lr"] = 0.05
    calm = plain(ok)
    assert calm.loss[-1] < calm.loss[0]
    return (
        f"loss {tr.loss[0]:.3g} -> {finite_losses[-1]:.3g} (x{grows:.3g}, then {tr.loss[-1]:.3g}); "
        f"|grad fc1.weight| x{g[-1] / g[0]:.3g}; at lr 0.05: loss {calm.loss[0]:.3g} -> "
        f"{calm.loss[-1]:.3g}"
    )


@bug(
    "exploding_gradient",
    {"fc1", "fc2", "fc3"},
    "every weight of a 3-layer MLP x30 (loss 1e7)",
    AFTER_EXPLOSION,
)
def explode_init_all() -> Setup:
    # The MLP: all three Linear layers carry the x30 initialisation, so each of them is
    # an acceptable answer.
    model = mlp([16, 64, 64, 4])
    with torch.no_grad():
        for name in ("fc1", "fc2", "fc3"):
            getattr(model, name).weight.mul_(30.0)
    x, y = regression()
    y = y.expand(-1, 4).contiguous()
    return Setup(model, torch.optim.SGD(model.parameters(), lr=1e-2), mse(model, x, y))


@proof("explode_init_all")
def prove_explode_init_all(build: Callable[[], Setup]) -> str:
    tr = plain(build)
    ratio = max(tr.grad[0][n] / tr.norm[0][n] for n in ("fc1.weight", "fc2.weight", "fc3.weight"))
    # an SGD step at a usual lr (1e-2) moves the weights by lr * ratio of their norm
    assert tr.loss[0] > 1e5 and ratio > 1e3, (tr.loss[0], ratio)
    assert not math.isfinite(tr.loss[-1]) or tr.loss[-1] > 1e3 * tr.loss[0], tr.loss
    return (
        f"step 0: loss {tr.loss[0]:.3g}, max |grad|/|W| {ratio:.3g} (an lr=1e-2 step moves W "
        f"by {1e-2 * ratio:.3g}x its norm); loss then {tr.loss[1]:.3g}, {tr.loss[-1]:.3g}"
    )


@bug(
    "exploding_gradient",
    {"fc3"},
    "one layer (fc3 of 5) initialised with normal(std=1) instead of ~1/sqrt(fan_in)",
    AFTER_EXPLOSION,
)
def explode_init_one() -> Setup:
    # fc3 alone has the bad init (std 1 against 0.036 for its 256 inputs: x28); the gradient
    # jumps in fc3's backward (W3^T is 28x too large), so `fc3` is the right answer.
    model = mlp([16, 256, 256, 256, 256, 1])
    with torch.no_grad():
        nn.init.normal_(model.fc3.weight, std=1.0)
    x, y = regression()
    return Setup(model, torch.optim.SGD(model.parameters(), lr=0.05), mse(model, x, y), steps=8)


@proof("explode_init_one")
def prove_explode_init_one(build: Callable[[], Setup]) -> str:
    tr = plain(build, watch=["fc2", "fc3"])
    jump = rms(tr.gout[0]["fc2"]) / rms(tr.gout[0]["fc3"])
    ratio = tr.grad[0]["fc2.weight"] / tr.norm[0]["fc2.weight"]
    finite_losses = [v for v in tr.loss if math.isfinite(v)]
    assert jump > 10 and max(finite_losses) > 1e3 * tr.loss[0], (jump, tr.loss)
    # the same network with fc3's default init converges at the same lr: the init is the bug
    ok = fresh(build)
    with torch.no_grad():
        ok.model.fc3.reset_parameters()
    calm = plain(ok)
    assert all(math.isfinite(v) for v in calm.loss) and calm.loss[-1] < calm.loss[0]
    return (
        f"step 0: grad RMS jumps x{jump:.3g} through fc3's backward, |grad fc2.W|/|W| "
        f"{ratio:.3g}; loss {tr.loss[0]:.3g} -> max {max(finite_losses):.3g}, last "
        f"{tr.loss[-1]:.3g} at lr 0.05; default fc3 init: {calm.loss[0]:.3g} -> {calm.loss[-1]:.3g}"
    )


class RNNRegressor(nn.Module):
    def __init__(self, rho: float) -> None:
        super().__init__()
        self.enc = nn.Linear(8, 32)
        self.rnn = nn.RNN(32, 32, nonlinearity="relu", batch_first=True)
        self.head = nn.Linear(32, 1)
        with torch.no_grad():  # IRNN init (Le et al. 2015) with the identity scaled by rho
            self.rnn.weight_hh_l0.copy_(rho * torch.eye(32))

    def forward(self, x: Tensor) -> Tensor:
        out, _ = self.rnn(self.enc(x))
        return self.head(out[:, -1])


@bug(
    "exploding_gradient",
    {"rnn"},
    "ReLU RNN, recurrent weight 1.4*I, 128 steps: its backward overflows to Inf, forward finite",
    AFTER_EXPLOSION,
)
def explode_rnn() -> Setup:
    # The gradient grows by ~1.4 per time step through the recurrence, backwards in time,
    # until the RNN's weight gradient overflows to Inf inside its backward (the forward and
    # the loss, 5e36, are still finite). The recurrence is the bug: `rnn`.
    model = RNNRegressor(rho=1.4)
    g = gen()
    x, y = torch.randn(16, 128, 8, generator=g), torch.randn(16, 1, generator=g)
    return Setup(model, torch.optim.SGD(model.parameters(), lr=1e-2), mse(model, x, y), steps=4)


@proof("explode_rnn")
def prove_explode_rnn(build: Callable[[], Setup]) -> str:
    tr = plain(build, watch=["enc", "rnn"])
    g = tr.gout[0]["enc"]  # gradient reaching the RNN's input, per time step
    per_t = g.abs().amax(dim=(0, 2))
    growth = (per_t[0] / per_t[-1]).item()
    assert math.isfinite(tr.loss[0]) and finite(tr.out[0]["rnn"]), "forward should be finite"
    s = fresh(build)
    s.loss(0).backward()
    w_hh = s.model.rnn.weight_hh_l0.grad
    assert growth > 1e12 and not finite(w_hh), (growth, w_hh.abs().max())
    assert not math.isfinite(tr.loss[1]), tr.loss
    return (
        f"step 0: loss {tr.loss[0]:.3g} and RNN output finite; max |dL/dx_t| grows "
        f"x{growth:.3g} from t=127 back to t=0 ({per_t[0].item():.3g}); "
        f"{int((~torch.isfinite(w_hh)).sum())} entries of rnn.weight_hh_l0.grad are Inf/NaN; "
        f"step 1: loss {tr.loss[1]}"
    )


@bug(
    "exploding_gradient",
    {"fc1", "act1", "fc2", "act2", "fc3"},
    "GradScaler(2**16) scales the loss, then opt.step() without scaler.step/unscale",
    AFTER_EXPLOSION,
)
def explode_loss_scale() -> Setup:
    # The loss scale sits outside every module (the loss and the loop): every module is an
    # acceptable answer (scored for the kind).
    model = mlp([16, 64, 64, 4])
    x, y = classes()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    return Setup(model, opt, ce(model, x, y), backward=lambda loss: scaler.scale(loss).backward())


@proof("explode_loss_scale")
def prove_explode_loss_scale(build: Callable[[], Setup]) -> str:
    s = fresh(build)
    F.cross_entropy(s.model(classes()[0]), classes()[1]).backward()
    true = s.model.fc1.weight.grad.norm().item()
    tr = plain(build)
    scale = tr.grad[0]["fc1.weight"] / true
    finite_losses = [v for v in tr.loss if math.isfinite(v)]
    assert abs(scale - 2**16) < 1 and max(finite_losses) > 100 * tr.loss[0], (scale, tr.loss)
    return (
        f"gradients x{scale:.6g} the true ones; loss {tr.loss[0]:.3g} -> max "
        f"{max(finite_losses):.3g}, last {tr.loss[-1]:.3g}"
    )


# == vanishing gradients ========================================================================

INPUT_SIDE_16 = {f"{p}{i}" for p in ("fc", "act") for i in range(1, 5)}


# The starved layers' updates are (correctly) too small.
AFTER_VANISHING = ("update_ratio<",)


@bug("vanishing_gradient", INPUT_SIDE_16, "a 16-layer sigmoid MLP, default init", AFTER_VANISHING)
def vanish_depth() -> Setup:
    # Sigmoid' <= 0.25 per layer: the gradient shrinks ~10x per layer towards the input. The
    # layers that stop learning are those near the input: the first quarter (fc1-fc4 and their
    # sigmoids) is the right answer, not the head where the chain of drops starts.
    model = mlp([16] + [32] * 15 + [4], act=nn.Sigmoid)
    x, y = classes()
    return Setup(model, torch.optim.SGD(model.parameters(), lr=0.1), ce(model, x, y))


def prove_vanishing(tr: Trace, first: str, last: str, head: tuple[str, str]) -> str:
    """The input side gets a gradient < 1e-5 of the head's, and (so) does not learn."""
    g_in, g_out = rms(tr.gout[0][first]), rms(tr.gout[0][last])
    up_in = max(u[f"{head[0]}.weight"] for u in tr.update)
    up_out = min(u[f"{head[1]}.weight"] for u in tr.update)
    assert g_in / g_out < 1e-5 and up_in < 1e-4 * up_out, (g_in, g_out, up_in, up_out)
    return (
        f"step 0: output-grad RMS {g_in:.3g} at {first} vs {g_out:.3g} at {last} "
        f"(x{g_in / g_out:.3g}); update ratio of {head[0]} <= {up_in:.3g} vs {head[1]} >= "
        f"{up_out:.3g}"
    )


@proof("vanish_depth")
def prove_vanish_depth(build: Callable[[], Setup]) -> str:
    tr = plain(build, watch=["fc1", "fc16"])
    return prove_vanishing(tr, "fc1", "fc16", ("fc1", "fc16"))


class WithTimestamp(nn.Module):
    """An encoder over normalised features, concatenated with one more raw feature, then a
    tanh layer and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.act1 = nn.Linear(16, 32), nn.ReLU()
        self.fc2, self.act2 = nn.Linear(32, 32), nn.ReLU()
        self.fc3, self.act3 = nn.Linear(33, 32), nn.Tanh()
        self.head = nn.Linear(32, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = self.act2(self.fc2(self.act1(self.fc1(x[:, :16]))))
        return self.head(self.act3(self.fc3(torch.cat([h, x[:, 16:]], -1))))


@bug(
    "vanishing_gradient",
    {"fc1", "act1", "fc2", "act2", "fc3"},
    "a raw unix timestamp (~1.7e9) concatenated into a tanh layer: act3 saturates exactly",
    ("saturated_units", "update_ratio<"),  # the cause (act3), and the starved layers' updates
)
def vanish_saturation() -> Setup:
    # One un-normalised feature drives every unit of act3 to exactly +-1 in float32, so
    # tanh' = 0 there and nothing flows back: every layer below act3 (fc3 and the encoder
    # fc1/act1/fc2/act2) is starved, and those are the right answers; act3 is where the
    # gradient stops, not what stopped learning.
    model = WithTimestamp()
    x, y = classes()
    stamps = 1.7e9 + 86400 * torch.arange(64.0)[:, None]  # one sample a day
    return Setup(
        model, torch.optim.SGD(model.parameters(), lr=0.05), ce(model, torch.cat([x, stamps], 1), y)
    )


@proof("vanish_saturation")
def prove_vanish_saturation(build: Callable[[], Setup]) -> str:
    tr = plain(build, watch=["fc1", "head", "act3"])
    sat = min(saturated_fraction(o["act3"], -1, 1) for o in tr.out)
    assert sat > 0.99, sat
    return f"{sat:.0%} of act3 saturated; " + prove_vanishing(tr, "fc1", "head", ("fc1", "head"))


@bug(
    "vanishing_gradient",
    {"fc1", "act1", "fc2", "act2"},
    "8-layer tanh MLP initialised normal(std=1e-3)",
    AFTER_VANISHING,
)
def vanish_tiny_init() -> Setup:
    # Every backward through a tiny W^T shrinks the gradient ~100x: the starved layers are
    # those near the input (fc1, fc2 and their tanhs).
    model = mlp([16] + [64] * 7 + [4], act=nn.Tanh)
    with torch.no_grad():
        for m in model:
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=1e-3)
    x, y = classes()
    return Setup(model, torch.optim.SGD(model.parameters(), lr=0.1), ce(model, x, y))


@proof("vanish_tiny_init")
def prove_vanish_tiny_init(build: Callable[[], Setup]) -> str:
    tr = plain(build, watch=["fc1", "fc8"])
    return prove_vanishing(tr, "fc1", "fc8", ("fc1", "fc8"))


# == dead units =================================================================================

AFTER_DEATH = (
    # a dead ReLU layer passes no gradient at all: the layers below it get exactly zero
    # (vanishing_gradient there, and their parameters receive no gradient: update_ratio, on
    # the "too small" side)
    "vanishing_gradient",
    "update_ratio<",
)


@bug("dead_units", {"act1", "fc1"}, "fc1's bias initialised to -10", AFTER_DEATH)
def dead_bias() -> Setup:
    # Pre-activations ~ N(-10, 0.6): every unit of act1 is off on every input. The ReLU that
    # died is the right answer (or fc1, whose bias killed it).
    model = mlp([16, 32, 32, 4])
    with torch.no_grad():
        model.fc1.bias.fill_(-10.0)
    x, y = classes()
    return Setup(model, torch.optim.SGD(model.parameters(), lr=0.05), ce(model, x, y))


@proof("dead_bias")
def prove_dead_bias(build: Callable[[], Setup]) -> str:
    tr = plain(build, watch=["act1"])
    dead = [dead_fraction(o["act1"]) for o in tr.out]
    assert min(dead) == 1.0 and all(g.get("fc1.weight", 0.0) == 0.0 for g in tr.grad)
    return f"act1 dead on every input at every step ({min(dead):.0%}); fc1 gradient exactly 0"


@bug(
    "dead_units",
    {"act2", "fc2"},
    "SGD lr 0.3 on a regression (fine at 0.01): oversized steps push act2 below 0 for good",
    (*AFTER_DEATH, "update_ratio>"),  # updates too large: the cause itself
)
def dead_lr() -> Setup:
    # The targets (-10) sit far below the initial outputs: the first steps at lr 0.3 overshoot
    # and drive fc2's pre-activations negative on every input. The ReLU that died (act2), or
    # fc2 that feeds it.
    model = mlp([16, 64, 64, 1])
    x, _ = regression()
    y = torch.full((64, 1), -10.0)
    return Setup(model, torch.optim.SGD(model.parameters(), lr=0.3), mse(model, x, y))


@proof("dead_lr")
def prove_dead_lr(build: Callable[[], Setup]) -> str:
    tr = plain(build, watch=["act2"])
    dead = [dead_fraction(o["act2"]) for o in tr.out]
    assert dead[0] < 0.3 and min(dead[2:]) >= 0.7, dead
    ok = fresh(build)
    ok.opt.param_groups[0]["lr"] = 0.01
    calm = plain(ok, watch=["act2"])
    calm_dead = max(dead_fraction(o["act2"]) for o in calm.out)
    assert calm_dead < 0.1 and calm.loss[-1] < calm.loss[0]
    return (
        f"units of act2 off on every input, by step: {', '.join(f'{d:.0%}' for d in dead)} "
        f"(at lr 0.01: <= {calm_dead:.0%}, loss {calm.loss[0]:.3g} -> {calm.loss[-1]:.3g})"
    )


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(32)
        self.relu2 = nn.ReLU()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(32, 4)

    def forward(self, x: Tensor) -> Tensor:
        x = self.relu1(self.bn1(self.conv1(x)))
        x = self.relu2(self.bn2(self.conv2(x)))
        return self.head(self.pool(x).flatten(1))


def images(n: int = 32, size: int = 16, seed: int = 0) -> tuple[Tensor, Tensor]:
    g = gen(seed)
    x = torch.randn(n, 3, size, size, generator=g)
    return x, (x.mean((2, 3)) @ torch.randn(3, 4, generator=g)).argmax(1)


@bug("dead_units", {"relu2", "bn2"}, "CNN: BatchNorm shift (beta) of -5 before a ReLU", AFTER_DEATH)
def dead_bn_shift() -> Setup:
    # bn2 normalises to N(0, 1) and then shifts by -5: relu2 is off on every position of every
    # image. relu2 (the ReLU that died), or bn2 whose shift killed it.
    model = ConvNet()
    with torch.no_grad():
        model.bn2.bias.fill_(-5.0)
    x, y = images()
    return Setup(model, torch.optim.Adam(model.parameters(), lr=1e-3), ce(model, x, y))


@proof("dead_bn_shift")
def prove_dead_bn_shift(build: Callable[[], Setup]) -> str:
    tr = plain(build, watch=["relu2"])
    dead = [dead_fraction(o["relu2"]) for o in tr.out]
    assert min(dead) >= 0.9, dead
    return f"relu2 units off at every position: {min(dead):.0%}..{max(dead):.0%} of units"


# == saturated units ============================================================================

AFTER_SATURATION = ("vanishing_gradient",)  # a saturated layer starves the layers below it


@bug(
    "saturated_units",
    {"act1", "fc1"},
    "tanh after a Linear initialised normal(std=1) on 256 inputs (pre-activations ~N(0, 16^2))",
    AFTER_SATURATION,
)
def sat_tanh_init() -> Setup:
    # act1 (the saturated tanh), or fc1 whose init drives it.
    model = mlp([256, 64, 4], act=nn.Tanh)
    with torch.no_grad():
        nn.init.normal_(model.fc1.weight, std=1.0)
    x, y = classes(d=256)
    return Setup(model, torch.optim.SGD(model.parameters(), lr=0.05), ce(model, x, y))


def prove_saturated(tr: Trace, name: str, lo: float, hi: float) -> str:
    sat = [saturated_fraction(o[name], lo, hi) for o in tr.out]
    assert min(sat) > 0.8, sat
    return f"{min(sat):.0%}..{max(sat):.0%} of {name}'s outputs within 1e-3 of its bounds"


@proof("sat_tanh_init")
def prove_sat_tanh_init(build: Callable[[], Setup]) -> str:
    return prove_saturated(plain(build, watch=["act1"]), "act1", -1, 1)


@bug(
    "saturated_units",
    {"act1", "fc1"},
    "sigmoid MLP fed raw pixel values 0..255 (inputs not normalised)",
    AFTER_SATURATION,
)
def sat_sigmoid_unnormalised() -> Setup:
    # act1 (the saturated sigmoid), or fc1 that receives the raw pixels.
    model = mlp([64, 32, 4], act=nn.Sigmoid)
    g = gen()
    x = torch.randint(0, 256, (64, 64), generator=g).float()
    y = (x[:, :32].mean(1) > x[:, 32:].mean(1)).long() + 2 * (x[:, 0] > 128).long()
    return Setup(model, torch.optim.SGD(model.parameters(), lr=0.05), ce(model, x, y))


@proof("sat_sigmoid_unnormalised")
def prove_sat_sigmoid_unnormalised(build: Callable[[], Setup]) -> str:
    return prove_saturated(plain(build, watch=["act1"]), "act1", 0, 1)


class Gated(nn.Module):
    """y = sigmoid(gate(x)) * tanh(cand(x)), then a head (a GLU/highway-style block)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(16, 32)
        self.gate_act = nn.Sigmoid()
        self.cand = nn.Linear(16, 32)
        self.cand_act = nn.Tanh()
        self.head = nn.Linear(32, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.gate_act(self.gate(x)) * self.cand_act(self.cand(x)))


@bug(
    "saturated_units",
    {"gate_act", "gate"},
    "gate bias initialised to +20 (a gate stuck open)",
    AFTER_SATURATION,
)
def sat_gate_bias() -> Setup:
    # The "open the gate at init" trick overdone: sigmoid(20) = 1 - 2e-9, the gate never
    # moves. gate_act (saturated) or gate (its bias).
    model = Gated()
    with torch.no_grad():
        model.gate.bias.fill_(20.0)
    x, y = classes()
    return Setup(model, torch.optim.SGD(model.parameters(), lr=0.05), ce(model, x, y))


@proof("sat_gate_bias")
def prove_sat_gate_bias(build: Callable[[], Setup]) -> str:
    tr = plain(build, watch=["gate_act"])
    return prove_saturated(tr, "gate_act", 0, 1) + (
        f"; |grad gate.weight| {max(g['gate.weight'] for g in tr.grad):.3g}"
    )


# == update ratios ==============================================================================

MLP3 = {"fc1", "fc2", "fc3"}
# What too-large updates wreck: the loss and gradients blow up, ReLUs die, bounded
# activations saturate, values overflow.
AFTER_BIG_UPDATES = ("exploding_gradient", "dead_units", "saturated_units", "nonfinite")


def prove_updates(tr: Trace, names: Iterable[str], lo: float, hi: float) -> str:
    """Every weight matrix's update ratio, measured by hand, inside [lo, hi] on every step."""
    names = list(names)
    values = [u[n] for u in tr.update for n in names]
    assert all(lo <= v <= hi for v in values), (min(values), max(values))
    return f"||dW||/||W|| of {', '.join(names)}: {min(values):.3g}..{max(values):.3g} on every step"


@bug(
    "update_ratio>",
    MLP3,  # the learning rate is global: any of the weight matrices it moves too far
    "Adam lr=1.0",
    AFTER_BIG_UPDATES,
)
def update_high_adam() -> Setup:
    model = mlp([16, 64, 64, 4])
    x, y = classes()
    return Setup(model, torch.optim.Adam(model.parameters(), lr=1.0), ce(model, x, y))


@proof("update_high_adam")
def prove_update_high_adam(build: Callable[[], Setup]) -> str:
    tr = plain(build)
    out = prove_updates(tr, ["fc1.weight", "fc2.weight", "fc3.weight"], 0.1, math.inf)
    assert max(tr.loss) > 10 * tr.loss[0], tr.loss
    ok = fresh(build)
    ok.opt.param_groups[0]["lr"] = 1e-3
    calm = plain(ok)
    assert calm.loss[-1] < calm.loss[0]
    return (
        f"{out}; loss {tr.loss[0]:.3g} -> max {max(tr.loss):.3g} (at lr 1e-3: "
        f"{calm.loss[0]:.3g} -> {calm.loss[-1]:.3g})"
    )


@bug("update_ratio>", MLP3, "SGD lr=5 on an MLP classifier (monotone at 0.5)", AFTER_BIG_UPDATES)
def update_high_sgd() -> Setup:
    # The learning rate is global: any of the weight matrices it moves too far. With a
    # cross-entropy loss the gradients stay bounded: the steps overshoot, the loss does not
    # diverge to Inf.
    model = mlp([16, 64, 64, 4])
    x, y = classes()
    return Setup(model, torch.optim.SGD(model.parameters(), lr=5.0), ce(model, x, y), steps=8)


@proof("update_high_sgd")
def prove_update_high_sgd(build: Callable[[], Setup]) -> str:
    tr = plain(build)
    names = ["fc1.weight", "fc2.weight", "fc3.weight"]
    big = [max(u[n] for n in names) for u in tr.update]
    rises = max(b / a for a, b in itertools.pairwise(tr.loss))
    assert min(big) > 0.1 and rises > 1.4, (big, tr.loss)
    ok = fresh(build)
    ok.opt.param_groups[0]["lr"] = 0.5
    calm = plain(ok)
    assert all(b < a for a, b in itertools.pairwise(calm.loss)), calm.loss
    return (
        f"largest ||dW||/||W|| per step {min(big):.3g}..{max(big):.3g}; the loss overshoots "
        f"(rises x{rises:.3g} in one step: {' '.join(f'{v:.3g}' for v in tr.loss)}); at lr 0.5 "
        f"it falls on every step"
    )


@bug("update_ratio<", MLP3, "SGD lr=1e-9")
def update_low_sgd() -> Setup:
    # The learning rate is global: any of the weight matrices it fails to move.
    model = mlp([16, 64, 64, 4])
    x, y = classes()
    return Setup(model, torch.optim.SGD(model.parameters(), lr=1e-9), ce(model, x, y))


@proof("update_low_sgd")
def prove_update_low_sgd(build: Callable[[], Setup]) -> str:
    tr = plain(build)
    out = prove_updates(tr, ["fc1.weight", "fc2.weight", "fc3.weight"], 0, 1e-7)
    assert abs(tr.loss[-1] - tr.loss[0]) < 1e-5 * tr.loss[0]
    return out + f"; loss {tr.loss[0]:.6g} -> {tr.loss[-1]:.6g}"


@bug("update_ratio<", MLP3, "Adam lr=1e-8")
def update_low_adam() -> Setup:
    model = mlp([16, 64, 64, 4])
    x, y = classes()
    return Setup(model, torch.optim.Adam(model.parameters(), lr=1e-8), ce(model, x, y))


@proof("update_low_adam")
def prove_update_low_adam(build: Callable[[], Setup]) -> str:
    tr = plain(build)
    out = prove_updates(tr, ["fc1.weight", "fc2.weight", "fc3.weight"], 0, 1e-6)
    assert abs(tr.loss[-1] - tr.loss[0]) < 1e-5 * tr.loss[0]
    return out + f"; loss {tr.loss[0]:.6g} -> {tr.loss[-1]:.6g}"


def prove_no_grad(build: Callable[[], Setup], names: list[str]) -> str:
    tr = plain(build)
    for name in names:
        assert name in tr.in_opt, f"{name} should be in the optimizer"
        assert all(name not in g for g in tr.grad), f"{name} should never get a gradient"
        assert all(u[name] == 0 for u in tr.update), f"{name} should never change"
    return f"{', '.join(names)}: in the optimizer, .grad None at every step, never updated"


class Detached(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 64)
        self.act1 = nn.ReLU()
        self.proj = nn.Linear(64, 64)
        self.act2 = nn.ReLU()
        self.head = nn.Linear(64 + 64, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = self.act1(self.fc1(x))
        p = self.act2(self.proj(h)).detach()  # a .detach() left over from debugging
        return self.head(torch.cat([h, p], -1))


@bug("update_ratio<", {"proj"}, "a layer whose output is .detach()ed")
def no_grad_detached() -> Setup:
    # proj's parameters are in the optimizer and never get a gradient: proj is the answer.
    model = Detached()
    x, y = classes()
    return Setup(model, torch.optim.Adam(model.parameters(), lr=1e-3), ce(model, x, y))


@proof("no_grad_detached")
def prove_no_grad_detached(build: Callable[[], Setup]) -> str:
    return prove_no_grad(build, ["proj.weight", "proj.bias"])


class Unused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 64)
        self.act1 = nn.ReLU()
        self.extra = nn.Linear(64, 64)  # registered, meant to be called, never called
        self.head = nn.Linear(64, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.act1(self.fc1(x)))


@bug("update_ratio<", {"extra"}, "a layer registered and never called")
def no_grad_unused() -> Setup:
    # extra's parameters sit in the optimizer (model.parameters()) and never get a gradient.
    model = Unused()
    x, y = classes()
    return Setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3), ce(model, x, y))


@proof("no_grad_unused")
def prove_no_grad_unused(build: Callable[[], Setup]) -> str:
    return prove_no_grad(build, ["extra.weight", "extra.bias"])


class NoGradBackbone(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.head = nn.Linear(64, 4)

    def forward(self, x: Tensor) -> Tensor:
        with torch.no_grad():  # meant for evaluation, left in the training forward
            h = self.backbone(x)
        return self.head(h)


@bug("update_ratio<", {"backbone.0", "backbone.2"}, "the backbone's forward under torch.no_grad()")
def no_grad_context() -> Setup:
    # backbone.0 and backbone.2 (its Linear layers) are in the optimizer, never get a gradient.
    model = NoGradBackbone()
    x, y = classes()
    return Setup(model, torch.optim.SGD(model.parameters(), lr=0.05), ce(model, x, y))


@proof("no_grad_context")
def prove_no_grad_context(build: Callable[[], Setup]) -> str:
    return prove_no_grad(build, ["backbone.0.weight", "backbone.2.weight"])


# == healthy runs ===============================================================================


def healthy(name: str, form: str, hf: bool = False) -> Callable[[Callable[[], Setup]], Any]:
    def register(build: Callable[[], Setup]) -> Callable[[], Setup]:
        CASES.append(Case(name, form, build, prove=prove_healthy, hf=hf))
        return build

    return register


def prove_healthy(build: Callable[[], Setup]) -> str:
    """Finite losses and gradients on every step, and the loss goes down on its fixed batch."""
    tr = plain(build)
    assert all(math.isfinite(v) for v in tr.loss), tr.loss
    assert all(math.isfinite(v) for g in tr.grad for v in g.values())
    assert min(tr.loss[-2:]) < tr.loss[0], tr.loss
    return f"loss {' '.join(f'{v:.3g}' for v in tr.loss)}"


@healthy("ok_mlp_sgd", "ReLU MLP, SGD lr 0.05 momentum 0.9")
def ok_mlp_sgd() -> Setup:
    model = mlp([16, 64, 64, 4])
    x, y = classes()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return Setup(model, opt, ce(model, x, y), steps=8)


@healthy("ok_mlp_tanh_adamw", "tanh MLP (4 layers), AdamW lr 1e-3")
def ok_mlp_tanh_adamw() -> Setup:
    model = mlp([16, 64, 64, 64, 4], act=nn.Tanh)
    x, y = classes()
    return Setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3), ce(model, x, y), steps=8)


@healthy("ok_digits_cnn", "the demo's DigitsCNN on sklearn digits, AdamW 1e-3, 8 batches")
def ok_digits_cnn() -> Setup:
    from hookscope._demo import DigitsCNN, load_digits

    x, y, _, _ = load_digits()
    model = DigitsCNN()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return Setup(
        model,
        opt,
        lambda step: F.cross_entropy(
            model(x[32 * step : 32 * step + 32]), y[32 * step : 32 * step + 32]
        ),
        steps=8,
    )


@healthy("ok_cnn_bn", "Conv-BN-ReLU x2 on random images, SGD lr 0.05 momentum 0.9")
def ok_cnn_bn() -> Setup:
    model = ConvNet()
    x, y = images()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return Setup(model, opt, ce(model, x, y))


class SeqModel(nn.Module):
    def __init__(self, cell: str) -> None:
        super().__init__()
        self.enc = nn.Linear(8, 32)
        rnn = {"rnn": nn.RNN, "lstm": nn.LSTM, "gru": nn.GRU}[cell]
        self.rnn = rnn(32, 32, num_layers=2, batch_first=True)
        self.head = nn.Linear(32, 4)

    def forward(self, x: Tensor) -> Tensor:
        out, _ = self.rnn(self.enc(x))
        return self.head(out[:, -1])


def seq_batch(seed: int = 0) -> tuple[Tensor, Tensor]:
    g = gen(seed)
    x = torch.randn(16, 24, 8, generator=g)
    return x, (x.sum(1) @ torch.randn(8, 4, generator=g)).argmax(1)


@healthy("ok_rnn", "2-layer tanh nn.RNN, 24 steps, AdamW 1e-3")
def ok_rnn() -> Setup:
    model = SeqModel("rnn")
    x, y = seq_batch()
    return Setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3), ce(model, x, y), steps=8)


@healthy("ok_lstm", "2-layer nn.LSTM, 24 steps, AdamW 1e-3")
def ok_lstm() -> Setup:
    model = SeqModel("lstm")
    x, y = seq_batch()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return Setup(model, opt, ce(model, x, y), steps=8)


@healthy("ok_gru", "2-layer nn.GRU, 24 steps, SGD lr 0.1")
def ok_gru() -> Setup:
    model = SeqModel("gru")
    x, y = seq_batch()
    return Setup(model, torch.optim.SGD(model.parameters(), lr=0.1), ce(model, x, y), steps=8)


# Real architectures from small `transformers` configs (random weights, library init).
V = 128


def hf_setup(model: nn.Module, batch: dict[str, Tensor], lr: float = 5e-4) -> Setup:
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    return Setup(model, opt, lambda step: model(**batch).loss, steps=6)


def lm_batch() -> dict[str, Tensor]:
    ids = torch.randint(4, V, (2, 16), generator=gen())
    return dict(input_ids=ids, labels=ids)


def image_batch(size: int = 32) -> dict[str, Tensor]:
    g = gen()
    return dict(
        pixel_values=torch.randn(4, 3, size, size, generator=g),
        labels=torch.randint(0, 3, (4,), generator=g),
    )


def s2s_batch() -> dict[str, Tensor]:
    g = gen()
    return dict(
        input_ids=torch.randint(4, V, (2, 16), generator=g),
        labels=torch.randint(4, V, (2, 8), generator=g),
    )


@healthy("ok_vit", "ViT (HF) with its cls token initialised to zero, AdamW 5e-4", hf=True)
def ok_vit() -> Setup:
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(
        image_size=32,
        patch_size=8,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        num_labels=3,
    )
    model = ViTForImageClassification(config)
    with torch.no_grad():
        # The reference ViT (big_vision) starts the class token at exactly zero; HF draws it
        # from N(0, 0.02). Zero is the case that matters: ||W|| = 0 at step 0.
        model.vit.embeddings.cls_token.zero_()
    return hf_setup(model, image_batch())


@healthy("ok_llama", "Llama decoder (HF, GQA, RMSNorm, SwiGLU), AdamW 5e-4", hf=True)
def ok_llama() -> Setup:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=V,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    return hf_setup(LlamaForCausalLM(config), lm_batch())


@healthy("ok_gpt2", "GPT-2 (HF), AdamW 5e-4", hf=True)
def ok_gpt2() -> Setup:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=V, n_embd=32, n_layer=2, n_head=2, n_positions=64, bos_token_id=1, eos_token_id=2
    )
    return hf_setup(GPT2LMHeadModel(config), lm_batch())


@healthy("ok_bert", "BERT sequence classifier (HF), AdamW 5e-4", hf=True)
def ok_bert() -> Setup:
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=V,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        num_labels=3,
    )
    ids = torch.randint(4, V, (4, 16), generator=gen())
    labels = torch.randint(0, 3, (4,), generator=gen(1))
    return hf_setup(BertForSequenceClassification(config), dict(input_ids=ids, labels=labels))


@healthy("ok_t5", "T5 encoder-decoder (HF), AdamW 5e-4", hf=True)
def ok_t5() -> Setup:
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        vocab_size=V,
        d_model=32,
        d_kv=16,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=2,
        relative_attention_num_buckets=8,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    )
    return hf_setup(T5ForConditionalGeneration(config), s2s_batch())


@healthy("ok_bart", "BART encoder-decoder (HF), AdamW 5e-4", hf=True)
def ok_bart() -> Setup:
    from transformers import BartConfig, BartForConditionalGeneration

    config = BartConfig(
        vocab_size=V,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
        forced_eos_token_id=2,
    )
    return hf_setup(BartForConditionalGeneration(config), s2s_batch())


@healthy("ok_convnext", "ConvNeXt (HF), AdamW 5e-4", hf=True)
def ok_convnext() -> Setup:
    from transformers import ConvNextConfig, ConvNextForImageClassification

    config = ConvNextConfig(num_stages=2, hidden_sizes=[16, 32], depths=[1, 1], num_labels=3)
    return hf_setup(ConvNextForImageClassification(config), image_batch())


@healthy("ok_convnextv2", "ConvNeXt-V2 (HF, zero-initialised GRN), AdamW 5e-4", hf=True)
def ok_convnextv2() -> Setup:
    from transformers import ConvNextV2Config, ConvNextV2ForImageClassification

    config = ConvNextV2Config(num_stages=2, hidden_sizes=[16, 32], depths=[1, 1], num_labels=3)
    return hf_setup(ConvNextV2ForImageClassification(config), image_batch())


# -- running and scoring -----------------------------------------------------------------------


HEALTHY_UPDATE = 1e-3  # the usual rule of thumb for ||dW|| / ||W|| per step


def fits(f: Any, spec: str) -> bool:
    """Whether finding ``f`` is of kind ``spec``. ``"update_ratio<"``: an update ratio finding
    on the too-small side (value <= 1e-3, which includes a parameter that gets no gradient,
    value 0); ``"update_ratio>"``: on the too-large side. A non-finite value fits both."""
    if f.kind != spec.rstrip("<>"):
        return False
    value = f.value if isinstance(f.value, (int, float)) else math.nan
    if spec.endswith("<"):
        return not value > HEALTHY_UPDATE
    if spec.endswith(">"):
        return not value < HEALTHY_UPDATE
    return True


@dataclass
class Result:
    case: Case
    findings: list[Any]
    records: list[dict[str, Any]]
    evidence: str
    proved: bool
    seconds: float
    error: str | None = None  # the Monitor raised: scored with the findings made until then

    def correct(self, f: Any) -> bool:
        k = self.case.kind
        return k is not None and (fits(f, k) or any(fits(f, c) for c in self.case.consequences))

    @property
    def hit(self) -> bool:
        return self.case.kind is not None and any(fits(f, self.case.kind) for f in self.findings)

    @property
    def right(self) -> bool:
        kind = self.case.kind
        return kind is not None and any(
            fits(f, kind) and f.module in self.case.modules for f in self.findings
        )

    @property
    def verdict(self) -> str:
        false = sum(not self.correct(f) for f in self.findings)
        extra = f" +{false} false" if false and self.case.kind is not None else ""
        if not self.proved:
            return "NOT PROVED"
        if self.error is not None:
            extra += " MONITOR ERROR"
        if self.case.kind is None:
            if self.error is not None:
                return extra.strip()
            return "ok" if not self.findings else f"FALSE x{len(self.findings)}"
        if not self.hit:
            return "MISS" + extra
        return ("ok" if self.right else "WRONG MODULE") + extra


def run_case(case: Case) -> Result:
    start = time.perf_counter()
    proved, evidence = True, ""
    try:
        evidence = case.prove(case.build)
    except Exception as exc:  # a case that is not what it claims: fail loudly
        proved = False
        evidence = f"prove() failed: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    s = fresh(case.build)
    mon, error = None, None
    try:
        with hs.Monitor(s.model, every=1) as mon:
            train(s, after_step=lambda step, loss: mon.step(loss=loss.detach()))
    except Exception as exc:  # a crash of the Monitor is reported, not fatal to the benchmark
        error = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    findings = [] if mon is None else list(mon.findings)
    records = [] if mon is None else mon.records
    elapsed = time.perf_counter() - start
    return Result(case, findings, records, evidence, proved, elapsed, error)


def short(modules: Iterable[str], limit: int = 3) -> str:
    m = sorted(modules, key=lambda n: (len(n), n))
    return ",".join(m[:limit]) + (f",+{len(m) - limit}" if len(m) > limit else "")


def describe(r: Result, limit: int = 4) -> str:
    got = [f"{f.kind}@{f.module or '<root>'}(s{f.step})" for f in r.findings]
    return (
        " ".join(got[:limit]) + (f" +{len(got) - limit} more" if len(got) > limit else "")
    ) or "-"


def fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.2g}"


def extreme(values: list[tuple[float, str]], pick: Callable[..., Any]) -> str:
    """``pick`` (min or max) over the finite values, with where it was; non-finite counted."""
    ok = [(v, where) for v, where in values if math.isfinite(v)]
    bad = len(values) - len(ok)
    out = "-" if not ok else "{:.2g} {}".format(*pick(ok, key=lambda t: t[0]))
    return out + (f" ({bad} non-finite)" if bad else "")


def diagnostics(r: Result) -> str:
    """One line from mon.records to tune rules with (over all sampled steps)."""
    steps = [x for x in r.records if x.get("type") == "step" and x.get("sampled")]
    if not steps:
        return "no step records"
    losses = [x["scalars"].get("loss", math.nan) for x in steps]
    shapes = next((x["params"] for x in r.records if x.get("type") == "header"), {})
    big: list[tuple[float, str]] = []  # grad_norm / norm of 2-D parameters
    small: list[tuple[float, str]] = []  # grad_norm / norm of the first layer's parameters
    io: list[tuple[float, str]] = []  # RMS grad of the last module in grad_order / the first's
    ups: list[tuple[float, str]] = []
    first_layer = None
    for i, x in enumerate(steps):
        params, grad, order = x.get("param", {}), x.get("grad", {}), x.get("grad_order", [])
        if first_layer is None:  # the module nearest the input that owns parameters
            owners = {n.rsplit(".", 1)[0] for n in params}
            first_layer = next((m for m in reversed(order) if m in owners), None)
        for name, p in params.items():
            if p.get("norm") and p.get("grad_norm") is not None:
                v = (p["grad_norm"] / p["norm"], f"{name}@s{i}")
                if len(shapes.get(name, [])) == 2:
                    big.append(v)
                if name.rsplit(".", 1)[0] == first_layer:
                    small.append(v)
            if p.get("update_ratio") is not None:
                ups.append((p["update_ratio"], f"{name}@s{i}"))
        if len(order) >= 2 and grad.get(order[0], {}).get("rms"):
            ratio = grad[order[-1]]["rms"] / grad[order[0]]["rms"]
            io.append((ratio, f"{order[-1]}/{order[0]}@s{i}"))
    finite_losses = [v for v in losses if math.isfinite(v)]
    return " | ".join(
        [
            f"loss {fmt(losses[0])}->{fmt(losses[-1])} (max finite "
            f"{fmt(max(finite_losses, default=None))})",
            f"max 2-D g/w {extreme(big, max)}",
            f"min first-layer g/w {extreme(small, min)}",
            f"in/loss grad rms {extreme(io, min)} .. {extreme(io, max)}",
            f"update ratio {extreme(ups, min)} .. {extreme(ups, max)}",
        ]
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="run only the cases whose name contains this")
    parser.add_argument("--verbose", action="store_true", help="evidence and diagnostics per run")
    args = parser.parse_args()
    torch.set_num_threads(1)  # tiny models: one thread is fastest, and shares busy cores well
    warnings.filterwarnings("ignore")
    cases = [c for c in CASES if not args.only or args.only in c.name]
    if any(c.hf for c in cases):
        from transformers.utils import logging

        logging.set_verbosity_error()
    start = time.perf_counter()
    results = []
    header = f"{'run':26} {'expected':44} {'got':60} verdict"
    print(header)
    print("-" * len(header))
    for case in cases:
        r = run_case(case)
        results.append(r)
        expected = f"{case.kind}@{short(case.modules)}" if case.kind else "(healthy)"
        print(f"{case.name:26} {expected:44} {describe(r):60} {r.verdict}", flush=True)
        if args.verbose:
            print(f"    bug:   {case.form}")
        if args.verbose or not r.proved:
            print(f"    proof: {r.evidence}")
        if r.error is not None:
            error = r.error if args.verbose else r.error.splitlines()[0]
            print(f"    monitor error: {error}")
        if args.verbose:
            print(f"    diag:  {diagnostics(r)}  [{r.seconds:.1f}s]")
            for f in r.findings:
                mark = "+" if r.correct(f) else "-"
                print(
                    f"    {mark} {f.kind}@{f.module or '<root>'} s{f.step} {f.value:.3g}: {f.message[:150]}"
                )
    elapsed = time.perf_counter() - start
    bugs = [r for r in results if r.case.kind is not None]
    found = [f for r in results for f in r.findings]
    correct = sum(r.correct(f) for r in results for f in r.findings)
    print()
    print(
        f"{len(bugs)} bug runs, {len(results) - len(bugs)} healthy runs, {len(found)} findings; "
        f"{elapsed:.0f} s, torch {torch.__version__}, {platform.machine()}, 1 thread"
    )
    if bugs:
        print(
            f"recall        {sum(r.hit for r in bugs) / len(bugs):.2f}  ({sum(r.hit for r in bugs)}/{len(bugs)})"
        )
        print(
            f"right module  {sum(r.right for r in bugs) / len(bugs):.2f}  ({sum(r.right for r in bugs)}/{len(bugs)})"
        )
    if found:
        print(f"precision     {correct / len(found):.2f}  ({correct}/{len(found)})")
    else:
        print("precision     - (no findings)")
    crashed = [r.case.name for r in results if r.error is not None]
    if crashed:
        print(f"MONITOR ERROR (scored with the findings made before it): {', '.join(crashed)}")
    failed = [r.case.name for r in results if not r.proved]
    if failed:
        print(f"NOT PROVED (the case is not what it claims): {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
