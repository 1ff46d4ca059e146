"""Search with several photos (issue 43): precision@10 with 1, 3 and 5 positive photos, with and without 3 negatives,
per query rule of :mod:`index.search.query`, against the one-photo search; the rule chosen on a tuning split, reported
on
another.

    OMP_NUM_THREADS=1 python bench/multi_query.py --work .bench_runs/multi_query --json bench/results/multi_query.json
    python bench/multi_query.py --photos 200 --trials 10 --work /tmp/mq                  # tiny

Two collections of ``--photos`` Fashion-MNIST images each (28 px enlarged to ``--size``, PNG, in class sub-folders:
the labels only score), the tuning one drawn from the ``train`` split, the report one from ``t10k``, each indexed
with the backbone (``--backbone``: an export; ``--run``: a training run's checkpoint, exported; neither: a randomly
initialized ResNet-18). A trial draws a class and 5 of its photos; the first 1, 3 or 5 are the positives. The
negatives are what a person would tick: the first 3 results of another class in the search with the positives alone
(the mean rule). Each query is searched through the index (:meth:`ImageIndex.search`, ``centred``), its own photos
left out (the negatives too: so even ``mean``, which ignores them, gains from 3 wrong results taken away); precision@10
is the share of the 10 results of the drawn class. ``one photo`` is the first positive's own
search (the floor). The rule kept is the one with the best mean precision over the six settings on the tuning split.
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
from PIL import Image  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._datasets import CLASSES, fashion_mnist, write_folder  # noqa: E402

POSITIVES = (1, 3, 5)
NEGATIVES = 3
# (name, rule, parameters of index.search.query.combine)
CANDIDATES: tuple[tuple[str, str, dict[str, float]], ...] = (
    ("mean", "mean", {}),
    ("difference b=0.1", "difference", {"beta": 0.1}),
    ("difference b=0.25", "difference", {"beta": 0.25}),
    ("difference b=0.5", "difference", {"beta": 0.5}),
    ("difference b=1", "difference", {"beta": 1.0}),
    ("rocchio b=0.1", "rocchio", {"beta": 0.1}),
    ("rocchio b=0.25", "rocchio", {"beta": 0.25}),
    ("rocchio b=0.5", "rocchio", {"beta": 0.5}),
    ("rocchio b=1", "rocchio", {"beta": 1.0}),
    ("logistic l2=0.1", "logistic", {"l2": 0.1}),
    ("logistic l2=1", "logistic", {"l2": 1.0}),
)


def _collection(root: Path, split: str, n: int, size: int, seed: int) -> Path:
    """``n`` seeded images of a Fashion-MNIST split, enlarged to ``size`` px, in class sub-folders under ``root``."""
    images, labels = fashion_mnist(split)
    pick = np.sort(np.random.default_rng(seed).choice(len(images), n, replace=False))
    big = np.stack([np.asarray(Image.fromarray(images[i]).resize((size, size), Image.Resampling.BICUBIC))
                    for i in pick])  # n x size x size
    return write_folder(root, big, labels[pick])


def _backbone(args: argparse.Namespace) -> tuple[Path, str]:
    """The backbone file and how it is described (:func:`bench._backbone.bench_backbone`)."""
    from bench._backbone import bench_backbone

    return bench_backbone(args.work, args.backbone, args.run, args.size)


def precision_at(ids: np.ndarray, labels: dict[int, int], want: int, k: int = 10) -> float:
    """Share of the first ``k`` of ``ids`` (-1: none) labelled ``want``; a missing result counts as wrong."""
    return sum(1 for j in ids[:k] if j >= 0 and labels[int(j)] == want) / k


def run_split(idx: Any, trials: int, seed: int) -> dict[str, Any]:
    """Mean precision@10 of every candidate rule (and the one-photo search) for each setting on one index."""
    from index.catalog import sample_ids
    from index.search.query import BACKGROUND, combine

    ids = idx.catalog.ok_ids()  # N
    rows = idx.catalog.rows_by_id(ids)
    label_of = {int(i): CLASSES.index(rows[int(i)].path.split("/")[0]) for i in ids}
    space = dict(zip(ids.tolist(), idx.to_space(idx.vectors(ids))))  # id -> D, as stored
    rng = np.random.default_rng(seed)
    by_class = {c: [i for i in ids.tolist() if label_of[i] == c] for c in range(len(CLASSES))}
    settings = [(p, n) for p in POSITIVES for n in (0, NEGATIVES)]
    scores: dict[str, dict[str, list[float]]] = {name: {f"{p}+{n}": [] for p, n in settings}
                                                 for name in ("one photo", *(c[0] for c in CANDIDATES))}
    t0 = time.perf_counter()
    for _ in range(trials):
        c = int(rng.integers(len(CLASSES)))
        chosen = [int(i) for i in rng.choice(by_class[c], max(POSITIVES), replace=False)]
        background = np.stack([space[int(i)] for i in sample_ids(ids, BACKGROUND, rng)])  # B x D
        one = idx.search(space[chosen[0]], k=10, centred=True, exclude_ids=chosen[:1]).ids[0]
        for p in POSITIVES:
            pos = np.stack([space[i] for i in chosen[:p]])  # p x D
            plain = idx.search(combine(pos, rule="mean"), k=60, centred=True, exclude_ids=chosen[:p]).ids[0]
            neg_ids = [int(j) for j in plain if j >= 0 and label_of[int(j)] != c][:NEGATIVES]
            for n in (0, NEGATIVES):
                key = f"{p}+{n}"
                scores["one photo"][key].append(precision_at(one, label_of, c))
                neg = np.stack([space[i] for i in neg_ids[:n]]) if n and neg_ids else None  # n x D
                for name, rule, params in CANDIDATES:
                    q = combine(pos, neg, rule, background=background, **params)  # D
                    got = idx.search(q, k=10, centred=True, exclude_ids=chosen[:p] + neg_ids[:n]).ids[0]
                    scores[name][key].append(precision_at(got, label_of, c))
    table = {name: {key: round(float(np.mean(v)), 4) for key, v in per.items()} for name, per in scores.items()}
    for per in table.values():
        per["mean"] = round(float(np.mean([per[f"{p}+{n}"] for p, n in settings])), 4)
    return {"photos": len(ids), "trials": trials, "seconds": round(time.perf_counter() - t0, 1), "table": table}


def _print(title: str, result: dict[str, Any]) -> None:
    keys = [f"{p}+{n}" for p in POSITIVES for n in (0, NEGATIVES)]
    print(f"\n{title}: {result['photos']} photos, {result['trials']} trials, precision@10 (positives+negatives)")
    print(f"{'rule':<20}" + "".join(f"{k:>8}" for k in keys) + f"{'mean':>8}")
    for name, per in result["table"].items():
        print(f"{name:<20}" + "".join(f"{per[k]:>8.3f}" for k in keys) + f"{per['mean']:>8.3f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--photos", type=int, default=2000, help="photos per split (default 2000)")
    p.add_argument("--trials", type=int, default=200, help="queries per split (default 200)")
    p.add_argument("--size", type=int, default=64, help="pixels per side of a photo (default 64)")
    p.add_argument("--backbone", type=Path, default=None, help="an exported backbone (.safetensors)")
    p.add_argument("--run", type=Path, default=None, help="a training run (its checkpoint.pt is exported)")
    p.add_argument("--work", type=Path, required=True, help="where the collections, indexes and export go")
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="write every figure here")
    args = p.parse_args(argv)

    from index.building.runner import build_index
    from index.search.image_index import ImageIndex

    args.work.mkdir(parents=True, exist_ok=True)
    backbone, described = _backbone(args)
    from bench._machine import cpu_model

    command = "OMP_NUM_THREADS=1 python bench/multi_query.py " + " ".join(argv if argv is not None else sys.argv[1:])
    report: dict[str, Any] = {"backbone": described, "photos": args.photos, "size": args.size, "seed": args.seed,
                              "negatives": NEGATIVES, "candidates": [c[0] for c in CANDIDATES], "cpu": cpu_model(),
                              "command": command}
    for name, split, seed in (("tuning", "train", args.seed), ("report", "t10k", args.seed + 1)):
        root = args.work / f"{name}_photos"
        shutil.rmtree(root, ignore_errors=True)
        _collection(root, split, args.photos, args.size, seed)
        shutil.rmtree(args.work / f"{name}.idx", ignore_errors=True)
        build_index(root, backbone, args.work / f"{name}.idx", progress=False, device=args.device, kind="flat")
        idx = ImageIndex.open(args.work / f"{name}.idx")
        report[name] = run_split(idx, args.trials, seed)
        report[name]["space"] = idx.describe_space()
        _print(f"{name} split (Fashion-MNIST {split})", report[name])
    rules = [c[0] for c in CANDIDATES]
    best = max(rules, key=lambda r: report["tuning"]["table"][r]["mean"])
    report["chosen"] = best
    rep = report["report"]["table"]
    print(f"\nchosen on the tuning split: {best}; on the report split its mean precision@10 is {rep[best]['mean']:.3f}"
          f" (one photo {rep['one photo']['mean']:.3f}, mean of positives {rep['mean']['mean']:.3f})")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
