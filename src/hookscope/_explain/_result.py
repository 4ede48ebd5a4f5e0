"""The :class:`Explanation` a user reads: maps by module, heatmaps, overlays, PNG files,
faithfulness metrics and a notebook view."""

from __future__ import annotations

import base64
import html
import re
from pathlib import Path
from typing import Any

import torch

from .._errors import LayoutError, MissingRecordError, did_you_mean, never_ran_message
from ._inputs import Inputs
from ._layout import Layout
from ._methods import ATTRIBUTIONS, upsample
from ._png import blend, colorize, png_bytes, to_rgb, write_png
from ._run import Explained

__all__ = ["Explanation", "Layouts"]


class Layouts(dict):  # type: ignore[type-arg]
    """``{module name: "NCHW" | "NHWC" | "NTC"}``, the layout each output was read in.

    Compares equal to a string when every module was read that way, so that
    ``exp.layout == "NTC"`` reads naturally for one module; ``.detail[name]`` says more (the
    grid's size, the class token).
    """

    def __init__(self, layouts: dict[str, Layout]) -> None:
        super().__init__({name: lay.kind for name, lay in layouts.items()})
        self.detail = {name: str(lay) for name, lay in layouts.items()}

    def __eq__(self, other: object) -> bool:
        if isinstance(other, str):
            return len(self) > 0 and all(kind == other for kind in self.values())
        return super().__eq__(other)

    def __ne__(self, other: object) -> bool:
        return not self == other

    __hash__ = None  # type: ignore[assignment]


class Explanation:
    """Where the model looked, for one batch: made by :func:`hookscope.explain`.

    ``exp[name]`` is the map of the module's (last) call: ``[N, *grid]`` float32 for the CAM
    methods, shaped like the module's output for ``grad_x_act`` and
    ``integrated_gradients``; ``exp.all(name)`` one per call. ``exp.target`` and ``exp.score``
    are ``[N]``: the explained index (``None`` for a callable target) and its score.
    """

    def __init__(self, explained: Explained, inputs: Inputs, target: Any = None) -> None:
        self.method = explained.method
        self._target = target  # as given: the callable, for metrics
        self._maps = explained.maps
        self._layouts = explained.layouts
        self.target = explained.target
        self.score = explained.score
        self.missing = list(explained.missing)
        self.input_size = explained.image_size
        self._inputs = inputs
        self.layout = Layouts(
            {n: lays[-1] for n, lays in self._layouts.items() if isinstance(lays[-1], Layout)}
        )

    # -- reading ---------------------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        return list(self._maps)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.all(name)[-1]

    def all(self, name: str) -> list[torch.Tensor]:
        """One map per call of ``name``, in call order."""
        if name not in self._maps:
            if name in self.missing:
                raise MissingRecordError(never_ran_message([name]))
            raise MissingRecordError(
                f"{name!r} is not one of the explained modules "
                f"({', '.join(map(repr, self.names))}){did_you_mean(name, self.names)}."
            )
        return list(self._maps[name])

    def __contains__(self, name: object) -> bool:
        return name in self._maps

    def __iter__(self) -> Any:
        return iter(self._maps)

    def __len__(self) -> int:
        return len(self._maps)

    def keys(self) -> list[str]:
        return self.names

    def _name(self, name: str | None) -> str:
        if name is not None:
            self.all(name)
            return name
        if len(self._maps) != 1:
            raise MissingRecordError(
                f"this explanation has {len(self._maps)} modules ({', '.join(map(repr, self.names))}): "
                "say which, e.g. exp.heatmap(name)."
            )
        return self.names[0]

    # -- pictures --------------------------------------------------------------------------
    def grid(self, name: str | None = None, call: int = -1) -> torch.Tensor:
        """The map of ``name`` as ``[N, *grid]`` at the layer's resolution (attribution maps
        summed over channels)."""
        name = self._name(name)
        m = self._maps[name][call]
        if self.method not in ATTRIBUTIONS:
            return m
        layout = self._layouts[name][call]
        if isinstance(layout, LayoutError):
            raise layout
        return layout.to_grid(m).sum(1)

    def heatmap(
        self, name: str | None = None, *, call: int = -1, size: tuple[int, ...] | None = None
    ) -> torch.Tensor:
        """``[N, H, W]`` in [0, 1]: the map upsampled (bilinear) to the input's size (or
        ``size``), then min-max scaled per sample (a constant map gives zeros)."""
        m = self.grid(name, call).float()
        size = size or self.input_size or tuple(m.shape[1:])
        up = upsample(m.unsqueeze(1), tuple(size)).squeeze(1)
        flat = up.flatten(1)
        low = flat.amin(1, keepdim=True)
        span = flat.amax(1, keepdim=True) - low
        scaled = torch.where(span > 0, (flat - low) / torch.where(span > 0, span, 1), 0)
        return scaled.view(up.shape)

    def overlay(
        self, images: torch.Tensor | None = None, name: str | None = None, *, alpha: float = 0.5
    ) -> torch.Tensor:
        """uint8 ``[N, H, W, 3]``: the heatmap (jet) blended on ``images`` (default: the
        explained input, min-max scaled for display)."""
        images = self._images(images)
        heat = self.heatmap(name, size=tuple(images.shape[1:3]) if images is not None else None)
        if images is None:
            return (colorize(heat) * 255).round().to(torch.uint8).cpu()
        return blend(images, heat.to(images.device), alpha).cpu()

    def _images(self, images: torch.Tensor | None) -> torch.Tensor | None:
        if images is None:
            if self.input_size is None or len(self.input_size) != 2:
                return None
            images = self._inputs.primary
            if images.shape[1] not in (1, 3):
                return None
        size = tuple(images.shape[-2:]) if images.shape[1] in (1, 3) else tuple(images.shape[1:3])
        return to_rgb(images, size)  # type: ignore[arg-type]

    def save(self, directory: str | Path, images: torch.Tensor | None = None) -> list[Path]:
        """One PNG per sample and module (and call, for a module called more than once):
        ``<module>_<sample>.png`` (``<module>.call<k>_<sample>.png``), the overlay on the
        images (or the explained input), else the heatmap alone. Returns the paths."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        rgb = self._images(images)
        paths = []
        for name, maps in self._maps.items():
            for call in range(len(maps)):
                size = tuple(rgb.shape[1:3]) if rgb is not None else None
                heat = self.heatmap(name, call=call, size=size)
                pictures = (
                    blend(rgb, heat.to(rgb.device), 0.5)
                    if rgb is not None
                    else (colorize(heat) * 255).round().to(torch.uint8)
                )
                stem = _slug(name) + (f".call{call}" if len(maps) > 1 else "")
                for i, picture in enumerate(pictures):
                    path = out / f"{stem}_{i}.png"
                    write_png(path, picture)
                    paths.append(path)
        return paths

    # -- faithfulness ----------------------------------------------------------------------
    def metrics(self, model: torch.nn.Module, name: str | None = None, **options: Any) -> Any:
        """Average drop, increase in confidence, deletion and insertion areas of each
        sample's heatmap: see :func:`hookscope._explain._metrics.faithfulness`."""
        from ._metrics import faithfulness

        return faithfulness(
            model, self._inputs, self.heatmap(name), self._target_for_metrics(), **options
        )

    def _target_for_metrics(self) -> Any:
        return self._target if self.target is None else self.target

    # -- views -----------------------------------------------------------------------------
    def __repr__(self) -> str:
        target = "callable" if self.target is None else self.target.tolist()
        lines = [f"Explanation(method={self.method!r}, target={target})"]
        for name, maps in self._maps.items():
            shapes = ", ".join(str(list(m.shape)) for m in maps)
            layout = self.layout.detail.get(name, "no grid")
            lines.append(f"  {name or '<root>'}: {shapes}  {layout}")
        return "\n".join(lines)

    def _repr_html_(self, limit: int = 8) -> str:
        parts = [f"<div><b>{html.escape(self.method)}</b>"]
        for name in self.names:
            try:
                pictures = self.overlay(name=name)
            except LayoutError as error:
                parts.append(f"<p>{html.escape(name)}: {html.escape(str(error))}</p>")
                continue
            parts.append(f"<p>{html.escape(name or '<root>')}</p><div>")
            for i, picture in enumerate(pictures[:limit]):
                data = base64.b64encode(png_bytes(picture)).decode()
                label = "" if self.target is None else f"target {self.target[i].item()}, "
                title = html.escape(f"sample {i}: {label}score {self.score[i].item():.4g}")
                parts.append(
                    f'<img src="data:image/png;base64,{data}" title="{title}" '
                    'style="width:96px;image-rendering:pixelated;margin:2px">'
                )
            parts.append("</div>")
        return "".join(parts) + "</div>"


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", name) or "model"
