"""GPU check for any CUDA machine: a few real training steps per preset in bf16 (fp16 where bf16 is
not supported), through the real `train()` (decode cache, augmentation on the GPU, MoCo step).

    python bench/gpu_check.py [--arch resnet50] [--image-size 224] [--batch-size 128] [--steps 12]

Prints images/s (steady state, first steps not counted) and peak GPU memory per preset; finishes within
about two minutes on a current GPU. Exits 1 when no CUDA device is visible.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moco.config import resolve_config  # noqa: E402
from moco.data.sample import make_sample_collection  # noqa: E402
from moco.training.loop import train  # noqa: E402
from moco.training.metrics import read_metrics  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="resnet50")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--presets", default="v1,v2,v3")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible (torch.cuda.is_available() is False)", file=sys.stderr)
        return 1
    name = torch.cuda.get_device_name()
    print(f"{name}, torch {torch.__version__}, bf16 {'yes' if torch.cuda.is_bf16_supported() else 'no'}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        per_family = max(1, (args.batch_size * 2) // 6 + 1)
        t = time.perf_counter()
        make_sample_collection(Path(tmp) / "photos", per_family=per_family, size=args.image_size + 32, seed=0)
        print(f"sample photos: {per_family * 6} in {time.perf_counter() - t:.1f} s", flush=True)
        for preset in args.presets.split(","):
            extra = dict(queue_size=65536) if preset != "v3" else {}
            cfg = resolve_config(
                preset,
                data_dir=str(Path(tmp) / "photos"),
                out=str(Path(tmp) / f"run_{preset}"),
                arch=args.arch,
                image_size=args.image_size,
                batch_size=args.batch_size,
                max_steps=args.warmup + args.steps,
                device="cuda",
                save_every_minutes=1e9,
                **extra,
            )
            torch.cuda.reset_peak_memory_stats()
            summary = train(cfg, progress=False)
            peak = torch.cuda.max_memory_allocated() / 2**30
            records = [r for r in read_metrics(Path(cfg.out) / "metrics.jsonl") if "loss" in r][args.warmup :]
            step_s = statistics.median(r["step_ms"] for r in records) / 1000
            data_ms = statistics.median(r["data_ms"] for r in records)
            row = {
                "preset": preset,
                "arch": args.arch,
                "image_size": args.image_size,
                "batch": args.batch_size,
                "precision": summary["precision"],
                "img_s": args.batch_size / step_s,
                "peak_gib": peak,
                "data_ms": data_ms,
                "final_loss": summary["final_loss"],
            }
            rows.append(row)
            print(
                f"{preset}: {row['img_s']:.0f} img/s ({summary['precision']}), peak {peak:.2f} GiB, "
                f"data+aug {data_ms:.1f} ms/step, loss {summary['final_loss']:.3f}",
                flush=True,
            )
    if args.json:
        args.json.write_text(json.dumps({"device": name, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
