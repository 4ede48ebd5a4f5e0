"""How a module's output is read as channels over a grid of positions.

The explain methods work on ``[N, K, *spatial]`` (channels first). Convolutions give that
already (``"NCHW"``); a Swin-style stage gives ``[N, H, W, C]`` (``"NHWC"``); a vision
transformer gives tokens ``[N, T, C]`` (``"NTC"``), a square grid of ``h * w`` patches, with or
without one class token first. ``layout="auto"`` picks the one reading that fits the output's
shape (the grid has the input's aspect ratio and is no larger than it) and refuses, naming
``layout=``, when none or several fit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from .._errors import LayoutError

__all__ = ["LAYOUTS", "Layout", "find_layout", "previous_in_sequential"]

LAYOUTS = ("NCHW", "NHWC", "NTC")

# Modules whose output is channels-first whatever its shape, and those that work on the last
# dimension (a channels-last output): they settle a shape that fits both 4-d readings.
_CHANNELS_FIRST = (
    nn.modules.conv._ConvNd,
    nn.modules.batchnorm._BatchNorm,
    nn.modules.pooling._MaxPoolNd,
    nn.modules.pooling._AvgPoolNd,
    nn.GroupNorm,
)
_CHANNELS_LAST = (nn.Linear, nn.LayerNorm)
# Modules that keep their input's layout (seen through to the module before them).
_ELEMENTWISE = (
    nn.ReLU,
    nn.ReLU6,
    nn.LeakyReLU,
    nn.GELU,
    nn.SiLU,
    nn.Hardswish,
    nn.Sigmoid,
    nn.Tanh,
    nn.Identity,
    nn.modules.dropout._DropoutNd,
)


@dataclass(frozen=True)
class Layout:
    """One reading of an output: ``kind`` (``"NCHW"``, ``"NHWC"`` or ``"NTC"``), how many
    tokens come before the grid (``prefix``, a class token: 1) and the grid's size."""

    kind: str
    grid: tuple[int, ...]
    prefix: int = 0

    def to_grid(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` read as ``[N, K, *grid]`` (a view where it can be)."""
        if self.kind == "NCHW":
            return t
        if self.kind == "NHWC":
            return t.movedim(-1, 1)
        tokens = t[:, self.prefix :, :]
        return tokens.reshape(t.shape[0], *self.grid, t.shape[-1]).movedim(-1, 1)

    def from_grid(self, grid: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """``grid`` (``[N, K, *grid]``) back in the output's own layout, prefix tokens 0."""
        if self.kind == "NCHW":
            return grid
        if self.kind == "NHWC":
            return grid.movedim(1, -1)
        out = like.new_zeros(like.shape)
        out[:, self.prefix :, :] = grid.movedim(1, -1).reshape(like.shape[0], -1, like.shape[-1])
        return out

    def __str__(self) -> str:
        grid = "x".join(map(str, self.grid))
        if self.kind == "NTC":
            first = (
                f"{self.prefix} token{'s' if self.prefix != 1 else ''} then " if self.prefix else ""
            )
            return f"NTC ({first}a {grid} grid)"
        return f"{self.kind} ({grid} grid)"


def find_layout(
    name: str,
    module: nn.Module,
    shape: tuple[int, ...],
    image: tuple[int, ...] | None,
    layout: str,
    before: list[nn.Module] | None = None,
) -> Layout:
    """The layout of ``module``'s output of ``shape``; ``image`` is the input's spatial size
    when the input is an image (it gives the grid's aspect ratio), ``layout`` what the user
    asked for (``"auto"`` or one of :data:`LAYOUTS`); ``before``: the modules before it in
    its parent ``nn.Sequential``, nearest first (they decide for an elementwise module)."""
    if layout != "auto" and layout not in LAYOUTS:
        raise LayoutError(
            f"layout={layout!r} is not a layout; choose 'auto' or one of {', '.join(LAYOUTS)}"
        )
    rank = len(shape)
    if rank < 3:
        raise LayoutError(
            f"the output of {name!r} has shape {list(shape)}: no positions to make a map of "
            "(a class activation map needs [N, C, H, W], [N, H, W, C] or [N, tokens, C]). "
            "Choose a convolutional or token layer, or method='grad_x_act' / "
            "'integrated_gradients', which attribute to any output."
        )
    fits = _candidates(shape, image)
    if layout != "auto":
        chosen = [f for f in fits if f.kind == layout]
        if not chosen:
            raise LayoutError(
                f"layout={layout!r} does not fit the output of {name!r}, shape "
                f"{list(shape)}{_against(image)}. {_readings(fits)}"
            )
        return chosen[0]
    if len(fits) > 1:
        fits = _settle(fits, [module, *(before or [])]) or fits
    if len(fits) == 1:
        return fits[0]
    if not fits:
        raise LayoutError(
            f"cannot read the output of {name!r}, shape {list(shape)}, as a grid of "
            f"positions{_against(image)}: neither [N, C, H, W], [N, H, W, C] nor tokens "
            "[N, (1 +) h*w, C] fit. Pass layout='NCHW', 'NHWC' or 'NTC' to say how to read it."
        )
    raise LayoutError(
        f"the output of {name!r}, shape {list(shape)}, can be read as "
        f"{' or as '.join(map(str, fits))}{_against(image)}; pass layout="
        f"{' or layout='.join(repr(f.kind) for f in fits)} to say which."
    )


def _candidates(shape: tuple[int, ...], image: tuple[int, ...] | None) -> list[Layout]:
    rank = len(shape)
    found = []
    if _fits(shape[2:], image) and (image is not None or rank >= 4):
        found.append(Layout("NCHW", tuple(shape[2:])))
    if rank == 4 and _fits(shape[1:3], image):
        found.append(Layout("NHWC", tuple(shape[1:3])))
    if rank == 3:
        for prefix in (0, 1):
            grid = _token_grid(shape[1] - prefix, image)
            if grid is not None:
                found.append(Layout("NTC", grid, prefix))
                break  # no class token when the tokens alone make a grid
    return found


def _fits(grid: tuple[int, ...], image: tuple[int, ...] | None) -> bool:
    """A grid of positions fits an image when it has the image's aspect ratio (within the
    rounding of strided layers) and is no larger; without an image, when it is square."""
    if not grid or min(grid) < 1:
        return False
    if image is None:
        return len(set(grid)) == 1
    if len(image) != len(grid) or any(g > i for g, i in zip(grid, image, strict=True)):
        return False
    scales = [i / g for g, i in zip(grid, image, strict=True)]
    return max(scales) / min(scales) <= 1 + 1 / min(grid) + 1e-9


def _token_grid(tokens: int, image: tuple[int, ...] | None) -> tuple[int, int] | None:
    if tokens < 1:
        return None
    ratio = image[0] / image[1] if image is not None and len(image) == 2 else 1.0
    h = max(1, round(math.sqrt(tokens * ratio)))
    for hh in (h, h - 1, h + 1):
        if hh >= 1 and tokens % hh == 0 and _fits((hh, tokens // hh), image):
            return hh, tokens // hh
    return None


def _settle(fits: list[Layout], chain: list[nn.Module]) -> list[Layout]:
    """Of several readings, those the module's kind allows (a conv's output is channels
    first; a Linear's or LayerNorm's has its channels last). An ``nn.Sequential`` returns
    its last child's output: that child decides; an elementwise module (ReLU, Dropout) keeps
    the layout of the module before it in ``chain``."""
    for module in chain:
        kind = _kind(module)
        if kind is not None:
            return [f for f in fits if (f.kind == "NCHW") == (kind == "first")]
        if not isinstance(module, _ELEMENTWISE):
            return []
    return []


def previous_in_sequential(model: nn.Module, name: str) -> list[nn.Module]:
    """The modules before ``name`` in its parent, nearest first, when the parent is an
    ``nn.Sequential`` (each one's output is the next one's input); else ``[]``."""
    if not name:
        return []
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name)
    if type(parent) is not nn.Sequential:
        return []
    names = list(parent._modules)
    return [parent._modules[n] for n in reversed(names[: names.index(child)])]  # type: ignore[misc]


def _kind(module: nn.Module) -> str | None:
    if isinstance(module, _CHANNELS_FIRST):
        return "first"
    if isinstance(module, _CHANNELS_LAST):
        return "last"
    if type(module) is nn.Sequential:
        last = [c for c in module.children() if not isinstance(c, _ELEMENTWISE)]
        return _kind(last[-1]) if last else None
    return None


def _against(image: tuple[int, ...] | None) -> str:
    return "" if image is None else f" for an input of size {'x'.join(map(str, image))}"


def _readings(fits: list[Layout]) -> str:
    if not fits:
        return "No layout reads it as a grid."
    return "It reads as " + " or ".join(map(str, fits)) + "."
