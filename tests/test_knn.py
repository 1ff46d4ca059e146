"""kNN monitor against a brute-force computation written with plain Python loops."""

import math

import pytest
import torch
import torch.nn.functional as F

from moco.knn import LabeledImages, knn_predict, knn_top1


def _brute_force(feats, bank, bank_labels, classes, k, t, leave_one_out):
    preds = []
    for i, f in enumerate(feats.tolist()):
        sims = []
        for j, b in enumerate(bank.tolist()):
            if leave_one_out and i == j:
                continue
            sims.append((sum(x * y for x, y in zip(f, b)), int(bank_labels[j])))
        sims.sort(key=lambda s: -s[0])
        votes = [0.0] * classes
        for s, label in sims[:k]:
            votes[label] += math.exp(s / t)
        preds.append(max(range(classes), key=lambda c: votes[c]))
    return preds


@pytest.mark.parametrize("n,m,d,classes,k,t", [(20, 50, 8, 3, 5, 0.1), (30, 40, 16, 5, 200, 0.1), (7, 9, 4, 2, 3, 0.5)])
def test_knn_predict_matches_brute_force(n, m, d, classes, k, t):
    g = torch.Generator().manual_seed(n + m)
    feats = F.normalize(torch.randn(n, d, generator=g), dim=1)
    bank = F.normalize(torch.randn(m, d, generator=g), dim=1)
    labels = torch.randint(0, classes, (m,), generator=g)
    got = knn_predict(feats, bank, labels, classes, k, t, chunk=8).tolist()
    assert got == _brute_force(feats, bank, labels, classes, k, t, False)


def test_leave_one_out_matches_brute_force_and_top1():
    g = torch.Generator().manual_seed(3)
    centers = F.normalize(torch.randn(4, 16, generator=g), dim=1)
    labels = torch.arange(4).repeat_interleave(10)
    feats = F.normalize(centers[labels] + 0.3 * torch.randn(40, 16, generator=g), dim=1)
    pred = knn_predict(feats, feats, labels, 4, k=5, t=0.1, leave_one_out=True, chunk=7).tolist()
    assert pred == _brute_force(feats, feats, labels, 4, 5, 0.1, True)
    top1 = knn_top1(feats, labels, k=5)
    assert top1 == pytest.approx(sum(int(p == y) for p, y in zip(pred, labels.tolist())) / 40)
    assert top1 > 0.9  # clustered data


def test_labeled_images_need_class_folders(sample_photos, tmp_path):
    data = LabeledImages(sample_photos, 16, tmp_path / "c")
    assert len(data.classes) == 6 and data.labels.shape == (48,)
    assert data.classes[int(data.labels[0])] == data.cache.files[0].split("/")[0]
    loose = tmp_path / "loose"
    loose.mkdir()
    (loose / "a.jpg").write_bytes(next(sample_photos.rglob("*.jpg")).read_bytes())
    from moco.errors import UserError

    with pytest.raises(UserError, match="sub-folder per class"):
        LabeledImages(loose, 16, tmp_path / "c2")
