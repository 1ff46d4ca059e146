"""The device check for a CUDA machine, in one command (about 5 minutes on a current GPU):

    python bench/gpu_check.py                  # -> bench/results/gpu_check.json; exit 1 on any mismatch

1. train: a few real training steps per preset in bf16 (fp16 where bf16 is not supported) and channels_last,
   through the real ``train()`` (decoded cache, augmentation on the GPU, MoCo step): images/s and peak memory;
2. run: ``moco run`` on a few hundred generated photos for a few dozen steps, end to end (train, export, index on the
   GPU, serve), then one search through the JSON API (include_queries), which must answer with the photo itself first;
3. faiss: the same vectors indexed and searched on the GPU and on the CPU: a flat index finds the same ids, an ivf
   index reaches its recall against the flat one;
4. embed: the same photos embedded on the GPU and on the CPU: images/s of each, the same vectors;
with the GPU memory each step peaked at. Without a CUDA device it says so and exits 0. ``--device cpu`` runs the same
steps on the CPU (faiss-cpu standing in for the GPU index): the test suite does, at small sizes, so that the script
cannot rot before a GPU is at hand.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moco.config import resolve_config  # noqa: E402
from moco.data.sample import make_sample_collection  # noqa: E402
from moco.training.loop import train  # noqa: E402
from moco.training.metrics import read_metrics  # noqa: E402

OUT = ROOT / "bench" / "results" / "gpu_check.json"
IVF_RECALL = 0.9  # an ivf index tuned by us must reach this recall@10 against the flat one
SAME_VECTOR = 0.999  # the cosine of a photo's GPU and CPU embeddings (bf16 on one side, fp32 on the other)


def _peak_reset(device: str) -> None:
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()


def _peak_gib(device: str) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None


def check_train(device: str, photos: Path, tmp: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Training steps per preset: images/s (steady state, the first steps not counted), precision, peak memory."""
    rows = []
    for preset in args.presets.split(","):
        queue = max(args.batch_size, min(4096, sum(1 for _ in photos.rglob("*.jpg"))))  # what the photos fill
        extra = dict(queue_size=queue) if preset != "v3" else {}
        cfg = resolve_config(preset, data_dir=str(photos), out=str(tmp / f"train_{preset}"), arch=args.arch,
                             image_size=args.image_size, batch_size=args.batch_size, workers=0,
                             max_steps=args.warmup + args.steps, device=device, save_every_minutes=1e9, **extra)
        _peak_reset(device)
        summary = train(cfg, progress=False)
        records = [r for r in read_metrics(Path(cfg.out) / "metrics.jsonl") if "loss" in r][args.warmup:]
        step_s = statistics.median(r["step_ms"] for r in records) / 1000
        rows.append({"preset": preset, "arch": args.arch, "image_size": args.image_size, "batch": args.batch_size,
                     "precision": summary.precision, "channels_last": cfg.memory_format != "contiguous",
                     "img_s": args.batch_size / step_s, "data_ms": statistics.median(r["data_ms"] for r in records),
                     "peak_gib": _peak_gib(device), "final_loss": summary.final_loss})
        print(f"train {preset}: {rows[-1]['img_s']:.0f} img/s ({summary.precision}), peak "
              f"{rows[-1]['peak_gib'] or 0:.2f} GiB", flush=True)
    return {"rows": rows}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get_json(url: str, timeout: float = 10) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def _search(url: str, photo: Path, k: int) -> dict[str, Any]:
    boundary = "gpucheckboundary"
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"k\"\r\n\r\n{k}\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"include_queries\"\r\n\r\ntrue\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"image\"; filename=\"{photo.name}\"\r\n"
            "Content-Type: image/jpeg\r\n\r\n").encode() + photo.read_bytes() + f"\r\n--{boundary}--\r\n".encode()
    req = urllib.request.Request(f"{url}/search", data=body,
                                 headers={"Content-Type": f"multipart/form-data; boundary={boundary}"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def check_run(device: str, photos: Path, tmp: Path, args: argparse.Namespace, mismatches: list[str]) -> dict:
    """``moco run`` end to end in its own process, then one API search of one of its photos."""
    port = _free_port()
    env = {**os.environ, **({"CUDA_VISIBLE_DEVICES": ""} if device == "cpu" else {})}
    log = tmp / "run.log"
    cmd = [sys.executable, "-m", "app.cli", "run", str(photos), "--work", str(tmp / "work"), "--pretrained", "none",
           "--max-steps", str(args.run_steps), "--port", str(port), "--quiet"]
    t0 = time.perf_counter()
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/api/v1"
    try:
        stats = None
        while time.perf_counter() - t0 < args.run_timeout and proc.poll() is None:
            try:
                stats = _get_json(f"{url}/stats")
                break
            except (OSError, ValueError):
                time.sleep(1)
        if stats is None:
            mismatches.append(f"run: no index served within {args.run_timeout:.0f} s (exit {proc.poll()}): "
                              f"{log.read_text(errors='replace')[-1500:]}")
            return {"seconds": time.perf_counter() - t0}
        ready_s = time.perf_counter() - t0
        query = sorted(photos.rglob("*.jpg"))[0]
        t1 = time.perf_counter()
        found = _search(url, query, k=5)
        search_ms = (time.perf_counter() - t1) * 1000
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    first = found["results"][0]["path"] if found.get("results") else None
    if first != str(query.relative_to(photos)):
        mismatches.append(f"run: the API's first result for {query.name} is {first}, not the photo itself")
    if device == "cuda" and not stats.get("on_gpu"):
        mismatches.append("run: the index is not on the GPU (is faiss-gpu installed? pip install '.[gpu,ui]')")
    print(f"run: served after {ready_s:.0f} s ({stats['images']} photos, {stats['kind']}, "
          f"{'GPU' if stats.get('on_gpu') else 'CPU'} index); one API search {search_ms:.0f} ms", flush=True)
    return {"photos": stats["images"], "steps": args.run_steps, "ready_s": ready_s, "kind": stats["kind"],
            "index_on_gpu": bool(stats.get("on_gpu")), "search_ms": search_ms, "first_is_query": first is not None
            and first == str(query.relative_to(photos))}


def check_faiss(device: str, args: argparse.Namespace, mismatches: list[str]) -> dict[str, Any]:
    """The same vectors in a flat and an ivf store on the GPU and on the CPU: ids and recall."""
    import faiss

    from index.search.store import VectorStore, exact_topk, recall_at

    on_gpu = "yes" if device == "cuda" else "no"
    rng = np.random.default_rng(0)
    n, dim, k = args.vectors, 256, 10
    centers = rng.standard_normal((max(8, n // 100), dim)).astype(np.float32)  # clustered, as photos' vectors are
    xb = centers[rng.integers(len(centers), size=n)] + 0.5 * rng.standard_normal((n, dim)).astype(np.float32)
    xb /= np.linalg.norm(xb, axis=1, keepdims=True)
    ids = np.arange(n, dtype=np.int64) * 7 + 3  # ids that are not positions
    queries = xb[rng.choice(n, 200, replace=False)] + 0.05 * rng.standard_normal((200, dim)).astype(np.float32)
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    out: dict[str, Any] = {"vectors": n, "dim": dim, "faiss": faiss.__version__, "gpus": faiss.get_num_gpus()}
    found = {}
    for where, use in (("cpu", "no"), ("device", on_gpu)):
        for kind in ("flat", "ivf"):
            store = VectorStore.create(kind, dim, n, use_gpu=use)
            t0 = time.perf_counter()
            store.train(xb)
            store.add(ids, xb)
            build_s = time.perf_counter() - t0
            if kind == "ivf":  # tuned as a build tunes it: the smallest nprobe with recall@10 >= 0.95
                tuned = rng.choice(n, 200, replace=False)
                out[f"ivf_{where}_nprobe"] = store.tune(xb, ids, xb[tuned], ids[tuned], k, held_out=False).value
            t0 = time.perf_counter()
            _, got = store.search(queries, k)
            out[f"{kind}_{where}"] = {"build_s": build_s, "search_ms": (time.perf_counter() - t0) * 1000,
                                      "on_gpu": store.on_gpu}
            found[(kind, where)] = got
    truth = exact_topk(xb, ids, queries, np.full(len(queries), -1), k)  # numpy's exact top-k
    same = [set(a) == set(b) for a, b in zip(found[("flat", "device")], found[("flat", "cpu")])]
    out["flat_same_ids"] = float(np.mean(same))
    out["flat_same_order"] = float(np.mean([np.array_equal(a, b) for a, b in zip(found[("flat", "device")],
                                                                                   found[("flat", "cpu")])]))
    if not all(same):
        mismatches.append(f"faiss: the flat index on the {device} finds other ids than on the CPU for "
                          f"{1 - out['flat_same_ids']:.1%} of the queries")
    if recall_at(found[("flat", "cpu")], truth) < 1.0:
        mismatches.append("faiss: the flat index on the CPU disagrees with exact search in numpy")
    recall = recall_at(found[("ivf", "device")], found[("flat", "cpu")])
    out["ivf_recall_at_10"] = recall
    if recall < IVF_RECALL:
        mismatches.append(f"faiss: ivf on the {device} reaches recall@10 {recall:.3f} of flat, under {IVF_RECALL}")
    if device == "cuda" and not out["flat_device"]["on_gpu"]:
        mismatches.append("faiss: no GPU index (faiss-gpu missing, or it does not run on this GPU)")
    print(f"faiss: flat top-{k} ids the same on the {device} and the CPU for {out['flat_same_ids']:.1%} of the queries "
          f"(the same order: {out['flat_same_order']:.1%}); ivf recall@10 {recall:.3f}", flush=True)
    return out


def check_embed(device: str, photos: Path, backbone: Path, args: argparse.Namespace,
                mismatches: list[str]) -> dict[str, Any]:
    """The same photos embedded on the device and on the CPU: images/s and agreement."""
    from moco.embed import Embedder

    files = sorted(str(p) for p in photos.rglob("*.jpg"))[: args.embed_photos]
    out: dict[str, Any] = {"photos": len(files)}
    vectors = {}
    for where in dict.fromkeys([device, "cpu"]):
        emb = Embedder.load(backbone, device=where)
        emb.embed(files[: min(8, len(files))])  # warm-up
        _peak_reset(where)
        t0 = time.perf_counter()
        vectors[where] = emb.embed(files)
        seconds = time.perf_counter() - t0
        out[where] = {"img_s": len(files) / seconds, "precision": emb.precision, "peak_gib": _peak_gib(where)}
    cos = float(np.min(np.sum(vectors[device] * vectors["cpu"], axis=1)))
    out["min_cosine_device_cpu"] = cos
    if cos < SAME_VECTOR:
        mismatches.append(f"embed: a photo's vector on the {device} and on the CPU have cosine {cos:.4f} "
                          f"(< {SAME_VECTOR})")
    speed = ", ".join(f"{w} {out[w]['img_s']:.0f} img/s" for w in dict.fromkeys([device, "cpu"]))
    print(f"embed: {speed}; min cosine {cos:.5f}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"),
                   help="auto: the CUDA device, or say that there is none and exit 0; cpu: the same steps on the CPU")
    p.add_argument("--arch", default="resnet50")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--steps", type=int, default=12, help="training steps timed per preset (after --warmup)")
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--presets", default="v2,v3")
    p.add_argument("--photos", type=int, default=300, help="generated photos for `moco run` and the embedding")
    p.add_argument("--run-steps", type=int, default=30, help="training steps of the `moco run` check")
    p.add_argument("--run-timeout", type=float, default=600.0, help="seconds `moco run` may take to serve")
    p.add_argument("--vectors", type=int, default=100_000, help="vectors of the FAISS check")
    p.add_argument("--embed-photos", type=int, default=300)
    p.add_argument("--out", type=Path, default=OUT, help=f"the JSON written (default: {OUT.relative_to(ROOT)})")
    args = p.parse_args(argv)
    device = args.device
    if device == "auto":
        if not torch.cuda.is_available():
            print("gpu_check: no CUDA device here (torch.cuda.is_available() is False): nothing to check; run it on a "
                  "CUDA machine, or with --device cpu to run its steps on the CPU")
            return 0
        device = "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: --device cuda, but no CUDA device is visible", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    print(f"gpu_check on {name}, torch {torch.__version__}", flush=True)
    mismatches: list[str] = []
    result: dict[str, Any] = {"device": name, "torch": torch.__version__, "device_arg": device}
    if device == "cuda":
        result["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
        result["bf16"] = torch.cuda.is_bf16_supported()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        photos = tmp / "photos"
        make_sample_collection(photos, per_family=max(4, args.photos // 6), size=max(48, args.image_size + 32), seed=0)
        result["train"] = check_train(device, photos, tmp, args)
        result["run"] = check_run(device, photos, tmp, args, mismatches)
        result["faiss"] = check_faiss(device, args, mismatches)
        backbone = next((tmp / "work").rglob("backbone.safetensors"), None)
        if backbone is None:
            mismatches.append("embed: `moco run` left no backbone.safetensors to embed with")
        else:
            result["embed"] = check_embed(device, photos, backbone, args, mismatches)
    result["seconds"] = time.perf_counter() - t0
    result["mismatches"] = mismatches
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for m in mismatches:
        print(f"MISMATCH {m}", file=sys.stderr)
    print(f"gpu_check: {len(mismatches)} mismatch(es) in {result['seconds']:.0f} s; {args.out}")
    return 1 if mismatches else 0


if __name__ == "__main__":
    raise SystemExit(main())
