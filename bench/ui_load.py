"""Load on the running search UI: 16 concurrent clients x 25 searches on a 10,000-image index.

    python bench/ui_load.py                       # generates the photos and the index under .bench_data/
    python bench/ui_load.py --clients 16 --searches 25 --images 10000

Starts `moco serve` in its own process (as a user would), then drives it over HTTP with
``gradio_client`` from N threads, each uploading a different photo of the collection per search.
Reports errors, p50/p99/max latency and searches/s, next to the same handler called in-process
(no HTTP, no queue) as the baseline: the difference is the web stack and the queue.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DATA = ROOT / ".bench_data" / "ui_load"


def _prepare(images: int) -> tuple[Path, Path]:
    """Photos, a backbone and an index of ``images`` images (reused when present)."""
    import torch
    import torchvision

    from index.build import build_index
    from moco.export import export_backbone
    from moco.sample import make_sample_collection

    photos, idx, bb = DATA / f"photos_{images}", DATA / f"idx_{images}", DATA / "backbone.safetensors"
    if not photos.is_dir():
        make_sample_collection(photos, per_family=-(-images // 6), size=48, seed=0)
        extra = sorted(photos.rglob("*.*"))[images:]
        for f in extra:
            f.unlink()
    if not bb.is_file():
        torch.manual_seed(0)
        torch.save(torchvision.models.resnet18(weights=None).state_dict(), DATA / "tv.pth")
        export_backbone(DATA / "tv.pth", bb, image_size=64)
    build_index(photos, bb, idx, progress=True)  # an update when it exists
    return photos, idx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    import httpx

    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"moco serve exited: {proc.stderr.read()[-2000:]}")
        with contextlib.suppress(httpx.HTTPError):  # not listening yet
            if httpx.get(url, timeout=2).status_code == 200:
                return
        time.sleep(0.5)
    raise TimeoutError(url)


def _client_run(url: str, files: list[Path], k: int) -> tuple[list[float], list[str]]:
    from gradio_client import Client, handle_file

    client = Client(url, verbose=False, download_files=False)  # a browser fetches thumbnails lazily, in parallel
    lat, errors = [], []
    for f in files:
        t0 = time.perf_counter()
        try:
            gallery, info, *_ = client.predict(handle_file(str(f)), k, "", api_name="/search")
            if not gallery or "Error" in info:
                errors.append(f"{f.name}: {info}")
        except Exception as e:  # noqa: BLE001 - counted, reported
            errors.append(f"{f.name}: {type(e).__name__}: {e}")
        lat.append(time.perf_counter() - t0)
    return lat, errors


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=10_000)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--searches", type=int, default=25, help="per client")
    ap.add_argument("-k", type=int, default=12)
    args = ap.parse_args()

    photos, idx = _prepare(args.images)
    files = sorted(p for p in photos.rglob("*") if p.is_file())
    rng = np.random.default_rng(0)
    picks = [[files[i] for i in rng.choice(len(files), args.searches)] for _ in range(args.clients)]

    # baseline: the same handler in-process, one at a time
    from app.ui import SearchApp
    from index.image_index import ImageIndex

    index = ImageIndex.open(idx)
    app = SearchApp(index, index.load_embedder(device="cpu"))
    base = []
    for f in picks[0][:25]:
        t0 = time.perf_counter()
        app.search(str(f), k=args.k)
        base.append(time.perf_counter() - t0)
    del app, index

    port = _free_port()
    url = f"http://127.0.0.1:{port}/"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "app.cli", "serve", str(idx), "--port", str(port), "--device",
                             "cpu"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        _wait(url, proc)
        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(args.clients) as pool:
            results = list(pool.map(lambda fs: _client_run(url, fs, args.k), picks))
        wall = time.perf_counter() - t0
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    lat = np.array([x for r, _ in results for x in r]) * 1000
    errors = [e for _, errs in results for e in errs]
    base_ms = np.array(base) * 1000
    out = {
        "command": "python bench/ui_load.py " + " ".join(sys.argv[1:]), "images": args.images,
        "clients": args.clients, "searches": int(lat.size), "errors": len(errors), "error_samples": errors[:5],
        "p50_ms": float(np.percentile(lat, 50)), "p99_ms": float(np.percentile(lat, 99)), "max_ms": float(lat.max()),
        "searches_per_s": lat.size / wall, "wall_s": wall, "in_process_p50_ms": float(np.percentile(base_ms, 50)),
        "in_process_searches_per_s": 1000 / float(base_ms.mean()), "cpus": os.cpu_count(),
        "machine": platform.processor() or platform.machine(),
    }  # fmt: skip
    print(f"{args.clients} clients x {args.searches} searches on {args.images} images, k={args.k}")
    print(f"{'':24}{'p50 ms':>10}{'p99 ms':>10}{'searches/s':>12}")
    print(f"{'served (HTTP + queue)':24}{out['p50_ms']:>10.0f}{out['p99_ms']:>10.0f}{out['searches_per_s']:>12.1f}")
    base_rate = out["in_process_searches_per_s"]
    print(f"{'in-process handler':24}{out['in_process_p50_ms']:>10.0f}{'':>10}{base_rate:>12.1f}")
    print(f"errors: {len(errors)}; served throughput = {out['searches_per_s'] / out['in_process_searches_per_s']:.2f}"
          " x the in-process handler")  # fmt: skip
    (ROOT / "bench" / "results").mkdir(exist_ok=True)
    (ROOT / "bench" / "results" / "ui_load.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
