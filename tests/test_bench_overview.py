"""bench/overview_layout.py and bench/overview_themes.py at a tiny size: their vectors, their scores against
hand-computed ones, and a run of each script (the themes one on Fashion-MNIST, skipped without it)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bench._datasets import FASHION_DIR
from bench.overview_layout import main as layout_main
from bench.overview_layout import mixture
from bench.overview_themes import main as themes_main
from bench.overview_themes import nmi, purity, whitened_pixels


def test_the_mixture_is_unit_vectors_in_groups():
    x, group = mixture(3000, 64, seed=1)
    assert x.shape == (3000, 64) and np.allclose(np.linalg.norm(x, axis=1), 1, atol=1e-5)
    a, b = x[group == group[0]][:40], x[group != group[0]][:40]
    within = (a @ a.T)[np.triu_indices(len(a), 1)].mean()
    between = (a @ b.T).mean()
    assert within > 0.3 and abs(between) < 0.1
    counts = np.bincount(group)
    assert counts.max() > 4 * counts.min() > 0
    assert np.array_equal(mixture(3000, 64, seed=1)[0], x)


def test_purity_and_nmi_by_hand():
    labels = np.array([0, 0, 0, 1, 1, 2])
    truth = np.array([5, 5, 6, 6, 6, 7])
    assert purity(labels, truth) == pytest.approx(5 / 6)
    assert nmi(labels, truth) == pytest.approx(nmi(truth, labels))
    assert nmi(labels, labels * 3 + 1) == pytest.approx(1.0)
    assert purity(np.arange(6), truth) == 1.0  # one photo per theme: pure, however useless
    rng = np.random.default_rng(0)
    assert nmi(rng.integers(0, 10, 5000), rng.integers(0, 10, 5000)) < 0.01  # independent: about 0
    z = whitened_pixels(rng.integers(0, 256, (200, 28, 28), np.uint8), 16)
    assert z.shape == (200, 16) and np.allclose(np.linalg.norm(z, axis=1), 1, atol=1e-5)


def test_the_layout_bench_runs_at_a_tiny_size(tmp_path, capsys):
    out = tmp_path / "layout.json"
    assert layout_main(["--sizes", "500,800", "--dim", "32", "--umap-up-to", "0", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [r["photos"] for r in report["sizes"]] == [500, 800] and report["cpu"]
    r = report["sizes"][1]
    assert r["themes"] == 20 and r["xy_range"] == [0.0, 1.0] and 0 < r["themes_purity_vs_groups"] <= 1
    assert "| 800 |" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.skipif(not FASHION_DIR.exists(), reason="apt-get install dataset-fashion-mnist")
def test_the_themes_bench_runs_at_a_tiny_size(tmp_path):
    out = tmp_path / "themes.json"
    assert themes_main(["--choose", "120", "--report", "100", "--pixel-dims", "8,16", "--work", str(tmp_path / "w"),
                        "--device", "cpu", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["pixel_dims_chosen"] in (8, 16) and doc["choose"]["auto_k"] == 8
    for split in ("choose", "report"):
        for row in doc[split]["k"].values():
            assert 0.1 <= row["ours"]["purity"] <= 1 and 0 <= row["ours"]["nmi"] <= 1
