"""The `hookscope demo`: a small CNN trained on scikit-learn's bundled digits, monitored.

Each ``fault`` injects one pathology into an otherwise healthy run, so that the Monitor's
finding appears on the layer named in :data:`FAULTS`:

- ``nan``: for one step, a log-compression of the second conv's output (``features.4``'s
  input) is applied in the demo's own code; the log of a negative is NaN, and the finding
  names the op (``aten.log``), the module and that line; the step is skipped, as a guarded
  training loop does.
- ``dead``: ``features.4`` (the second BatchNorm) gets a shift of -20, so the ReLU after it
  (``features.5``) never fires again.
- ``explode``: the gradient the last layer (``classifier.3``) passes back to its input is
  multiplied by 1e6 (an intervention at ``grad_input``, as a bad custom backward would), so
  every earlier layer sees an exploding gradient; the finding names ``classifier.1``, the
  first weights it reaches.
- ``vanish``: the gradient reaching ``classifier.1``'s output is multiplied by 1e-9 (an
  intervention at ``grad_output``, as a bad loss scale in one branch would), so every earlier
  layer is starved; the finding names the starved input side, ``features.0``.

Every run also explains one test digit of each class at the last conv (``features.3``,
Grad-CAM) about eight times over training (``Monitor(explain=hs.Probe(...))``): the report's
*Explanations* part shows where the model looks as it learns.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ._errors import HookscopeError, missing_extra
from ._format import progress_bar

__all__ = ["FAULTS", "DemoResult", "DigitsCNN", "load_digits", "run_demo"]

# fault -> (Finding kind, module it names)
FAULTS: dict[str, tuple[str, str] | None] = {
    "none": None,
    "nan": ("nonfinite", "features.4"),
    "dead": ("dead_units", "features.5"),
    "explode": ("exploding_gradient", "classifier.1"),
    "vanish": ("vanishing_gradient", "features.0"),  # the starved input side
}


class DigitsCNN(nn.Module):
    """Conv-BN-ReLU x2, max-pool, then a two-layer classifier: 8x8 digits -> 10 logits."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
            nn.Conv2d(width, 2 * width, 3, padding=1),
            nn.BatchNorm2d(2 * width),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),  # (B, 2w, 4, 4)
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(2 * width * 16, 64),
            nn.ReLU(inplace=True),
            nn.Linear(64, 10),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def load_digits(seed: int = 0) -> tuple[torch.Tensor, ...]:
    """scikit-learn's bundled 8x8 digits (no download), standardized, split 80/20."""
    try:
        from sklearn.datasets import load_digits as sk_load_digits
    except ImportError:
        raise missing_extra("sklearn", "demo") from None
    data = sk_load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1)  # (N, 1, 8, 8)
    x = (x - x.mean()) / x.std()
    y = torch.tensor(data.target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(x))
    train, test = order[:cut], order[cut:]
    return x[train], y[train], x[test], y[test]


@dataclass
class DemoResult:
    accuracy: float
    findings: list[Any]
    log_dir: Path
    report: Path
    seconds: float
    steps: int
    tensorboard: bool = False
    notes: list[str] = field(default_factory=list)


def _fault_context(model: nn.Module, fault: str, step: int, nan_step: int) -> Any:
    from ._intervene import intervene

    if fault == "nan" and step == nan_step:
        return intervene(model, {"features.4": _log_input}, at="input")
    if fault == "explode":
        return intervene(model, {"classifier.3": lambda g, site: g * 1e6}, at="grad_input")
    if fault == "vanish":
        return intervene(model, {"classifier.1": lambda g, site: g * 1e-9}, at="grad_output")
    return contextlib.nullcontext()


def _one_per_class(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The first test digit of each class, in class order."""
    return torch.stack([x[(y == c).nonzero()[0, 0]] for c in range(10) if (y == c).any()])


def _log_input(args: tuple[torch.Tensor, ...], site: Any) -> tuple[torch.Tensor, ...]:
    """A log-compression of the second conv's output, a bug: the log of a negative is NaN."""
    (x,) = args
    return (torch.log(x),)


def run_demo(
    out: str | Path = "hookscope-demo",
    *,
    epochs: int = 4,
    fault: str = "none",
    seed: int = 0,
    every: int = 10,
    progress: bool = True,
) -> DemoResult:
    """Train :class:`DigitsCNN` with a Monitor attached and write the log and the report.

    Returns:
        Test accuracy, the Monitor's findings, and where the log and report went.
    """
    if fault not in FAULTS:
        raise HookscopeError(f"unknown fault {fault!r}; choose one of {', '.join(FAULTS)}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a model this small runs fastest on one core, and shares it well
    try:
        return _train(Path(out), epochs, fault, seed, every, progress)
    finally:
        torch.set_num_threads(threads)


def _train(
    log_dir: Path, epochs: int, fault: str, seed: int, every: int, progress: bool
) -> DemoResult:
    from ._explain._probe import Probe
    from ._extract import extract
    from ._monitor import Monitor
    from ._report import report
    from ._summary import summary

    start = time.perf_counter()
    torch.manual_seed(seed)
    x_train, y_train, x_test, y_test = load_digits(seed)
    model = DigitsCNN()
    if fault == "dead":
        with torch.no_grad():
            model.features[4].bias.fill_(-20.0)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    log_dir.mkdir(parents=True, exist_ok=True)
    batch = 32
    per_epoch = math.ceil(len(x_train) / batch)
    nan_step = per_epoch // 2
    model_summary = summary(model, x_train[:2])
    # The Monitor finds the optimizer by itself and skips an update that would write a NaN;
    # the probe explains one test digit per class at the last conv, ~8 times over training.
    probe = Probe(
        _one_per_class(x_test, y_test),
        where="features.3",
        every=max(1, epochs * per_epoch // 8),
    )
    mon = Monitor(model, every=every, log_dir=log_dir, on_nonfinite="skip", explain=probe)
    bar = progress_bar(
        progress, total=epochs * per_epoch, desc="training", unit="step", leave=False
    )
    step = 0
    with mon:
        mon.log("summary", **model_summary.to_dict())
        for _ in range(epochs):
            model.train()
            order = torch.randperm(len(x_train))
            for i in range(0, len(x_train), batch):
                idx = order[i : i + batch]
                with _fault_context(model, fault, step, nan_step):
                    loss = nn.functional.cross_entropy(model(x_train[idx]), y_train[idx])
                    loss.backward()
                    opt.step()
                opt.zero_grad(set_to_none=True)
                mon.step(loss=loss.detach())
                step += 1
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{loss.item():.3f}")
        model.eval()
        with torch.no_grad():
            accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
        mon.log("event", step=step, kind="evaluation", message=f"test accuracy {accuracy:.4f}")
        maps = extract(model, x_test[:1], where=["features.0", "features.3"])
        for name, value in maps.items():
            mon.log(
                "feature_maps",
                step=step,
                module=name,
                shape=list(value.shape[1:]),
                data=value[0].tolist(),
            )
    if bar is not None:
        bar.close()
    path = report(log_dir, log_dir / "report.html")
    tb = any(log_dir.rglob("events.out.tfevents.*"))
    return DemoResult(
        accuracy, list(mon.findings), log_dir, path, time.perf_counter() - start, step, tb
    )
