"""Memory layout on this machine: contiguous (NCHW) vs channels_last, for training steps and inference.

    python bench/layout.py [--steps 3] [--quick]

The evidence behind ``--memory-format auto`` choosing channels_last for CNNs on every device.
Training: one full MoCo v2 step (``MoCo.forward`` with split BN over 8 chunks, backward, SGD) on
random inputs; inference: the backbone alone in eval mode. Each cell builds the model in both
layouts twice, interleaved (contiguous, channels_last, contiguous, channels_last), so drift on the
machine hits both alike, and reports the median step time. Random weights (speed does not depend
on them). Results: bench/results/layout.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moco.config import resolve_config  # noqa: E402
from moco.model.backbones import build_backbone  # noqa: E402
from moco.training.setup import build_model  # noqa: E402

# (what, arch, small stem, image size, batch, precision)
CASES = [
    ("train", "resnet18", True, 32, 256, "bf16"),
    ("train", "resnet18", True, 64, 128, "bf16"),
    ("train", "resnet18", False, 112, 128, "bf16"),
    ("train", "resnet50", False, 224, 32, "bf16"),
    ("train", "resnet18", True, 32, 256, "fp32"),
    ("train", "resnet50", False, 224, 16, "fp32"),
    ("embed", "resnet50", False, 224, 32, "bf16"),
    ("embed", "resnet50", False, 224, 32, "fp32"),
    ("embed", "resnet18", True, 64, 256, "bf16"),
]
LAYOUTS = {"contiguous": torch.contiguous_format, "channels_last": torch.channels_last}


def _train_step(arch: str, small: bool, size: int, batch: int, layout: torch.memory_format, bf16: bool):
    torch.manual_seed(0)
    cfg = resolve_config("v2", data_dir=".", out=".", arch=arch, small_stem=small, image_size=size, batch_size=batch)
    model = build_model(cfg).to(memory_format=layout).train()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.03, momentum=0.9)
    x1, x2 = (torch.randn(batch, 3, size, size).contiguous(memory_format=layout) for _ in range(2))  # B x 3 x S x S
    ids = torch.arange(batch)

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss, _ = model(x1, x2, 0.999, ids)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def _embed_step(arch: str, small: bool, size: int, batch: int, layout: torch.memory_format, bf16: bool):
    net = build_backbone(arch, small)[0].to(memory_format=layout).eval()
    x = torch.randn(batch, 3, size, size).contiguous(memory_format=layout)  # B x 3 x S x S

    def step() -> None:
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            net(x)

    return step


def measure(case: tuple, steps: int) -> dict:
    what, arch, small, size, batch, precision = case
    make = _train_step if what == "train" else _embed_step
    times: dict[str, list[float]] = {name: [] for name in LAYOUTS}
    for _ in range(2):
        for name, layout in LAYOUTS.items():
            step = make(arch, small, size, batch, layout, precision == "bf16")
            step()  # warm-up: oneDNN picks and caches its kernels
            for _ in range(steps):
                t = time.perf_counter()
                step()
                times[name].append(time.perf_counter() - t)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    return {
        "what": what,
        "model": f"{arch}{' small stem' if small else ''}, {size} px, batch {batch}, {precision}",
        "contiguous_s": med["contiguous"],
        "channels_last_s": med["channels_last"],
        "speedup": med["contiguous"] / med["channels_last"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=3, help="timed steps per layout and build")
    p.add_argument("--quick", action="store_true", help="the first training and the first embedding case only")
    p.add_argument("--json", type=Path, default=Path("bench/results/layout.json"))
    args = p.parse_args()
    cases = [CASES[0], CASES[6]] if args.quick else CASES
    rows = []
    for case in cases:
        rows.append(measure(case, args.steps))
        r = rows[-1]
        print(f"{r['what']:<6} {r['model']:<45} contiguous {r['contiguous_s']:6.3f} s  "
              f"channels_last {r['channels_last_s']:6.3f} s  {r['speedup']:.2f}x", flush=True)
    if not args.quick:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        result = {"threads": torch.get_num_threads(), "steps": args.steps, "rows": rows}
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
