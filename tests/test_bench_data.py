"""bench/_datasets.py: the crop sets keep held-out crops apart from training crops, one class per picture."""

from __future__ import annotations

import numpy as np
from PIL import Image

from bench._datasets import _crops


def test_crops_come_from_the_top_for_training_and_from_the_bottom_for_validation(tmp_path):
    pictures = []
    for label, (w, h) in enumerate([(300, 200), (200, 320)]):  # landscape and portrait
        img = np.zeros((h, w, 3), np.uint8)
        img[: int(0.7 * h), :, 0] = 255  # top 70% red
        img[int(0.7 * h) :, :, 2] = 255  # bottom 30% blue
        Image.fromarray(img).save(tmp_path / f"{label}.png")
        pictures.append((tmp_path / f"{label}.png", label))
    train, train_labels, val, val_labels = _crops(pictures, 40, 20, 16, seed=0, sides=(1 / 8, 1 / 3))
    assert train.shape == (40, 16, 16, 3) and val.shape == (20, 16, 16, 3)
    assert sorted(set(train_labels.tolist())) == [0, 1] and np.bincount(val_labels).tolist() == [10, 10]
    assert train[..., 2].max() == 0 and train[..., 0].min() == 255  # no training crop reaches the held-out part
    assert val[..., 0].max() == 0 and val[..., 2].min() == 255  # and no held-out crop the training part
