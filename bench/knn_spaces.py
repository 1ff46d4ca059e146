"""kNN top-1 of one model and of the pixels in three spaces: as they are, centred (what the index searches
today), whitened (``moco.whiten``), with fixed shrinkages beside Ledoit-Wolf's to show how much it matters.

    moco train .bench_data/fmnist_train --out runs/f20 --time-budget 20 --image-size 32
    python bench/knn_spaces.py runs/f20 --dataset fashion --json bench/results/knn_spaces_fashion_cpu20.json
    python bench/knn_spaces.py runs/b5 --dataset backgrounds --json bench/results/knn_spaces_backgrounds_cpu5.json

The model is a run directory (its ``checkpoint.pt``) or any file ``moco export`` reads. Protocol as
``bench/quality_per_minute.py`` (its folders under ``.bench_data``; k=200, T=0.1): Fashion-MNIST leave-one-out
on the test images, whitening fitted on them; backgrounds and photos: held-out crops against the training crops,
fitted on the training crops (the collection searched). No labels are used to fit anything.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

K, T = 200, 0.1
SHRINKAGES = (None, 0.01, 0.1)  # None: Ledoit-Wolf (what the monitor uses); the others for comparison


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", type=Path, help="a run directory (its checkpoint.pt) or a checkpoint/export file")
    p.add_argument("--dataset", choices=("fashion", "backgrounds", "photos"), default="fashion")
    p.add_argument("--data", type=Path, default=Path(".bench_data"))
    p.add_argument("--no-pixels", action="store_true", help="skip the pixel rows (the slow part: 3,072-d)")
    p.add_argument("--json", type=Path, default=None, help="write the figures here too")
    args = p.parse_args()

    from moco.embed import Embedder

    path = args.model / "checkpoint.pt" if args.model.is_dir() else args.model
    emb = Embedder.load(path, device="cpu", precision="fp32")
    val_dir, bank_dir = {"fashion": ("fmnist_test", None), "backgrounds": ("bg16_val", "bg16_bank"),
                         "photos": ("photos90_val", "photos90_bank")}[args.dataset]
    tmp = Path(tempfile.mkdtemp())  # the decoded caches, removed at the end
    try:
        return _measure(args, emb, path, tmp, val_dir, bank_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _measure(args: argparse.Namespace, emb, path: Path, tmp: Path, val_dir: str, bank_dir: str | None) -> int:
    import torch
    import torch.nn.functional as F

    from bench._machine import cpu_model
    from moco.data.cache import cache_size_for
    from moco.training.knn import LabeledImages, extract_features, knn_top1, pixel_features, whitened
    from moco.whiten import ledoit_wolf_shrinkage

    size, mean, std = emb.image_size, emb.mean, emb.std
    bank = LabeledImages(args.data / bank_dir, cache_size_for(size), tmp / "b") if bank_dir else None
    val = LabeledImages(args.data / val_dir, cache_size_for(size), tmp / "v", 0, bank.classes if bank else None)
    classes = len(val.classes)

    def top1(f: torch.Tensor, b: torch.Tensor | None) -> float:  # leave-one-out when b is None
        return knn_top1(f, val.labels, b, None if b is None else bank.labels, classes, K, T)

    def spaces(f: torch.Tensor, b: torch.Tensor | None) -> dict[str, float]:
        """f, b: L2-normalized rows (uncentred)."""
        fit_on = f if b is None else b
        mu = fit_on.mean(0, keepdim=True)  # 1 x D
        cb = None if b is None else F.normalize(b - mu, dim=1)
        out = {"raw": top1(f, b), "centred": top1(F.normalize(f - mu, dim=1), cb)}
        for a in SHRINKAGES:
            out["whitened" if a is None else f"whitened_shrink{a:g}"] = top1(*whitened(f, b, a))
        out["ledoit_wolf_shrinkage"] = ledoit_wolf_shrinkage((fit_on - mu).double().numpy())
        return out

    cpu = torch.device("cpu")
    f = extract_features(emb.backbone, val.cache.array, size, mean, std, cpu)  # N x D
    b = extract_features(emb.backbone, bank.cache.array, size, mean, std, cpu) if bank else None  # M x D
    rows = {"model": spaces(f, b)}
    if not args.no_pixels:
        zero = torch.zeros(3 * size * size)  # uncentred pixel vectors; spaces() centres them itself
        pf = pixel_features(val.cache.array, size, mean, std, center_on=zero)[0]
        pb = pixel_features(bank.cache.array, size, mean, std, center_on=zero)[0] if bank else None
        rows["pixels"] = spaces(pf, pb)
    print(f"{args.dataset}: {path} ({emb.config.arch}, {size} px), {cpu_model()}")
    for name, r in rows.items():
        print(f"{name:<7} " + "  ".join(f"{k} {100 * v:.2f}%" if "shrinkage" not in k else f"{k} {v:.3f}"
                                         for k, v in r.items()))
    if args.json:
        command = " ".join(["python bench/knn_spaces.py", *sys.argv[1:]])
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"command": command, "cpu": cpu_model(), "dataset": args.dataset,
                                         "model": str(path), "arch": emb.config.arch, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
