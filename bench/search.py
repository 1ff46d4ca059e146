"""Vector search: FAISS Flat vs numpy brute force, and the auto-chosen approximate index vs Flat, in one run.

    python bench/search.py [--n 1000000] [--n-2048 N] [--dims 128 2048] [--dists uniform clustered]
                           [--queries 1000] [--memory-budget-gb 8] [--threads T] [--seed 0] [--quick]

For each distribution and dimension: N unit vectors (ids 0..N-1, float32) and 1,000 fresh queries
from the same distribution (not in the database):
- uniform: iid Gaussian, L2-normalized (no structure at all: the worst case for any ANN index);
- clustered: 5,000 random unit centers + isotropic Gaussian noise (norm 0.75 x the center's),
  normalized (image embeddings form clusters like this).
The database is generated in chunks straight into the Flat store; numpy and the approximate index read
it from there (one copy of N x D for the data, one more for the approximate index).
Measured, top-10 by cosine, all on the CPU:
- exact: ``VectorStore`` kind flat (``IDMap2,Flat``) vs numpy ``q @ x.T`` + argpartition (chunks of
  queries); single-query latency (median / p99, one query at a time) and batched QPS (all queries in
  one call, best of up to 3 rounds), the methods taking turns (5 single queries or one batch each) so
  that load from elsewhere on the machine hits all alike, each turn after 0.2 s of quiet and one
  untimed query (see ``measure``); Flat's top-10 checked against numpy's (ties: scores within 1e-5);
- approximate: the kind ``choose_kind(N, D, budget)`` picks (ivf when ``auto`` would say flat), built
  as index/sync_store.py builds a new index: 500 database vectors held out, train on a sample of
  max(64 nlist, 10,000) of the others, add the others, ``tune`` nprobe to recall@10 >= 0.95 on the
  held-out ones, add them; then recall@10 on the fresh queries against exact, latency, QPS and
  speedup vs Flat;
- memory: serialized index bytes / N; build (train, add, tune) times.
Targets: Flat >= numpy (single and batched); approximate >= 20x Flat at recall@10 >= 0.95.
Results: bench/results/search_<dist>_<dim>.json (``--quick``: N=100,000, search_<dist>_<dim>_quick.json).
"""

from __future__ import annotations

import os
import sys


def _blas_threads() -> None:
    """``--threads`` for numpy's BLAS too: it reads its thread count once, when numpy loads."""
    if "--threads" in sys.argv[1:-1]:
        os.environ["OPENBLAS_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"] = sys.argv[sys.argv.index("--threads") + 1]


_blas_threads()

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import shlex  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402

import faiss  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from index.catalog import sample_ids  # noqa: E402
from index.search.store import (  # noqa: E402
    VectorStore,
    choose_kind,
    recall_at,  # noqa: E402
)

K = 10
TUNE_QUERIES, TARGET = 500, 0.95  # as index/sync_store.py: database vectors held out of training and tuning
CHUNK = 1 << 16  # rows generated and added at a time
PAUSE, BLOCK = 0.2, 5  # timing: seconds of quiet before each method's turn, single queries per turn


# ------------------------------------------------------------------------------------------ data
def _normalize(a: np.ndarray) -> None:
    """L2-normalize the rows of ``a`` in place."""
    a /= np.linalg.norm(a, axis=1, keepdims=True)


def draw(dist: str, rng: np.random.Generator, centers: np.ndarray, m: int, spread: float = 0.75) -> np.ndarray:
    """``m`` unit float32 vectors (m x D): iid Gaussian (uniform) or a random center + noise of norm ~spread."""
    out = rng.standard_normal((m, centers.shape[1]), dtype=np.float32)  # m x D
    if dist == "clustered":
        out *= np.float32(spread / np.sqrt(centers.shape[1]))
        out += centers[rng.integers(0, len(centers), m)]  # m x D
    _normalize(out)
    return out


def stored_vectors(flat: VectorStore) -> np.ndarray:
    """The N x D float32 array inside a flat store, without a copy (valid while ``flat`` lives)."""
    inner = faiss.downcast_index(faiss.downcast_index(flat.index).index)  # IDMap2 -> IndexFlat
    return faiss.rev_swig_ptr(inner.get_xb(), inner.ntotal * inner.d).reshape(inner.ntotal, inner.d)


# ---------------------------------------------------------------------------------------- search
def numpy_topk(x: np.ndarray, q: np.ndarray, k: int = K) -> tuple[np.ndarray, np.ndarray]:
    """Brute force: (scores Q x k, ids Q x k) by inner product, best first; ``q @ x.T`` in chunks of queries."""
    if len(q) == 1:  # one query: a matrix-vector product
        sim = x @ q[0]  # N
        top = np.argpartition(sim, len(x) - k)[len(x) - k :]  # k, unordered
        top = top[np.argsort(-sim[top])]  # k, best first
        return sim[top][None], top[None].astype(np.int64)
    n = len(x)
    rows = max(1, (1 << 28) // n)  # about 1 GB of scores at a time
    scores, ids = [], []
    for s in range(0, len(q), rows):
        sim = q[s : s + rows] @ x.T  # r x N
        top = np.argpartition(sim, n - k, axis=1)[:, n - k :]  # r x k, unordered
        val = np.take_along_axis(sim, top, axis=1)  # r x k
        order = np.argsort(-val, axis=1)  # r x k
        scores.append(np.take_along_axis(val, order, axis=1))
        ids.append(np.take_along_axis(top, order, axis=1))
    return np.concatenate(scores), np.concatenate(ids).astype(np.int64)


Search = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]


def measure(methods: dict[str, Search], q: np.ndarray, single: int, budget_s: float) -> tuple[dict, dict]:
    """Interleaved timings, so that load from elsewhere on the machine hits every method alike.

    Before each method's turn: ``PAUSE`` s of quiet (numpy's OpenBLAS threads spin ~0.1 s after a call
    and slow a FAISS call that follows on 2 cores), then one untimed query (FAISS's OpenMP threads take
    ~10 ms to wake after an idle pause on this VM). Single: blocks of ``BLOCK`` queries one at a time,
    methods taking turns (order rotating), ``single`` queries or fewer (at least one block) once
    ``budget_s`` of timed calls are spent. Batched: all of ``q`` in one call per method, in rounds (3, or
    fewer past ``budget_s``), best round kept. Returns (figures per method, first batched result per method).
    """
    names = list(methods)

    def settle(m: str) -> None:
        time.sleep(PAUSE)
        methods[m](q[-1:])

    ms: dict[str, list[float]] = {m: [] for m in names}
    spent = 0.0
    for b, i in enumerate(range(0, min(single, len(q)), BLOCK)):
        for m in names[b % len(names) :] + names[: b % len(names)]:
            settle(m)
            for j in range(i, min(i + BLOCK, single, len(q))):
                t = time.perf_counter()
                methods[m](q[j : j + 1])
                ms[m].append(1000 * (time.perf_counter() - t))
                spent += ms[m][-1] / 1000
        if spent > budget_s:
            break
    best = {m: np.inf for m in names}
    first: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    spent = 0.0
    for _ in range(3):
        for m in names:
            settle(m)
            t = time.perf_counter()
            out = methods[m](q)
            dt = time.perf_counter() - t
            best[m], spent = min(best[m], dt), spent + dt
            first.setdefault(m, out)
        if spent > budget_s:
            break
    figures = {
        m: {"single_ms_median": float(np.median(ms[m])), "single_ms_p99": float(np.percentile(ms[m], 99)),
            "single_queries": len(ms[m]), "batched_s": best[m], "qps": len(q) / best[m]}
        for m in names
    }
    return figures, first


def check_exact(x: np.ndarray, q: np.ndarray, f_scores: np.ndarray, f_ids: np.ndarray, n_scores: np.ndarray,
                n_ids: np.ndarray) -> dict:
    """Flat's top-k against numpy's: same ids, or ids whose true scores tie numpy's top-k within 1e-5."""
    true = np.einsum("qkd,qd->qk", x[f_ids], q)  # Q x k: each returned id's score, recomputed
    err_own = float(np.abs(true - f_scores).max())
    err_rank = float(np.abs(np.sort(f_scores, axis=1) - np.sort(n_scores, axis=1)).max())
    same = int((np.sort(f_ids, axis=1) == np.sort(n_ids, axis=1)).all(axis=1).sum())
    return {"identical_rows": same, "rows": len(q), "max_score_error": err_own, "max_rank_score_diff": err_rank,
            "ok": bool(err_own <= 1e-5 and err_rank <= 1e-5)}


def index_bytes(index: faiss.Index) -> int:
    """Bytes of ``faiss.serialize_index(index)``, counted as written (no copy of an 8 GB index in memory)."""
    total = 0

    def count(chunk: bytes) -> None:
        nonlocal total
        total += len(chunk)

    faiss.write_index(index, faiss.PyCallbackIOWriter(count))
    return total


# ------------------------------------------------------------------------------------- one dataset
def bench(dist: str, dim: int, n: int, args: argparse.Namespace) -> dict:
    """Every figure for one (distribution, dimension)."""
    t0 = time.perf_counter()
    log = lambda what: print(f"  {what} at {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    rng = np.random.default_rng(args.seed)
    centers = rng.standard_normal((args.clusters, dim), dtype=np.float32)  # C x D
    _normalize(centers)
    ids = np.arange(n, dtype=np.int64)  # N

    # exact: the database is generated straight into the Flat store, numpy reads it from there
    flat = VectorStore.create("flat", dim, n, use_gpu="no")
    add_s = 0.0
    for s in range(0, n, CHUNK):
        chunk = draw(dist, rng, centers, min(CHUNK, n - s), args.spread)  # c x D
        t = time.perf_counter()
        flat.add(ids[s : s + CHUNK], chunk)
        add_s += time.perf_counter() - t
    q = draw(dist, rng, centers, args.queries, args.spread)  # Q x D, fresh
    x = stored_vectors(flat)  # N x D view
    log("data")

    # approximate: built and tuned as index/sync_store.py builds a new index (sync_store, _fresh_store)
    kind = choose_kind(n, dim, int(args.memory_budget_gb * 2**30))
    forced = kind == "flat"
    kind = "ivf" if forced else kind
    store = VectorStore.create(kind, dim, n, use_gpu="no")
    nlist = int(faiss.extract_index_ivf(store.index).nlist)
    held = sample_ids(ids, min(TUNE_QUERIES, n // 10), np.random.default_rng(n))  # H tuning queries
    sample = sample_ids(np.setdiff1d(ids, held), max(nlist * 64, 10_000), np.random.default_rng(0))  # S, not held
    t = time.perf_counter()
    store.train(x[sample])  # S x D copy, freed after training
    train_s = time.perf_counter() - t
    t = time.perf_counter()
    for s in range(0, n, CHUNK):  # everything but the tuning queries, in chunks (no N x D copy)
        keep = ~np.isin(ids[s : s + CHUNK], held)  # c
        store.add(ids[s : s + CHUNK][keep], x[s : s + CHUNK][keep])
    ivf_add_s = time.perf_counter() - t
    log("approx trained and added")
    t = time.perf_counter()
    tuning = store.tune(x, ids, x[held], held, k=K, target=TARGET, held_out=True)
    tune_s = time.perf_counter() - t
    store.add(held, x[held])  # then the tuning queries join the index, as in the product
    store.set_param(tuning.param, tuning.value)
    log("approx tuned")

    methods = {"numpy": lambda qq: numpy_topk(x, qq), "flat": lambda qq: flat.search(qq, K),
               "approx": lambda qq: store.search(qq, K)}
    fig, out = measure(methods, q, args.single, args.budget_s)
    log("measured")
    (n_scores, n_ids), (f_scores, f_ids), (_, a_ids) = out["numpy"], out["flat"], out["approx"]
    return {
        "dist": dist, "dim": dim, "n": n, "queries": args.queries, "clusters": args.clusters, "spread": args.spread,
        "numpy": fig["numpy"],
        "flat": {"factory": "IDMap2,Flat", **fig["flat"], "add_s": add_s, "recall": recall_at(f_ids, n_ids),
                 "bytes_per_vector": index_bytes(flat.index) / n},
        "check": check_exact(x, q, f_scores, f_ids, n_scores, n_ids),
        "approx": {
            "kind": kind, "forced_ivf": forced, "factory": store.factory_string or store.factory(), "nlist": nlist,
            "param": tuning.param, "value": tuning.value, "tune_recall": tuning.recall, "tune_queries": len(held),
            "train_vectors": len(sample), "train_s": train_s, "add_s": ivf_add_s, "tune_s": tune_s,
            **fig["approx"], "recall": recall_at(a_ids, n_ids), "bytes_per_vector": index_bytes(store.index) / n,
        },
        "wall_s": time.perf_counter() - t0,
    }


# ------------------------------------------------------------------------------------------ report
def report(r: dict) -> list[str]:
    """The table and target lines for one dataset."""
    nm, fl, ap, ck = r["numpy"], r["flat"], r["approx"], r["check"]
    name = f"IVF{ap['nlist']}" + (",PQ" if ap["kind"] == "ivfpq" else ",Flat") + f" {ap['param']}={ap['value']}"
    lines = [
        f"{r['dist']} {r['dim']}-d, N={r['n']:,}, {r['queries']:,} fresh queries, top-{K}, {r['threads']} threads "
        f"(wall {r['wall_s']:.0f} s)",
        f"  {'':24} {'single ms med':>13} {'p99':>7} {'x Flat':>7} {'batch s':>8} {'QPS':>8} {'x Flat':>7} "
        f"{'recall@10':>9} {'B/vector':>8} {'build s':>8}   (x Flat: speed relative to FAISS Flat)",
    ]

    def row(label: str, m: dict, recall: float, bpv: float | None, build: float | None) -> str:
        bpv_s = f"{bpv:8.0f}" if bpv is not None else f"{'-':>8}"
        build_s = f"{build:8.1f}" if build is not None else f"{'-':>8}"
        return (f"  {label:24} {m['single_ms_median']:13.2f} {m['single_ms_p99']:7.2f} "
                f"{fl['single_ms_median'] / m['single_ms_median']:6.2f}x {m['batched_s']:8.3f} {m['qps']:8.0f} "
                f"{m['qps'] / fl['qps']:6.2f}x {recall:9.3f} {bpv_s} {build_s}")

    lines.append(row("numpy brute force", nm, 1.0, None, None))
    lines.append(row("FAISS Flat", fl, fl["recall"], fl["bytes_per_vector"], fl["add_s"]))
    lines.append(row(name, ap, ap["recall"], ap["bytes_per_vector"], ap["train_s"] + ap["add_s"] + ap["tune_s"]))
    lines.append(
        f"  exact check: Flat top-{K} == numpy top-{K} on {ck['identical_rows']}/{ck['rows']} queries; returned scores "
        f"within {ck['max_score_error']:.1e} of recomputed, top-{K} scores within {ck['max_rank_score_diff']:.1e} of "
        f"numpy's: {'OK' if ck['ok'] else 'MISMATCH'}"
    )
    lines.append(
        f"  {ap['kind']}{' (forced: auto says flat at this N)' if ap['forced_ivf'] else ''}: trained on "
        f"{ap['train_vectors']:,} vectors in {ap['train_s']:.1f} s, add {ap['add_s']:.1f} s, tune {ap['tune_s']:.1f} s "
        f"-> {ap['param']}={ap['value']} (recall@{K} {ap['tune_recall']:.3f} on {ap['tune_queries']} held-out vectors)"
    )
    ok = lambda c: "PASS" if c else "FAIL"
    fs, fb = nm["single_ms_median"] / fl["single_ms_median"], fl["qps"] / nm["qps"]
    as_, ab = fl["single_ms_median"] / ap["single_ms_median"], ap["qps"] / fl["qps"]
    good = ap["recall"] >= 0.95
    lines.append(
        f"  targets: Flat >= numpy brute force: batched {ok(fb >= 1)} ({fb:.2f}x), single {ok(fs >= 1)} ({fs:.2f}x); "
        f"approx >= 20x Flat at recall@10 >= 0.95: batched {ok(ab >= 20 and good)} ({ab:.2f}x), "
        f"single {ok(as_ >= 20 and good)} ({as_:.2f}x), recall@10 {ap['recall']:.3f}"
    )
    return lines


def _ram() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def fit_n(n: int, dim: int) -> int:
    """``n`` halved until the 2 full copies of the vectors (Flat, IVF-Flat) take at most 60% of RAM."""
    while n > 10_000 and 2 * n * dim * 4 > 0.6 * _ram():
        n //= 2
    return n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=1_000_000)
    p.add_argument("--n-2048", type=int, default=None, help="N for dim >= 2048 (default: --n, halved to fit RAM)")
    p.add_argument("--dims", type=int, nargs="+", default=[128, 2048])
    p.add_argument("--dists", nargs="+", choices=["uniform", "clustered"], default=["uniform", "clustered"])
    p.add_argument("--queries", type=int, default=1000)
    p.add_argument("--single", type=int, default=50, help="single queries timed one at a time per method")
    p.add_argument("--budget-s", type=float, default=90.0, help="fewer single queries / batched rounds past this")
    p.add_argument("--clusters", type=int, default=5000, help="clustered: number of centers")
    p.add_argument("--spread", type=float, default=0.75, help="clustered: noise norm / center norm (higher: harder)")
    p.add_argument("--memory-budget-gb", type=float, default=8.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="faiss and BLAS threads (default: all cores)")
    p.add_argument("--quick", action="store_true", help="N=100,000: a fast smoke run")
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    args = p.parse_args()
    if args.threads:
        faiss.omp_set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO, format="  %(asctime)s %(message)s", datefmt="%H:%M:%S")
    if args.quick:
        args.n, args.n_2048 = 100_000, min(args.n_2048 or 100_000, 100_000)
    command = shlex.join([sys.executable.rsplit("/", 1)[-1], *sys.argv])
    meta = {"command": command, "faiss_version": faiss.__version__, "numpy_version": np.__version__,
            "cpus": os.cpu_count(), "threads": faiss.omp_get_max_threads(), "n_requested": args.n}
    versions = f"faiss {faiss.__version__}, numpy {np.__version__}"
    print(f"{command}\n{versions}, {meta['cpus']} CPUs, {meta['threads']} threads", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    for dim in args.dims:
        n = args.n_2048 if dim >= 2048 and args.n_2048 is not None else fit_n(args.n, dim)
        if n != args.n:
            print(f"note: N={n:,} at {dim}-d, not {args.n:,}: the Flat and IVF-Flat indexes hold 2 x N x "
                  f"{4 * dim:,} B ({2 * args.n * dim * 4 / 2**30:.1f} GiB at N={args.n:,}), more than 60% of "
                  f"this machine's {_ram() / 2**30:.1f} GiB with the benchmark's temporaries")
        for dist in args.dists:
            print(f"[{dist} {dim}-d N={n:,}]", file=sys.stderr, flush=True)
            r = {**meta, **bench(dist, dim, n, args)}
            print("\n" + "\n".join(report(r)), flush=True)
            spread = f"_spread{args.spread:g}" if dist == "clustered" and args.spread != 0.75 else ""
            name = f"search_{dist}_{dim}{spread}{'_quick' if args.quick else ''}.json"
            (args.out / name).write_text(json.dumps(r, indent=2) + "\n")


if __name__ == "__main__":
    main()
