"""A small generated collection of synthetic "photos" for demos and tests.

Six visually distinct families (sunsets, mountains, bubbles, waves, tiles, starry nights), each
image with random colors, positions, scales, angles and sensor-like noise. Deterministic per seed.
"""

from __future__ import annotations

import argparse
import logging
import math
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

__all__ = ["FAMILIES", "make_sample_collection", "main"]

logger = logging.getLogger(__name__)

FAMILIES: tuple[str, ...] = ("sunset", "mountains", "bubbles", "waves", "tiles", "stars")
"""Family names, also the sub-folder names of a generated collection."""

_Canvas = np.ndarray  # float32 H x W x 3 in 0..255


def _grid(size: int) -> tuple[np.ndarray, np.ndarray]:
    """Pixel-center coordinates in [0, 1): (y, x), each size x size."""
    c = (np.arange(size, dtype=np.float32) + 0.5) / size
    return np.meshgrid(c, c, indexing="ij")


def _hsv(
    rng: np.random.Generator, h: tuple[float, float], s: tuple[float, float], v: tuple[float, float]
) -> np.ndarray:
    """A random RGB color (0..255 floats) with hue/saturation/value drawn from the given ranges."""
    hue = rng.uniform(*h) % 1.0
    sat, val = rng.uniform(*s), rng.uniform(*v)
    i = int(hue * 6) % 6
    f = hue * 6 - math.floor(hue * 6)
    p, q, t = val * (1 - sat), val * (1 - f * sat), val * (1 - (1 - f) * sat)
    rgb = [(val, t, p), (q, val, p), (p, val, t), (p, q, val), (t, p, val), (val, p, q)][i]
    return np.array(rgb, dtype=np.float32) * 255.0


def _mix(a: np.ndarray, b: np.ndarray, t: np.ndarray) -> _Canvas:
    """Per-pixel blend of colors a and b with weights t (H x W in 0..1)."""
    return a[None, None, :] * (1.0 - t[..., None]) + b[None, None, :] * t[..., None]


def _paint(canvas: _Canvas, mask: np.ndarray, color: np.ndarray) -> None:
    canvas[:] = canvas * (1.0 - mask[..., None]) + color[None, None, :] * mask[..., None]


def _disc(y: np.ndarray, x: np.ndarray, cy: float, cx: float, r: float, size: int) -> np.ndarray:
    """Anti-aliased disc mask (about one pixel of soft edge)."""
    d = np.sqrt((y - cy) ** 2 + (x - cx) ** 2)
    return np.clip((r - d) * size + 0.5, 0.0, 1.0)


def _sunset(rng: np.random.Generator, size: int) -> _Canvas:
    y, x = _grid(size)
    horizon = rng.uniform(0.55, 0.8)
    top = _hsv(rng, (0.6, 0.8), (0.5, 0.9), (0.25, 0.55))
    glow = _hsv(rng, (-0.05, 0.1), (0.6, 1.0), (0.85, 1.0))
    t = np.clip(y / horizon, 0, 1) ** rng.uniform(0.6, 1.6)
    img = _mix(top, glow, t)
    cx, r = rng.uniform(0.2, 0.8), rng.uniform(0.06, 0.14)
    cy = horizon - rng.uniform(-0.3, 1.0) * r
    sun = _hsv(rng, (0.1, 0.16), (0.2, 0.6), (0.95, 1.0))
    halo = np.exp(-((y - cy) ** 2 + (x - cx) ** 2) / (2 * (2.5 * r) ** 2)) * 0.5
    _paint(img, halo * (y < horizon), sun)
    _paint(img, _disc(y, x, cy, cx, r, size) * (y < horizon), sun)
    sea = _hsv(rng, (0.55, 0.75), (0.4, 0.8), (0.08, 0.3))
    below = y >= horizon
    depth = np.clip((y - horizon) / max(1e-3, 1 - horizon), 0, 1)
    water = _mix(glow * 0.6, sea, depth**0.5)
    ripple = 0.5 + 0.5 * np.sin(y * size * rng.uniform(1.5, 3.0) + rng.uniform(0, 6.3))
    reflect = np.exp(-((x - cx) ** 2) / (2 * r**2)) * ripple * (1 - depth) * 0.8
    _paint(water, reflect, sun)
    img[below] = water[below]
    return img


def _mountains(rng: np.random.Generator, size: int) -> _Canvas:
    y, _ = _grid(size)
    sky_top = _hsv(rng, (0.53, 0.63), (0.3, 0.7), (0.7, 1.0))
    sky_low = _hsv(rng, (0.5, 0.6), (0.05, 0.25), (0.9, 1.0))
    img = _mix(sky_top, sky_low, y)
    pil = Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(pil)
    layers = int(rng.integers(3, 6))
    base_hue = rng.uniform(0.25, 0.7)
    for k in range(layers):
        depth = k / max(1, layers - 1)  # 0 = far, 1 = near
        n = int(rng.integers(4, 9))
        xs = np.linspace(-0.1, 1.1, n + 1)
        level = 0.3 + 0.45 * depth + rng.uniform(-0.05, 0.05)
        peaks = level - rng.uniform(0.05, 0.3, n + 1) * (1.1 - 0.5 * depth)
        peaks[1::2] += rng.uniform(0.05, 0.15, len(peaks[1::2]))
        pts = [(float(px * size), float(py * size)) for px, py in zip(xs, peaks, strict=True)]
        pts += [(1.1 * size, 1.1 * size), (-0.1 * size, 1.1 * size)]
        color = _hsv(rng, (base_hue - 0.05, base_hue + 0.05), (0.2, 0.6), (0.75 - 0.55 * depth, 0.85 - 0.55 * depth))
        draw.polygon(pts, fill=tuple(int(c) for c in color))
    img = np.asarray(pil, dtype=np.float32).copy()
    if rng.random() < 0.5:
        img = img[:, ::-1]
    return img


def _bubbles(rng: np.random.Generator, size: int) -> _Canvas:
    y, x = _grid(size)
    bg1 = _hsv(rng, (0, 1), (0.2, 0.6), (0.15, 0.45))
    bg2 = _hsv(rng, (0, 1), (0.2, 0.6), (0.15, 0.45))
    angle = rng.uniform(0, 2 * math.pi)
    img = _mix(bg1, bg2, np.clip(0.5 + (x - 0.5) * math.cos(angle) + (y - 0.5) * math.sin(angle), 0, 1))
    for _ in range(int(rng.integers(6, 16))):
        cy, cx = rng.uniform(-0.05, 1.05, 2)
        r = rng.uniform(0.04, 0.18)
        color = _hsv(rng, (0, 1), (0.5, 1.0), (0.7, 1.0))
        disc = _disc(y, x, cy, cx, r, size)
        shade = 1.0 - 0.45 * np.clip(np.sqrt((y - cy + 0.4 * r) ** 2 + (x - cx + 0.4 * r) ** 2) / (1.4 * r), 0, 1)
        _paint(img, disc * 0.9, color * 0.6)
        img += (disc * shade * 0.9)[..., None] * (color * 0.5)[None, None, :]
        rim = np.clip(1.0 - np.abs(np.sqrt((y - cy) ** 2 + (x - cx) ** 2) - r) * size / 1.2, 0, 1)
        _paint(img, rim * 0.7, np.full(3, 255.0, dtype=np.float32))
    return img


def _waves(rng: np.random.Generator, size: int) -> _Canvas:
    y, x = _grid(size)
    angle = rng.uniform(0, math.pi)
    u = (x - 0.5) * math.cos(angle) + (y - 0.5) * math.sin(angle)
    v = -(x - 0.5) * math.sin(angle) + (y - 0.5) * math.cos(angle)
    freq = rng.uniform(3, 9) * 2 * math.pi
    wobble = rng.uniform(0, 0.08) * np.sin(v * rng.uniform(4, 14) + rng.uniform(0, 6.3))
    t = 0.5 + 0.5 * np.sin((u + wobble) * freq + rng.uniform(0, 6.3))
    t = t ** rng.uniform(0.5, 2.0)
    a = _hsv(rng, (0, 1), (0.6, 1.0), (0.6, 1.0))
    b = _hsv(rng, (0, 1), (0.3, 1.0), (0.05, 0.5))
    return _mix(b, a, t)


def _tiles(rng: np.random.Generator, size: int) -> _Canvas:
    y, x = _grid(size)
    angle = rng.uniform(0, math.pi / 2)
    cell = rng.uniform(0.08, 0.25)
    u = ((x - 0.5) * math.cos(angle) + (y - 0.5) * math.sin(angle)) / cell + rng.uniform(0, 1)
    v = (-(x - 0.5) * math.sin(angle) + (y - 0.5) * math.cos(angle)) / cell + rng.uniform(0, 1)
    checker = ((np.floor(u) + np.floor(v)) % 2).astype(np.float32)
    a = _hsv(rng, (0, 1), (0.0, 0.8), (0.75, 1.0))
    b = _hsv(rng, (0, 1), (0.3, 1.0), (0.1, 0.55))
    img = _mix(a, b, checker)
    grout = np.minimum(np.abs(u - np.round(u)), np.abs(v - np.round(v))) * cell * size
    _paint(img, np.clip(1.2 - grout, 0, 1) * 0.8, _hsv(rng, (0, 1), (0, 0.2), (0.35, 0.6)))
    return img


def _stars(rng: np.random.Generator, size: int) -> _Canvas:
    y, x = _grid(size)
    top = _hsv(rng, (0.6, 0.72), (0.5, 0.9), (0.02, 0.1))
    low = _hsv(rng, (0.58, 0.7), (0.4, 0.8), (0.12, 0.3))
    img = _mix(top, low, y ** rng.uniform(1.0, 2.5))
    n = int(rng.integers(30, 90) * (size / 96) ** 2) + 5
    sy = rng.integers(0, size, n)
    sx = rng.integers(0, size, n)
    bright = rng.uniform(120, 255, n).astype(np.float32)
    tint = rng.uniform(0.8, 1.0, (n, 3)).astype(np.float32)
    np.maximum.at(img, (sy, sx), bright[:, None] * tint)
    big = rng.random(n) < 0.15
    for dy, dx in ((0, 1), (1, 0), (0, -1), (-1, 0)):
        yy, xx = np.clip(sy[big] + dy, 0, size - 1), np.clip(sx[big] + dx, 0, size - 1)
        np.maximum.at(img, (yy, xx), (bright[big, None] * tint[big]) * 0.6)
    if rng.random() < 0.6:
        cy, cx, r = rng.uniform(0.1, 0.45), rng.uniform(0.1, 0.9), rng.uniform(0.04, 0.09)
        moon = _disc(y, x, cy, cx, r, size) * (1 - _disc(y, x, cy - 0.3 * r, cx + 0.4 * r, r, size))
        _paint(img, moon, _hsv(rng, (0.1, 0.17), (0.05, 0.3), (0.9, 1.0)))
    return img


_RENDER: dict[str, Callable[[np.random.Generator, int], _Canvas]] = {
    "sunset": _sunset,
    "mountains": _mountains,
    "bubbles": _bubbles,
    "waves": _waves,
    "tiles": _tiles,
    "stars": _stars,
}


def _render(family: str, rng: np.random.Generator, size: int) -> np.ndarray:
    img = _RENDER[family](rng, size)
    img = img + rng.normal(0.0, rng.uniform(2.0, 7.0), img.shape).astype(np.float32)
    return np.clip(np.rint(img), 0, 255).astype(np.uint8)


def make_sample_collection(out_dir: str | Path, per_family: int = 40, size: int = 96, seed: int = 0) -> list[Path]:
    """Write ``per_family`` synthetic photos per family to ``out_dir/<family>/<family>_<i:03d>.<ext>``.

    Every 4th image is PNG, the rest JPEG (quality 90). Deterministic for ``seed``: image ``i`` of
    a family is the same whatever ``per_family`` is. Returns the written paths, sorted.
    """
    if per_family < 0:
        raise ValueError(f"per_family must be >= 0, got {per_family}")
    if size < 8:
        raise ValueError(f"size must be at least 8 pixels, got {size}")
    out = Path(out_dir)
    written: list[Path] = []
    for f_idx, family in enumerate(FAMILIES):
        folder = out / family
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(per_family):
            rng = np.random.default_rng([seed, f_idx, i])
            pixels = _render(family, rng, size)
            if i % 4 == 3:
                path = folder / f"{family}_{i:03d}.png"
                Image.fromarray(pixels).save(path, format="PNG")
            else:
                path = folder / f"{family}_{i:03d}.jpg"
                Image.fromarray(pixels).save(path, format="JPEG", quality=90)
            written.append(path)
    logger.info("wrote %d sample photos to %s", len(written), out)
    return sorted(written)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m moco.data.sample OUT_DIR [--per-family N] [--size PX] [--seed S]``."""
    parser = argparse.ArgumentParser(
        prog="python -m moco.data.sample", description="Write a small synthetic photo collection."
    )
    parser.add_argument("out_dir", type=Path, help="folder to write into (created if missing)")
    parser.add_argument("--per-family", type=int, default=40, help="images per family (default 40)")
    parser.add_argument("--size", type=int, default=96, help="image side in pixels (default 96)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    args = parser.parse_args(argv)
    if args.per_family < 0 or args.size < 8:
        parser.error("--per-family must be >= 0 and --size >= 8")
    paths = make_sample_collection(args.out_dir, args.per_family, args.size, args.seed)
    print(f"wrote {len(paths)} images to {args.out_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
