"""Training throughput, ours vs lightly's MoCo building blocks, in the same run on this machine.

    python bench/train_throughput.py [--images 4096] [--steps 10] [--warmup 3]

Images/s of the whole training pipeline (data + augmentation + step) for ResNet-18 with the small
stem, batch 256, 32 px, the v2 recipe, on Fashion-MNIST train images written as PNG files. Steady
state: the first ``--warmup`` steps of each run are not counted. Ours also reports its one-time decode
into the uint8 cache (not part of the steady state; lightly decodes every image at every epoch instead).
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

from bench._datasets import fashion_mnist, write_folder  # noqa: E402
from moco.config import resolve_config  # noqa: E402
from moco.training.loop import train  # noqa: E402
from moco.training.metrics import read_metrics  # noqa: E402

SETUP = dict(arch="resnet18", small_stem=True, image_size=32, batch_size=256, queue_size=4096)


def ours(data: Path, steps: int, warmup: int, workers: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cfg = resolve_config(
            "v2",
            data_dir=str(data),
            out=tmp,
            max_steps=warmup + steps,
            workers=workers,
            save_every_minutes=1e9,
            **SETUP,
        )
        t0 = time.perf_counter()
        summary = train(cfg, progress=False)
        total = time.perf_counter() - t0
        records = [r for r in read_metrics(Path(tmp) / "metrics.jsonl") if "loss" in r][warmup:]
    step_s = statistics.mean(r["step_ms"] for r in records) / 1000
    data_s = statistics.mean(r["data_ms"] for r in records) / 1000
    return {
        "name": f"ours ({summary.precision})",
        "img_s": SETUP["batch_size"] / step_s,
        "step_s": step_s,
        "data_share": data_s / step_s,
        "wall_s": total,
    }


def peer(data: Path, steps: int, warmup: int, workers: int, bf16: bool) -> dict:
    """lightly as its example has it (fp32), or with our two speed settings (bf16, channels_last) added."""
    from bench._lightly_moco import lightly_train

    times = []
    for step, dt, _ in lightly_train(data, workers=workers, bf16=bf16, channels_last=bf16, **SETUP):
        if step > warmup:
            times.append(dt)
        if step == warmup + steps:
            break
    step_s = statistics.mean(times)
    name = f"lightly ({'bf16 + channels_last, as ours' if bf16 else 'fp32, as its example'}, {workers} workers)"
    return {"name": name, "img_s": SETUP["batch_size"] / step_s, "step_s": step_s}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=int, default=4096)
    p.add_argument("--steps", type=int, default=10, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=3, help="untimed first steps per run")
    p.add_argument("--workers", type=int, default=2, help="decode processes / DataLoader workers")
    p.add_argument("--data", type=Path, default=Path(".bench_data"))
    p.add_argument("--json", type=Path, default=Path("bench/results/train_throughput.json"))
    args = p.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    images, _ = fashion_mnist("train")
    data = write_folder(args.data / f"fmnist_train_{args.images}", images[: args.images])
    print(
        f"data: {args.images} Fashion-MNIST train images as PNG in {data}; "
        f"{torch.get_num_threads()} torch threads; {SETUP}",
        flush=True,
    )
    rows = []
    for run in (
        lambda: ours(data, args.steps, args.warmup, args.workers),
        lambda: peer(data, args.steps, args.warmup, args.workers, bf16=False),
        lambda: peer(data, args.steps, args.warmup, args.workers, bf16=True),
    ):
        rows.append(run())
        r = rows[-1]
        extra = f"  (data+aug {100 * r['data_share']:.1f}% of a step)" if "data_share" in r else ""
        print(f"{r['name']:<55} {r['img_s']:8.1f} img/s  {r['step_s']:6.2f} s/step{extra}", flush=True)
    base = rows[0]["img_s"]
    print("\nratio ours / peer:")
    for r in rows[1:]:
        print(f"  vs {r['name']:<52} {base / r['img_s']:5.2f}x")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps(
            {"setup": SETUP, "images": args.images, "steps": args.steps, "warmup": args.warmup, "rows": rows}, indent=2
        )
    )


if __name__ == "__main__":
    main()
