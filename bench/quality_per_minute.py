"""Learning per CPU minute: training-recipe candidates against today's default and lightly, by kNN top-1 over minutes.

    python bench/quality_per_minute.py --minutes 5                       # screening: every candidate, 5 min each
    python bench/quality_per_minute.py --minutes 20 --only cpu,default,lightly --evals 20   # confirmation runs
    python bench/quality_per_minute.py --dataset backgrounds --minutes 5      # the second set
    python bench/quality_per_minute.py --dataset photos --minutes 20 --only cpu,issue_cmd   # the third

Each candidate is today's Fashion-MNIST setup (MoCo v2, ResNet-18, 32 px, batch 256, queue 4096, lr 0.06)
with a few settings changed ("cpu": the cpu preset itself at 32 px), trained under the same time budget
(``--time-budget``: its schedule is fitted to the minutes, kNN evaluations not counted) on the unlabeled
training images. "lightly" is lightly's MoCo v2 example set up like the default, trained for the same minutes.
Quality is the kNN monitor (k=200, T=0.1; Fashion-MNIST: leave-one-out on the 10,000 test images;
backgrounds: held-out crops against the training crops, by source picture) during the run, with the
centred-pixel baseline beside it. Results: JSON and a kNN-over-minutes plot in bench/results/.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BASE = dict(arch="resnet18", small_stem=False, image_size=32, batch_size=256, queue_size=4096, lr=0.06)
# name -> settings changed from BASE (each alone first; combinations once the single ones are measured)
CANDIDATES: dict[str, dict[str, Any]] = {
    "default": {},
    "cpu": dict(preset="cpu"),  # the cpu preset as `moco train --time-budget` takes it on a CPU, at BASE's crop size
    "t01_m099": dict(temperature=0.1, momentum=0.99),  # a short run: a faster key encoder, a sharper softmax
    "b128": dict(batch_size=128),  # twice the updates per minute (lr scales with the batch)
    "b128_lr012": dict(batch_size=128, lr=0.12),  # ... keeping the per-step lr
    "symmetric": dict(symmetric=True),  # both views as queries: twice the signal per image, twice the cost
    "q16k": dict(queue_size=16384),
    "resnet10t": dict(arch="resnet10t"),  # a shallower backbone (timm)
    "small_stem": dict(small_stem=True),  # full-resolution early layers: more compute per image
    "b128_t01_m099": dict(batch_size=128, temperature=0.1, momentum=0.99),
    "resnet10t_b128": dict(arch="resnet10t", batch_size=128),  # the two single winners of the 5-minute screen
    "resnet10t_b128_lr012": dict(arch="resnet10t", batch_size=128, lr=0.12),
    "resnet10t_b64_lr012": dict(arch="resnet10t", batch_size=64, lr=0.12),
    # resnet10t has no small stem, and bf16 needs crops of 32 px or more on it (moco.training.setup.safe_precision), so
    # progressive resolution is measured at 64 px (kNN at 64 px too): 32 -> 64 against 64 throughout
    "resnet10t_b128_64px": dict(arch="resnet10t", batch_size=128, image_size=64),
    "resnet10t_b128_64px_prog32": dict(arch="resnet10t", batch_size=128, image_size=64, min_image_size=32),
    "resnet10t_b128_q16k": dict(arch="resnet10t", batch_size=128, queue_size=16384),  # the preset's queue x4
    # the cpu preset's own settings, one at a time ("cpu_seed1": the same recipe, another seed: the noise floor)
    "cpu_seed1": dict(preset="cpu", seed=1),
    "cpu_crop04": dict(preset="cpu", crop_min=0.4),  # gentler crops: at least 40% of the photo
    "cpu_crop06": dict(preset="cpu", crop_min=0.6),
    "cpu_m099": dict(preset="cpu", momentum=0.99),  # a faster key encoder for a run of a few thousand steps
    "cpu_t01": dict(preset="cpu", temperature=0.1),
    "cpu_bn2": dict(preset="cpu", bn_splits=2),  # Shuffle BN over 2 splits of 64 instead of 8 of 16
    "cpu_wd5e4": dict(preset="cpu", weight_decay=5e-4),  # the official CIFAR demo's weight decay
    "cpu_symmetric": dict(preset="cpu", symmetric=True),
    "cpu_lr003": dict(preset="cpu", lr=0.03),  # half the preset's lr (0.12 lost: resnet10t_b128_lr012)
    "cpu_decor0": dict(preset="cpu", decorrelation=0.0),  # the cpu preset before its decorrelation term (round 5)
    "cpu_decor0_seed1": dict(preset="cpu", decorrelation=0.0, seed=1),
    "cpu_decor02": dict(preset="cpu", decorrelation=0.2),
    "cpu_decor_decay": dict(preset="cpu", decorrelation_decay=True),  # the term fades with the lr (round 8)
    "cpu_decor_decay_seed1": dict(preset="cpu", decorrelation_decay=True, seed=1),
    # the held-out command (`--preset v2 --arch resnet18 --small-stem ... --temperature 0.1 --momentum 0.99`)
    "cpu_head_bn": dict(preset="cpu", head_bn=True),  # BN in the head's hidden layer (v3's, SimCLR's projector)
    "cpu_hidden2048": dict(preset="cpu", mlp_hidden=2048),  # a wider head (solo-learn's MoCo v2+ projector)
    "cpu_mcos": dict(preset="cpu", momentum=0.99, momentum_cosine=True),  # v3's momentum: cosine from 0.99 to 1
    "issue_cmd": dict(small_stem=True, temperature=0.1, momentum=0.99),
}
K, T = 200, 0.1
PEER = "lightly"  # lightly's MoCo v2 example (bench/_lightly_moco.py), set up like BASE, fp32 as the example runs


def run_candidate(name: str, train_dir: Path, test_dir: Path, minutes: float, evals: int,
                  bank_dir: Path | None = None, keep: Path | None = None) -> dict[str, Any]:
    """Train one candidate for ``minutes``; its kNN curve over training minutes and the pixel baseline.

    ``keep``: train in ``keep/name`` (kept: its checkpoint for later probes) instead of a temporary folder."""
    from bench.fashion_mnist import _seconds_per_step
    from moco.config import resolve_config
    from moco.training.loop import train
    from moco.training.metrics import read_metrics

    spec = dict(CANDIDATES[name])
    preset = spec.pop("preset", "v2")
    setup = {**BASE, **spec} if preset == "v2" else {"image_size": BASE["image_size"], **spec}  # a preset: its own
    resolved = resolve_config(preset, **setup)
    every = max(1, int(minutes * 60 / evals / _seconds_per_step({k: getattr(resolved, k) for k in BASE})))
    setup = {"preset": preset, **{k: getattr(resolved, k) for k in BASE}, **setup}
    if keep is not None:
        shutil.rmtree(keep / name, ignore_errors=True)  # a fresh run, not a resume of an earlier one
    with (contextlib.nullcontext(str(keep / name)) if keep else tempfile.TemporaryDirectory()) as tmp:
        cfg = resolve_config(preset, data_dir=str(train_dir), out=tmp, time_budget=minutes, val_dir=str(test_dir),
                             knn_train_dir=str(bank_dir or ""), knn_k=K, knn_t=T, knn_every=every,
                             save_every_minutes=1e9, **{k: v for k, v in setup.items() if k != "preset"})
        t0 = time.perf_counter()
        summary = train(cfg, progress=False)
        wall = time.perf_counter() - t0
        records = read_metrics(Path(tmp) / "metrics.jsonl")
    elapsed = {r["step"]: r["elapsed_s"] for r in records if "elapsed_s" in r}
    elapsed[0] = 0.0
    knn = [r for r in records if "knn_top1" in r]
    curve = [(elapsed.get(r["step"], 0.0) / 60, r["knn_top1"]) for r in knn]
    white = [(elapsed.get(r["step"], 0.0) / 60, r["knn_whitened"]) for r in knn]
    fit = summary.whitening  # the end-of-run whitening's fit (None: none)
    return {"name": name, "setup": setup, "steps": summary.steps, "minutes": minutes, "wall_s": round(wall),
            "img_s": summary.steps * setup["batch_size"] / max(1e-9, elapsed.get(summary.steps, wall)),
            "knn_top1": curve[-1][1], "curve": curve, "pixels": knn[0]["knn_pixels"],
            "knn_whitened": white[-1][1], "curve_whitened": white,
            "pixels_whitened": knn[0]["knn_pixels_whitened"],
            "knn_exported": next((r["knn_exported"] for r in records if "knn_exported" in r), None),
            "whitening_s": fit.seconds if fit else None,
            "whitening_mirror": fit.mirror if fit else None,
            "whitening_stages": list(fit.stages) if fit else None}


def run_lightly(train_dir: Path, test_dir: Path, minutes: float, evals: int,
                bank_dir: Path | None = None) -> dict[str, Any]:
    """lightly's example for ``minutes`` of training, evaluated by the same kNN monitor as ours."""
    import torch

    from bench._lightly_moco import lightly_train
    from moco.config import IMAGENET_MEAN, IMAGENET_STD
    from moco.data.cache import cache_size_for
    from moco.training.knn import KnnMonitor

    setup = dict(BASE)
    with tempfile.TemporaryDirectory() as tmp:
        monitor = KnnMonitor(str(test_dir), str(bank_dir or ""), cache_size_for(setup["image_size"]), Path(tmp),
                             setup["image_size"], IMAGENET_MEAN, IMAGENET_STD, K, T, workers=2)

        def evaluate(model, at: float) -> None:
            top1, white = monitor.evaluate(model.backbone, torch.device("cpu"))
            curve.append((at, top1))
            curve_white.append((at, white))
            model.train()

        spent, curve, curve_white, step, t0 = 0.0, [], [], 0, time.perf_counter()
        for step, dt, model in lightly_train(train_dir, **setup, momentum=0.999, temperature=0.2):  # noqa: B007
            if not curve:
                evaluate(model, 0.0)  # after its first step (ours: before it)
            spent += dt
            if spent >= len(curve) * minutes * 60 / evals or spent >= minutes * 60:
                evaluate(model, spent / 60)
            if spent >= minutes * 60:
                break
        pixels = monitor.pixels_top1()
    return {"name": PEER, "setup": setup, "steps": step, "minutes": minutes, "wall_s": round(time.perf_counter() - t0),
            "img_s": step * setup["batch_size"] / spent, "knn_top1": curve[-1][1], "curve": curve,
            "pixels": pixels, "knn_whitened": curve_white[-1][1], "curve_whitened": curve_white,
            "pixels_whitened": monitor.pixels_whitened_top1()}


def main() -> int:
    from bench._machine import cpu_model

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=5.0, help="time budget of each candidate (default: 5)")
    p.add_argument("--only", default="", help="comma-separated candidates (default: all, then the peer): "
                   + ", ".join([*CANDIDATES, PEER]))
    p.add_argument("--evals", type=int, default=4, help="kNN evaluations during each run")
    p.add_argument("--dataset", choices=("fashion", "backgrounds", "photos"), default="fashion",
                   help="fashion: Fashion-MNIST, kNN leave-one-out on the test images; backgrounds: crops of "
                   "gnome-backgrounds pictures, kNN of held-out crops against the training crops by source design; "
                   "photos: the same with 40-px crops of about 90 other desktop pictures (bench._datasets.photo_crops)")
    p.add_argument("--data", type=Path, default=Path(".bench_data"))
    p.add_argument("--keep", type=Path, default=None,
                   help="train each candidate in KEEP/NAME and keep its run (checkpoint, metrics) for later probes")
    p.add_argument("--json", type=Path, default=None,
                   help="default: bench/results/quality_per_minute_<DATASET>_<M>min.json")
    args = p.parse_args()
    from bench._datasets import background_crops, fashion_mnist, photo_crops, write_folder

    names = [n for n in args.only.split(",") if n] or [*CANDIDATES, PEER]
    unknown = [n for n in names if n not in CANDIDATES and n != PEER]
    if unknown:
        p.error(f"unknown candidates {unknown}: use {', '.join([*CANDIDATES, PEER])}")
    bank_dir = None
    if args.dataset == "fashion":
        train_images, _ = fashion_mnist("train")
        test_images, test_labels = fashion_mnist("t10k")
        train_dir = write_folder(args.data / "fmnist_train", train_images)
        test_dir = write_folder(args.data / "fmnist_test", test_images, test_labels)
    else:  # bg16: gnome-backgrounds, crop sides 1/16 to 1/4; photos90: other pictures, 1/8 to 1/3, 40 px
        crops, prefix = (background_crops, "bg16") if args.dataset == "backgrounds" else (photo_crops, "photos90")
        train_images, train_labels, val_images, val_labels, designs = crops()
        train_dir = write_folder(args.data / f"{prefix}_train", train_images)
        bank_dir = write_folder(args.data / f"{prefix}_bank", train_images, train_labels, classes=designs)
        test_dir = write_folder(args.data / f"{prefix}_val", val_images, val_labels, classes=designs)
    out = args.json or Path(f"bench/results/quality_per_minute_{args.dataset}_{args.minutes:g}min.json")
    cpu = cpu_model()
    import torch

    threads = torch.get_num_threads()
    print(f"{args.dataset}, {args.minutes:g} min per candidate, {cpu}, {threads} thread(s)", flush=True)
    rows = json.loads(out.read_text())["rows"] if out.is_file() else []
    for name in names:
        rows = [r for r in rows if r["name"] != name]
        if name == PEER:
            rows.append(run_lightly(train_dir, test_dir, args.minutes, args.evals, bank_dir))
        else:
            rows.append(run_candidate(name, train_dir, test_dir, args.minutes, args.evals, bank_dir, args.keep))
        r = rows[-1]
        print(f"{name:<16} kNN top-1 {100 * r['knn_top1']:.2f}% (pixels {100 * (r['pixels'] or 0):.2f}%), whitened "
              f"{100 * r['knn_whitened']:.2f}% (pixels {_pct(r['pixels_whitened'])}) {r['steps']} steps, "
              f"{r['img_s']:.0f} img/s, {r['wall_s']} s wall", flush=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        command = " ".join(["python bench/quality_per_minute.py", *sys.argv[1:]])
        out.write_text(json.dumps({"command": command, "minutes": args.minutes, "cpu": cpu, "threads": threads,
                                   "base": BASE, "dataset": args.dataset, "rows": rows}, indent=1))
    base = next((r for r in rows if r["name"] == "default"), None)
    print(f"\n{'candidate':<16} {'kNN top-1':>9} {'vs default':>10}")
    for r in sorted(rows, key=lambda r: -r["knn_top1"]):
        delta = f"{100 * (r['knn_top1'] - base['knn_top1']):+.2f}" if base else ""
        print(f"{r['name']:<16} {100 * r['knn_top1']:8.2f}% {delta:>10}")
    _plot(rows, out.with_suffix(".png"))
    return 0


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.2f}%"


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    try:
        import matplotlib
    except ModuleNotFoundError:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    for r in rows:
        (line,) = ax.plot([m for m, _ in r["curve"]], [100 * v for _, v in r["curve"]], "o-", label=r["name"])
        if r.get("curve_whitened"):  # the same features whitened on the collection: dotted, same colour
            ax.plot([m for m, _ in r["curve_whitened"]], [100 * v for _, v in r["curve_whitened"]], "s:",
                    color=line.get_color(), label=f"{r['name']} whitened")
    pixels = next((r["pixels"] for r in rows if r.get("pixels") is not None), None)
    if pixels is not None:
        ax.axhline(100 * pixels, color="k", ls="--", lw=1, label=f"centred pixels {100 * pixels:.1f}%")
    white = next((r["pixels_whitened"] for r in rows if r.get("pixels_whitened") is not None), None)
    if white is not None:
        ax.axhline(100 * white, color="k", ls=":", lw=1, label=f"whitened pixels {100 * white:.1f}%")
    ax.set_xlabel("training minutes")
    ax.set_ylabel("kNN top-1 (%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
