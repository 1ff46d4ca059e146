"""kNN monitor against a brute-force computation written with plain Python loops."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from moco.training.knn import LabeledImages, knn_predict, knn_top1


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


def test_pixel_baseline_is_the_knn_of_centred_pixels(sample_photos, tmp_path):
    """KnnMonitor.pixels_top1 against a by-hand baseline: crop, scale, flatten, subtract the bank mean, normalize."""
    import numpy as np

    from moco.training.knn import KnnMonitor

    mean, std = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
    mon = KnnMonitor(str(sample_photos), "", 20, tmp_path / "c", 16, mean, std, k=5)
    imgs = mon.val.cache.array  # N x 20 x 20 x 3 uint8: the central 16 x 16 is the eval view
    x = (np.asarray(imgs[:, 2:18, 2:18, :], np.float32) / 255 - np.array(mean, np.float32)) / np.array(std, np.float32)
    flat = torch.from_numpy(x.transpose(0, 3, 1, 2).reshape(len(x), -1).copy())  # N x 768
    ref = knn_top1(F.normalize(flat - flat.mean(0), dim=1), mon.val.labels, k=5, num_classes=6)
    assert mon.pixels_top1() == pytest.approx(ref, abs=1e-6)
    assert 1 / 6 < mon.pixels_top1() <= 1 and mon._pixels == ref  # computed once, then cached


def test_whitened_pixel_baseline_is_the_knn_of_whitened_centred_pixels(sample_photos, tmp_path):
    """pixels_whitened_top1 against a by-hand baseline: the centred pixels above, whitened on themselves
    (leave-one-out) by the Mahalanobis cosine of their Ledoit-Wolf covariance."""
    import numpy as np

    from moco.training.knn import KnnMonitor
    from moco.whiten import ledoit_wolf_shrinkage

    mean, std = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
    mon = KnnMonitor(str(sample_photos), "", 12, tmp_path / "c", 10, mean, std, k=5)
    imgs = mon.val.cache.array  # N x 12 x 12 x 3 uint8: the central 10 x 10 is the eval view
    x = (np.asarray(imgs[:, 1:11, 1:11, :], np.float64) / 255 - np.array(mean)) / np.array(std)
    flat = x.transpose(0, 3, 1, 2).reshape(len(x), -1)  # N x 300
    flat = flat - flat.mean(0)
    flat /= np.linalg.norm(flat, axis=1, keepdims=True)  # the centred pixel features
    xc = flat - flat.mean(0)
    d = xc.shape[1]
    s = xc.T @ xc / len(xc)
    a = ledoit_wolf_shrinkage(xc)
    chol = np.linalg.cholesky(np.linalg.inv((1 - a) * s + a * np.trace(s) / d * np.eye(d)))  # L L^T = C^-1
    feats = torch.from_numpy(xc @ chol)  # N x D: inner products x^T C^-1 y (Mahalanobis)
    ref = knn_top1(F.normalize(feats.float(), dim=1), mon.val.labels, k=5, num_classes=6)
    assert mon.pixels_whitened_top1() == pytest.approx(ref, abs=1e-6)
    assert mon.pixels_whitened_top1() != mon.pixels_top1() or ref == mon.pixels_top1()


def test_monitor_scores_a_backbone_as_is_and_whitened_on_the_bank(sample_photos, tmp_path):
    """evaluate() against by-hand: features of val and bank, kNN as they are, then whitened with the bank's fit."""
    from moco.training.knn import KnnMonitor, extract_features
    from moco.whiten import fit_whitening

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
                              torch.nn.Flatten(), torch.nn.Linear(8, 6))
    mean, std = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
    mon = KnnMonitor(str(sample_photos), str(sample_photos), 16, tmp_path / "c", 16, mean, std, k=5)
    plain, white = mon.evaluate(net, torch.device("cpu"))
    f = extract_features(net, mon.val.cache.array, 16, mean, std, torch.device("cpu"))  # N x 6
    b = extract_features(net, mon.bank.cache.array, 16, mean, std, torch.device("cpu"))  # M x 6
    w = fit_whitening(b.numpy())
    wf, wb = (torch.from_numpy(w(v.numpy())) for v in (f, b))
    assert plain == pytest.approx(knn_top1(f, mon.val.labels, b, mon.bank.labels, 6, 5, 0.1), abs=1e-6)
    assert white == pytest.approx(knn_top1(wf, mon.val.labels, wb, mon.bank.labels, 6, 5, 0.1), abs=1e-6)


def test_monitor_scores_the_exported_embedding_with_and_without_the_mirror_image(sample_photos, tmp_path):
    """evaluate_exported() against by-hand: each view's and its mirror image's normalized features, summed, then
    the run's whitening (or the plain features for a whitening fitted without the mirror image)."""
    from dataclasses import replace

    from moco.data.augment import center_view
    from moco.training.knn import KnnMonitor
    from moco.whiten import fit_whitening

    torch.manual_seed(1)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                              torch.nn.Linear(8 * 14 * 14, 6))  # not mirror-invariant: the flatten keeps positions
    mean, std = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
    mon = KnnMonitor(str(sample_photos), str(sample_photos), 16, tmp_path / "c", 16, mean, std, k=5)

    def by_hand(images, mirror):
        x = center_view(torch.from_numpy(np.array(images)), 16, mean, std)  # N x 3 x 16 x 16
        with torch.no_grad():
            f = torch.nn.functional.normalize(net(x), dim=1)  # N x 6
            if mirror:
                f = torch.nn.functional.normalize(f + torch.nn.functional.normalize(net(x.flip(3)), dim=1), dim=1)
        return f

    for mirror in (True, False):
        f, b = by_hand(mon.val.cache.array, mirror), by_hand(mon.bank.cache.array, mirror)
        w = replace(fit_whitening(b.numpy()), mirror=mirror)
        got = mon.evaluate_exported(net, w, torch.device("cpu"))
        wf, wb = (torch.from_numpy(w(v.numpy())) for v in (f, b))
        assert got == pytest.approx(knn_top1(wf, mon.val.labels, wb, mon.bank.labels, 6, 5, 0.1), abs=1e-6)
    plain_f, mirror_f = by_hand(mon.val.cache.array, False), by_hand(mon.val.cache.array, True)
    assert (plain_f - mirror_f).abs().max() > 0.05  # the two paths embed differently: the test tells them apart
