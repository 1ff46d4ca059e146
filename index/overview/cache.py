"""What the views of a whole collection are computed from, and where they are kept: the index's version, its
vectors (centred as its space centres them; as search scores them), and the arrays computed for one version
(``IDX/<name>.npz``, with that version).

The map and the themes read the catalog's features centred on the index's mean and L2-normalized, without the
whitening an index of 2,000 photos or more adds (:func:`centred_vectors`): whitening gives every direction the same
weight, which is what finds a photo's nearest neighbours (search, the unusual photos) but flattens the few broad
directions that tell a collection's kinds of photos apart. Measured on Fashion-MNIST (10,000 photos, a whitened
index; BENCHMARKS.md, "The whole collection"): 10 themes in the whitened space reached NMI 0.06 with the classes
(purity 0.22), in the centred one 0.47 (0.50); the 2-D PCA map's 10 nearest points shared a photo's class 17% of the
time in the whitened space (chance: 10%), 51% in the centred one. An index that only centres has one space for both.

An index's version changes whenever ``moco index update`` writes its vectors anew (``index.faiss`` replaced,
``index.json``'s ``updated``): reading it costs one ``stat`` and
what :meth:`~index.search.image_index.ImageIndex.refresh`
reads anyway, so every call can check it. A view computed for another version is computed again; one computed for
this version is read from its file (or from memory, once read). A read-only index directory computes in memory and
writes nothing; a damaged file is computed again, never an error. Paths are never cached: they are read from the
catalog when a view is shown, so a photo moved since still shows where it is.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from index.catalog import Catalog
from index.search.index_dir import INDEX_FILE
from index.search.store import VectorStore
from moco.errors import StorageError
from moco.files import atomic_write

__all__ = ["Collection", "index_version", "space_vectors", "centred_vectors", "cached", "cache_file",
           "forget_views"]

logger = logging.getLogger(__name__)

_MEMO_SIZE = 32  # views kept in memory (a server shows the same few again and again)
_memo: dict[tuple[str, str, str], tuple[str, dict[str, np.ndarray]]] = {}
_lock = threading.Lock()  # guards _memo and _computing
_computing: dict[tuple[str, str, str], threading.Lock] = {}  # one lock per view: a long UMAP blocks no other view


class Collection(Protocol):
    """What the views read of an index (an :class:`~index.search.image_index.ImageIndex` has it)."""

    dir: Path
    meta: dict[str, Any]
    catalog: Catalog
    store: VectorStore

    @property
    def dim(self) -> int: ...

    @property
    def mean(self) -> np.ndarray | None: ...

    def refresh(self) -> bool: ...

    def to_space(self, vectors: np.ndarray) -> np.ndarray: ...


def index_version(index: Collection) -> str:
    """The version of ``index``'s vectors (16 hex digits): its id, when ``index.json`` says it was last written,
    how many vectors, and ``index.faiss``'s size and time. Cheap: the index reloads itself first if its files
    changed (:meth:`~index.search.image_index.ImageIndex.refresh`), then one ``stat``."""
    index.refresh()
    st = os.stat(index.dir / INDEX_FILE)
    key = [index.meta.get("index_id"), index.meta.get("updated"), index.meta.get("ntotal"), st.st_size,
           st.st_mtime_ns]
    return hashlib.blake2b(json.dumps(key).encode(), digest_size=8).hexdigest()


def space_vectors(index: Collection) -> tuple[np.ndarray, np.ndarray]:
    """(ids N int64 ascending, vectors N x D float32): every photo of the catalog (live, indexed without error) in
    the index's own space, as search scores them (centred, whitened where the index whitens, L2-normalized: the
    cosine of two photos is the inner product of their rows)."""
    ids, raw = index.catalog.vectors(dim=index.dim)  # N, N x D
    if not len(ids):
        return ids, raw
    return ids, index.to_space(raw)  # N x D


def centred_vectors(index: Collection) -> tuple[np.ndarray, np.ndarray]:
    """(ids N int64 ascending, vectors N x D float32): every photo of the catalog centred on the index's mean (the
    centre of its space; none for an uncentred index) and L2-normalized, without its whitening (the module's
    docstring says why); a photo equal to the mean stays as it is."""
    ids, raw = index.catalog.vectors(dim=index.dim)  # N, N x D
    if not len(ids):
        return ids, raw
    x = raw if index.mean is None else raw - index.mean  # N x D
    norm = np.linalg.norm(x, axis=1, keepdims=True)  # N x 1
    return ids, np.where(norm > 1e-6, x / np.maximum(norm, 1e-12), raw).astype(np.float32)


def cache_file(index: Collection, name: str) -> Path:
    """Where the view ``name`` of ``index`` is kept: ``IDX/<name>.npz``."""
    return index.dir / f"{name}.npz"


def _load(path: Path, version: str, params: str) -> dict[str, np.ndarray] | None:
    """The arrays of ``path`` when it holds this version and these parameters; None when not (or unreadable)."""
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as f:
            arrays = {k: f[k] for k in f.files}
    except (OSError, ValueError, EOFError) as e:
        logger.warning("%s is unreadable (%s): computing it again", path, e)
        return None
    if str(arrays.pop("_version", "")) != version or str(arrays.pop("_params", "")) != params:
        return None
    return arrays


def _save(path: Path, arrays: dict[str, np.ndarray], version: str, params: str) -> None:
    buf = io.BytesIO()
    np.savez(buf, _version=np.array(version), _params=np.array(params), **arrays)
    try:
        atomic_write(path, lambda f: f.write(buf.getvalue()))
    except StorageError as e:  # a full disk: the view is shown all the same, computed again next time
        logger.warning("%s", e)


def cached(index: Collection, name: str, params: dict[str, Any], compute: Callable[[], dict[str, np.ndarray]],
           refresh: bool = False, keep: bool = True) -> tuple[dict[str, np.ndarray], str]:
    """(arrays, version) of the view ``name`` of ``index`` with ``params``: from memory or ``IDX/<name>.npz`` when
    computed for the index's current version and these parameters, else ``compute()`` (then written to the file
    when ``keep`` and the index directory is writable). ``refresh``: compute even so."""
    version = index_version(index)
    ps = json.dumps(params, sort_keys=True)
    key = (str(Path(index.dir).resolve()), name, ps)
    with _lock:
        hit = _memo.get(key)
        if hit is not None and hit[0] == version and not refresh:
            return hit[1], version
        one = _computing.setdefault(key, threading.Lock())
    with one:  # two requests for the same view compute it once: the second finds the first's in memory
        with _lock:
            hit = _memo.get(key)
        if hit is not None and hit[0] == version and not refresh:
            return hit[1], version
        path = cache_file(index, name)
        arrays = None if refresh or not keep else _load(path, version, ps)
        if arrays is None:
            arrays = compute()
            if keep and not index.catalog.read_only and os.access(index.dir, os.W_OK):
                _save(path, arrays, version, ps)
        with _lock:
            if len(_memo) >= _MEMO_SIZE:
                _memo.pop(next(iter(_memo)))
            _memo[key] = (version, arrays)
        return arrays, version


def forget_views() -> None:
    """Drop the views kept in memory (the next call reads their files, as another process would)."""
    with _lock:
        _memo.clear()
