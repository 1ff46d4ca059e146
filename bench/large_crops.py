"""Crops of large photos with fine texture, and the fine check that finds them (issue 52): the choose set.

The gnome-backgrounds pictures of `bench/dedup_scale.py`'s choose split (its report split's six are left out:
reporting is on them) and ``--textures`` seeded fine textures of each kind (:func:`_texture`: grids of dots of random
brightness, of bevelled tiles of random colours, and mosaics of small bricks, as wallpapers are made), 1024 px on
their long side, each cut at seeded places to shares of ``--shares`` (JPEG quality 92, as the bench's crops). Every
crop is scored with its picture, and every picture with each other picture and each other picture's crops (distinct
pairs: light and dark versions of one design among them), by:

- ``thumbs``: the check as a search runs it, on frames of the index's 256-px JPEG thumbnails;
- ``search``: the check as a search runs it, the thumbnails' score and then, where
  :meth:`index.duplicates.verify.FineCheck.applies`, the fine check from the photos (written as JPEG files);
- each fine check of ``--variants`` (``SIDE:STEP``: frames of SIDE pixels a side from the photos, crop shares from
  1.0 down to 0.7 every STEP), beside frames of 48 px at the same shares, the better of the two, on every pair (what
  the fine check could find with other settings).

Prints, for each, the crops scored at least the copy score (by share), the distinct pairs that did, the lowest crop's
and the highest distinct pair's thumbnail score (what the fine check's gate, ``FINE_FROM``, must let through), and the
milliseconds a pair.

    OMP_NUM_THREADS=2 python bench/large_crops.py [--variants 96:0.03,192:0.01] --json F
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._machine import cpu_model  # noqa: E402
from index.duplicates import verify  # noqa: E402

REPORT = 6  # pictures of the report split (the first of the sorted list), left out here


def _pictures(long_side: int) -> dict[str, Image.Image]:
    """The choose set's pictures by name, ``long_side`` pixels on their long side."""
    from bench._datasets import BACKGROUNDS_DIR
    from bench.dedup_scale import FLAT_STD

    found = sorted(p for p in (BACKGROUNDS_DIR / "gnome").glob("*") if p.suffix.lower() in (".jpg", ".jpeg", ".png",
                                                                                             ".webp"))
    out = {}
    kept = 0
    for p in found:
        with Image.open(p) as im:
            img = im.convert("RGB")
        if np.asarray(img.convert("L").resize((48, 48), Image.Resampling.BILINEAR), np.float64).std() < FLAT_STD:
            continue
        kept += 1
        if kept <= REPORT:
            continue
        img.thumbnail((long_side, long_side), Image.Resampling.LANCZOS)
        out[p.stem] = img
    return out


TEXTURES = ("dots", "tiles", "bricks")


def _texture(kind: str, rng: np.random.Generator, side: int = 1024) -> Image.Image:
    """A fine texture ``side`` pixels a side: regular cells of 18 to 30 pixels, each of its own random shade."""
    from PIL import ImageDraw

    cell = int(rng.integers(18, 31))
    img = Image.new("RGB", (side, side), tuple(int(v) for v in rng.integers(0, 60, 3)))
    draw = ImageDraw.Draw(img)
    hue = rng.random(3)
    for y in range(0, side, cell):
        for x in range(0, side, cell):
            if kind == "dots":
                v = float(rng.random())
                draw.ellipse((x + 2, y + 2, x + cell - 3, y + cell - 3), fill=tuple(int(40 + 215 * v * h) for h in hue))
            elif kind == "tiles":
                c = rng.integers(40, 256, 3)
                draw.rectangle((x, y, x + cell - 2, y + cell - 2), fill=tuple(int(v) for v in c))
                draw.line((x, y + cell - 2, x + cell - 2, y + cell - 2), fill=tuple(int(v) // 2 for v in c), width=3)
            else:  # bricks: two to a cell, rows shifted by half a brick
                shift = (y // cell) % 2 * cell // 2
                for k in range(2):
                    c = rng.integers(60, 256, 3)
                    x0 = x + shift + k * cell // 2
                    draw.rectangle((x0, y, x0 + cell // 2 - 2, y + cell - 3), fill=tuple(int(v) for v in c))
    return img


def _jpeg(img: Image.Image, quality: int) -> Image.Image:
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=quality)
    buf.seek(0)
    return Image.open(buf).convert("RGB")


def _thumb_frame(img: Image.Image) -> verify.Frame:
    """The frame a search checks: from the index's thumbnail (256 px, JPEG)."""
    t = img.copy()
    t.thumbnail((256, 256))
    return verify.frame_of(_jpeg(t, 90))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default="", help="other fine checks to compare, SIDE:STEP, comma-separated")
    p.add_argument("--shares", default="0.7,0.75,0.8,0.85,0.9", help="crop shares of a side")
    p.add_argument("--textures", type=int, default=2, help="seeded textures of each kind (default 2)")
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    pictures = _pictures(1024)
    pictures.update({f"{kind}{n}": _texture(kind, rng) for kind in TEXTURES for n in range(args.textures)})
    shares = [float(s) for s in args.shares.split(",")]
    photos: dict[str, Image.Image] = dict(pictures)
    crop_of: dict[str, str] = {}
    for name, img in pictures.items():
        w, h = img.size
        for s in shares:
            cw, ch = round(s * w), round(s * h)
            x, y = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
            photos[f"{name}_crop{round(100 * s)}"] = _jpeg(img.crop((x, y, x + cw, y + ch)), 92)
            crop_of[f"{name}_crop{round(100 * s)}"] = name
    names = list(photos)
    copies = [(crop_of[c], c) for c in crop_of]
    distinct = [(a, b) for n, a in enumerate(pictures) for b in list(pictures)[n + 1 :]]
    distinct += [(a, c) for a in pictures for c in crop_of if crop_of[c] != a]
    pos = {n: k for k, n in enumerate(names)}
    thumbs = {pos[n]: _thumb_frame(img) for n, img in photos.items()}
    pairs = [(pos[a], pos[b]) for a, b in copies + distinct]
    got: dict[str, dict[tuple[int, int], float]] = {"thumbs": verify.copy_scores(pairs, thumbs)}
    seconds = {"thumbs": 0.0}
    with tempfile.TemporaryDirectory() as tmp:  # the check as a search runs it: thumbnails, then the fine check
        for n, img in photos.items():
            img.save(Path(tmp) / f"{pos[n]}.jpg", "JPEG", quality=92)
        check = verify.FineCheck(tmp, {pos[n]: f"{pos[n]}.jpg" for n in photos})
        keys = np.array(pairs, np.int64)  # P x 2
        first = np.array([got["thumbs"][k] for k in pairs])  # P
        t0 = time.perf_counter()
        again = check.rescore(keys, first, thumbs)  # P
        seconds["search"] = (time.perf_counter() - t0) / len(pairs)
        got["search"] = {k: float(v) for k, v in zip(pairs, again.tolist())}
        fine_checked = sum(check.applies(a, b, s, thumbs) for (a, b), s in zip(pairs, first.tolist()))
    for variant in filter(None, args.variants.split(",")):
        side, step = variant.split(":")
        scales = tuple(float(s) for s in np.round(np.arange(1.0, 0.7 - 1e-9, -float(step)), 4))
        t0 = time.perf_counter()
        fine = {pos[n]: verify.frame_of(img, int(side)) for n, img in photos.items()}
        coarse = {pos[n]: verify.frame_of(img) for n, img in photos.items()}
        a = verify.copy_scores(pairs, coarse, screen=False, scales=scales)
        b = verify.copy_scores(pairs, fine, screen=False, scales=scales)
        got[variant] = {k: max(a[k], b[k]) for k in a}
        seconds[variant] = (time.perf_counter() - t0) / len(pairs)
    copy_keys = [(pos[a], pos[b]) for a, b in copies]
    other_keys = [(pos[a], pos[b]) for a, b in distinct]
    report: dict = {"cpu": cpu_model(), "pictures": list(pictures), "shares": shares, "copies": len(copies),
                    "fine_checked": {"copies": sum(check.applies(*k, got["thumbs"][k], thumbs) for k in copy_keys),
                                     "distinct": fine_checked - sum(check.applies(*k, got["thumbs"][k], thumbs)
                                                                    for k in copy_keys)},
                    "distinct_pairs": len(distinct), "command": "python bench/large_crops.py " + " ".join(argv or
                                                                                                      sys.argv[1:]),
                    "lowest_copy_on_thumbs": float(min(got["thumbs"][k] for k in copy_keys)),
                    "highest_distinct_on_thumbs": float(max(got["thumbs"][k] for k in other_keys)), "checks": {}}
    print(f"{len(pictures)} pictures ({', '.join(pictures)}), {len(copies)} crops, {len(distinct)} distinct pairs; "
          f"on thumbnails the lowest crop scores {report['lowest_copy_on_thumbs']:.4f}, the highest distinct pair "
          f"{report['highest_distinct_on_thumbs']:.4f}; a search checks again from the photos "
          f"{report['fine_checked']['copies']} crops and {report['fine_checked']['distinct']} distinct pairs")
    for name, scores in got.items():
        by_share = {f"{s:.2f}": int(sum(scores[(pos[crop_of[c]], pos[c])] >= verify.COPY_SCORE
                                    for c in crop_of if c.endswith(f"crop{round(100 * s)}"))) for s in shares}
        wrong = sorted(((scores[k], names[k[0]], names[k[1]]) for k in other_keys if scores[k] >= verify.COPY_SCORE),
                       reverse=True)
        top = max((scores[k], names[k[0]], names[k[1]]) for k in other_keys)
        lowest = min((scores[k], names[k[1]]) for k in copy_keys)
        report["checks"][name] = {"found_by_share": by_share, "found": sum(by_share.values()),
                                  "distinct_over": [list(w) for w in wrong], "highest_distinct": list(top),
                                  "lowest_copy": list(lowest), "ms_a_pair": round(1000 * seconds[name], 1),
                                  "crops": {names[k[1]]: round(float(scores[k]), 4) for k in copy_keys},
                                  "distinct_at_least": {str(t): int(sum(scores[k] >= t for k in other_keys))
                                                        for t in (0.8, 0.9, 0.95, 0.98)}}
        print(f"{name:>10}: crops found {sum(by_share.values())}/{len(copies)} {by_share}; distinct pairs over the "
              f"copy score {len(wrong)} (highest {top[0]:.4f} {top[1]}~{top[2]}); lowest crop {lowest[0]:.4f} "
              f"({lowest[1]}); {1000 * seconds[name]:.1f} ms a pair")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, default=float))
    return report


if __name__ == "__main__":
    main()
