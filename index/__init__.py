"""index: a FAISS index over a photo collection, kept in step with the folder.

    from index import ImageIndex, build_index, update_index
    build_index("~/Pictures", "backbone.safetensors", "my_index")
    idx = ImageIndex.open("my_index")
    hits = idx.search(vectors, k=10)        # hits.ids, hits.scores, hits.paths

Names are imported when first used: ``import index`` stays cheap (no faiss or torch until one is).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from moco._lazy import lazy_face

if TYPE_CHECKING:  # what editors and type checkers see; at run time each name is imported when first used
    from index.building.runner import build_index as build_index
    from index.building.runner import update_index as update_index
    from index.duplicates.dedup import find_duplicates as find_duplicates
    from index.search.image_index import ImageIndex as ImageIndex
    from index.search.image_index import SearchResult as SearchResult
    from index.search.store import VectorStore as VectorStore

__all__, __getattr__, __dir__ = lazy_face(__name__, {
    "ImageIndex": "search.image_index", "SearchResult": "search.image_index", "build_index": "building.runner",
    "update_index": "building.runner", "find_duplicates": "duplicates.dedup", "VectorStore": "search.store",
})
