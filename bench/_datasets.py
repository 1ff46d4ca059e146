"""Real images for the benchmarks, written as image files the way a user's photos would be.

Fashion-MNIST comes from Debian's ``dataset-fashion-mnist`` (``apt-get install dataset-fashion-mnist``);
its labels are used only to lay out the evaluation folders (one sub-folder per class).
"""

from __future__ import annotations

import gzip
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
                 classes: tuple[str, ...] = CLASSES) -> Path:  # fmt: skip
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
    files = sorted(p for p in BACKGROUNDS_DIR.rglob("*") if p.suffix.lower() in (".jpg", ".jpeg", ".png", ".webp"))
    if not files:
        raise SystemExit(f"no pictures under {BACKGROUNDS_DIR}: apt-get install gnome-backgrounds")
    designs = sorted({p.stem.rsplit("-", 1)[0] for p in files})
    rng = np.random.default_rng(seed)
    out: dict[str, tuple[list[np.ndarray], list[int]]] = {"train": ([], []), "val": ([], [])}
    for p in files:
        with Image.open(p) as im:
            img = im.convert("RGB")
        img.thumbnail((1024, 1024))
        w, h = img.size
        label = designs.index(p.stem.rsplit("-", 1)[0])
        for split, count, (top, bottom) in (("train", n_train, (0.0, 0.7)), ("val", n_val, (0.7, 1.0))):
            for _ in range(count // len(files)):
                side = int(rng.uniform(min(w, h) * sides[0], min(min(w, h) * sides[1], h * (bottom - top))))
                x = int(rng.integers(0, w - side + 1))
                y = int(rng.integers(int(top * h), max(int(top * h) + 1, int(bottom * h) - side + 1)))
                crop = img.crop((x, y, x + side, y + side)).resize((size, size), Image.Resampling.BICUBIC)
                out[split][0].append(np.asarray(crop))
                out[split][1].append(label)
    (tr, trl), (va, val) = out["train"], out["val"]
    return np.stack(tr), np.array(trl), np.stack(va), np.array(val), tuple(designs)
