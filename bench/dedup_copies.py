"""Duplicates found among planted copies (issue 42): recall per edit, precision of grouped pairs and the largest group
of distinct photos, at the index's default threshold, for collection sizes.

    OMP_NUM_THREADS=1 python bench/dedup_copies.py --dataset fashion --sizes 2000,10000 --backbone B.safetensors \\
        --split report --work .bench_runs/dedup_copies --json bench/results/dedup_copies_fashion.json
    python bench/dedup_copies.py --dataset fashion --sizes 200,400 --work /tmp/dc        # tiny, a random network

A collection of N photos of a set (``fashion``: Fashion-MNIST images, 28 px enlarged to ``--size``, saved as PNG;
``backgrounds``: crops of the gnome-backgrounds pictures, bench/_datasets.py; overlapping crops of one picture are
distinct photos here, so its precision is a lower bound; ``tiles``: 64-px squares of the other desktop pictures that
share no pixel, flat ones left out, :func:`bench._datasets.picture_tiles`, a third of the pictures per split;
pixel-identical images of a set count once; ``--split choose`` draws other images than ``report``, the default, so
rules are tuned on one and reported on the other) in which a seeded ``--copies`` share of the photos each get one copy,
the edits taken in turn: ``exact`` (the same bytes), ``jpeg`` (re-encoded, quality 70), ``resized`` (60%), ``cropped``
(its central 85%), ``brightened`` (x1.3) and ``mirrored`` (left-right). The index is built with the backbone
(``--backbone``: an export; ``--run``: a training run's checkpoint, exported; neither: a randomly initialized
ResNet-18, the weakest model there is), its exact and near groups found as `moco index dedup` finds them, then:

- recall of an edit: the share of its copies in the same group as their photo;
- pair precision: of all pairs of photos in one group, the share that are a photo and its copy;
- largest group of distinct photos: the most different photos (a photo and its copy count once) in one group.

Aim: recall >= 0.98, pair precision >= 0.95, no group of more than 10 distinct photos. Each size writes its
collection and index under ``--work/SIZE`` (made anew); the JSON holds every figure and the threshold's rule.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # a shared machine: one thread unless told otherwise

import argparse  # noqa: E402
import io  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import shlex  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import TYPE_CHECKING, Any  # noqa: E402

import numpy as np  # noqa: E402
from PIL import Image, ImageEnhance, ImageOps  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

if TYPE_CHECKING:
    from index.duplicates.groups import Group

EDITS = ("exact", "jpeg", "resized", "cropped", "brightened", "mirrored")
AIM = {"recall": 0.98, "pair_precision": 0.95, "largest_distinct": 10}


def _edit(img: Image.Image, edit: str) -> Image.Image:
    """A copy of ``img`` as ``edit`` makes it (``exact`` and ``jpeg`` are made from the file)."""
    w, h = img.size
    if edit == "resized":
        return img.resize((max(1, round(w * 0.6)), max(1, round(h * 0.6))), Image.Resampling.BICUBIC)
    if edit == "cropped":
        dx, dy = round(w * 0.075), round(h * 0.075)
        return img.crop((dx, dy, w - dx, h - dy))
    if edit == "brightened":
        return ImageEnhance.Brightness(img).enhance(1.3)
    if edit == "mirrored":
        return ImageOps.mirror(img)
    raise ValueError(edit)


def _distinct(images: np.ndarray, n: int) -> np.ndarray:
    """The first ``n`` of ``images`` whose pixels no earlier one has (a set's own exact duplicates, like the blank
    crops of a flat wallpaper, are not distinct photos); a SystemExit when there are fewer."""
    seen, keep = set(), []
    for i, x in enumerate(images):
        key = x.tobytes()
        if key not in seen:
            seen.add(key)
            keep.append(i)
            if len(keep) == n:
                return images[keep]
    raise SystemExit(f"--sizes {n}: only {len(keep)} distinct images")


FASHION_TRAINED = 20000  # a bench model trains on Fashion-MNIST's first 20,000 train images: never in a collection


def _fashion_pool(split: str) -> np.ndarray:
    """Fashion-MNIST images of one split of this bench (N x 28 x 28 uint8), none a bench model trained on: ``choose``
    (train images 20,000-39,999: where thresholds and rules are chosen) or ``report`` (the 10,000 t10k images, then
    train images 40,000-59,999: where figures are reported)."""
    from bench._datasets import fashion_mnist

    train, _ = fashion_mnist("train")
    if split == "choose":
        return train[FASHION_TRAINED : 2 * FASHION_TRAINED]
    test, _ = fashion_mnist("t10k")
    return np.concatenate([test, train[2 * FASHION_TRAINED :]])


def _images(dataset: str, n: int, size: int, seed: int, split: str = "report") -> np.ndarray:
    """``n`` distinct images of ``dataset`` (N x size x size x 3 uint8), a seeded choice from ``split``."""
    from bench._datasets import background_crops

    rng = np.random.default_rng(seed)
    if dataset == "fashion":
        pool = _fashion_pool(split)
        pool = _distinct(pool[rng.permutation(len(pool))], min(len(pool), n + n // 10 + 100))
        return np.stack([np.asarray(Image.fromarray(x).convert("RGB").resize((size, size), Image.Resampling.BICUBIC))
                         for x in _distinct(pool, n)])
    if dataset == "tiles":
        from bench._datasets import picture_tiles

        tiles = picture_tiles(1 if split == "choose" else 2)  # part 0: what a bench model of tiles trains on
        return _distinct(tiles[rng.permutation(len(tiles))], n)
    tr, _, _, _, _ = background_crops(n_train=2 * n + 64, n_val=64, size=size,
                                      seed=seed + (split == "choose") * 1000)  # per picture, rounded
    return _distinct(tr[rng.permutation(len(tr))], n)


def write_collection(root: Path, images: np.ndarray, share: float, seed: int) -> dict[str, str]:
    """Write ``images`` as ``photos/NNNNN.png`` under ``root`` and a copy of a ``share`` of them (``copies/``), the
    edits in turn; returns each copy's path -> its photo's path (relative to ``root``)."""
    rng = np.random.default_rng(seed + 1)
    (root / "photos").mkdir(parents=True)
    (root / "copies").mkdir()
    for i, x in enumerate(images):
        Image.fromarray(x).save(root / "photos" / f"{i:05d}.png")
    planted = np.sort(rng.choice(len(images), max(len(EDITS), round(share * len(images))), replace=False))
    copies = {}
    for i, edit in zip(planted, itertools.cycle(EDITS)):
        src = root / "photos" / f"{i:05d}.png"
        dst = root / "copies" / f"{i:05d}_{edit}.{'jpg' if edit == 'jpeg' else 'png'}"
        if edit == "exact":
            shutil.copyfile(src, dst)
        elif edit == "jpeg":
            buf = io.BytesIO()
            Image.fromarray(images[i]).save(buf, "JPEG", quality=70)
            dst.write_bytes(buf.getvalue())
        else:
            _edit(Image.fromarray(images[i]), edit).save(dst)
        copies[dst.relative_to(root).as_posix()] = src.relative_to(root).as_posix()
    return copies


def score(groups: list[Group], copies: dict[str, str]) -> dict[str, Any]:
    """Recall per edit, pair precision and the largest group of distinct photos of ``groups`` (paths relative to the
    collection) against the planted ``copies`` (copy -> its photo)."""
    source = lambda p: copies.get(p, p)  # noqa: E731 - a photo and its copy: one source
    group_of = {m.path: n for n, g in enumerate(groups) for m in g.members}
    recall: dict[str, list[bool]] = {e: [] for e in EDITS}
    for copy, photo in copies.items():
        edit = Path(copy).stem.split("_", 1)[1]
        recall[edit].append(copy in group_of and group_of.get(photo) == group_of[copy])
    pairs = real = 0
    largest = 0
    for g in groups:
        paths = [m.path for m in g.members]
        for a, b in itertools.combinations(paths, 2):
            pairs += 1
            real += source(a) == source(b)
        largest = max(largest, len({source(p) for p in paths}))
    found = [x for v in recall.values() for x in v]
    return {"recall": {e: round(float(np.mean(v)), 4) if v else None for e, v in recall.items()},
            "copies": {e: len(v) for e, v in recall.items()},
            "recall_all": round(float(np.mean(found)), 4) if found else None,
            "pair_precision": round(real / pairs, 4) if pairs else 1.0, "pairs": pairs, "real_pairs": real,
            "largest_distinct": largest, "groups": len(groups),
            "grouped_photos": sum(len(g.members) for g in groups)}


def _backbone(args: argparse.Namespace) -> tuple[Path, str]:
    """The backbone file and how it is described (:func:`bench._backbone.bench_backbone`)."""
    from bench._backbone import bench_backbone

    return bench_backbone(args.work, args.backbone, args.run, args.size)


def run_size(n: int, args: argparse.Namespace, backbone: Path) -> dict[str, Any]:
    """One collection of ``n`` photos (and their copies): built, indexed, grouped, scored."""
    from index.building.runner import build_index
    from index.duplicates.dedup import search_duplicates
    from index.search.image_index import ImageIndex

    root = args.work / str(n)
    shutil.rmtree(root, ignore_errors=True)
    copies = write_collection(root, _images(args.dataset, n, args.size, args.seed, args.split), args.copies,
                              args.seed)
    shutil.rmtree(args.work / f"{n}.idx", ignore_errors=True)
    t0 = time.perf_counter()
    build_index(root, backbone, args.work / f"{n}.idx", progress=False, device=args.device)
    built = time.perf_counter() - t0
    idx = ImageIndex.open(args.work / f"{n}.idx")
    t0 = time.perf_counter()
    found = search_duplicates(idx, save=False)
    d = found.decision
    return {"photos": n, "copies_planted": len(copies), "index": str(args.work / f"{n}.idx"),
            "space": idx.describe_space(), "threshold": d["threshold"], "rule": d["rule"], "base": d["base"],
            "base_rule": d["base_rule"], "crowd_level": d["crowd_level"], "copy_score": d["copy_score"],
            "proposed": d["proposed"], "verified": d["verified"], "turned_down": d["turned_down"],
            "crowded": d["crowded"],
            "calibration": idx.meta.get("dedup_calibration"), "seconds_build": round(built, 1),
            "seconds_dedup": round(time.perf_counter() - t0, 2), **score(found.groups, copies)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", choices=["fashion", "backgrounds", "tiles"], default="fashion")
    p.add_argument("--split", choices=["choose", "report"], default="report",
                   help="choose: the images rules are tuned on; report: the others, for the figures (default)")
    p.add_argument("--sizes", default="2000,10000", help="collection sizes, comma separated (default 2000,10000)")
    p.add_argument("--copies", type=float, default=0.075, help="share of the photos given a copy (default 0.075)")
    p.add_argument("--size", type=int, default=64, help="pixels per side of a photo (default 64)")
    p.add_argument("--backbone", type=Path, default=None, help="an exported backbone (.safetensors)")
    p.add_argument("--run", type=Path, default=None, help="a training run (its checkpoint.pt is exported)")
    p.add_argument("--work", type=Path, required=True, help="where the collections, indexes and export go")
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)

    from bench._machine import cpu_model

    backbone, described = _backbone(args)
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    report: dict[str, Any] = {"dataset": args.dataset, "split": args.split, "backbone": described,
                              "photo_px": args.size,
                              "copies_share": args.copies, "edits": list(EDITS), "aim": AIM, "cpu": cpu_model(),
                              "command": shlex.join(["python", "bench/dedup_copies.py", *(argv or sys.argv[1:])]),
                              "sizes": [run_size(n, args, backbone) for n in sizes]}
    report["meets_aim"] = all(min(r["recall"].values(), default=0) >= AIM["recall"]
                              and r["pair_precision"] >= AIM["pair_precision"]
                              and r["largest_distinct"] <= AIM["largest_distinct"] for r in report["sizes"])
    print(f"{args.dataset}; backbone {described}; {report['cpu']}")
    print(f"{'photos':>7} {'threshold':>9} {'rule':>10} " + " ".join(f"{e:>10}" for e in EDITS)
          + f" {'precision':>9} {'pairs':>6} {'largest':>7}")
    for r in report["sizes"]:
        print(f"{r['photos']:>7} {r['threshold']:>9} {r['rule']:>10} "
              + " ".join(f"{r['recall'][e] if r['recall'][e] is not None else '-':>10}" for e in EDITS)
              + f" {r['pair_precision']:>9} {r['pairs']:>6} {r['largest_distinct']:>7}")
    print(f"aim (recall >= {AIM['recall']}, pair precision >= {AIM['pair_precision']}, no group of more than "
          f"{AIM['largest_distinct']} distinct photos): {'met' if report['meets_aim'] else 'not met'}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
