"""Whiten or only centre an index's embedding space, by collection size: leave-one-out kNN in six spaces (issue 28).

    OMP_NUM_THREADS=1 python bench/quality_per_minute.py --dataset fashion --minutes 5 --only cpu --evals 1 \\
        --keep .bench_runs/fashion --json bench/results/space_by_size_train_fashion_cpu5min.json
    OMP_NUM_THREADS=1 python bench/quality_per_minute.py --dataset backgrounds --minutes 5 --only cpu --evals 1 \\
        --keep .bench_runs/backgrounds --json bench/results/space_by_size_train_backgrounds_cpu5min.json
    OMP_NUM_THREADS=1 python bench/space_by_size.py .bench_runs/fashion/cpu --dataset fashion \\
        --json bench/results/space_by_size_fashion_on_fashion.json
    OMP_NUM_THREADS=1 python bench/space_by_size.py .bench_runs/backgrounds/cpu --dataset backgrounds \\
        --sizes 20,50,240,1000,2000,4800 --json bench/results/space_by_size_backgrounds_on_backgrounds.json
    OMP_NUM_THREADS=1 python bench/space_by_size.py .bench_runs/backgrounds/cpu --dataset fashion \\
        --json bench/results/space_by_size_backgrounds_on_fashion.json         # a foreign backbone
    OMP_NUM_THREADS=1 python bench/space_by_size.py .bench_runs/fashion/cpu --dataset backgrounds \\
        --sizes 20,50,240,1000,2000,4800 --json bench/results/space_by_size_fashion_on_backgrounds.json  # foreign
    python bench/space_by_size.py --markdown bench/results/space_by_size.md bench/results/space_by_size_*_on_*.json

(The photos set, 90 other desktop pictures, needs packages this machine lacks; backgrounds, crops of the
gnome-backgrounds pictures, stands in: its pool of 9,600 crops halves into 4,800, the largest N there.)

A collection is N photos of a set; each photo queries the other N-1 (kNN top-1, k = min(200, N-1), T = 0.1,
moco.training.knn.knn_top1); labels score, nothing is fitted on them. Features f: what the run's export embeds
before its whitening, ``normalize(embedding_features(backbone, x, mirror=True, stages=whitening.stage_names))``;
(m_t, M_t): the run's training-time whitening (Embedder.load(...).space); m_c: the collection's mean. Spaces:

    A  centred                      normalize(f - m_c)
    B  collection-whitened          normalize((f - m_c) @ M_c), M_c Ledoit-Wolf fitted on the N features
                                    (moco.whiten.fit_whitening)
    C  training matrix, coll. mean  normalize((f - m_c) @ M_t)
    D  today's index                normalize(w - mean_c(w)), w = normalize((f - m_t) @ M_t)
    E  pixels centred               moco.training.knn.pixel_features of the N photos (the eval view's normalized pixels)
    F  pixels whitened              E whitened as B (fitted on the N pixel vectors, as the kNN monitor does)

Choose on one split, report on the other: the pool (Fashion-MNIST: the 10,000 test images; photos: the 12,000
training crops and the 2,000 held-out crops of bench/quality_per_minute.py's 90 pictures; backgrounds: its 8,000
and 1,600 crops of the gnome pictures) is halved by a seeded permutation; subsets of the CHOOSE half decide the
rule, subsets of the REPORT half give the figures. A size equal to the half is the whole half (one draw). The same
subsets serve every space (paired). Below 3,072 photos the pixels' whitening is computed in the N-dimensional dual
(the same map on the collection's own vectors, by Woodbury; ``--check-dual`` compares it with fit_whitening).
Folders come from bench/quality_per_minute.py (it writes them under .bench_data).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # a shared machine: one thread unless told otherwise
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

K, T = 200, 0.1
SIZES = (20, 50, 240, 1000, 2000, 5000)
EXTRA_K = (10, 1)  # beside k = min(200, N-1): at small N that k lets nearly every photo vote
SUBSETS = {20: 20, 50: 20, 240: 5, 1000: 3, 2000: 2, 5000: 2}  # draws per size (one: a size equal to the half)
SPACES = ("A", "B", "C", "D", "E", "F")
LABELS = {
    "A": "centred",
    "B": "coll.-whitened",
    "C": "train M, coll. mean",
    "D": "today's index",
    "E": "pixels centred",
    "F": "pixels whitened",
}
NONE = {"mean": -1.0}  # a space not measured
POOLS = {"fashion": ("fmnist_test",), "photos": ("photos90_bank", "photos90_val"),
         "backgrounds": ("bg16_bank", "bg16_val")}


def _unit(v: np.ndarray) -> np.ndarray:
    return (v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-12)).astype(np.float32)


def dual_whitened(x: np.ndarray) -> tuple[np.ndarray, float]:
    """Vectors (N x N) whose inner products are those of ``normalize((x - m) @ M)``, M the Ledoit-Wolf whitening of
    ``x`` (N x D) as :func:`moco.whiten.fit_whitening` fits it; and the shrinkage. For N < D: the shrunk covariance
    C = (1-a) Xc'Xc/N + a mu I gives Xc C^-1 Xc' = U diag(l / ((1-a) l/N + a mu)) U' with Xc Xc' = U diag(l) U'."""
    from moco.whiten import ledoit_wolf_shrinkage

    v = x.astype(np.float64)
    xc = v - v.mean(0)  # N x D
    n, d = xc.shape
    a = ledoit_wolf_shrinkage(xc)
    mu = float((xc**2).sum()) / n / d  # trace(cov) / D
    lam, u = np.linalg.eigh(xc @ xc.T)  # N, N x N
    lam = np.maximum(lam, 0.0)
    scale = lam / ((1 - a) * lam / n + a * mu)  # N: the whitened Gram's eigenvalues
    return _unit(u * np.sqrt(scale)[None, :]), a


def whiten_on_itself(x: np.ndarray) -> tuple[np.ndarray, float]:
    """``normalize((x - m_c) @ M_c)`` with M_c fitted on ``x`` itself (Ledoit-Wolf), and the shrinkage; the dual
    form (same inner products) when there are fewer rows than dimensions and the dimension is large."""
    from moco.whiten import fit_whitening

    if len(x) < x.shape[1] and x.shape[1] > 1024:
        return dual_whitened(x)
    w = fit_whitening(x)
    return w(x), w.shrinkage


def top1(v: np.ndarray, labels: np.ndarray, classes: int, space: str) -> dict[str, float]:
    """Leave-one-out kNN top-1 of the rows ``v`` (N x D, L2-normalized) as ``{space: k = min(200, N-1)}``, and
    with the small k's of ``EXTRA_K`` as ``{space_k10: ...}`` (what a search's first results see)."""
    import torch

    from moco.training.knn import knn_top1

    x, y = torch.from_numpy(np.ascontiguousarray(v, np.float32)), torch.from_numpy(labels)
    out = {space: knn_top1(x, y, None, None, classes, K, T)}
    out.update({f"{space}_k{k}": knn_top1(x, y, None, None, classes, k, T) for k in EXTRA_K})
    return out


def spaces_of(f: np.ndarray, p: np.ndarray | None, labels: np.ndarray, classes: int, white,
              pixel_cache: dict[str, float] | None = None) -> dict[str, float]:
    """Top-1 of one collection in every space: ``f`` (N x D') L2-normalized features, ``p`` (N x 3·s·s) the eval
    view's pixels, not centred (None: skip E and F), ``white`` the run's training whitening or None;
    ``pixel_cache``: E and F of this very collection measured before (they do not depend on the model)."""
    mc = f.mean(0, keepdims=True)  # 1 x D'
    out: dict[str, float] = top1(_unit(f - mc), labels, classes, "A")
    b, out["shrink_B"] = whiten_on_itself(f)
    out.update(top1(b, labels, classes, "B"))
    if white is not None:
        out.update(top1(_unit((f - mc) @ white.matrix), labels, classes, "C"))
        w = white(f)  # normalize((f - m_t) @ M_t)
        out.update(top1(_unit(w - w.mean(0, keepdims=True)), labels, classes, "D"))
    if p is not None and pixel_cache:
        out.update(pixel_cache)
    elif p is not None:
        e = _unit(p - p.mean(0, keepdims=True))  # knn.pixel_features on the collection: centred, normalized
        out.update(top1(e, labels, classes, "E"))
        fw, out["shrink_F"] = whiten_on_itself(e)  # as knn.whitened: fitted on the centred pixel features
        out.update(top1(fw, labels, classes, "F"))
    return out


def load_pool(dataset: str, data: Path, size: int, tmp: Path) -> tuple[np.ndarray, np.ndarray, int]:
    """(uint8 images P x S x S x 3, labels P, classes) of the set's pool, decoded as the kNN monitor does."""
    from moco.data.cache import cache_size_for
    from moco.training.knn import LabeledImages

    arrays, labels, classes = [], [], None
    for i, folder in enumerate(POOLS[dataset]):
        root = data / folder
        if not (root / ".complete").exists():
            raise SystemExit(f"{root} missing: run bench/quality_per_minute.py --dataset {dataset} first (it writes "
                             "the folders)")
        li = LabeledImages(root, cache_size_for(size), tmp / f"c{i}", 0, classes)
        classes = li.classes
        arrays.append(np.asarray(li.cache.array))
        labels.append(li.labels.numpy())
    return np.concatenate(arrays), np.concatenate(labels), len(classes)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from bench._machine import cpu_model
    from moco.data.augment import center_view
    from moco.embed import Embedder
    from moco.training.knn import extract_features

    torch.set_num_threads(1)
    path = args.model / "checkpoint.pt" if args.model.is_dir() else args.model
    emb = Embedder.load(path, device="cpu", precision="fp32")
    white = emb.space
    stages = white.stage_names if white is not None else ()
    tmp = Path(tempfile.mkdtemp())
    try:
        images, labels, classes = load_pool(args.dataset, args.data, emb.image_size, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    t0 = time.perf_counter()
    cpu = torch.device("cpu")
    feats = extract_features(
        emb.backbone,
        images,
        emb.image_size,
        emb.pixel_mean,
        emb.pixel_std,
        cpu,
        mirror=True,
        stages=stages,
        channels_last=emb.channels_last,
    ).numpy()  # P x D', normalized
    pixels = torch.cat([center_view(torch.from_numpy(np.array(images[i : i + 1024])), emb.image_size, emb.pixel_mean,
                                    emb.pixel_std).flatten(1) for i in range(0, len(images), 1024)]).numpy()
    print(f"{len(images)} photos, features {feats.shape[1]}-d, pixels {pixels.shape[1]}-d "
          f"({time.perf_counter() - t0:.0f} s)", flush=True)
    perm = np.random.default_rng(args.seed).permutation(len(images))
    # E and F depend on the photos and the eval view only: measured once per set, reused by the next model
    tag = hashlib.sha256(json.dumps([args.dataset, len(images), args.seed, emb.image_size, list(emb.pixel_mean),
                                     list(emb.pixel_std), K, T, EXTRA_K]).encode()).hexdigest()[:12]
    cache_file = args.data / f"space_by_size_pixels_{args.dataset}_{tag}.json"
    cache = json.loads(cache_file.read_text()) if cache_file.is_file() and not args.no_pixel_cache else {}
    halves = {"choose": perm[: len(perm) // 2], "report": perm[len(perm) // 2 :]}
    results: dict[str, Any] = {}
    for split, half in halves.items():
        results[split] = {}
        for n in args.sizes:
            if n > len(half):
                print(f"{split} N={n}: the half holds {len(half)} photos, skipped", flush=True)
                continue
            draws = 1 if n == len(half) else SUBSETS.get(n, 3)
            rows, t1 = [], time.perf_counter()
            for s in range(draws):
                rng = np.random.default_rng([args.seed, n, s, 0 if split == "choose" else 1])
                idx = np.sort(rng.choice(half, n, replace=False))
                use_pixels = not args.no_pixels and n <= args.pixels_up_to
                key = f"{split}/{n}/{s}"
                rows.append(spaces_of(feats[idx], pixels[idx] if use_pixels else None, labels[idx], classes, white,
                                      cache.get(key)))
                if use_pixels and key not in cache:
                    cache[key] = {k: v for k, v in rows[-1].items() if k[0] in "EF" or k == "shrink_F"}
                    cache_file.write_text(json.dumps(cache))
            keys = [k for k in rows[0]]
            results[split][str(n)] = {"subsets": draws, "seconds": round(time.perf_counter() - t1, 1),
                                      **{k: {"mean": float(np.mean([r[k] for r in rows])),
                                             "std": float(np.std([r[k] for r in rows], ddof=1)) if draws > 1 else 0.0,
                                             "values": [float(r[k]) for r in rows]} for k in keys}}
            for suffix in ("", *(f"_k{k}" for k in EXTRA_K)):
                print(f"{split:<6} {_row(n, results[split][str(n)], suffix)}", flush=True)
    return {"command": " ".join(["python bench/space_by_size.py", *sys.argv[1:]]), "cpu": cpu_model(),
            "threads": torch.get_num_threads(), "dataset": args.dataset, "model": str(path),
            "trained_on": _trained_on(path), "arch": emb.config.arch, "image_size": emb.image_size,
            "feature_dim": int(feats.shape[1]), "pixel_dim": int(pixels.shape[1]),
            "training_whitening": None if white is None else {"count": white.count, "shrinkage": white.shrinkage,
                                                              "stages": list(stages), "mirror": white.mirror},
            "pool": {"folders": list(POOLS[args.dataset]), "photos": len(images), "classes": classes,
                     "half": len(halves["report"])},
            "k": K, "t": T, "extra_k": list(EXTRA_K), "seed": args.seed,
            "pixels_up_to": None if args.no_pixels else args.pixels_up_to,
            "results": results, "rule": choose_rule(results["choose"], white is not None),
            "rule_by_k": {f"k{k}": choose_rule(results["choose"], white is not None, f"_k{k}") for k in EXTRA_K},
            "wall_s": round(time.perf_counter() - t0)}


def _trained_on(path: Path) -> str | None:
    """The training data folder of a run (its checkpoint's config), for the tables' titles."""
    try:
        import torch

        cfg = torch.load(path, map_location="cpu", weights_only=False).get("config") or {}
        return str(cfg.get("data_dir")) if isinstance(cfg, dict) else None
    except Exception:  # noqa: BLE001 - a label only
        return None


def choose_rule(choose: dict[str, Any], has_training: bool, suffix: str = "") -> dict[str, Any]:
    """From the CHOOSE split: the best unwhitened space (among A, C, D with a training whitening, else A; on average
    over the sizes) and the smallest N from which B beats it at that size and every larger one. ``suffix``: the
    figures of another k ("_k10")."""
    sizes = sorted(int(n) for n in choose)

    def at(n: int, space: str) -> float:
        return choose[str(n)].get(space + suffix, NONE)["mean"]

    fallback = max(("A", "C", "D") if has_training else ("A",), key=lambda s: np.mean([at(n, s) for n in sizes]))
    wins = {n: at(n, "B") - at(n, fallback) for n in sizes}
    start = None
    for n in reversed(sizes):
        if wins[n] <= 0:
            break
        start = n
    return {"fallback": fallback, "whiten_from": start,
            "b_minus_fallback": {str(n): round(100 * w, 2) for n, w in wins.items()},
            "best_per_size": {str(n): max("ABCD", key=lambda s, n=n: at(n, s)) for n in sizes}}


def _fmt(cell: dict[str, float] | None) -> str:
    if cell is None:
        return "n/a"
    return f"{100 * cell['mean']:.1f} ± {100 * cell['std']:.1f}"


def _row(n: int | str, r: dict[str, Any], suffix: str = "") -> str:
    cells = "  ".join(f"{s} {_fmt(r.get(s + suffix)):>12}" for s in SPACES)
    return f"N={n:<5} {suffix or 'k200':<4} {cells}  ({r['subsets']} subsets)"


def _own(d: dict[str, Any]) -> str:
    """Whether the run was trained on the set it is measured on: "own", else "foreign"."""
    trained = (d.get("trained_on") or "").replace("fmnist", "fashion").replace("bg16", "backgrounds")
    return "own" if d["dataset"] in trained else "foreign"


def _rule_text(docs: list[dict[str, Any]]) -> list[str]:
    """The rule the CHOOSE half gives over every (model, set) at the main k, and what the REPORT half says of it."""
    starts = [d["rule"]["whiten_from"] for d in docs]
    if any(x is None for x in starts):
        return ["**Rule (CHOOSE half):** whitening on the collection does not win on every (model, set): see below."]
    x = max(starts)
    fallbacks = [d["rule"]["fallback"] for d in docs]
    fb = max(set(fallbacks), key=fallbacks.count)
    lines = [f"**Rule (chosen on the CHOOSE half, k = min(200, N-1)):** whiten on the collection (B) from N >= {x:,} "
             f"photos (the first measured size where B beats the best unwhitened space on every (model, set)), "
             f"otherwise {fb} ({LABELS[fb]}; the CHOOSE half's best unwhitened space on {fallbacks.count(fb)} of "
             f"{len(docs)}). REPORT half, B minus {fb} (points):"]
    for d in docs:
        rep = d["results"]["report"]
        diffs = ", ".join(f"N={n}: {100 * (r['B']['mean'] - r[fb]['mean']):+.1f}" for n, r in rep.items())
        lines.append(f"- {Path(d['model']).parent.parent.name} on {d['dataset']} ({_own(d)}): {diffs}")
    return lines


def markdown(files: list[Path]) -> str:
    """The tables of the JSON results ``files``: one per (model, set), the REPORT half's figures."""
    docs = [json.loads(f.read_text()) for f in files]
    out = ["## Whiten or centre, by collection size (issue 28; `bench/space_by_size.py`)", "",
           f"CPU: {docs[0]['cpu']} (lscpu), one thread. Leave-one-out kNN top-1 (%) inside a collection of N photos "
           f"(k = min(200, N-1), T = 0.1), mean ± std over seeded random subsets. Figures: the **REPORT** half of "
           "each pool; the rule was chosen on the **CHOOSE** half. Spaces: A centred; B whitened on the collection "
           "(Ledoit-Wolf); C the run's training matrix, the collection's mean; D today's index (training whitening, "
           "then centred on the collection); E pixels centred; F pixels whitened as B. Bold: the best of A-D.", "",
           "| model on set | CHOOSE: B wins from N = (k200 / k10 / k1) | otherwise (k200) |",
           "|---|---|---|"]
    for d in docs:
        by_k = [d["rule"], *d["rule_by_k"].values()]
        out.append(
            f"| {Path(d['model']).parent.parent.name} on {d['dataset']} ({_own(d)}) | "
            + " / ".join(str(r["whiten_from"] or "never") for r in by_k)
            + f" | {d['rule']['fallback']} |"
        )
    out += ["", *_rule_text(docs), ""]
    for d, f in zip(docs, files):
        rep, rule = d["results"]["report"], d["rule"]
        out += [f"### {Path(d['model']).parent.parent.name} model ({_own(d)} backbone) on {d['dataset']} "
                f"(`{f.name}`; pool {d['pool']['photos']} photos, {d['pool']['classes']} classes, "
                f"halves of {d['pool']['half']}; {d['feature_dim']}-d features)", "",
                "| N | subsets | " + " | ".join(f"{s} {LABELS[s]}" for s in SPACES) + " | LW shrinkage B |",
                "|---" * (len(SPACES) + 3) + "|"]
        for n, r in rep.items():
            best = max("ABCD", key=lambda s, r=r: r.get(s, NONE)["mean"])
            cells = [(f"**{_fmt(r.get(s))}**" if s == best else _fmt(r.get(s))) for s in SPACES]
            out.append(f"| {n} | {r['subsets']} | " + " | ".join(cells) + f" | {r['shrink_B']['mean']:.2f} |")
        out += [
            "",
            "Smaller k (the first results a search shows), REPORT half, A / B / C / D / E / F:",
            "",
            "| N | " + " | ".join(f"k = {k}" for k in d["extra_k"]) + " |",
            "|---" * (1 + len(d["extra_k"])) + "|",
        ]
        for n, r in rep.items():
            out.append(f"| {n} | " + " | ".join(" / ".join(f"{100 * r[f'{s}_k{k}']['mean']:.1f}" if f"{s}_k{k}" in r
                                                             else "n/a" for s in SPACES)
                                                 for k in d["extra_k"]) + " |")
        out.append("")
        for name, rl in [("k200", rule), *d["rule_by_k"].items()]:
            suffix = "" if name == "k200" else f"_{name}"
            ch = ", ".join(f"{n}: {v:+.1f}" for n, v in rl["b_minus_fallback"].items())
            rp = ", ".join(f"{n}: {100 * (r['B' + suffix]['mean'] - r[rl['fallback'] + suffix]['mean']):+.1f}"
                           for n, r in rep.items())
            out.append(f"- {name}: B minus {rl['fallback']} (points), CHOOSE half {ch} (B wins from N = "
                       f"{rl['whiten_from'] or 'never'}); REPORT half {rp}.")
        out += ["", f"Command: `{d['command']}` ({d['wall_s']} s)", ""]
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", type=Path, nargs="?", help="a run directory (its checkpoint.pt) or a checkpoint/export")
    p.add_argument("--dataset", choices=tuple(POOLS), default="fashion")
    p.add_argument("--data", type=Path, default=Path(".bench_data"))
    p.add_argument("--sizes", default=",".join(map(str, SIZES)), help="collection sizes N, comma-separated")
    p.add_argument("--seed", type=int, default=0, help="the halving and the subsets")
    p.add_argument("--pixels-up-to", type=int, default=5000, help="spaces E and F only for N up to this")
    p.add_argument("--no-pixels", action="store_true", help="skip E and F")
    p.add_argument(
        "--no-pixel-cache",
        action="store_true",
        help="measure E and F again (default: reuse DATA/space_by_size_pixels_*.json of the same photos)",
    )
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--markdown", type=Path, default=None, help="write the tables of the JSON files given instead")
    p.add_argument("--check-dual", action="store_true", help="compare the dual whitening with fit_whitening, exit")
    p.add_argument("files", type=Path, nargs="*", help="with --markdown: the JSON results")
    args = p.parse_args()
    if args.markdown:
        files = ([args.model] if args.model else []) + args.files
        args.markdown.write_text(markdown(files) + "\n")
        print(args.markdown.read_text())
        return 0
    if args.check_dual:
        from moco.whiten import fit_whitening

        x = _unit(np.random.default_rng(0).standard_normal((60, 1500)).cumsum(1))  # correlated dims
        w = fit_whitening(x)
        v, a = dual_whitened(x)
        err = np.abs(w(x) @ w(x).T - v @ v.T).max()
        print(f"dual vs fit_whitening: shrinkage {a:.4f} / {w.shrinkage:.4f}, max |cosine difference| {err:.2e}")
        return 0 if err < 1e-3 else 1
    if args.model is None:
        p.error("a model is required")
    args.sizes = [int(s) for s in args.sizes.split(",") if s]
    doc = measure(args)
    print(f"\n{args.dataset}: {doc['model']} ({doc['arch']}, {doc['feature_dim']}-d), {doc['cpu']}; REPORT half")
    for suffix in ("", *(f"_k{k}" for k in EXTRA_K)):
        for n, r in doc["results"]["report"].items():
            print(_row(n, r, suffix))
    for name, rule in [("k200", doc["rule"]), *doc["rule_by_k"].items()]:
        print(f"CHOOSE half, {name}: B - {rule['fallback']} = {rule['b_minus_fallback']} -> whiten from N >= "
              f"{rule['whiten_from']}, else {rule['fallback']}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
