"""Pictures without a plotting library: a jet colour map, blending, and PNG files written
with ``zlib`` and ``struct`` (8-bit RGB, no interlace)."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import torch

__all__ = ["blend", "colorize", "png_bytes", "to_rgb", "write_png"]


def colorize(heat: torch.Tensor) -> torch.Tensor:
    """``[..., H, W]`` values in [0, 1] -> ``[..., H, W, 3]`` floats in [0, 1] (jet: blue for
    0, through cyan, yellow, to red for 1)."""
    t = heat.float().clamp(0, 1).unsqueeze(-1)
    centres = torch.tensor([3.0, 2.0, 1.0], device=t.device)  # red, green, blue
    return (1.5 - (4 * t - centres).abs()).clamp(0, 1)


def to_rgb(images: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Images as float ``[N, H, W, 3]`` in [0, 1]: from ``[N, C, H, W]`` (C = 1 or 3) or
    ``[N, H, W, C]``; uint8 is read as 0-255, floats outside [0, 1] are min-max scaled per
    image (a normalised model input); resized (bilinear) to ``size``."""
    x = images.detach()
    if x.dim() == 3:  # [N, H, W] grey
        x = x.unsqueeze(1)
    if x.dim() != 4:
        raise ValueError(f"images must be [N, C, H, W] or [N, H, W, C], got {list(x.shape)}")
    if x.shape[1] not in (1, 3) and x.shape[-1] in (1, 3):
        x = x.movedim(-1, 1)
    if x.shape[1] not in (1, 3):
        raise ValueError(f"images must have 1 or 3 channels, got shape {list(x.shape)}")
    if x.dtype == torch.uint8:
        x = x.float() / 255
    else:
        x = x.float()
        low = x.flatten(1).amin(1).view(-1, 1, 1, 1)
        high = x.flatten(1).amax(1).view(-1, 1, 1, 1)
        outside = (low < 0) | (high > 1)
        x = torch.where(outside, (x - low) / (high - low).clamp_min(1e-12), x)
    if tuple(x.shape[2:]) != tuple(size):
        x = torch.nn.functional.interpolate(x, size=size, mode="bilinear", align_corners=False)
    return x.expand(-1, 3, -1, -1).movedim(1, -1).clamp(0, 1)


def blend(rgb: torch.Tensor, heat: torch.Tensor, alpha: float) -> torch.Tensor:
    """uint8 ``[N, H, W, 3]``: ``(1 - alpha) * image + alpha * jet(heat)``."""
    mixed = (1 - alpha) * rgb + alpha * colorize(heat).to(rgb.device)
    return (mixed * 255).round().clamp(0, 255).to(torch.uint8)


def png_bytes(rgb: torch.Tensor) -> bytes:
    """A PNG file's bytes for one uint8 ``[H, W, 3]`` image."""
    rgb = rgb.detach().to("cpu", torch.uint8).contiguous()
    height, width = rgb.shape[:2]
    rows = torch.cat([torch.zeros(height, 1, dtype=torch.uint8), rgb.reshape(height, -1)], 1)
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + _chunk(b"IHDR", header)
        + _chunk(b"IDAT", zlib.compress(rows.numpy().tobytes(), 6))
        + _chunk(b"IEND", b"")
    )


def write_png(path: Path, rgb: torch.Tensor) -> None:
    path.write_bytes(png_bytes(rgb))


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
