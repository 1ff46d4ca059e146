"""Quality in fixed time: MoCo v2 on Fashion-MNIST train images, ours vs lightly vs raw pixels.

    python bench/fashion_mnist.py [--minutes 20] [--arch resnet18] [--small-stem] [--image-size 32]

Both trainers see the 60,000 train images as unlabeled PNG files and train for the same number of
minutes (kNN evaluations not counted) with the same network, batch, crop size, queue, temperature,
momentum and learning rate. Quality is the kNN monitor of the MoCo papers (k=200, T=0.1, cosine,
leave-one-out) on the 10,000 test images, labels used only there; the raw-pixel baseline is the same
kNN on the test images' pixels.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._datasets import fashion_mnist, write_folder  # noqa: E402
from moco.config import resolve_config  # noqa: E402
from moco.data.cache import cache_size_for
from moco.training.knn import LabeledImages, extract_features, knn_top1  # noqa: E402
from moco.training.loop import train  # noqa: E402
from moco.training.metrics import read_metrics  # noqa: E402

K, T = 200, 0.1


def raw_pixels(test_images: np.ndarray, test_labels: np.ndarray) -> float:
    feats = F.normalize(torch.from_numpy(test_images.reshape(len(test_images), -1).copy()).float(), dim=1)  # N x 784
    return knn_top1(feats, torch.from_numpy(test_labels.astype(np.int64)), k=K, t=T)


def ours(train_dir: Path, test_dir: Path, setup: dict, minutes: float, knn_every: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cfg = resolve_config(
            "v2",
            data_dir=str(train_dir),
            out=tmp,
            time_budget=minutes,
            val_dir=str(test_dir),
            knn_k=K,
            knn_t=T,
            knn_every=knn_every,
            save_every_minutes=1e9,
            **setup,
        )
        summary = train(cfg, progress=False)
        records = read_metrics(Path(tmp) / "metrics.jsonl")
    losses = [r for r in records if "loss" in r]
    train_s = sum(r["step_ms"] for r in losses) / 1000
    curve = [(r["step"] / max(1, len(losses)) * train_s / 60, r["knn_top1"]) for r in records if "knn_top1" in r]
    return {
        "name": f"ours ({summary.precision})",
        "steps": summary.steps,
        "train_minutes": train_s / 60,
        "images_seen": summary.steps * setup["batch_size"],
        "knn_top1": curve[-1][1],
        "curve": curve,
    }


def peer(train_dir: Path, test: LabeledImages, setup: dict, minutes: float, eval_minutes: float) -> dict:
    from bench._lightly_moco import lightly_train

    def evaluate(model) -> float:
        feats = extract_features(
            model.backbone,
            test.cache.array,
            setup["image_size"],
            (0.485, 0.456, 0.406),
            (0.229, 0.224, 0.225),
            torch.device("cpu"),
            precision="fp32",
        )
        model.train()
        return knn_top1(feats, test.labels, k=K, t=T)

    spent, next_eval, curve, step = 0.0, 0.0, [], 0
    for step, dt, model in lightly_train(train_dir, **setup):
        if not curve:
            curve.append((0.0, evaluate(model)))  # the same start as ours: before any update (after step 1 here)
        spent += dt
        if spent >= next_eval + eval_minutes * 60 or spent >= minutes * 60:
            next_eval = spent
            curve.append((spent / 60, evaluate(model)))
            print(f"  lightly: {spent / 60:.1f} min, step {step}, kNN top-1 {100 * curve[-1][1]:.2f}%", flush=True)
        if spent >= minutes * 60:
            break
    return {
        "name": "lightly (fp32, as its example)",
        "steps": step,
        "train_minutes": spent / 60,
        "images_seen": step * setup["batch_size"],
        "knn_top1": curve[-1][1],
        "curve": curve,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=20.0)
    p.add_argument("--arch", default="resnet18")
    p.add_argument("--small-stem", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--queue-size", type=int, default=4096)
    p.add_argument("--lr", type=float, default=0.06)
    p.add_argument("--evals", type=int, default=5, help="kNN evaluations during each run")
    p.add_argument("--skip-peer", action="store_true")
    p.add_argument(
        "--peer-from",
        type=Path,
        default=None,
        help="take the lightly row from this earlier result JSON (same setup) instead of running it",
    )
    p.add_argument("--data", type=Path, default=Path(".bench_data"))
    p.add_argument("--json", type=Path, default=Path("bench/results/fashion_mnist.json"))
    args = p.parse_args()
    setup = dict(
        arch=args.arch,
        small_stem=args.small_stem,
        image_size=args.image_size,
        batch_size=args.batch_size,
        queue_size=args.queue_size,
        lr=args.lr,
    )
    train_images, _ = fashion_mnist("train")
    test_images, test_labels = fashion_mnist("t10k")
    train_dir = write_folder(args.data / "fmnist_train", train_images)
    test_dir = write_folder(args.data / "fmnist_test", test_images, test_labels)
    print(
        f"Fashion-MNIST: {len(train_images)} train PNGs (unlabeled), {len(test_images)} test PNGs; {setup}; "
        f"{args.minutes} min each; kNN k={K} T={T} leave-one-out on test",
        flush=True,
    )

    rows = [{"name": "raw pixels (28x28, cosine)", "knn_top1": raw_pixels(test_images, test_labels)}]
    print(f"{rows[0]['name']:<34} kNN top-1 {100 * rows[0]['knn_top1']:.2f}%", flush=True)

    # ours: how many steps fit is unknown before it runs, so evaluate every ~minutes/evals of its speed
    t0 = time.perf_counter()
    probe_steps = max(1, int(args.minutes * 60 / args.evals / _seconds_per_step(setup)))
    rows.append(ours(train_dir, test_dir, setup, args.minutes, probe_steps))
    print(
        f"{rows[-1]['name']:<34} kNN top-1 {100 * rows[-1]['knn_top1']:.2f}%  ({rows[-1]['steps']} steps, "
        f"{rows[-1]['train_minutes']:.1f} min training, {time.perf_counter() - t0:.0f} s wall)",
        flush=True,
    )
    if args.peer_from:
        earlier = json.loads(args.peer_from.read_text())
        if earlier["setup"] != setup or earlier["minutes"] != args.minutes:
            raise SystemExit(f"{args.peer_from} was run with {earlier['setup']}, {earlier['minutes']} min")
        rows.append(next(r for r in earlier["rows"] if r["name"].startswith("lightly")))
        print(f"{rows[-1]['name']:<34} kNN top-1 {100 * rows[-1]['knn_top1']:.2f}%  (from {args.peer_from})")
    elif not args.skip_peer:
        with tempfile.TemporaryDirectory() as tmp:
            test = LabeledImages(test_dir, cache_size_for(args.image_size), Path(tmp), workers=2)
            rows.append(peer(train_dir, test, setup, args.minutes, args.minutes / args.evals))
        print(
            f"{rows[-1]['name']:<34} kNN top-1 {100 * rows[-1]['knn_top1']:.2f}%  ({rows[-1]['steps']} steps, "
            f"{rows[-1]['train_minutes']:.1f} min training)",
            flush=True,
        )
    print("\nkNN top-1 (test set, leave-one-out, k=200, T=0.1):")
    for r in rows:
        print(f"  {r['name']:<34} {100 * r['knn_top1']:6.2f}%  {r['knn_top1'] / rows[1]['knn_top1']:.3f} of ours")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"setup": setup, "minutes": args.minutes, "rows": rows}, indent=2))
    _plot(rows, args.json.with_suffix(".png"), args.minutes)


def _seconds_per_step(setup: dict) -> float:
    """A quick timing of a few training steps on random data, to space out the kNN evaluations."""
    from moco.training.setup import build_model

    cfg = resolve_config("v2", **setup)
    model = build_model(cfg)
    x = torch.randn(setup["batch_size"], 3, setup["image_size"], setup["image_size"])
    times = []
    for _ in range(3):
        t = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, _ = model(x, x, 0.999, torch.arange(len(x)))
        loss.backward()
        times.append(time.perf_counter() - t)
    return min(times[1:]) * 1.1


def _plot(rows: list[dict], path: Path, minutes: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    for r in rows:
        if "curve" in r:
            ax.plot([c[0] for c in r["curve"]], [100 * c[1] for c in r["curve"]], "o-", label=r["name"])
        else:
            ax.axhline(100 * r["knn_top1"], color="gray", ls="--", label=r["name"])
    ax.set_xlabel("training minutes (2 CPU cores)")
    ax.set_ylabel("kNN top-1 on test (%)")
    ax.set_xlim(0, minutes * 1.02)
    ax.set_title("Fashion-MNIST, MoCo v2, same network and time")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    main()
