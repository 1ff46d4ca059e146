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


def write_folder(root: Path, images: np.ndarray, labels: np.ndarray | None = None, fmt: str = "png") -> Path:
    """Write images as files (in class sub-folders when labels are given); reuses a complete folder."""
    root = Path(root)
    done = root / ".complete"
    if done.exists() and int(done.read_text()) == len(images):
        return root
    for i, img in enumerate(images):
        sub = root / CLASSES[int(labels[i])] if labels is not None else root / f"{i // 1000:03d}"
        sub.mkdir(parents=True, exist_ok=True)
        Image.fromarray(img).save(sub / f"{i:05d}.{fmt}")
    done.write_text(str(len(images)))
    return root
