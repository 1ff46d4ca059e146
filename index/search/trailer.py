"""The trailer of ``index.faiss``: what the file carries after FAISS's bytes (``faiss.read_index`` never reads it).

From the end of the file backwards: the index id (32 hex digits), the mean embedding the vectors are centred on
(D float32) with its digest, and the whitening matrix of the index's space (D x D float32) with its digest;
:meth:`index.search.store.VectorStore.save` writes them with the FAISS bytes, in one atomic file.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from moco.errors import UserError

__all__ = ["trailer_bytes", "read_index_id", "mean_digest", "read_mean", "read_space_arrays"]

_ID_TAG = b"\nmoco-retrieval-index-id:"  # index.faiss ends with this, 32 hex digits and a newline
_ID_TRAILER = len(_ID_TAG) + 32 + 1
_MEAN_TAG = b"\nmoco-retrieval-mean:"  # before the id trailer: a digest of the mean the vectors are centred on
_MEAN_TRAILER = len(_MEAN_TAG) + 16 + 1
_MATRIX_TAG = b"\nmoco-retrieval-matrix:"  # before the mean: the whitening matrix of the index's space, if any
_MATRIX_TRAILER = len(_MATRIX_TAG) + 16 + 1


def trailer_bytes(index_id: str | None, mean: np.ndarray | None = None, matrix: np.ndarray | None = None) -> bytes:
    """What follows the FAISS bytes: ``matrix`` (D x D) and ``mean`` (D), each with its digest, then ``index_id``.

    Without ``index_id`` nothing (no id, no space); ``matrix`` only with ``mean``. A ValueError for an id that is
    not 32 lowercase hex digits.
    """
    if index_id is not None and not _is_index_id(index_id):
        raise ValueError(f"index id must be 32 lowercase hex digits, got {index_id!r}")
    trailer = _ID_TAG + index_id.encode() + b"\n" if index_id else b""
    if mean is not None and index_id:
        m = np.asarray(mean, "<f4")  # D
        trailer = m.tobytes() + _MEAN_TAG + mean_digest(m).encode() + b"\n" + trailer
        if matrix is not None:
            w = np.ascontiguousarray(matrix, "<f4")  # D x D
            trailer = w.tobytes() + _MATRIX_TAG + mean_digest(w).encode() + b"\n" + trailer
    return trailer


def mean_digest(mean: np.ndarray | list[float] | None) -> str | None:
    """16 hex digits that identify a mean embedding (None for an uncentred index)."""
    if mean is None:
        return None
    import hashlib

    return hashlib.blake2b(np.asarray(mean, "<f4").tobytes(), digest_size=8).hexdigest()


def read_mean(path: str | Path, dim: int) -> np.ndarray | None:
    """The mean embedding (D float32) an ``index.faiss`` is centred on, from its trailer; None if uncentred."""
    return read_space_arrays(path, dim)[0]


def read_space_arrays(path: str | Path, dim: int) -> tuple[np.ndarray | None, np.ndarray | None]:
    """The mean (D float32) and whitening matrix (D x D float32, None: centring only) of the space an
    ``index.faiss``'s vectors are in, from its trailer; (None, None) for an uncentred index.

    They travel inside the file (see :meth:`VectorStore.save`), so the vectors and their space are replaced
    together, atomically: a kill between writing ``index.faiss`` and ``index.json`` cannot pair them wrongly.
    """
    mean = _read_mean(path, dim)
    if mean is None:
        return None, None
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        start = size - _ID_TRAILER - _MEAN_TRAILER - 4 * dim - _MATRIX_TRAILER
        if start - 4 * dim * dim < 0:
            return mean, None
        f.seek(start)
        tail = f.read(_MATRIX_TRAILER)
        if not tail.startswith(_MATRIX_TAG):
            return mean, None
        f.seek(start - 4 * dim * dim)
        matrix = np.frombuffer(f.read(4 * dim * dim), "<f4").astype(np.float32).reshape(dim, dim)  # D x D
    if mean_digest(matrix) != tail[len(_MATRIX_TAG) : -1].decode("ascii", "replace"):
        raise UserError(f"{path} is damaged (its whitening matrix does not match its digest): rebuild it with "
                        f"`moco index update {Path(path).parent}`")
    return mean, matrix


def _read_mean(path: str | Path, dim: int) -> np.ndarray | None:
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        start = size - _ID_TRAILER - _MEAN_TRAILER
        if start - 4 * dim < 0:
            return None
        f.seek(start)
        tail = f.read(_MEAN_TRAILER)
        if not tail.startswith(_MEAN_TAG):
            return None
        f.seek(start - 4 * dim)
        mean = np.frombuffer(f.read(4 * dim), "<f4").astype(np.float32)  # D
    if mean_digest(mean) != tail[len(_MEAN_TAG) : -1].decode("ascii", "replace"):
        raise UserError(f"{path} is damaged (its mean embedding does not match its digest): rebuild it with "
                        f"`moco index update {Path(path).parent}`")
    return mean


def read_index_id(path: str | Path) -> str | None:
    """The index id in the trailer of an ``index.faiss`` (see :meth:`VectorStore.save`); None when it has none."""
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        if size < _ID_TRAILER:
            return None
        f.seek(size - _ID_TRAILER)
        tail = f.read(_ID_TRAILER)
    hex_id = tail[len(_ID_TAG) : -1].decode("ascii", "replace")
    return hex_id if tail.startswith(_ID_TAG) and tail.endswith(b"\n") and _is_index_id(hex_id) else None


def _is_index_id(s: str) -> bool:
    return len(s) == 32 and all(c in "0123456789abcdef" for c in s)
