"""The files of an index directory: their names, ``index.json`` read and written, ``index.faiss`` loaded, and
their index ids checked against each other.

An index directory holds::

    index.faiss      the FAISS index (CPU form), replaced atomically
    index.json       backbone sha256 and path, dim, metric, kind, factory, tuned parameter, recall, and the
                     collection's mean embedding ("mean", from "mean_count" vectors) with "weak_below",
                     "augment_level" (how close two training views of one photo score) and
                     "dedup_calibration" (the near-duplicate threshold measured on copies of its photos)
    catalog.sqlite   the source of truth: files, their state and their vectors (see catalog.py)
    thumbs/          <id>.jpg, about 256 px, the only images the UI serves
    dedup.json       groups of duplicates (exact, near, similar) with their keepers, written by `moco index dedup` or
                     the page (the moves' journal, "not duplicates" marks and chosen keepers are in the catalog)
    dedup-frames.bin, dedup-windows.bin, dedup-flats.bin, dedup-checked.bin, dedup-neighbours.bin, dedup-links.bin
                     the pixel check's frames (with their crop windows and shrunk forms) and scored pairs, the proposed
                     neighbours and the model's links (about 22 kB a photo), kept so the next search looks up and
                     checks only what is new
                     (index.duplicates.dedup_cache; deleting them loses nothing but time)
    themes.npz, map-pca.npz, map-umap.npz, unusual.npz
                     views of the whole collection, each with the index version it was computed for
                     (index.overview: computed again when the index changed; deleting them loses nothing)
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from index.search.store import VectorStore, require_faiss
from index.search.trailer import read_index_id
from moco.errors import UserError
from moco.files import atomic_write

__all__ = ["read_meta", "write_meta", "kind_of", "load_store", "check_index_ids", "INDEX_FILE", "META_FILE",
           "CATALOG_FILE", "THUMBS_DIR", "DEDUP_FILE", "INDEX_VERSION", "INDEX_ID_KEY", "DEDUP_LAST_KEY", "VECTORS"]

logger = logging.getLogger(__name__)

INDEX_FILE, META_FILE, CATALOG_FILE, THUMBS_DIR, DEDUP_FILE = (
    "index.faiss", "index.json", "catalog.sqlite", "thumbs", "dedup.json")
INDEX_VERSION = 1
INDEX_ID_KEY = "index_id"  # catalog meta key of the index id (also in index.json and in index.faiss's trailer)
DEDUP_LAST_KEY = "dedup_last"  # catalog meta key of the last search for duplicates: its thresholds and their rule
VECTORS = "features"  # what the catalog stores (index.json "vectors"); older indexes stored the export's output


def read_meta(index_dir: Path) -> dict[str, Any]:
    """``index.json`` of an index directory, with a clear error when it is missing or damaged."""
    path = Path(index_dir) / META_FILE
    if not path.is_file():
        if (Path(index_dir) / CATALOG_FILE).is_file():  # a build killed before its first index.json, or a lost file
            raise UserError(f"{path} is missing: `moco index update {index_dir}` rewrites it and {INDEX_FILE} "
                            f"from {CATALOG_FILE}")
        raise UserError(f"{index_dir} is not an index directory (no {META_FILE}): "
                        f"create one with `moco index build PHOTOS --backbone B -o {index_dir}`")
    try:
        meta = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"{path} is unreadable ({e}): rebuild with `moco index build`") from e
    if meta.get("format") != INDEX_VERSION:
        raise UserError(f"{path} has format {meta.get('format')!r}, this version reads {INDEX_VERSION}: rebuild the "
                        "index")
    return meta


def write_meta(index_dir: Path, meta: dict[str, Any]) -> None:
    """Replace ``index.json`` atomically."""
    data = (json.dumps(meta, indent=2, sort_keys=True) + "\n").encode()
    atomic_write(Path(index_dir) / META_FILE, lambda f: f.write(data))


def kind_of(index: Any) -> str:
    """The kind of a FAISS index, from its structure (index.json may lag behind a crash)."""
    faiss = require_faiss()

    outer = faiss.downcast_index(index)
    if isinstance(outer, faiss.IndexIVFFlat):
        return "ivf"
    inner = faiss.downcast_index(outer.index) if isinstance(outer, faiss.IndexIDMap2) else outer
    if isinstance(inner, faiss.IndexFlat):
        return "flat"
    if isinstance(inner, faiss.IndexHNSW):
        return "hnsw"
    if isinstance(inner, faiss.IndexRefine):
        return "ivfpq"
    raise UserError(f"unsupported FAISS index structure {type(inner).__name__}: rebuild with `moco index build`")


def load_store(index_dir: Path, use_gpu: str = "auto") -> VectorStore:
    """``index.faiss`` with its kind detected and the tuned search parameter of ``index.json`` applied."""
    faiss = require_faiss()

    path = Path(index_dir) / INDEX_FILE
    if not path.is_file():
        raise UserError(f"{path} is missing: finish the index with `moco index update {index_dir}`")
    try:
        with open(path, "rb") as f:  # through Python: FAISS's own open refuses a path that is not UTF-8
            cpu = faiss.read_index(faiss.PyCallbackIOReader(f.read))
    except RuntimeError as e:
        raise UserError(f"{path} is not a readable FAISS index: `moco index update {index_dir}` rewrites it "
                        f"from {CATALOG_FILE}") from e
    store = VectorStore(cpu, kind_of(cpu), use_gpu)
    store.index_id = read_index_id(path)
    params = read_meta(index_dir).get("params") or {}
    for name, value in params.items():
        try:
            store.set_param(name, int(value))
        except RuntimeError:
            logger.debug("parameter %s does not apply to this %s index", name, store.kind)
    return store


def check_index_ids(index_dir: Path, catalog_id: str | None, meta_id: str | None, faiss_id: str | None) -> None:
    """Refuse an index directory whose files carry different index ids (a file copied from another index).

    A missing id (a file written before index ids existed) is not compared, so an index from an older
    version opens, and stays searchable while its first update is interrupted; that update adds the ids.
    """
    ids = {CATALOG_FILE: catalog_id, META_FILE: meta_id, INDEX_FILE: faiss_id}
    known = {name: i for name, i in ids.items() if i}
    if len(set(known.values())) <= 1:
        return
    d = Path(index_dir)
    fix = f"`moco index update {d}` rewrites {INDEX_FILE} and {META_FILE} from {CATALOG_FILE}, the source of truth"
    if catalog_id and meta_id and meta_id == faiss_id:  # the catalog is the odd one out
        raise UserError(f"{d / CATALOG_FILE} belongs to another index (id {catalog_id[:8]}...) than {META_FILE} and "
                        f"{INDEX_FILE} (id {meta_id[:8]}...): put back the {CATALOG_FILE} of this index, or, to keep "
                        f"this catalog and its photos, run {fix}")
    ref = catalog_id or meta_id
    odd = [name for name, i in known.items() if i != ref]
    raise UserError(f"{' and '.join(str(d / n) for n in odd)} {'belongs' if len(odd) == 1 else 'belong'} to another "
                    f"index than {CATALOG_FILE if catalog_id else META_FILE} (id {ref[:8]}...): {fix}")
