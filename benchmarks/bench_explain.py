"""What hs.explain costs, side by side in one process with what people use instead.

Model (research/round4-anchors.md, section 3.3): a 7-conv CNN, a stem and six
conv-BN-ReLU(inplace) blocks of 32 channels, 64x64 inputs, batch 8, explained at the last
block; fp32 on the CPU, ``torch.set_num_threads(1)``.

Method: paired, interleaved timing. For each condition, warm-up pairs, then N pairs of
(reference, condition) timed back to back, alternating which goes first; the ratio is the
median over pairs of condition / reference.

- gradcam against one forward + a full backward (``loss.backward()`` through every
  parameter, what pytorch-grad-cam runs): aim <= 0.4x;
- gradcam against Captum's ``LayerGradCam(relu_attributions=True)`` when captum is
  installed: aim <= 1.0x;
- scorecam against a plain implementation of the same formula (torchcam's approach: all
  masks made, then batched masked forwards of ``batch_size`` rows, no hooks, no state kept).

    python benchmarks/bench_explain.py            # 15 pairs per condition
    python benchmarks/bench_explain.py --quick    # 4 pairs, a smoke test
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

import hookscope as hs

LAYER = "blocks.5"


def block(cin: int, cout: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(inplace=True),
    )


class CNN(nn.Module):
    def __init__(self, width: int = 32, classes: int = 10) -> None:
        super().__init__()
        self.stem = block(3, width, stride=2)
        self.blocks = nn.Sequential(*[block(width, width) for _ in range(6)])
        self.fc = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.blocks(self.stem(x)).mean((2, 3)))


def paired(reference: Callable[[], object], condition: Callable[[], object], pairs: int) -> float:
    """Median over pairs of time(condition) / time(reference)."""
    for _ in range(2):
        reference()
        condition()
    ratios = []
    for i in range(pairs):
        times = {}
        order = (reference, condition) if i % 2 == 0 else (condition, reference)
        for fn in order:
            start = time.perf_counter()
            fn()
            times[fn] = time.perf_counter() - start
        ratios.append(times[condition] / times[reference])
    return statistics.median(ratios)


def plain_scorecam(
    model: nn.Module, x: torch.Tensor, target: torch.Tensor, batch_size: int
) -> torch.Tensor:
    """Score-CAM without hookscope: a forward hook for A, every mask made up front, then
    batched masked forwards."""
    layer = dict(model.named_modules())[LAYER]
    kept = []
    handle = layer.register_forward_hook(lambda m, i, o: kept.append(o.detach().clone()))
    with torch.no_grad():
        model(x)
    handle.remove()
    a = kept[0]
    n, k = a.shape[:2]
    up = F.interpolate(a, size=x.shape[2:], mode="bilinear", align_corners=False).flatten(2)
    low, high = up.amin(2, keepdim=True), up.amax(2, keepdim=True)
    masks = ((up - low) / (high - low).clamp_min(1e-12)).view(n, k, *x.shape[2:])
    rows = torch.arange(n * k)
    scores = torch.empty(n * k)
    with torch.no_grad():
        for chunk in rows.split(batch_size):
            s, c = chunk // k, chunk % k
            out = model(x[s] * masks[s, c].unsqueeze(1))
            scores[chunk] = out.gather(1, target[s, None]).squeeze(1)
    w = torch.softmax(scores.view(n, k), 1)
    return torch.relu((w[:, :, None, None] * a).sum(1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    pairs = 4 if parser.parse_args().quick else 15
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = CNN().eval()
    x = torch.randn(8, 3, 64, 64)
    target = model(x).argmax(1)
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, 1 thread")

    def forward_backward() -> None:
        model.zero_grad(set_to_none=True)
        model(x).gather(1, target[:, None]).sum().backward()

    def gradcam() -> None:
        hs.explain(model, x, LAYER, "gradcam", target=target)

    ratio = paired(forward_backward, gradcam, pairs)
    print(f"gradcam / (forward + full backward): {ratio:.2f}x  (aim <= 0.4x)")

    try:
        from captum.attr import LayerGradCam
    except ImportError:
        print("captum not installed: no comparison with LayerGradCam")
    else:
        captum = LayerGradCam(model, dict(model.named_modules())[LAYER])

        def captum_gradcam() -> None:
            captum.attribute(x, target=target, relu_attributions=True)

        ratio = paired(captum_gradcam, gradcam, pairs)
        print(f"gradcam / Captum LayerGradCam: {ratio:.2f}x  (aim <= 1.0x)")

    def scorecam() -> None:
        hs.explain(model, x, LAYER, "scorecam", target=target, batch_size=64)

    def plain() -> None:
        plain_scorecam(model, x, target, 64)

    same = hs.explain(model, x, LAYER, "scorecam", target=target)[LAYER]
    print(
        f"scorecam, largest difference from the plain one: {(same - plain_scorecam(model, x, target, 64)).abs().max():.1e}"
    )
    ratio = paired(plain, scorecam, max(3, pairs // 3))
    print(f"scorecam / plain batched masked forwards: {ratio:.2f}x")


if __name__ == "__main__":
    main()
