"""Real images for the benchmarks, written as image files the way a user's photos would be.

Fashion-MNIST comes from Debian's ``dataset-fashion-mnist`` (``apt-get install dataset-fashion-mnist``);
its labels are used only to lay out the evaluation folders (one sub-folder per class).
"""

from __future__ import annotations

import gzip
import re
import struct
from pathlib import Path

import numpy as np
from PIL import Image

FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")
CLASSES = ("tshirt", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag", "boot")


def _idx(path: Path) -> np.ndarray:
    with gzip.open(path, "rb") as f:
        data = f.read()
    _, _, dims = struct.unpack(">HBB", data[:4])
    shape = struct.unpack(">" + "I" * dims, data[4 : 4 + 4 * dims])
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)


def fashion_mnist(split: str) -> tuple[np.ndarray, np.ndarray]:
    """(images N x 28 x 28 uint8, labels N) of the ``train`` or ``t10k`` split."""
    if not FASHION_DIR.exists():
        raise SystemExit(f"{FASHION_DIR} not found: apt-get install dataset-fashion-mnist")
    return _idx(FASHION_DIR / f"{split}-images-idx3-ubyte.gz"), _idx(FASHION_DIR / f"{split}-labels-idx1-ubyte.gz")


def write_folder(root: Path, images: np.ndarray, labels: np.ndarray | None = None, fmt: str = "png",
                 classes: tuple[str, ...] = CLASSES) -> Path:
    """Write images as files (in sub-folders named by ``classes`` when labels are given); reuses a complete folder."""
    root = Path(root)
    done = root / ".complete"
    if done.exists() and int(done.read_text()) == len(images):
        return root
    for i, img in enumerate(images):
        sub = root / classes[int(labels[i])] if labels is not None else root / f"{i // 1000:03d}"
        sub.mkdir(parents=True, exist_ok=True)
        Image.fromarray(img).save(sub / f"{i:05d}.{fmt}")
    done.write_text(str(len(images)))
    return root


BACKGROUNDS_DIR = Path("/usr/share/backgrounds")
WALLPAPERS_DIR = Path("/usr/share/wallpapers")  # KDE Plasma's: one folder per picture, several sizes of it
PICTURE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp")


def background_crops(
    n_train: int = 8000, n_val: int = 1600, size: int = 64, seed: int = 0, sides: tuple[float, float] = (1 / 16, 1 / 4)
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, tuple[str, ...]]:
    """Crops of Debian's ``gnome-backgrounds`` pictures, labelled by the picture they come from (light and dark
    variants of one design are one class): (train N x s x s x 3, train labels, val M x s x s x 3, val labels,
    the class names).

    Train crops come from the top 70% of each picture and val crops from the bottom 30%, so no val crop
    overlaps a training crop; crop sides vary within ``sides`` of the picture's short side (scale changes; small
    crops of abstract wallpapers are what makes it hard: 1/8-1/2 gave 92% kNN after 5 minutes of training).
    """
    files = sorted(p for p in (BACKGROUNDS_DIR / "gnome").rglob("*") if p.suffix.lower() in PICTURE_SUFFIXES)
    if not files:
        raise SystemExit(f"no pictures under {BACKGROUNDS_DIR / 'gnome'}: apt-get install gnome-backgrounds")
    designs = sorted({p.stem.rsplit("-", 1)[0] for p in files})
    labelled = [(p, designs.index(p.stem.rsplit("-", 1)[0])) for p in files]
    return (*_crops(labelled, n_train, n_val, size, seed, sides), tuple(designs))


def photo_crops(
    n_train: int = 12000, n_val: int = 2000, size: int = 40, seed: int = 0, sides: tuple[float, float] = (1 / 8, 1 / 3)
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, tuple[str, ...]]:
    """Small crops of the other desktop pictures Debian ships (MATE, Sway, UKUI, Lomiri, KDE Plasma: about 90
    pictures, photos and artwork), one class per picture, as :func:`background_crops` (train crops from the
    top 70%, val crops from the bottom 30%): a harder, CIFAR-sized second set (many classes, 40-px crops).

    A picture shipped in several sizes or as light and dark variants is one class (its largest file).
    """
    found = _other_pictures()
    names = sorted(found)
    return (*_crops([(found[n], i) for i, n in enumerate(names)], n_train, n_val, size, seed, sides), tuple(names))


def picture_tiles(part: int, parts: int = 3, tile: int = 64, short_side: int = 1024,
                  min_std: float = 16.0) -> np.ndarray:
    """Non-overlapping ``tile``-px squares (N x tile x tile x 3 uint8) of the desktop pictures of
    :func:`photo_crops` (photos and artwork), each picture scaled to a ``short_side`` first: distinct photos that share
    no pixel, many alike (the sky of one picture). The pictures are split in ``parts`` by their sorted names (picture
    i goes to part i % parts), so tiles a model trains on (one part) and tiles a bench scores (another) never come
    from one picture. Tiles with a pixel standard deviation under ``min_std`` (flat colour: copies of each other in
    all but name) are left out."""
    found = _other_pictures()
    out = []
    for n, name in enumerate(sorted(found)):
        if n % parts != part:
            continue
        with Image.open(found[name]) as im:
            img = im.convert("RGB")
        scale = short_side / min(img.size)
        img = img.resize((round(img.width * scale), round(img.height * scale)), Image.Resampling.BICUBIC)
        a = np.asarray(img)
        for y in range(0, a.shape[0] - tile + 1, tile):
            for x in range(0, a.shape[1] - tile + 1, tile):
                t = a[y : y + tile, x : x + tile]
                if t.std() >= min_std:
                    out.append(t)
    return np.stack(out)


def _other_pictures() -> dict[str, Path]:
    """The desktop pictures other than gnome-backgrounds' (MATE, Sway, UKUI, Lomiri, KDE Plasma), one file per
    picture: its largest."""
    found: dict[str, Path] = {}
    candidates = [p for p in BACKGROUNDS_DIR.rglob("*") if "gnome" not in p.relative_to(BACKGROUNDS_DIR).parts]
    candidates += list(WALLPAPERS_DIR.glob("*/contents/images/*"))
    for p in sorted(candidates):
        if p.suffix.lower() not in PICTURE_SUFFIXES:
            continue
        name = p.parts[4] if p.is_relative_to(WALLPAPERS_DIR) else p.stem
        name = re.sub(r"(_\d+x\d+)?(_Portrait)?$", "", name)  # Sway_Wallpaper_Blue_1366x768 -> Sway_Wallpaper_Blue
        name = re.sub(r"-(Dark|Light)$", "", name)  # MATE-Stripes-Dark and -Light: one design
        if name not in found or p.stat().st_size > found[name].stat().st_size:
            found[name] = p
    if len(found) < 20:
        raise SystemExit(f"only {len(found)} pictures under {BACKGROUNDS_DIR} and {WALLPAPERS_DIR}: apt-get install "
                         "mate-backgrounds ukui-wallpapers lomiri-wallpapers plasma-workspace-wallpapers "
                         "sway-backgrounds")
    return found


def _crops(labelled: list[tuple[Path, int]], n_train: int, n_val: int, size: int, seed: int,
           sides: tuple[float, float]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Square crops of each picture, resized to ``size``: train ones from its top 70%, val ones from the rest."""
    rng = np.random.default_rng(seed)
    out: dict[str, tuple[list[np.ndarray], list[int]]] = {"train": ([], []), "val": ([], [])}
    for p, label in labelled:
        with Image.open(p) as im:
            img = im.convert("RGB")
        img.thumbnail((1024, 1024))
        w, h = img.size
        for split, count, (top, bottom) in (("train", n_train, (0.0, 0.7)), ("val", n_val, (0.7, 1.0))):
            for _ in range(count // len(labelled)):
                side = int(rng.uniform(min(w, h) * sides[0], min(min(w, h) * sides[1], h * (bottom - top))))
                x = int(rng.integers(0, w - side + 1))
                y = int(rng.integers(int(top * h), max(int(top * h) + 1, int(bottom * h) - side + 1)))
                crop = img.crop((x, y, x + side, y + side)).resize((size, size), Image.Resampling.BICUBIC)
                out[split][0].append(np.asarray(crop))
                out[split][1].append(label)
    (tr, trl), (va, val) = out["train"], out["val"]
    return np.stack(tr), np.array(trl), np.stack(va), np.array(val)
