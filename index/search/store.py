"""VectorStore: a FAISS index of L2-normalized vectors under stable int64 ids, on a GPU when there is one.

Cosine similarity is the inner product of L2-normalized vectors, so every index uses
``METRIC_INNER_PRODUCT``. Index kinds (``--kind``):

========  =======================================  ==========================================
kind      factory string                           notes
========  =======================================  ==========================================
flat      ``IDMap2,Flat``                          exact; the reference for recall
ivf       ``IVF{nlist},Flat``                      approximate, same memory as flat; tuned nprobe
ivfpq     ``IDMap2,IVF{nlist},PQ{m}x4fs,Refine(SQ8)``  compressed (m + D bytes per vector); tuned nprobe
hnsw      ``IDMap2,HNSW32``                        graph; tuned efSearch; removals rebuild it
========  =======================================  ==========================================

``auto`` picks flat below ``EXACT_UP_TO`` vectors, ivf when D float32s per vector fit the memory
budget, and ivfpq otherwise. Approximate kinds are tuned on held-out queries (sampled vectors left
out of training, their own id removed from the answers) to the smallest search parameter that
reaches the target recall@10 against exact search (:func:`tune_store`). The file's trailer (index id, the space's
mean and matrix) is :mod:`index.search.trailer`'s.

Exact top-k by inner product in numpy (:func:`exact_topk`, tie-aware) is both a flat store's search of a few queries
and the ground truth that tuning measures recall against, on held-out queries (sampled vectors left out of training,
their own id removed from the answers) or on stored ones.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from index.search.trailer import trailer_bytes
from moco.errors import UserError
from moco.extras import install_hint

try:
    import faiss
except ModuleNotFoundError as _e:  # the `index` extra is missing: this module still imports (KINDS, for --help)
    if _e.name != "faiss":
        raise
    faiss = None

__all__ = ["VectorStore", "choose_kind", "factory_for", "require_faiss", "installed_faiss", "KINDS", "EXACT_UP_TO",
           "gpu_count", "tune_store", "Tuning", "exact_topk", "few_topk", "recall_at"]

logger = logging.getLogger(__name__)


FAISS_DISTRIBUTIONS = ("faiss-cpu", "faiss-gpu", "faiss-gpu-cu12", "faiss-gpu-cu11")  # each ships `faiss`


@functools.cache
def installed_faiss() -> tuple[str, ...]:
    """The FAISS distributions installed in this environment, as "name version"."""
    from importlib.metadata import PackageNotFoundError, version

    found = []
    for name in FAISS_DISTRIBUTIONS:
        try:
            found.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            continue
    return tuple(found)


def require_faiss() -> Any:
    """The ``faiss`` module; a UserError naming the extra to install when it is missing, or both builds and the fix
    when two are installed (they ship the same module: the files of the one installed last replaced the other's, so
    the module may be neither) (call before any work)."""
    if faiss is None:
        raise UserError(f"FAISS is not installed, and the index needs it: {install_hint('index')}; on a CUDA "
                        f"machine the gpu extra instead: {install_hint('gpu')}")
    builds = installed_faiss()
    if len(builds) > 1:
        gpu = " ".join(b.split()[0] for b in builds if b.startswith("faiss-gpu"))
        raise UserError(f"two FAISS builds are installed here ({', '.join(builds)}), and both ship the same `faiss` "
                        f"module: keep one, then install it again over what the other overwrote. On the CPU: pip "
                        f"uninstall -y {gpu} && pip install --force-reinstall faiss-cpu; with a GPU: pip uninstall -y "
                        f"faiss-cpu && pip install --force-reinstall {gpu.split()[0]} (extras: [index] or [gpu], not "
                        "both; [all] includes [index])")
    return faiss

KINDS = ("auto", "flat", "ivf", "ivfpq", "hnsw")
EXACT_UP_TO = 50_000  # below this, exact search answers a query in a few ms: no reason to approximate
REFINE_K_FACTOR = 16  # 4-bit PQ alone ranks poorly; re-ranking 16 x k candidates with SQ8 restores recall


_FEW_QUERIES = 20  # below this many queries FAISS scans on one thread (distance_compute_blas_threshold)
_SHARD_FROM = 20_000  # below this, FAISS's own scan is as fast


def gpu_count() -> int:
    """GPUs faiss can use: 0 with faiss-cpu or without a device."""
    get = getattr(faiss, "get_num_gpus", None)
    return int(get()) if get is not None else 0


def choose_kind(n: int, dim: int, memory_budget: int) -> str:
    """The ``auto`` kind for ``n`` vectors of ``dim`` float32 under ``memory_budget`` bytes."""
    if n <= EXACT_UP_TO:
        return "flat"
    return "ivf" if n * dim * 4 <= memory_budget else "ivfpq"


def _nlist(n: int) -> int:
    """IVF lists: about 4 sqrt(n), a power of two, at least 39 training points per list."""
    target = 2 ** round(math.log2(max(1.0, 4 * math.sqrt(n))))
    return int(max(1, min(target, n // 39)))


def _pq_m(dim: int) -> int:
    """PQ sub-quantizers: dim/4 (4-bit fast scan codes), a divisor of dim."""
    m = max(1, dim // 4)
    while dim % m:
        m -= 1
    return m


def factory_for(kind: str, n: int, dim: int) -> str:
    """The FAISS factory string for a concrete ``kind`` and ``n`` vectors."""
    if kind == "flat":
        return "IDMap2,Flat"
    if kind == "ivf":
        return f"IVF{_nlist(n)},Flat"
    if kind == "ivfpq":
        return f"IDMap2,IVF{_nlist(n)},PQ{_pq_m(dim)}x4fs,Refine(SQ8)"
    if kind == "hnsw":
        return "IDMap2,HNSW32"
    raise UserError(f"index kind {kind!r} is not one of {', '.join(KINDS)}")


class VectorStore:
    """FAISS index with stable ids; searches are serialized on a GPU, saving goes through the CPU form.

    Args:
        index: a CPU FAISS index made by ``index_factory`` (trained or not).
        kind: flat, ivf, ivfpq or hnsw.
        use_gpu: "auto" (a GPU when faiss reports one and the kind runs there), "yes" or "no".
    """

    def __init__(self, index: faiss.Index, kind: str, use_gpu: str = "auto") -> None:
        self.kind = kind
        self.factory_string = ""  # set by create(); a loaded index keeps the one in index.json
        self.index_id: str | None = None  # the id of the index directory, from the file's trailer when loaded
        self.dim = index.d
        self._cpu = index
        self._lock = threading.Lock()
        self._res = None  # faiss.StandardGpuResources, kept alive as long as the GPU index
        self._gpu = None
        want = use_gpu == "yes" or (use_gpu == "auto" and gpu_count() > 0)
        if use_gpu == "yes" and gpu_count() == 0:
            raise UserError("--gpu yes, but faiss sees no GPU: install the `gpu` extra (faiss-gpu) on a CUDA machine")
        if want and kind in ("flat", "ivf"):  # HNSW and refined PQ have no GPU form: they stay on the CPU
            self._res = faiss.StandardGpuResources()
            self._gpu = faiss.index_cpu_to_gpu(self._res, 0, index)
            logger.info("FAISS index on GPU 0")

    @property
    def index(self) -> faiss.Index:
        """The index searches run on (the GPU copy when there is one)."""
        return self._gpu if self._gpu is not None else self._cpu

    @property
    def on_gpu(self) -> bool:
        return self._gpu is not None

    # ------------------------------------------------------------------------------- lifecycle
    @classmethod
    def create(cls, kind: str, dim: int, n: int, use_gpu: str = "auto") -> VectorStore:
        """An empty store of ``kind`` sized for about ``n`` vectors."""
        require_faiss()
        factory = factory_for(kind, n, dim)
        store = cls(index=faiss.index_factory(dim, factory, faiss.METRIC_INNER_PRODUCT), kind=kind, use_gpu=use_gpu)
        store.factory_string = factory
        if kind == "ivfpq":  # re-rank REFINE_K_FACTOR x k PQ candidates with the 8-bit codes
            faiss.downcast_index(faiss.downcast_index(store._cpu).index).k_factor = REFINE_K_FACTOR
        return store

    def save(self, path: str | Path, index_id: str | None = None, mean: np.ndarray | None = None,
             matrix: np.ndarray | None = None) -> None:
        """Write the CPU form and its trailer (:func:`index.search.trailer.trailer_bytes`) atomically (temporary file,
        fsync,
        rename).

        ``index_id`` (32 hex digits) is appended after the FAISS bytes as a fixed-size trailer, which
        ``faiss.read_index`` never reads; :func:`read_index_id` gets it back. ``mean`` (D floats, the
        embedding the vectors are centred on) goes just before it with its digest (:func:`read_mean`), and before
        that ``matrix`` (D x D, the space's whitening; :func:`read_space_arrays`).
        """
        from moco.files import atomic_write

        trailer = trailer_bytes(index_id, mean, matrix)

        def write(f: Any) -> None:
            faiss.write_index(cpu, faiss.PyCallbackIOWriter(f.write))
            f.write(trailer)

        with self._lock:
            cpu = faiss.index_gpu_to_cpu(self._gpu) if self._gpu is not None else self._cpu
            atomic_write(path, write)
        self.index_id = index_id

    def factory(self) -> str:
        """A readable description of the index structure."""
        return type(faiss.downcast_index(self._cpu)).__name__

    @property
    def ntotal(self) -> int:
        return int(self.index.ntotal)

    @property
    def is_trained(self) -> bool:
        return bool(self._cpu.is_trained)

    # --------------------------------------------------------------------------------- content
    def train(self, vectors: np.ndarray) -> None:
        """Train an approximate index on a sample (N x D float32); a no-op for flat."""
        if self._cpu.is_trained:
            return
        logger.info("training %s on %d vectors", self.kind, len(vectors))
        self._cpu.train(np.ascontiguousarray(vectors, np.float32))
        if self._gpu is not None:
            self._gpu = faiss.index_cpu_to_gpu(self._res, 0, self._cpu)

    def add(self, ids: np.ndarray, vectors: np.ndarray) -> None:
        """Add ``vectors`` (N x D, L2-normalized) under ``ids`` (N int64)."""
        if len(ids) == 0:
            return
        with self._lock:
            self.index.add_with_ids(np.ascontiguousarray(vectors, np.float32), np.asarray(ids, np.int64))

    def can_remove(self) -> bool:
        """Whether this kind removes ids in place (hnsw and refined PQ need a rebuild instead)."""
        return self.kind in ("flat", "ivf")

    def remove(self, ids: np.ndarray) -> int:
        """Remove ``ids`` (absent ones are ignored); the number removed."""
        if len(ids) == 0:
            return 0
        if not self.can_remove():
            raise RuntimeError(f"{self.kind} indexes cannot remove in place: rebuild with VectorStore.emptied()")
        with self._lock:
            n = int(self._cpu.remove_ids(faiss.IDSelectorBatch(np.asarray(ids, np.int64))))
            if self._gpu is not None:
                self._gpu = faiss.index_cpu_to_gpu(self._res, 0, self._cpu)
        return n

    def contains_any(self, ids: np.ndarray) -> bool:
        """Whether any of ``ids`` is stored (for kinds that cannot remove)."""
        if len(ids) == 0 or self.ntotal == 0:
            return False
        idmap = faiss.downcast_index(self._cpu)
        stored = faiss.vector_to_array(idmap.id_map)
        return bool(np.isin(np.asarray(ids, np.int64), stored).any())

    def emptied(self) -> VectorStore:
        """A trained, empty copy (same quantizer and parameters) to rebuild into."""
        clone = faiss.clone_index(self._cpu)
        clone.reset()
        out = VectorStore(clone, self.kind, "no")
        out._res, out._gpu, out.factory_string = self._res, None, self.factory_string
        if self._res is not None:
            out._gpu = faiss.index_cpu_to_gpu(self._res, 0, clone)
        return out

    # ---------------------------------------------------------------------------------- search
    def set_param(self, name: str, value: int) -> None:
        """Set a search parameter (nprobe, efSearch) through any wrapper."""
        with self._lock:
            space = faiss.GpuParameterSpace() if self._gpu is not None else faiss.ParameterSpace()
            space.set_index_parameter(self.index, name, value)

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Top-``k`` by cosine: (scores Q x k float32, ids Q x k int64; -1 where fewer exist)."""
        q = np.ascontiguousarray(np.atleast_2d(queries), np.float32)  # Q x D
        if q.shape[1] != self.dim:
            raise UserError(f"query vectors have dimension {q.shape[1]}, the index holds {self.dim}: "
                            "embed queries with the backbone the index was built with")
        k = max(1, min(int(k), 2048 if self._gpu is not None else self.ntotal or 1))
        with self._lock:
            if self.kind == "flat" and self._gpu is None and len(q) < _FEW_QUERIES and self.ntotal >= _SHARD_FROM:
                return self._flat_few(q, k)
            scores, ids = self.index.search(q, k)  # Q x k, Q x k
        return scores, ids

    def _flat_few(self, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Exact search of a few queries (Q x D) on the stored vectors in place (:func:`index.search.store.few_topk`).

        FAISS scans on one thread below 20 queries; BLAS reads the vectors with every core.
        """
        idmap = faiss.downcast_index(self._cpu)
        flat = faiss.downcast_index(idmap.index)
        n = flat.ntotal
        xb = faiss.rev_swig_ptr(flat.get_xb(), n * self.dim).reshape(n, self.dim)  # N x D, no copy
        labels = faiss.rev_swig_ptr(idmap.id_map.data(), n)  # N, no copy
        return few_topk(q, xb, labels, k)

    def range_search(self, queries: np.ndarray, threshold: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """All stored vectors with cosine >= ``threshold``: (lims Q+1, scores, ids) as in FAISS."""
        q = np.ascontiguousarray(np.atleast_2d(queries), np.float32)
        with self._lock:
            return self._cpu.range_search(q, float(threshold))

    # ------------------------------------------------------------------------------------ tune
    def tune(self, vectors: np.ndarray, ids: np.ndarray, queries: np.ndarray, query_ids: np.ndarray,
             k: int = 10, target: float = 0.95, held_out: bool = True) -> Tuning:
        """Smallest nprobe/efSearch whose recall@k on ``queries`` reaches ``target``, and that recall
        (:func:`index.search.store.tune_store`)."""
        return tune_store(self, vectors, ids, queries, query_ids, k, target, held_out)

    def _param_limit(self) -> int:
        if self.kind == "hnsw":
            return 4096
        return int(faiss.extract_index_ivf(self._cpu).nlist)


_PARAM = {"ivf": "nprobe", "ivfpq": "nprobe", "hnsw": "efSearch"}  # the search parameter each approximate kind tunes


@dataclass
class Tuning:
    """Outcome of tuning: the search parameter, its value, and the recall@k it measured."""

    param: str | None
    value: int | None
    recall: float
    queries: int


def tune_store(store: VectorStore, vectors: np.ndarray, ids: np.ndarray, queries: np.ndarray, query_ids: np.ndarray,
               k: int = 10, target: float = 0.95, held_out: bool = True) -> Tuning:
    """Smallest nprobe/efSearch of ``store`` whose recall@k on ``queries`` reaches ``target``, and that recall.

    ``vectors``/``ids``: the whole collection (ground truth by exact search in numpy, each query's
    own id left out). ``held_out``: the queries are not in the index yet (the honest measure, used
    when building); otherwise they are, and their own id is dropped from the answers.
    """
    param = _PARAM.get(store.kind)
    if len(queries) == 0 or store.ntotal < 2:
        return Tuning(None, None, 1.0, 0)
    order = np.argsort(ids)  # positions by id (no copy of the vectors: they may be most of the RAM)
    sorted_ids = ids[order]
    exclude = query_ids if held_out else None  # held-out queries are not in the index: not in the truth
    truth = exact_topk(vectors, ids, queries, query_ids, k, exclude)  # Q x k ids
    kth = np.einsum("qd,qkd->qk", queries, vectors[order[np.searchsorted(sorted_ids, truth)]]).min(1)  # Q

    def measure() -> float:
        found = store.search(queries, k if held_out else k + 1)[1]
        found = found if held_out else _drop_self(found, query_ids, k)
        # tie-aware: a result scoring at least the true k-th score counts, whichever tied id it is
        pos = np.clip(np.searchsorted(sorted_ids, found), 0, len(sorted_ids) - 1)  # Q x k
        score = np.einsum("qd,qkd->qk", queries, vectors[order[pos]])
        good = (found >= 0) & (sorted_ids[pos] == found) & (score >= kth[:, None] - 1e-5)
        return float(good.sum(1).clip(max=k).mean() / k)

    if param is None:
        return Tuning(None, None, measure(), len(queries))
    limit = store._param_limit()
    value = min(limit, 1 if param == "nprobe" else k)
    while True:
        store.set_param(param, value)
        recall = measure()
        logger.info("tuning %s=%d: recall@%d %.4f", param, value, k, recall)
        if recall >= target or value >= limit:
            break
        value = min(value * 2, limit)
    if recall < target:
        logger.warning("%s reaches recall@%d %.3f at most (%s=%d), below the target %.2f: consider --kind flat",
                       store.kind, k, recall, param, value, target)
    return Tuning(param, value, recall, len(queries))


def _drop_self(found: np.ndarray, self_ids: np.ndarray, k: int) -> np.ndarray:
    """Remove each row's own id, keeping the first ``k`` of the rest."""
    out = np.full((len(found), k), -1, np.int64)
    for i, (row, own) in enumerate(zip(found, self_ids)):
        rest = row[row != own][:k]
        out[i, : len(rest)] = rest
    return out


def few_topk(q: np.ndarray, xb: np.ndarray, labels: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Exact search of a few queries ``q`` (Q x D) over ``xb`` (N x D) stored under ``labels`` (N int64): (scores
    Q x k float32, labels Q x k int64), by score, ties by position.

    One BLAS product over the stored vectors, then an exact top-k. The top-k avoids a full partition of N scores:
    the k-th best score of a strided sample is a lower bound of the true k-th best (a subset's k-th largest never
    exceeds the whole set's), so every true top-k score is at or above it, and only those few candidates are sorted.
    """
    n = len(xb)
    scores = q @ xb.T  # Q x N
    out_s = np.empty((len(q), k), np.float32)
    out_i = np.empty((len(q), k), np.int64)
    step = 16 if n >= 16 * 64 * k else 1  # a 1/16 sample: its k-th best bounds the top ~16k
    for r, row in enumerate(scores):
        sample = row[::step]
        bound = np.partition(sample, len(sample) - k)[len(sample) - k] if len(sample) >= k else -np.inf
        cand = np.flatnonzero(row >= bound)  # includes the true top-k
        best = cand[np.lexsort((cand, -row[cand]))[:k]]  # by score, ties by position
        out_s[r], out_i[r] = row[best], labels[best]
    return out_s, out_i


def exact_topk(vectors: np.ndarray, ids: np.ndarray, queries: np.ndarray, query_ids: np.ndarray,
               k: int, exclude: np.ndarray | None = None) -> np.ndarray:
    """Ground truth: each query's top-``k`` ids by inner product (numpy, chunked), own id excluded.

    ``exclude``: ids left out for every query (e.g. all the held-out queries).
    """
    gone = np.isin(ids, exclude) if exclude is not None and len(exclude) else None  # N
    out = []
    for start in range(0, len(queries), 64):
        q = queries[start : start + 64]
        scores = q @ vectors.T  # q x N
        own = query_ids[start : start + 64]
        scores[ids[None, :] == own[:, None]] = -np.inf
        if gone is not None:
            scores[:, gone] = -np.inf
        kk = min(k, scores.shape[1])
        top = np.argpartition(-scores, kk - 1, axis=1)[:, :kk]  # q x k, unordered
        out.append(ids[top])
    return np.concatenate(out)


def recall_at(found: np.ndarray, truth: np.ndarray) -> float:
    """Mean fraction of each row of ``truth`` present in the same row of ``found``."""
    hits = [len(np.intersect1d(f[f >= 0], t)) / max(1, len(t)) for f, t in zip(found, truth)]
    return float(np.mean(hits)) if hits else 1.0
