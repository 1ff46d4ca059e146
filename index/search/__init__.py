"""index.search: an index directory's files and the search over them.

    from index.search import ImageIndex
    idx = ImageIndex.open("my_index")
    hits = idx.search(vectors, k=10)        # hits.ids, hits.scores, hits.paths

Rooms: ``trailer`` (the space and index id written after the FAISS bytes), ``store`` (the FAISS index: kinds,
tuning, exact search of a few queries), ``index_dir`` (the files of an index directory and its ``index.json``),
``query`` (one query from several photos; the size a query photo needs) and ``image_index`` (:class:`ImageIndex`:
an index opened, searched by vector or by image, browsed).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from moco._lazy import lazy_face

if TYPE_CHECKING:  # what editors and type checkers see; at run time each name is imported when first used
    from index.search.image_index import ImageIndex as ImageIndex
    from index.search.image_index import SearchResult as SearchResult
    from index.search.image_index import row_filter as row_filter
    from index.search.index_dir import read_meta as read_meta
    from index.search.query import check_query_size as check_query_size
    from index.search.query import combine as combine
    from index.search.store import VectorStore as VectorStore

__all__, __getattr__, __dir__ = lazy_face(__name__, {
    "ImageIndex": "image_index", "SearchResult": "image_index", "row_filter": "image_index", "read_meta": "index_dir",
    "combine": "query", "check_query_size": "query", "VectorStore": "store",
})
