"""Load on the running server, the JSON API and the page side by side, on a 10,000-image index.

    python bench/ui_load.py                       # generates the photos and the index under .bench_data/
    python bench/ui_load.py --clients 16 --searches 25 --api-searches 100 --overload-clients 64 --soak-s 600
    python bench/ui_load.py --phases api                          # one phase (to compare two versions of the server)
    python bench/ui_load.py --serve-args "--max-batch 8"          # the server's own settings

Starts `moco serve` in its own process (as a user would) pinned to CPU 0, and pins this process (the load
generator) to CPU 1 (on a machine with at least 2 CPUs). Then, one phase after another against the same server:
the JSON API (``POST /api/v1/search``, N asyncio clients, each uploading a different photo of the collection per
search), the page (N asyncio users speaking the browser's protocol: upload, join the queue, read the event's
stream; then again from N ``gradio_client`` threads, whose own CPU saturates the load generator's core first: its
CPU seconds are recorded), the API under overload (M clients: 503s
with Retry-After counted apart from other errors; a client told to wait waits), and a soak of the API (the
server's RSS at its start and end). Beside them: the page's handler called in-process one at a time (no HTTP, no
queue), the ceiling of one search at a time.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DATA = ROOT / ".bench_data" / "ui_load"
PHASES = ("api", "page", "gradio_client", "overload", "soak")  # in the order they run


def _prepare(images: int) -> tuple[Path, Path]:
    """Photos, a backbone and an index of ``images`` images (reused when present)."""
    import torch
    import torchvision

    from index.building.runner import build_index
    from moco.data.sample import make_sample_collection
    from moco.export.exporter import export_backbone

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
            raise RuntimeError(f"moco serve exited: {(DATA / 'serve.log').read_text()[-2000:]}")
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


async def _page_load(url: str, picks: list[list[Path]], k: int) -> dict:
    """N concurrent page users (one per list of photos), each searching its photos one after another as the browser
    does it: upload the photo, join the queue with the search event, read the event's stream until its result. One
    asyncio process: what is measured is the server, not a client's threads (gradio_client takes ~100 ms of CPU per
    search, and 16 of them saturate the load generator's core first)."""
    import uuid

    import httpx

    config = httpx.get(url + "config", timeout=60).json()
    prefix = url + config.get("api_prefix", "/gradio_api").lstrip("/") + "/"
    search = next(d for d in config["dependencies"] if d.get("api_name") == "search")
    props = {c["id"]: c.get("props", {}) for c in config["components"]}
    rest = [props.get(i, {}).get("value") for i in search["inputs"][3:]]  # the filters the page has: their defaults
    data = {f: f.read_bytes() for fs in picks for f in fs}
    lat: list[float] = []
    errors: list[str] = []

    async def one(f: Path, http: httpx.AsyncClient, session: str) -> None:
        up = await http.post(prefix + "upload", files={"files": (f.name, data[f])})
        up.raise_for_status()
        image = {"path": up.json()[0], "orig_name": f.name, "meta": {"_type": "gradio.FileData"}}
        join = await http.post(prefix + "queue/join", json={
            "data": [image, k, "", *rest], "fn_index": search["id"], "trigger_id": search["targets"][0][0],
            "session_hash": session, "event_data": None})
        join.raise_for_status()
        async with http.stream("GET", prefix + "queue/data", params={"session_hash": session}) as r:
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                msg = json.loads(line[5:])
                if msg.get("msg") == "process_completed":
                    out = (msg.get("output") or {}).get("data") or []
                    if not msg.get("success") or len(out) < 2 or not out[0] or "Error" in str(out[1]):
                        errors.append(f"{f.name}: {str(msg)[:200]}")
                    return
        errors.append(f"{f.name}: the event's stream ended without its result")

    async def client(files: list[Path], http: httpx.AsyncClient) -> None:
        session = uuid.uuid4().hex
        for f in files:
            t0 = time.perf_counter()
            try:
                await one(f, http, session)
            except Exception as e:  # noqa: BLE001 - counted, reported
                errors.append(f"{f.name}: {type(e).__name__}: {e}")
            lat.append(time.perf_counter() - t0)

    limits = httpx.Limits(max_connections=2 * len(picks) + 8, max_keepalive_connections=2 * len(picks) + 8)
    async with httpx.AsyncClient(timeout=120, limits=limits) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(fs, http) for fs in picks))
        wall = time.perf_counter() - t0
    return _summary(lat, errors, wall)


async def _api_load(url: str, picks: list[list[Path]], k: int, until: float | None = None) -> dict:
    """N concurrent API clients (one per list of photos), each uploading its photos one after another (again and
    again until ``until``, a perf_counter time, when given). 503s are counted apart; the client waits Retry-After."""
    import httpx

    data = {f: f.read_bytes() for fs in picks for f in fs}
    lat: list[float] = []
    shed, errors = 0, []

    async def client(files: list[Path], http: httpx.AsyncClient) -> None:
        nonlocal shed
        n = 0
        while True:
            f = files[n % len(files)]
            n += 1
            t0 = time.perf_counter()
            try:
                r = await http.post(url + "api/v1/search", files={"image": (f.name, data[f])}, data={"k": str(k)})
                if r.status_code == 503:
                    shed += 1
                    await asyncio.sleep(float(r.headers.get("retry-after", "1")))
                elif r.status_code != 200 or len(r.json()["results"]) != k:
                    errors.append(f"{f.name}: {r.status_code} {r.text[:200]}")
                else:
                    lat.append(time.perf_counter() - t0)
            except Exception as e:  # noqa: BLE001 - counted, reported
                errors.append(f"{f.name}: {type(e).__name__}: {e}")
            if (until is None and n >= len(files)) or (until is not None and time.perf_counter() >= until):
                return

    limits = httpx.Limits(max_connections=len(picks) + 8, max_keepalive_connections=len(picks) + 8)
    async with httpx.AsyncClient(timeout=120, limits=limits) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(fs, http) for fs in picks))
        wall = time.perf_counter() - t0
    return _summary(lat, errors, wall, shed=shed)


def _summary(lat: list[float], errors: list[str], wall: float, shed: int = 0) -> dict:
    ms = np.array(lat) * 1000 if lat else np.array([np.nan])
    return {"searches": len(lat), "errors": len(errors), "error_samples": errors[:5], "shed_503": shed,
            "p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)), "max_ms": float(ms.max()),
            "searches_per_s": len(lat) / wall, "wall_s": wall}


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _pins() -> tuple[set[int] | None, set[int] | None]:
    """(server CPUs, load generator CPUs): the first CPU and the second, or (None, None) on one CPU."""
    cpus = sorted(os.sched_getaffinity(0))
    return ({cpus[0]}, {cpus[1]}) if len(cpus) >= 2 else (None, None)


def main() -> None:
    from bench._machine import cpu_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=10_000)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--searches", type=int, default=25, help="per page client")
    ap.add_argument("--api-searches", type=int, default=100, help="per API client")
    ap.add_argument("--overload-clients", type=int, default=64)
    ap.add_argument("--overload-s", type=float, default=20.0, help="length of the overload phase")
    ap.add_argument("--soak-s", type=float, default=0.0, help="length of the API soak (0: none)")
    ap.add_argument("-k", type=int, default=12)
    ap.add_argument("--out", default=None, help="file name under bench/results/ (default: ui_load.json for all the "
                    "phases, which BENCHMARKS.md reports; ui_load_PHASES.json for some)")
    ap.add_argument("--phases", default=",".join(PHASES),
                    help=f"comma-separated, of {','.join(PHASES)} (e.g. api alone, to compare two versions)")
    ap.add_argument("--serve-args", default="", help="more `moco serve` flags, e.g. '--max-batch 8'")
    args = ap.parse_args()
    phases = set(args.phases.split(","))
    if not phases or phases - set(PHASES):
        ap.error(f"--phases {args.phases!r}: choose among {','.join(PHASES)}")
    if args.out is None:  # a partial run never replaces the full run's figures
        some = "_".join(p for p in PHASES if p in phases)
        args.out = "ui_load.json" if phases == set(PHASES) else f"ui_load_{some}.json"

    photos, idx = _prepare(args.images)
    files = sorted(p for p in photos.rglob("*") if p.is_file())
    rng = np.random.default_rng(0)
    picks = [[files[i] for i in rng.choice(len(files), args.searches)] for _ in range(args.clients)]
    api_picks = [[files[i] for i in rng.choice(len(files), args.api_searches)] for _ in range(args.clients)]
    over_picks = [[files[i] for i in rng.choice(len(files), 50)] for _ in range(args.overload_clients)]
    server_cpus, load_cpus = _pins()
    if load_cpus:
        os.sched_setaffinity(0, load_cpus)  # the ceiling and the load generator: one CPU, the server's is the other

    # the ceiling: the page's handler in-process, one search at a time, on one CPU
    import torch

    from app.page.handlers import SearchApp
    from index.search.image_index import ImageIndex

    torch.set_num_threads(1)
    index = ImageIndex.open(idx)
    app = SearchApp(index, index.load_embedder(device="cpu"))
    base = []
    for f in picks[0][:25]:
        t0 = time.perf_counter()
        app.search(str(f), k=args.k)
        base.append(time.perf_counter() - t0)
    app.close()
    del app, index

    port = _free_port()
    url = f"http://127.0.0.1:{port}/"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "app.cli", "serve", str(idx), "--port", str(port), "--device", "cpu",
           *args.serve_args.split()]
    pin = (lambda: os.sched_setaffinity(0, server_cpus)) if server_cpus else None
    log = open(DATA / "serve.log", "w")  # noqa: SIM115 - a file, never a pipe nobody reads (it would fill and block)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=log, text=True, preexec_fn=pin)
    out: dict = {}
    try:
        _wait(url, proc)
        asyncio.run(_api_load(url, [fs[:3] for fs in api_picks], args.k))  # warm-up
        if "api" in phases:
            out["api"] = asyncio.run(_api_load(url, api_picks, args.k))
        if "page" in phases:
            asyncio.run(_page_load(url, [fs[:2] for fs in picks], args.k))  # warm-up, as for the API
            c0 = time.process_time()
            out["page"] = asyncio.run(_page_load(url, picks, args.k))  # as the browser does it
            out["page"]["load_generator_cpu_s"] = time.process_time() - c0
        if "gradio_client" in phases:
            t0, c0 = time.perf_counter(), time.process_time()
            with concurrent.futures.ThreadPoolExecutor(args.clients) as pool:
                results = list(pool.map(lambda fs: _client_run(url, fs, args.k), picks))
            out["page_gradio_client"] = _summary([x for r, _ in results for x in r],
                                                 [e for _, errs in results for e in errs], time.perf_counter() - t0)
            out["page_gradio_client"]["load_generator_cpu_s"] = time.process_time() - c0  # its core saturates first
        if "overload" in phases:
            out["overload"] = asyncio.run(_api_load(url, over_picks, args.k, time.perf_counter() + args.overload_s))
            out["overload"]["clients"] = args.overload_clients
        if "soak" in phases and args.soak_s > 0:
            rss0 = _rss_mb(proc.pid)
            soak = asyncio.run(_api_load(url, api_picks, args.k, time.perf_counter() + args.soak_s))
            out["soak"] = {**soak, "seconds": args.soak_s, "rss_start_mb": rss0, "rss_end_mb": _rss_mb(proc.pid)}
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
    base_ms = np.array(base) * 1000
    out.update({
        "command": "python bench/ui_load.py " + " ".join(sys.argv[1:]), "images": args.images,
        "clients": args.clients, "k": args.k, "in_process_p50_ms": float(np.percentile(base_ms, 50)),
        "in_process_searches_per_s": 1000 / float(base_ms.mean()), "cpus": os.cpu_count(), "cpu_model": cpu_model(),
        "pinned": {"server": sorted(server_cpus or []), "load": sorted(load_cpus or [])},
    })
    print(f"{args.clients} clients on {args.images} images, k={args.k}; {out['cpu_model']}; server on CPU "
          f"{out['pinned']['server']}, load generator on CPU {out['pinned']['load']}")
    print(f"{'':30}{'p50 ms':>10}{'p99 ms':>10}{'searches/s':>12}{'errors':>8}{'503s':>8}")
    for name, key in [("JSON API", "api"), ("page (browser protocol)", "page"),
                      ("page (16 gradio_client threads)", "page_gradio_client"),
                      (f"API overload, {args.overload_clients} clients", "overload"), ("API soak", "soak")]:
        if key in out:
            d = out[key]
            print(f"{name:30}{d['p50_ms']:>10.0f}{d['p99_ms']:>10.0f}{d['searches_per_s']:>12.1f}{d['errors']:>8}"
                  f"{d['shed_503']:>8}")
    print(f"{'in-process handler, 1 at a time':30}{out['in_process_p50_ms']:>10.0f}{'':>10}"
          f"{out['in_process_searches_per_s']:>12.1f}")
    if "soak" in out:
        soak = out["soak"]
        print(f"soak {args.soak_s:.0f} s: server RSS {soak['rss_start_mb']:.0f} -> {soak['rss_end_mb']:.0f} MB")
    (ROOT / "bench" / "results").mkdir(exist_ok=True)
    (ROOT / "bench" / "results" / args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
