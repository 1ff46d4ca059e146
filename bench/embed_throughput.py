"""Embedding throughput: ours vs a plain torchvision loop vs the model-only ceiling, in the same run.

    python bench/embed_throughput.py [--images 2000] [--arch resnet50] [--batch-size 64]

A folder of real JPEG photos (random crops of the gnome-backgrounds wallpapers, 480-1600 px, as a
phone or camera folder would hold), ResNet-50 at 224 px:
- ours: ``Embedder.embed_folder`` (decode + resize in threads ahead of the model, bf16 autocast where
  fast, inference mode), preprocessing from the backbone's metadata;
- plain: ``torchvision.datasets.ImageFolder`` + ``DataLoader`` (worker processes) + Resize(256) +
  CenterCrop(224) + fp32 forward;
- ceiling: our model alone on pre-decoded tensors (the best any pipeline around it can do).
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
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moco.embed import Embedder  # noqa: E402
from moco.export.exporter import export_backbone  # noqa: E402

BACKGROUNDS = Path("/usr/share/backgrounds")


def make_photos(root: Path, n: int, seed: int = 0) -> Path:
    """``n`` JPEG crops of the raster gnome-backgrounds (apt-get install gnome-backgrounds)."""
    done = root / ".complete"
    if done.exists() and int(done.read_text()) == n:
        return root
    sources = []
    for p in sorted(BACKGROUNDS.rglob("*")):
        if p.suffix.lower() in (".jpg", ".jpeg", ".png", ".webp"):
            img = Image.open(p).convert("RGB")
            img.thumbnail((2400, 2400))
            if min(img.size) >= 720:  # big enough for 480-1600 px crops
                sources.append(img)
    if not sources:
        raise SystemExit(f"no raster images under {BACKGROUNDS}: apt-get install gnome-backgrounds")
    rng = np.random.default_rng(seed)
    sub = root / "photos"
    sub.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        src = sources[i % len(sources)]
        w = int(rng.integers(480, min(1600, src.width) + 1))
        h = int(min(src.height, max(360, w * rng.uniform(0.56, 1.34))))  # landscape and portrait shapes
        x, y = int(rng.integers(0, src.width - w + 1)), int(rng.integers(0, src.height - h + 1))
        src.crop((x, y, x + w, y + h)).save(sub / f"IMG_{i:05d}.jpg", quality=90)
    done.write_text(str(n))
    return root


def ours(emb: Embedder, root: Path, batch: int, workers: int) -> tuple[float, int]:
    t = time.perf_counter()
    count = sum(len(paths) for paths, _, _ in emb.embed_folder(root, batch_size=batch, workers=workers, progress=False))
    return count / (time.perf_counter() - t), count


def plain(root: Path, arch: str, batch: int, workers: int) -> tuple[float, int]:
    import torchvision
    import torchvision.transforms as T

    tf = T.Compose(
        [T.Resize(256), T.CenterCrop(224), T.ToTensor(), T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))]
    )
    data = torchvision.datasets.ImageFolder(str(root), transform=tf)
    loader = torch.utils.data.DataLoader(data, batch_size=batch, num_workers=workers)
    model = getattr(torchvision.models, arch)(weights=None)
    model.fc = torch.nn.Identity()
    model.eval()
    t, count = time.perf_counter(), 0
    with torch.no_grad():
        for x, _ in loader:
            torch.nn.functional.normalize(model(x), dim=1).numpy()
            count += len(x)
    return count / (time.perf_counter() - t), count


def ceiling(emb: Embedder, batch: int, batches: int) -> float:
    squares = torch.randint(0, 256, (batch, emb.resize, emb.resize, 3), dtype=torch.uint8)
    emb.embed_squares(squares)  # warm-up
    t = time.perf_counter()
    for _ in range(batches):
        emb.embed_squares(squares)
    return batch * batches / (time.perf_counter() - t)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=int, default=2000)
    p.add_argument("--arch", default="resnet50")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--data", type=Path, default=Path(".bench_data"))
    p.add_argument("--json", type=Path, default=Path("bench/results/embed_throughput.json"))
    args = p.parse_args()
    root = make_photos(args.data / f"gnome_jpeg_{args.images}", args.images)
    with tempfile.TemporaryDirectory() as tmp:
        import torchvision

        torch.save(getattr(torchvision.models, args.arch)(weights=None).state_dict(), Path(tmp) / "w.pth")
        export_backbone(Path(tmp) / "w.pth", Path(tmp) / "b.safetensors")
        emb = Embedder.load(Path(tmp) / "b.safetensors")
    print(
        f"{args.images} JPEG photos in {root}; {args.arch} at 224 px; batch {args.batch_size}; "
        f"{args.workers} decode workers; {torch.get_num_threads()} torch threads; ours in {emb.precision}",
        flush=True,
    )
    rows = {}
    rows["ceiling"] = ceiling(emb, args.batch_size, max(2, args.images // args.batch_size // 4))
    print(f"model-only ceiling ({emb.precision}, pre-decoded)     {rows['ceiling']:7.1f} img/s", flush=True)
    rows["ours"], n = ours(emb, root, args.batch_size, args.workers)
    print(f"ours: Embedder.embed_folder                      {rows['ours']:7.1f} img/s  ({n} images)", flush=True)
    rows["plain"], n = plain(root, args.arch, args.batch_size, args.workers)
    print(f"plain: ImageFolder + DataLoader + fp32           {rows['plain']:7.1f} img/s  ({n} images)", flush=True)
    ratio, share = rows["ours"] / rows["plain"], 100 * rows["ours"] / rows["ceiling"]
    print(f"\nours / plain loop: {ratio:.2f}x   ours / ceiling: {share:.0f}%")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps(
            {
                "images": args.images,
                "arch": args.arch,
                "batch": args.batch_size,
                "precision": emb.precision,
                "img_s": rows,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
