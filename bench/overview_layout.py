"""How long the views of the whole collection take to compute (issue 43): the map's layout (PCA; UMAP where
umap-learn is installed) and the themes (spherical k-means), for 10,000 and 100,000 photos.

    OMP_NUM_THREADS=1 python bench/overview_layout.py --sizes 10000,100000 --json bench/results/overview_layout.json
    python bench/overview_layout.py --sizes 2000 --umap-up-to 0                                  # tiny, PCA only

The vectors: a seeded mixture on the unit sphere shaped like an index's (``--dim`` 512, L2-normalized): 64
groups of Zipf-like sizes (the largest ~10 times the smallest), each photo its group's centre plus Gaussian noise
(cosine ~0.7 to its centre, ~0.5 between two photos of a group, ~0 between groups). The computation is exactly the
one :func:`index.overview.layout.collection_map` and :func:`index.overview.themes.collection_themes` run on an
index's vectors (``pca_layout`` + ``scale_unit``; the themes' k-means with the automatic number of themes); reading
the vectors from the catalog is not counted (about 1 s per 100,000 512-d vectors, SQLite). UMAP is timed twice on
the first size (numba compiles on the first call) and once on the others up to ``--umap-up-to``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # a shared machine: one thread unless told otherwise

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GROUPS = 64


def mixture(n: int, dim: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(vectors N x dim float32 with unit rows, group N int): the seeded mixture of the module's docstring."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(GROUPS, dim))  # G x D
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    weights = 1.0 / np.arange(1, GROUPS + 1) ** 0.55  # Zipf-like: the largest ~10x the smallest
    group = rng.choice(GROUPS, size=n, p=weights / weights.sum())  # N
    x = centres[group] + rng.normal(size=(n, dim)) / np.sqrt(dim)  # N x D: cosine ~0.7 to the centre
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x.astype(np.float32), group


def _timed(fn: Any, *args: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t0


def knn_seconds(x: np.ndarray, k: int) -> tuple[str, float]:
    """(the store kind ``auto`` picks for ``x``, seconds for a k-NN search of every row): what the themes' averaging
    over each photo's closest photos costs (:func:`index.overview.themes.smoothed_vectors`); building and training
    the store is the index build's, not counted."""
    from index.search.store import VectorStore, choose_kind

    kind = choose_kind(len(x), x.shape[1], 1 << 40)
    store = VectorStore.create(kind, x.shape[1], len(x), use_gpu="no")
    if not store.is_trained:
        store.train(x)
    store.add(np.arange(len(x), dtype=np.int64), x)
    t0 = time.perf_counter()
    for start in range(0, len(x), 2048):
        store.search(x[start : start + 2048], k)
    return kind, time.perf_counter() - t0


def run_size(n: int, args: argparse.Namespace, first_umap: bool) -> dict[str, Any]:
    from index.overview.layout import pca_layout, scale_unit, umap_layout
    from index.overview.themes import _ASK_MORE, SMOOTH, _kmeans, auto_themes

    x, group = mixture(n, args.dim, args.seed)
    xy, pca_s = _timed(lambda v: scale_unit(pca_layout(v)), x)
    k = auto_themes(n)
    themes, kmeans_s = _timed(_kmeans, x, k)
    sizes = np.bincount(themes["labels"])
    majority = sum(np.bincount(group[themes["labels"] == t]).max() for t in range(len(sizes)))
    out = {"photos": n, "dim": args.dim, "pca_seconds": round(pca_s, 3), "themes": int(len(sizes)),
           "kmeans_seconds": round(kmeans_s, 3), "themes_purity_vs_groups": round(float(majority / n), 4),
           "xy_range": [float(xy.min()), float(xy.max())]}
    out["store"], knn_s = knn_seconds(x, SMOOTH + 1 + _ASK_MORE)
    out["knn_seconds"] = round(knn_s, 2)
    if n <= args.umap_up_to:
        try:
            import umap  # noqa: F401
        except ImportError:
            out["umap"] = "umap-learn not installed (pip install 'moco-retrieval[map]')"
            return out
        if first_umap:
            _, out["umap_first_call_seconds"] = _timed(umap_layout, x)  # numba compiles here
            out["umap_first_call_seconds"] = round(out["umap_first_call_seconds"], 2)
        _, umap_s = _timed(umap_layout, x)
        out["umap_seconds"] = round(umap_s, 2)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="10000,100000", help="numbers of photos, comma separated")
    p.add_argument("--dim", type=int, default=512, help="vector width (default 512: a ResNet-18's features)")
    p.add_argument("--umap-up-to", type=int, default=10_000, help="time UMAP up to this many photos (0: never)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = p.parse_args(argv)
    from bench._machine import cpu_model

    sizes = [int(s) for s in args.sizes.split(",") if s]
    rows = []
    for n, size in enumerate(sizes):
        rows.append(run_size(size, args, first_umap=n == 0))
        print(json.dumps(rows[-1]), flush=True)
    report = {"command": " ".join(["python bench/overview_layout.py", *(argv if argv is not None else sys.argv[1:])]),
              "cpu": cpu_model(), "threads": os.environ.get("OMP_NUM_THREADS"), "sizes": rows}
    print("| photos | PCA layout (s) | themes: k-NN averaging (s, store) | themes: k-means (s) | themes | UMAP (s) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['photos']:,} | {r['pca_seconds']} | {r['knn_seconds']} ({r['store']}) | {r['kmeans_seconds']} | "
              f"{r['themes']} | {r.get('umap_seconds', '-')} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
