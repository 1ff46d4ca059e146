"""How pure the themes are (issue 43): Fashion-MNIST photos cut into themes as `moco index themes` cuts them (on the
index's centred features), against the same k-means on whitened pixels; labels used only to score.

    OMP_NUM_THREADS=1 python bench/overview_themes.py --run .bench_runs/overview/run --work .bench_runs/overview \\
        --json bench/results/overview_themes_fashion.json
    python bench/overview_themes.py --choose 300 --report 300 --work /tmp/ot            # tiny, a random network

Two collections of Fashion-MNIST images written as PNG files in numbered folders (no labels on disk): ``choose``
(``--choose`` images of the train split, from image 50,000: after the 20,000 a ``--run`` of this page trains on)
and ``report`` (``--report`` images of the t10k split). Each is indexed with the backbone (``--backbone``: an
export; ``--run``: a training run's checkpoint, exported; neither: a randomly initialized ResNet-18), then cut into
themes as ``moco index themes`` does (spherical k-means, FAISS, on the features centred on the index's mean), with the
automatic number of themes (``round(sqrt(N/2))`` in [2, 64]) and with 10 (the number of classes); and, to show why
the themes leave the whitening out, the same k-means in the index's search space (whitened from 2,000 photos).

The baseline gets its best shot: k-means with the same settings on the images' pixels, centred, PCA-whitened to
``d`` components and L2-normalized, ``d`` chosen on ``choose`` (the best purity at the automatic k among
``--pixel-dims``), then reported on ``report``. Scores: purity (the share of photos in their theme's majority
class: what a person browsing a theme sees) and NMI (normalized mutual information, which does not reward more
themes).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # a shared machine: one thread unless told otherwise

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CHOOSE_FROM = 50_000  # the choose split starts here in the train images (a --run trains on the first 20,000)
CLASSES = 10


def purity(labels: np.ndarray, truth: np.ndarray) -> float:
    """The share of items whose cluster's majority class is theirs."""
    return float(sum(np.bincount(truth[labels == c]).max() for c in np.unique(labels)) / len(truth))


def nmi(labels: np.ndarray, truth: np.ndarray) -> float:
    """Normalized mutual information (arithmetic mean of the two entropies)."""
    _, a = np.unique(labels, return_inverse=True)
    _, b = np.unique(truth, return_inverse=True)
    joint = np.zeros((a.max() + 1, b.max() + 1))
    np.add.at(joint, (a, b), 1)
    joint /= joint.sum()
    pa, pb = joint.sum(1), joint.sum(0)
    nz = joint > 0
    mi = float((joint[nz] * np.log(joint[nz] / np.outer(pa, pb)[nz])).sum())
    h = float(-(pa[pa > 0] * np.log(pa[pa > 0])).sum() - (pb[pb > 0] * np.log(pb[pb > 0])).sum()) / 2
    return mi / h if h > 0 else 1.0


def whitened_pixels(images: np.ndarray, dims: int) -> np.ndarray:
    """Pixels (N x 784) centred, PCA-whitened to ``dims`` components (fitted on these images), L2-normalized."""
    x = images.reshape(len(images), -1).astype(np.float64) / 255.0  # N x P
    x -= x.mean(0)
    _, s, vt = np.linalg.svd(x, full_matrices=False)
    d = min(dims, len(s))
    z = x @ vt[:d].T / np.maximum(s[:d] / np.sqrt(len(x)), 1e-6)  # N x d, unit variance per component
    z /= np.maximum(np.linalg.norm(z, axis=1, keepdims=True), 1e-12)
    return z.astype(np.float32)


def _backbone(args: argparse.Namespace) -> tuple[Path, str]:
    from bench.dedup_copies import _backbone as dedup_backbone

    args.size = 32  # a random network's input size (bench/dedup_copies.py exports it at --size)
    path, described = dedup_backbone(args)
    if args.run and (args.run / "config.json").is_file():  # what the run was: its preset, arch, budget and steps
        cfg = json.loads((args.run / "config.json").read_text())
        lines = (args.run / "metrics.jsonl").read_text().splitlines() if (args.run / "metrics.jsonl").is_file() else []
        steps = json.loads(lines[-1]).get("step") if lines else None
        described += (f": the {cfg.get('preset')} preset, {cfg.get('arch')} at {cfg.get('image_size')} px, "
                      f"{cfg.get('time_budget')} min, {steps} steps on {cfg.get('data_dir')}")
    return path, described


def _split(name: str, images: np.ndarray, args: argparse.Namespace, backbone: Path) -> Any:
    """The split's images written and indexed: its ImageIndex and the image number of each photo id."""
    from bench._datasets import write_folder
    from index.building.runner import build_index
    from index.search.image_index import ImageIndex

    root = args.work / f"{name}{len(images)}"
    write_folder(root, images)  # numbered folders of 1,000: no labels on disk
    out = args.work / f"{name}{len(images)}.idx"
    shutil.rmtree(out, ignore_errors=True)
    build_index(root, backbone, out, progress=False, device=args.device)
    idx = ImageIndex.open(out)
    ids, paths, _ = idx.catalog.entries()
    number = {int(i): int(Path(p).stem) for i, p in zip(ids, paths)}
    return idx, number


def measure(name: str, images: np.ndarray, truth: np.ndarray, args: argparse.Namespace, backbone: Path,
            dims: list[int]) -> dict[str, Any]:
    from index.overview.cache import space_vectors
    from index.overview.themes import _kmeans, auto_themes, collection_themes

    idx, number = _split(name, images, args, backbone)
    out: dict[str, Any] = {"photos": len(images), "space": idx.describe_space(), "k": {}}
    auto = auto_themes(len(images))
    for k in (auto, CLASSES):
        t0 = time.perf_counter()
        themes = collection_themes(idx, None if k == auto else k)
        took = time.perf_counter() - t0
        y = truth[[number[int(i)] for i in themes.ids]]
        row: dict[str, Any] = {"ours": {"purity": round(purity(themes.labels, y), 4),
                                        "nmi": round(nmi(themes.labels, y), 4), "seconds": round(took, 2)}}
        ids, x = space_vectors(idx)  # N, N x D: the search space
        labels = _kmeans(x, k)["labels"]
        y = truth[[number[int(i)] for i in ids]]
        row["search_space"] = {"purity": round(purity(labels, y), 4), "nmi": round(nmi(labels, y), 4)}
        for d in dims:
            labels = _kmeans(whitened_pixels(images, d), k)["labels"]
            row[f"pixels_{d}"] = {"purity": round(purity(labels, truth), 4), "nmi": round(nmi(labels, truth), 4)}
        out["k"][str(k)] = row
    out["auto_k"] = auto
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--choose", type=int, default=5000, help="images of the choose split (train, from 50,000)")
    p.add_argument("--report", type=int, default=10000, help="images of the report split (t10k)")
    p.add_argument("--pixel-dims", default="16,32,64,128,784", help="whitened pixel components tried on choose")
    p.add_argument("--backbone", type=Path, default=None, help="an exported backbone (.safetensors)")
    p.add_argument("--run", type=Path, default=None, help="a training run (its checkpoint.pt is exported)")
    p.add_argument("--work", type=Path, required=True, help="where the collections, indexes and export go")
    p.add_argument("--device", default="auto")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    from bench._datasets import fashion_mnist
    from bench._machine import cpu_model

    backbone, described = _backbone(args)
    train, train_y = fashion_mnist("train")
    test, test_y = fashion_mnist("t10k")
    dims = [int(d) for d in args.pixel_dims.split(",") if d]
    choose = measure("choose", train[CHOOSE_FROM : CHOOSE_FROM + args.choose],
                     train_y[CHOOSE_FROM : CHOOSE_FROM + args.choose].astype(np.int64), args, backbone, dims)
    auto = str(choose["auto_k"])
    best = max(dims, key=lambda d: choose["k"][auto][f"pixels_{d}"]["purity"])
    report = measure("report", test[: args.report], test_y[: args.report].astype(np.int64), args, backbone, [best])
    doc = {"command": " ".join(["python bench/overview_themes.py", *(argv if argv is not None else sys.argv[1:])]),
           "cpu": cpu_model(), "threads": os.environ.get("OMP_NUM_THREADS"), "backbone": described,
           "pixel_dims_chosen": best, "choose": choose, "report": report}
    print(json.dumps(doc, indent=1))
    print(f"\n| split | photos | k | ours: purity / NMI | search space | pixels whitened to {best}: purity / NMI |")
    print("|---|---|---|---|---|---|")
    for split, r in (("choose", choose), ("report", report)):
        for k, row in r["k"].items():
            px = row[f"pixels_{best}"]
            ws = row["search_space"]
            print(f"| {split} | {r['photos']:,} | {k} | {row['ours']['purity']:.3f} / {row['ours']['nmi']:.3f} | "
                  f"{ws['purity']:.3f} / {ws['nmi']:.3f} | {px['purity']:.3f} / {px['nmi']:.3f} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
