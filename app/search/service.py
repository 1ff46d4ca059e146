"""Searches that arrive together share the model: the page's Search and the JSON API's searches alike.

Every search is checked once, before it joins a batch (:meth:`SearchService.check`: a :class:`~app.search.scope.Scope`,
or the error naming the value, that request's alone). Uploads are decoded in a small thread pool, then embedded and
searched in batches (:mod:`app.search.batcher`); past ``max_pending`` requests in flight one more gets
:class:`~app.search.batcher.Overloaded` (the API's 503 with ``Retry-After``). Each search leaves its own query photos
out of its results (an upload's byte-identical indexed files, the photo searched by id), even in a batch. A search's
answer is a :class:`Found` (its rows of the index's :class:`~index.search.image_index.SearchResult`): the API writes it
as
JSON; the page's Search takes the upload's embedding (:meth:`SearchService.embed_upload`) and shows its own results.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import shutil
import tempfile
import time
import weakref
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from app.search.batcher import Batcher
from app.search.scope import Scope, Searcher
from app.search.uploads import read_upload, upload_suffix
from index.search.image_index import SearchResult
from moco.errors import NotFoundError, UserError, quoted

__all__ = ["SearchService", "Found", "Several", "NotFound", "NotReady", "DECODE_WORKERS"]

DECODE_WORKERS = 2  # uploads decoded at once (the rest wait for a thread; all count against max_pending)


class NotFound(NotFoundError):
    """A photo id the index does not hold (the API's 404)."""


class NotReady(UserError):
    """The index is not there yet (``moco run`` still training or indexing; the API's 503)."""


@dataclass(frozen=True)
class Found:
    """One search's answer: query ``n`` of ``hits``, within ``scope`` from ``offset``; ``left_out``: the indexed
    photos the query left out (its own), which no page of results holds; ``took_ms``: the request's time."""

    hits: SearchResult
    n: int
    scope: Scope
    offset: int
    left_out: int = 0
    took_ms: float = 0.0

    @property
    def last(self) -> bool:
        """Whether no page of results follows this one."""
        got = len(self.hits.rows[self.n])
        return got < self.scope.k or self.offset + got >= len(self.scope.index) - self.left_out


@dataclass
class Several:
    """A search with several photos: uploads (bytes and a name for messages) and indexed photos' ids to be like,
    others to be less like; or a vector of the index's space instead of photos."""

    images: list[tuple[bytes, str]] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    not_images: list[tuple[bytes, str]] = field(default_factory=list)
    not_ids: list[int] = field(default_factory=list)
    vector: np.ndarray | None = None  # D, in the index's space


@dataclass
class _Several:
    """A :class:`Several` ready for its batch: decoded images, and the query photos to leave out."""

    images: list[Any]
    ids: list[int]
    not_images: list[Any]
    not_ids: list[int]
    vector: np.ndarray | None
    exclude_ids: list[int]


@dataclass
class _Query:
    scope: Scope
    offset: int = 0
    image: Any = None  # a decoded PIL image, or ...
    image_id: int | None = None  # ... an indexed photo's id, or ...
    several: _Several | None = None  # ... several photos
    embed_only: bool = False  # the page's Search: its upload's embedding is the answer
    deduplicate: bool = False
    exclude_ids: tuple[int, ...] = ()  # the query photo, left out: its id, or the indexed files with an upload's bytes


class SearchService:
    """Batched searches of one :class:`~app.search.scope.Searcher`: a decode pool and a batcher around its model and
    index (``window_ms``, ``max_batch``, ``max_pending``: :class:`~app.search.batcher.Batcher`'s)."""

    def __init__(self, searcher: Searcher, window_ms: float = 5.0, max_batch: int = 32, max_pending: int = 64) -> None:
        self.searcher = searcher
        self.batcher: Batcher[_Query, Any] = Batcher(self._batch, window_ms, max_batch, max_pending)
        self._decode = concurrent.futures.ThreadPoolExecutor(DECODE_WORKERS, thread_name_prefix="decode")
        self._tmp = Path(tempfile.mkdtemp(prefix="moco-api-"))  # uploads on their way to the decoder (0700)
        self._remove_tmp = weakref.finalize(self, shutil.rmtree, self._tmp, ignore_errors=True)

    def close(self) -> None:
        """Stop the worker threads and remove the uploads folder."""
        self.batcher.close()
        self._decode.shutdown(wait=False, cancel_futures=True)
        self._remove_tmp()

    def ready(self) -> None:
        """Nothing, or :class:`NotReady` while there is no index yet."""
        try:
            self.searcher.ready_index()
        except UserError as e:
            raise NotReady(str(e)) from None

    def check(self, k: int, folder: str | None = None, exclude_folders: tuple[str, ...] = (),
              taken_from: str | None = None, taken_to: str | None = None) -> Scope:
        """A search's values checked before it joins a batch (:meth:`Searcher.check`: its 400, or
        :class:`~app.search.scope.NoSuchFolder`'s 404), so that a batch holds only requests that can be answered."""
        self.ready()
        return self.searcher.check(k, folder, exclude_folders, taken_from, taken_to)

    def _read(self, data: bytes, name: str) -> Any:
        """Decode an upload with the page's decoder (the same caps and messages): through a file, as Gradio does.

        The file is named by us (``upload`` and the name's suffix when it is a plain one), never by the client: a
        name too long for the file system, or one that means something to it, never reaches it."""
        folder = Path(tempfile.mkdtemp(dir=self._tmp))
        try:
            path = folder / ("upload" + upload_suffix(name))
            path.write_bytes(data)
            return read_upload(str(path), self._embedder().resize, name=name)
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def _embedder(self) -> Any:
        return self.searcher.embedder()

    def _twins(self, uploads: list[bytes]) -> tuple[int, ...]:
        """Ids of the indexed photos with one of these uploads' very bytes: the query photos themselves."""
        return tuple(self.searcher.twins(data=uploads))

    async def search_image(self, data: bytes, name: str, scope: Scope, offset: int = 0, deduplicate: bool = False,
                           include_queries: bool = False) -> Found:
        """An uploaded image's results (decoded in the pool, embedded and searched in a batch); the indexed files
        with its very bytes left out unless ``include_queries``."""
        t0 = time.perf_counter()
        async with self.batcher.admit():
            loop = asyncio.get_running_loop()
            image = await loop.run_in_executor(self._decode, self._read, data, name)
            skip = () if include_queries else await loop.run_in_executor(self._decode, self._twins, [data])
            out = await self.batcher.submit(_Query(scope, offset, image=image, deduplicate=deduplicate,
                                                   exclude_ids=skip))
        return replace(out, took_ms=(time.perf_counter() - t0) * 1000)

    async def search_several(self, query: Several, scope: Scope, offset: int = 0, deduplicate: bool = False,
                             include_queries: bool = False) -> Found:
        """A search with several photos: every field checked before it joins a batch (a bad one is this request's
        400 or 404 alone), the images decoded in the pool, then embedded in a batch and combined into one query of
        the index's space (:meth:`ImageIndex.query_vector`)."""
        if query.vector is not None and (query.images or query.ids or query.not_images or query.not_ids):
            raise UserError("vector is a whole query: send it without images, ids, not_images or not_ids")
        if query.vector is None and not (query.images or query.ids):
            raise UserError("a search needs a photo to search with: images (base64) or ids of indexed photos (or a "
                            "vector)")
        for i in (*query.ids, *query.not_ids):
            self.vector(i)  # an unknown id: its 404 now
        t0 = time.perf_counter()
        loop = asyncio.get_running_loop()
        async with self.batcher.admit():
            decoded = {side: [await loop.run_in_executor(self._decode, self._read, b, name) for b, name in items]
                       for side, items in (("images", query.images), ("not_images", query.not_images))}
            skip: list[int] = []  # the query photos (one image alone as several), unless include_queries
            if not include_queries:
                uploads = [b for b, _ in (*query.images, *query.not_images)]
                skip = [*query.ids, *query.not_ids, *(await loop.run_in_executor(self._decode, self._twins, uploads)
                                                      if uploads else ())]
            several = _Several(decoded["images"], list(query.ids), decoded["not_images"], list(query.not_ids),
                               query.vector, skip)
            out = await self.batcher.submit(_Query(scope, offset, several=several, deduplicate=deduplicate))
        return replace(out, took_ms=(time.perf_counter() - t0) * 1000)

    async def embed_upload(self, image: Any, scope: Scope) -> tuple[np.ndarray, float, list[int]]:
        """The page's Search (an upload Gradio saved, checked as ``scope``): its embedding (D, computed in a batch
        with whatever else arrives, the page's and the API's alike), the batch's embedding time (ms) and the indexed
        photos with the upload's very bytes."""
        async with self.batcher.admit():
            loop = asyncio.get_running_loop()
            decoded = await loop.run_in_executor(self._decode, read_upload, image, self._embedder().resize)
            twins = await loop.run_in_executor(self._decode, self.searcher.twins, [image])
            vector, embed_ms = await self.batcher.submit(_Query(scope, image=decoded, embed_only=True))
        return vector, embed_ms, twins

    async def embed_image(self, data: bytes, name: str) -> tuple[np.ndarray, float]:
        """An uploaded image's vector in the index's space (D: what ``Embedder.load(B, space=IDX)`` gives, and what a
        search with it uses), embedded in a batch with the searches, and the time in the server (ms)."""
        scope = self.check(1)
        t0 = time.perf_counter()
        async with self.batcher.admit():
            loop = asyncio.get_running_loop()
            image = await loop.run_in_executor(self._decode, self._read, data, name)
            vector, _ = await self.batcher.submit(_Query(scope, image=image, embed_only=True))  # D: the model's
        return scope.index.to_space(vector[None])[0], (time.perf_counter() - t0) * 1000  # D: the index's space

    async def search_id(self, image_id: int, scope: Scope, offset: int = 0, deduplicate: bool = False,
                        include_queries: bool = False) -> Found:
        """An indexed photo's results, from its stored vector (nothing decoded or embedded); the photo itself left
        out unless ``include_queries``."""
        self.vector(image_id)  # an unknown id: its 404 now, before it joins a batch
        t0 = time.perf_counter()
        async with self.batcher.admit():
            out = await self.batcher.submit(_Query(scope, offset, image_id=image_id, deduplicate=deduplicate,
                                                   exclude_ids=() if include_queries else (int(image_id),)))
        return replace(out, took_ms=(time.perf_counter() - t0) * 1000)

    def vector(self, image_id: int) -> np.ndarray:
        """An indexed photo's stored vector (D), or :class:`NotFound`."""
        index = self.searcher.ready_index()
        row = index.catalog.rows_by_id([int(image_id)]).get(int(image_id))
        if row is None or row.deleted or row.status != "ok":
            raise NotFound(f"photo id {quoted(image_id)} is not an indexed photo: search again for current ids")
        try:
            return index.vectors(np.array([int(image_id)], np.int64))[0]  # D
        except KeyError:  # removed since its row was read
            raise NotFound(f"photo id {image_id} has no vector: search again for current ids") from None

    def _batch(self, queries: list[_Query]) -> list[Any]:
        """One batch (in the batcher's thread): embed every upload in one call, then one search per (scope, offset,
        deduplicate) group, each query leaving out its own photos."""
        out: list[Any] = [None] * len(queries)
        vectors: list[np.ndarray | None] = [None] * len(queries)
        uploads = [i for i, q in enumerate(queries) if q.image is not None]
        images = [queries[i].image for i in uploads]
        for q in queries:
            if q.several is not None:
                images += q.several.images + q.several.not_images
        t0 = time.perf_counter()
        embedded = self._embedder().embed(images) if images else np.zeros((0, 0), np.float32)  # B x D
        for i, v in zip(uploads, embedded):
            vectors[i] = v
        embed_ms = (time.perf_counter() - t0) * 1000
        at = len(uploads)
        for i, q in enumerate(queries):
            if q.several is not None:
                n_pos, n_neg = len(q.several.images), len(q.several.not_images)
                pos, neg = embedded[at : at + n_pos], embedded[at + n_pos : at + n_pos + n_neg]  # P x D, N x D
                at += n_pos + n_neg
                out[i] = self._several(q, pos, neg)
            elif q.embed_only:
                out[i] = (vectors[i], embed_ms)
        for i, q in enumerate(queries):
            if q.image_id is not None:
                try:
                    vectors[i] = self.vector(q.image_id)
                except Exception as e:  # noqa: BLE001 - that search's own error (NotFound: its 404)
                    out[i] = e
        groups: dict[tuple[Scope, int, bool], list[int]] = {}
        for i, q in enumerate(queries):
            if out[i] is None:
                groups.setdefault((q.scope, q.offset, q.deduplicate), []).append(i)
        for (scope, offset, dedup), members in groups.items():
            try:
                hits = self.searcher.search(scope, np.stack([vectors[i] for i in members]), offset,  # Q x D
                                            deduplicate=dedup, exclude_each=[queries[i].exclude_ids for i in members])
                answers: list[Any] = [Found(hits, n, scope, offset, len(set(queries[i].exclude_ids)))
                                      for n, i in enumerate(members)]
            except Exception:  # noqa: BLE001 - one query may fail the group's search: each one alone, its own error
                answers = [self._alone(vectors[i], queries[i]) for i in members]  # type: ignore[arg-type]
            for i, r in zip(members, answers):
                out[i] = r
        return out

    def _several(self, q: _Query, pos: np.ndarray, neg: np.ndarray) -> Found | BaseException:
        """A search with several photos, from its images' features (``pos`` P x D, ``neg`` N x D, embedded in the
        batch): its answer, or its own error."""
        assert q.several is not None
        m = q.several
        try:
            index = q.scope.index
            if m.vector is not None:
                query = m.vector  # D, in the space already
            else:
                sides = [[x for x in (feats if len(feats) else None,
                                      index.vectors(np.array(ids, np.int64)) if ids else None) if x is not None]
                         for feats, ids in ((pos, m.ids), (neg, m.not_ids))]
                query = index.query_vector(np.concatenate(sides[0]),  # P x D: the images', then the ids'
                                           np.concatenate(sides[1]) if sides[1] else None)  # D
            hits = self.searcher.search(q.scope, query[None], q.offset, centred=True, exclude_ids=m.exclude_ids,
                                        deduplicate=q.deduplicate)
            return Found(hits, 0, q.scope, q.offset, len(set(m.exclude_ids)))
        except KeyError:  # an id removed since it was checked
            return NotFound("a photo of the query is no longer indexed: search again for current ids")
        except Exception as e:  # noqa: BLE001 - this request's caller gets it, no other
            return e

    def _alone(self, vector: np.ndarray, q: _Query) -> Found | BaseException:
        """One query's search by itself (its group's search failed): its answer, or its own error."""
        try:
            hits = self.searcher.search(q.scope, vector[None], q.offset, deduplicate=q.deduplicate,
                                        exclude_ids=q.exclude_ids)
            return Found(hits, 0, q.scope, q.offset, len(set(q.exclude_ids)))
        except Exception as e:  # noqa: BLE001 - this request's caller gets it, no other
            return e
