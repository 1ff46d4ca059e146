"""What a one-shot `moco index search` costs, against its floor: the CPU-seconds of Python importing torch, faiss and
PIL, in the same run.

    python bench/cli_latency.py --repeats 7 --json bench/results/cli_latency.json

Builds a 64-photo index (the generated sample, a seeded random ResNet-18 at 64 px) in a scratch folder, then runs
each command ``--repeats`` times, the commands interleaved so that a busy machine weighs on each alike, and reports
the median CPU-seconds (user + system, of the child process and its children) and wall seconds of each:

- ``floor``: ``python -c "import torch, faiss, PIL.Image"``;
- ``search``: ``moco index search IDX PHOTO -k 10``;
- ``not an image``: ``moco index search IDX NOTES.txt`` (refused before torch, the index or the model loads);
- ``help``: ``moco index search --help``.

Aim (issue 51): ``search`` at most 1 CPU-second above ``floor``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
AIM_S = 1.0


def _build(work: Path) -> tuple[Path, Path]:
    """The index (64 photos) and one photo of it."""
    from bench._backbone import bench_backbone
    from index.building.runner import build_index
    from moco.data.sample import make_sample_collection

    photos = work / "photos"
    if not (work / "idx" / "index.faiss").is_file():
        make_sample_collection(photos, per_family=11, size=64, seed=0)
        backbone, _ = bench_backbone(work, None, None, 64)
        build_index(photos, backbone, work / "idx", progress=False)
    return work / "idx", sorted(photos.rglob("*.jpg"))[0]


def _run(argv: list[str]) -> tuple[float, float, int]:
    """(CPU seconds, wall seconds, exit code) of one command."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    done = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu, wall, done.returncode


def main() -> None:
    from bench._machine import cpu_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temporary one)")
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "cli_latency.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="cli-latency-") as tmp:
        work = args.work or Path(tmp)
        idx, photo = _build(work)
        notes = ROOT / "bench" / "NOTES.md"
        moco = [sys.executable, "-m", "app.cli"]
        commands = {
            "floor": ([sys.executable, "-c", "import torch, faiss, PIL.Image"], 0),
            "search": ([*moco, "index", "search", str(idx), str(photo), "-k", "10"], 0),
            "not an image": ([*moco, "index", "search", str(idx), str(notes)], 2),
            "help": ([*moco, "index", "search", "--help"], 0),
        }
        runs: dict[str, list[tuple[float, float]]] = {name: [] for name in commands}
        _run(commands["search"][0])  # the page cache warm for every command alike
        for _ in range(args.repeats):
            for name, (argv, code) in commands.items():
                cpu, wall, rc = _run(argv)
                if rc != code:
                    raise SystemExit(f"{name}: exit {rc}, expected {code}: {' '.join(argv)}")
                runs[name].append((cpu, wall))
    rows = {name: {"cpu_s": statistics.median(c for c, _ in r), "wall_s": statistics.median(w for _, w in r),
                   "cpu_runs": [round(c, 3) for c, _ in r]} for name, r in runs.items()}
    over = rows["search"]["cpu_s"] - rows["floor"]["cpu_s"]
    result = {"command": f"python bench/cli_latency.py --repeats {args.repeats}", "cpu": cpu_model(),
              "cores": os.cpu_count(), "repeats": args.repeats, "photos": 66, "rows": rows,
              "search_over_floor_s": round(over, 3), "aim_s": AIM_S}
    print(f"{'command':<14} {'CPU s':>7} {'wall s':>7}   (median of {args.repeats}; {result['cpu']})")
    for name, r in rows.items():
        print(f"{name:<14} {r['cpu_s']:>7.2f} {r['wall_s']:>7.2f}")
    print(f"search - floor: {over:.2f} CPU-s (aim: at most {AIM_S:.1f}): {'met' if over <= AIM_S else 'NOT met'}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
