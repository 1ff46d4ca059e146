"""ImageIndex: open an index directory (its files: :mod:`index.search.index_dir`) and search it by vector or by image.

    >>> from index import ImageIndex                                     # doctest: +SKIP
    >>> idx = ImageIndex.open("my_index")                                # doctest: +SKIP
    >>> hits = idx.search(vectors, k=10)   # vectors: Q x D, L2-normalized   # doctest: +SKIP
    >>> hits.ids[0], hits.scores[0], hits.paths[0]                       # doctest: +SKIP

The catalog keeps each photo's features ``f`` (what ``ImageIndex.load_embedder()`` embeds: the backbone's
features, with the mirror image and pooled stages where the export says so, L2-normalized). ``index.faiss`` holds
them in the index's own embedding space, fitted on this collection (:func:`moco.whiten.fit_space`): centred on
its mean, whitened where that helps, L2-normalized; the space travels in ``index.faiss``'s trailer (and a copy
in ``space.safetensors`` for other doors: ``Embedder.load(B, space=INDEX_DIR)``, ``moco export --space``).
:meth:`ImageIndex.search` maps its queries (features) the same way, so an unrelated photo scores near 0; a
score under ``weak_below`` (the chance level of random pairs) is a weak match.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import warnings
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from index.calibrate import dedup_threshold, threshold_source
from index.catalog import Catalog, Row, sample_ids
from index.search.index_dir import (
    CATALOG_FILE,
    DEDUP_LAST_KEY,
    INDEX_FILE,
    INDEX_ID_KEY,
    META_FILE,
    VECTORS,
    check_index_ids,
    load_store,
    read_meta,
)
from index.search.query import BACKGROUND, RULE, check_query_size, combine, query_size
from index.search.store import require_faiss
from index.search.trailer import read_space_arrays
from moco.edges import EDGES
from moco.edges import WEIGHT as EDGE_WEIGHT
from moco.errors import UserError
from moco.whiten import Whitening, features_text

# with the names of index.search.index_dir, importable from here as well
__all__ = ["ImageIndex", "SearchResult", "row_filter", "BROWSE_SORTS"]

logger = logging.getLogger(__name__)

_REQUIRED_META = ("root", "dim", "backbone_sha256", "backbone_path")  # what search and stats read from index.json
BROWSE_SORTS = ("name", "date", "-date")  # :meth:`ImageIndex.browse`'s orders: by path, taken oldest / newest first
def row_filter(folder: str | None = None, exclude_folders: Sequence[str] = (),
               taken: tuple[float | None, float | None] = (None, None)) -> Callable[[Row], bool] | None:
    """Which catalog rows a search keeps: under ``folder`` (None: all), under none of ``exclude_folders``, and
    taken in ``[taken[0], taken[1])`` (catalog ``taken`` values, :func:`index.catalog.taken_bound`; None: open; a row
    whose date is unknown is outside any range). None when it keeps every row."""
    prefix = folder.strip("/") + "/" if folder and folder.strip("/") else None
    away = tuple(f.strip("/") + "/" for f in exclude_folders if f and f.strip("/"))
    lo, hi = taken
    if prefix is None and not away and lo is None and hi is None:
        return None

    def keep(row: Row) -> bool:
        if prefix is not None and not row.path.startswith(prefix):
            return False
        if away and row.path.startswith(away):
            return False
        if lo is not None or hi is not None:
            if row.date is None or (lo is not None and row.date < lo) or (hi is not None and row.date >= hi):
                return False
        return True

    return keep


@dataclass
class SearchResult:
    """Ranked hits for Q queries: ``ids`` and ``scores`` are Q x k (-1 / nan where fewer matched)."""

    ids: np.ndarray
    scores: np.ndarray
    paths: list[list[str]]
    rows: list[list[Row]]


class ImageIndex:
    """A searchable index directory. Reloads itself when ``moco index update`` replaces the files."""

    def __init__(self, index_dir: str | Path, use_gpu: str = "auto") -> None:
        self.dir = Path(index_dir)
        self.use_gpu = use_gpu
        self._lock = threading.Lock()
        self._stamp: tuple[int, int, int] | None = None
        self.meta: dict[str, Any] = {}
        self.space: Whitening | None = None  # the index's space (centred, whitened); None for an uncentred index
        self.catalog = Catalog(self.dir / CATALOG_FILE)
        self._load()

    @classmethod
    def open(cls, index_dir: str | Path, use_gpu: str = "auto") -> ImageIndex:
        """Open an index made by ``moco index build``."""
        require_faiss()  # before the catalog is opened
        read_meta(Path(index_dir))
        return cls(index_dir, use_gpu)

    def _files_stamp(self) -> tuple[int, int, int]:
        """Changes when ``index.faiss`` or ``index.json`` is replaced, or ``catalog.sqlite`` is another file."""
        st = [os.stat(self.dir / n) for n in (INDEX_FILE, META_FILE, CATALOG_FILE)]
        return (st[0].st_mtime_ns ^ st[0].st_ino, st[1].st_mtime_ns ^ st[1].st_ino, st[2].st_ino)

    def _load(self) -> None:
        if self._stamp is not None and os.stat(self.dir / CATALOG_FILE).st_ino != self._stamp[2]:
            logger.info("%s was replaced: opening the new one", self.dir / CATALOG_FILE)
            self.catalog.close()
            self.catalog = Catalog(self.dir / CATALOG_FILE)  # the index was rebuilt (or the catalog swapped)
        self.meta = read_meta(self.dir)
        self.store = load_store(self.dir, self.use_gpu)
        check_index_ids(self.dir, self.catalog.get_meta(INDEX_ID_KEY), self.meta.get("index_id"), self.store.index_id)
        self._check_meta()
        mean, matrix = read_space_arrays(self.dir / INDEX_FILE, self.store.dim)  # D, D x D: travel with the vectors
        info = self.meta.get("space") if isinstance(self.meta.get("space"), dict) else {}
        feats = self.features
        self.space = None if mean is None else Whitening(
            mean, matrix, float(info.get("shrinkage") or (0.0 if matrix is not None else 1.0)),
            int(info.get("count") or self.meta.get("mean_count") or 0), bool(feats["mirror"]),
            tuple((str(n), int(c)) for n, c in feats["stages"]),
            str(info.get("fitted_on") or "collection"))
        if mean is None:
            logger.info("%s has no mean embedding (made before centred scores): searching uncentred until "
                        "`moco index update %s` centres it", self.dir, self.dir)
        self._stamp = self._files_stamp()

    def _check_meta(self) -> None:
        """``index.json`` holds what search needs, and its dim agrees with ``index.faiss`` and the catalog."""
        path, fix = self.dir / META_FILE, f"run `moco index update {self.dir}` to rewrite it from the catalog"
        missing = [k for k in _REQUIRED_META if k not in self.meta]
        if missing:
            raise UserError(f"{path} is damaged: it lacks {', '.join(missing)}; {fix}")
        cat_dim = json.loads(self.catalog.get_meta("dim") or "null")
        if cat_dim is not None and cat_dim != self.store.dim:
            raise UserError(f"{self.dir / INDEX_FILE} holds {self.store.dim}-d vectors, the catalog {cat_dim}-d: "
                            f"delete {INDEX_FILE} and run `moco index update {self.dir}` to rebuild it from the "
                            "catalog")
        if self.meta["dim"] != self.store.dim:
            raise UserError(f"{path} is damaged: its dim {self.meta['dim']!r} disagrees with {INDEX_FILE} and the "
                            f"catalog ({self.store.dim}); {fix}")
        mean = self.meta.get("mean")
        if mean is not None and (not isinstance(mean, list) or len(mean) != self.store.dim
                                 or not all(isinstance(x, (int, float)) for x in mean)):
            raise UserError(f"{path} is damaged: its mean is not {self.store.dim} numbers; {fix}")

    def refresh(self) -> bool:
        """Reload when the index files changed on disk; whether it did."""
        with self._lock:
            try:
                stamp = self._files_stamp()
            except FileNotFoundError:
                return False
            if stamp == self._stamp:
                return False
            logger.info("index files changed on disk: reloading %s", self.dir)
            self._load()
            return True

    # ------------------------------------------------------------------------------ properties
    @property
    def stamp(self) -> tuple[int, int, int] | None:
        """What changes when ``moco index update`` replaces the files: a key for what is computed from them."""
        return self._stamp

    @property
    def root(self) -> Path:
        """The collection root the catalog's paths are relative to."""
        return Path(self.meta["root"])

    @property
    def dim(self) -> int:
        return int(self.meta["dim"])

    def __len__(self) -> int:
        return self.store.ntotal

    @property
    def weak_below(self) -> float | None:
        """Scores under this are weak matches (no close match); None for an index from before centred scores."""
        value = self.meta.get("weak_below")
        return float(value) if value is not None else None

    @property
    def mean(self) -> np.ndarray | None:
        """D: the collection's mean feature (the space's centre); None for an uncentred index."""
        return None if self.space is None else self.space.mean

    @property
    def whitened(self) -> bool:
        """Whether the index's space whitens (not only centres) its vectors: scores spread wider."""
        return self.space is not None and self.space.whitened

    @property
    def pooled_stages(self) -> bool:
        """Whether the features hold the pooled earlier stages (``--whiten-stages``)."""
        return bool(self.features["stages"])

    @property
    def features(self) -> dict[str, Any]:
        """Which features the catalog holds: ``{"mirror", "stages"}`` (from ``index.json``, or for an older index
        from its backbone's whitening)."""
        feats = self.meta.get("features")
        if isinstance(feats, dict):
            return {"mirror": bool(feats.get("mirror")), "stages": [list(x) for x in feats.get("stages") or []]}
        try:
            white = json.loads((self.meta.get("backbone") or {}).get("whitening") or "{}")
        except (TypeError, ValueError):
            white = {}
        return {"mirror": bool(white.get("mirror")), "stages": [list(x) for x in white.get("stages") or []]}

    def describe_space(self) -> str:
        """One line: what the index's vectors are (for messages)."""
        feats = self.features
        what = "mirror-averaged " if feats["mirror"] else ""
        stages = features_text([n for n, _ in feats["stages"]])
        if self.space is None:
            return f"{what}backbone features{stages}, uncentred (an older index)"
        how = "whitened" if self.whitened else "centred"
        edges = f"; the edges {self.edges_share:.0%} of each score" if self.edges_share else ""
        return f"{what}backbone features{stages}, {how} on {self.space.source}{edges}"

    @property
    def edges_share(self) -> float | None:
        """The share of each score that is the photos' edge layout (:mod:`moco.edges`): its features take it after
        a run from scratch on few photos, a model too weak to trust alone; None where they do not."""
        return EDGE_WEIGHT if any(name == EDGES for name, _ in self.features["stages"]) else None

    @property
    def dedup_threshold(self) -> float:
        """The near-duplicate threshold for this index's scores (:func:`index.calibrate.dedup_threshold`)."""
        return dedup_threshold(self)

    @property
    def dedup_last(self) -> dict[str, Any] | None:
        """The last search for duplicates (``moco index dedup``, the page): its near and similar thresholds, the rule
        that set the near one (``calibrated``, ``default``, ``crowd`` or ``given``), the crowd level, the copy score of
        the pixel check with the pairs it was given and those of the model it turned down, when, and how many groups;
        None before a first one."""
        try:
            value = json.loads(self.catalog.get_meta(DEDUP_LAST_KEY) or "null")
        except ValueError:
            return None
        if not isinstance(value, dict):
            return None
        return {k: value.get(k) for k in ("threshold", "rule", "similar_threshold", "crowd_level", "kinds",
                                          "copy_score", "proposed", "turned_down", "groups", "created")}

    @property
    def augment_level(self) -> dict[str, Any] | None:
        """How close two "v2" training views of one photo score (centred cosine): ``{"median", "p10", "pairs",
        "recipe", "space"}``, measured at build time on a sample of the collection; None for an older index."""
        value = self.meta.get("augment_level")
        return dict(value) if isinstance(value, dict) and "median" in value else None

    def to_space(self, vectors: np.ndarray) -> np.ndarray:
        """Features (Q x D, L2-normalized: what :meth:`load_embedder` embeds) in the space of ``index.faiss``:
        ``normalize((f - mean) @ matrix)``, the matrix where the space whitens."""
        v = np.ascontiguousarray(np.atleast_2d(vectors), np.float32)  # Q x D
        return v if self.space is None else self.space(v)

    def center(self, vectors: np.ndarray) -> np.ndarray:
        """Deprecated name of :meth:`to_space` (which also whitens where the index's space does)."""
        warnings.warn("ImageIndex.center is now ImageIndex.to_space: it maps into the index's space, which may "
                      "whiten as well as centre", DeprecationWarning, stacklevel=2)
        return self.to_space(vectors)

    def thumb_path(self, row: Row) -> Path | None:
        """Absolute path of a row's thumbnail (inside ``thumbs/``), when it has one."""
        return (self.dir / row.thumb) if row.thumb else None

    def check_backbone(self, sha256: str) -> None:
        """Refuse vectors from another backbone than the one the index was built with."""
        if sha256 and sha256 != self.meta["backbone_sha256"]:
            raise UserError(
                f"this index was built with backbone sha256 {self.meta['backbone_sha256'][:12]}... "
                f"({self.meta.get('backbone_path')}), the given backbone is {sha256[:12]}...: vectors from "
                f"different backbones are not comparable; rebuild with `moco index build {self.root} "
                f"--backbone NEW.safetensors -o {self.dir}`"
            )

    def check_embedder(self, embedder: Any) -> None:
        """Refuse an Embedder whose vectors are not what this index takes (another backbone, other features, or
        vectors already in some space): the message names both."""
        self.check_backbone(embedder.sha256)
        feats = self.features
        want = (bool(feats["mirror"]), [[str(n), int(c)] for n, c in feats["stages"]])
        have = (bool(embedder.mirror), [[str(n), int(c)] for n, c in embedder.stages])
        if embedder.space is not None or want != have:
            d = embedder.describe()
            theirs = (f"{'mirror-averaged ' if d['mirror'] else ''}features"
                      + (f" with the pooled {'/'.join(n for n, _ in d['stages'])}" if d["stages"] else "")
                      + (f", already {'whitened' if d['whitened'] else 'centred'} on {d['fitted_on']}"
                         if embedder.space is not None else ""))
            raise UserError(f"{self.dir} searches in its own space ({self.describe_space()}) and takes the "
                            f"backbone's features as its embedder makes them; this embedder gives {theirs}: the two "
                            f"spaces do not mix. Use ImageIndex.load_embedder() (or "
                            f"Embedder.load(B, space='{self.dir}') for vectors already in the index's space)")

    def load_embedder(self, backbone: str | Path | None = None, device: str = "auto") -> Any:
        """The Embedder of this index (its features, what :meth:`search` takes): ``backbone`` or the file recorded at
        build time, sha-checked."""
        from moco.embed import Embedder

        path = Path(backbone or self.meta["backbone_path"])
        if not path.is_file():
            raise UserError(f"backbone {path} not found: pass --backbone with the file this index was built with")
        emb = Embedder.load(path, device=device, space="features")
        self.check_backbone(emb.sha256)
        if self.meta.get("vectors") != VECTORS and (emb.mirror or emb.stages or emb.config.whitening):
            raise UserError(f"{self.dir} was built by an older version that stored the backbone's whitened output: "
                            f"run `moco index update {self.dir}` once (it embeds the photos again)")
        self.check_embedder(emb)
        return emb

    # ---------------------------------------------------------------------------------- search
    def search(self, vectors: np.ndarray, k: int = 10, folder: str | None = None, offset: int = 0,
               exclude_folders: Sequence[str] = (),
               taken: tuple[float | None, float | None] = (None, None), centred: bool = False,
               exclude_ids: Collection[int] = (), deduplicate: bool = False,
               exclude_each: Sequence[Collection[int]] = (), refresh: bool = True) -> SearchResult:
        """Top-``k`` (after skipping ``offset``) by cosine for each row of ``vectors`` (Q x D); ``k`` is capped at
        the number of vectors in the index.

        ``vectors`` are features (what :meth:`load_embedder` embeds), mapped into the index's space by
        :meth:`to_space`; ``centred``: they are already in it (:meth:`query_vector`'s, or a raw query vector), searched
        as they are. ``folder``: only files under this sub-folder of the collection root; ``exclude_folders``: none
        under these; ``taken``: only photos taken in this range (:func:`row_filter`); ``exclude_ids``: never these
        photos (the query's own); ``exclude_each``: one collection of ids per row of ``vectors``, never that row's
        results (a batch of queries, each leaving out its own photo); ``deduplicate``: no result within the
        near-copy threshold (:attr:`dedup_threshold`) of a better-ranked result kept (photos left out hide nothing).
        The filters apply before ``k`` and ``offset``: a page holds ``k`` photos that pass them (fewer only at the
        end). Ids the catalog no longer lists (deleted since the index file was written) are skipped. ``refresh``:
        reload first if ``moco index update`` replaced the files (False: the caller has just done so).
        """
        if refresh:
            self.refresh()
        q = np.ascontiguousarray(np.atleast_2d(vectors), np.float32)  # Q x D
        if q.shape[1] != self.dim:
            raise UserError(f"vectors have dimension {q.shape[1]}, this index holds {self.dim}: embed with "
                            f"the index's backbone ({self.meta.get('backbone_path')})")
        if not centred:
            q = self.to_space(q)  # Q x D, as the stored vectors
        if exclude_each and len(exclude_each) != len(q):
            raise ValueError(f"exclude_each has {len(exclude_each)} collections of ids for {len(q)} query vectors: "
                             "give one per query (empty for none)")
        skip = {int(i) for i in exclude_ids}
        skips = [skip | {int(i) for i in own} for own in exclude_each] if exclude_each else [skip] * len(q)
        near = self.dedup_threshold if deduplicate else None
        ntotal = self.store.ntotal
        k = min(k, ntotal)  # never more results than vectors: a huge k allocates nothing more
        want = offset + k
        keeps = row_filter(folder, exclude_folders, taken)
        out_ids = np.full((len(q), k), -1, np.int64)
        out_scores = np.full((len(q), k), np.nan, np.float32)
        out_paths: list[list[str]] = []
        out_rows: list[list[Row]] = []
        fetch = min(ntotal, want + 16)
        todo = list(range(len(q)))
        found: dict[int, list[tuple[int, float, Row]]] = {}
        while todo and fetch > 0:
            scores, ids = self.store.search(q[todo], fetch)  # T x fetch
            rows = self.catalog.rows_by_id(np.unique(ids[ids >= 0]))
            again = []
            for t, i in enumerate(todo):
                keep = [(int(j), float(s), rows[int(j)]) for j, s in zip(ids[t], scores[t]) if j >= 0
                        and int(j) in rows and int(j) not in skips[i] and (keeps is None or keeps(rows[int(j)]))]
                if near is not None:
                    keep = self._distinct(keep, near, want)
                found[i] = keep
                if len(keep) < want and fetch < ntotal:
                    again.append(i)
            todo = again
            fetch = min(ntotal, fetch * 4)
        for i in range(len(q)):
            hits = found.get(i, [])[offset:want]
            for r, (j, s, _) in enumerate(hits):
                out_ids[i, r], out_scores[i, r] = j, s
            out_paths.append([row.path for _, _, row in hits])
            out_rows.append([row for _, _, row in hits])
        return SearchResult(out_ids, out_scores, out_paths, out_rows)

    def _distinct(self, hits: list[tuple[int, float, Row]], near: float,
                  want: int) -> list[tuple[int, float, Row]]:
        """``hits`` (best first) less every one within ``near`` (centred cosine) of a better one kept, up to ``want``
        of them kept."""
        if not hits:
            return hits
        x = self.to_space(self.vectors(np.array([j for j, _, _ in hits], np.int64)))  # H x D, as stored
        kept: list[int] = []
        for n in range(len(hits)):
            if not kept or float((x[kept] @ x[n]).max()) < near:
                kept.append(n)
                if len(kept) == want:
                    break
        return [hits[n] for n in kept]

    def query_vector(self, positives: np.ndarray, negatives: np.ndarray | None = None, rule: str = RULE,
                     seed: int = 0) -> np.ndarray:
        """One query (D, in the index's space: what :meth:`search` takes with ``centred=True``) from the features of
        ``positives`` (P x D) and ``negatives`` (N x D or None), each mapped by :meth:`to_space` as one photo's query
        is, then combined by :func:`index.search.query.combine` (``rule``; the logistic rule's background: a seeded
        sample of the collection). One positive alone gives exactly the vector a search with that photo uses."""
        pos = self.to_space(np.atleast_2d(positives))  # P x D
        neg = None if negatives is None or len(negatives) == 0 else self.to_space(np.atleast_2d(negatives))  # N x D
        background = None
        if rule == "logistic":
            picked = sample_ids(self.catalog.ok_ids(), BACKGROUND, np.random.default_rng(seed))  # B
            background = self.to_space(self.vectors(picked)) if len(picked) else None  # B x D
        return combine(pos, neg, rule, background=background)

    def ids_of_files(self, hashes: Collection[str]) -> list[int]:
        """Ids of the indexed photos whose bytes have one of these content hashes (blake2b-128 hex, as
        :func:`index.building.plan.file_hash`): an uploaded query that is a photo of the collection."""
        return self.catalog.ids_with_hashes(hashes)

    def search_image(self, image: Any, embedder: Any, k: int = 10, folder: str | None = None,
                     offset: int = 0, exclude_folders: Sequence[str] = (),
                     taken: tuple[float | None, float | None] = (None, None),
                     exclude_ids: Collection[int] = ()) -> SearchResult:
        """:meth:`search` with one image (a path, a PIL image or an H x W x 3 uint8 array) embedded by ``embedder``
        (:meth:`load_embedder`); an image too small to search with is refused, as at every door
        (:func:`check_query_size`); ``exclude_ids``: never these photos (the doors leave out the indexed files with
        the image's very bytes: :meth:`ids_of_files`)."""
        size = query_size(image)
        if size is not None:
            check_query_size(*size)
        return self.search(embedder.embed(image), k=k, folder=folder, offset=offset,
                           exclude_folders=exclude_folders, taken=taken, exclude_ids=exclude_ids)

    def browse(self, folder: str | None = None, among: Collection[int] | None = None, sort: str = "name",
               offset: int = 0, limit: int = 60) -> tuple[list[Row], int]:
        """A page of the collection's photos (live, indexed without error) and how many there are: under
        ``folder`` (the rule of :meth:`search`'s: :func:`row_filter`), among the photo ids ``among`` (None: all; a
        theme's members: :func:`index.overview.documents.browse_photos` browses by theme), by ``sort``: ``"name"``
        (the path), ``"date"`` (taken, oldest first) or ``"-date"`` (newest first); photos without a date come last,
        ties go by path."""
        if sort not in BROWSE_SORTS:
            raise UserError(f"sort {sort!r}: choose among {', '.join(BROWSE_SORTS)}")
        self.refresh()
        ids, paths, taken = self.catalog.entries()  # N, N, N
        keep = np.ones(len(ids), bool)  # N
        if folder and folder.strip("/"):
            prefix = folder.strip("/") + "/"  # the prefix of row_filter
            keep &= np.array([p.startswith(prefix) for p in paths], bool)
        if among is not None:
            keep &= np.isin(ids, np.asarray(list(among), np.int64))
        at = np.flatnonzero(keep)
        by_path = np.array(sorted(at.tolist(), key=lambda i: paths[i]), np.int64)  # ties of dates go by path
        if sort == "name":
            order = by_path
        else:
            t = taken[by_path]
            known = ~np.isnan(t)
            dated = by_path[known][np.argsort(t[known] if sort == "date" else -t[known], kind="stable")]
            order = np.concatenate([dated, by_path[~known]])
        offset, limit = max(0, int(offset)), max(0, int(limit))
        page = ids[order[offset : offset + limit]]
        rows = self.catalog.rows_by_id(page)
        return [rows[int(i)] for i in page if int(i) in rows], len(order)

    def embed_queries(self, images: Sequence[Any], embedder: Any) -> np.ndarray:
        """Features (N x D: what :meth:`search` and :meth:`query_vector` take) of query images (paths, PIL images or
        H x W x 3 uint8 arrays), each refused as at every door when too small (:func:`check_query_size`)."""
        for image in images:
            size = query_size(image)
            if size is not None:
                check_query_size(*size)
        return np.asarray(embedder.embed(list(images)), np.float32)  # N x D

    def vectors(self, ids: np.ndarray) -> np.ndarray:
        """Stored raw vectors (len(ids) x D, uncentred: what :meth:`search` takes) in the order of ``ids``."""
        got_ids, vecs = self.catalog.vectors(ids, self.dim)
        pos = {int(i): n for n, i in enumerate(got_ids)}
        missing = [int(i) for i in ids if int(i) not in pos]
        if missing:
            raise KeyError(f"ids not in the catalog: {missing[:5]}")
        return vecs[[pos[int(i)] for i in ids]]

    def stats(self) -> dict[str, Any]:
        """Counts, kind, recall, backbone, size on disk, the centring (mean count, weak-match threshold), the
        augmentation level and the near-duplicate threshold with where it comes from (and its calibration), and the
        thresholds of the last search for duplicates with the rule that set them (``dedup_last``)."""

        counts = self.catalog.counts()
        size = sum(f.stat().st_size for f in self.dir.rglob("*") if f.is_file())
        return {
            "index": str(self.dir), "root": str(self.root), "vectors": self.store.ntotal, **counts,
            "kind": self.store.kind, "factory": self.meta.get("factory"), "params": self.meta.get("params"),
            "recall_at_10": self.meta.get("recall_at_10"), "dim": self.dim, "on_gpu": self.store.on_gpu,
            "backbone_path": self.meta.get("backbone_path"), "backbone_sha256": self.meta.get("backbone_sha256"),
            "backbone_arch": self.meta.get("backbone", {}).get("arch"), "size_on_disk_bytes": size,
            "updated": self.meta.get("updated"), "read_only": self.catalog.read_only,
            "centred": self.mean is not None, "mean_count": self.meta.get("mean_count"),
            "weak_below": self.weak_below, "augment_level": self.augment_level, "whitened": self.whitened,
            "dedup_threshold": self.dedup_threshold, "dedup_threshold_source": threshold_source(self),
            "dedup_calibration": self.meta.get("dedup_calibration"), "dedup_last": self.dedup_last,
            "space": self.meta.get("space"),
            "features": self.features, "space_description": self.describe_space(),
            "exclude": json.loads(self.catalog.get_meta("exclude") or "[]"),
        }
