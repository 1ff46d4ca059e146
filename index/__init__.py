"""index: a FAISS index over a photo collection, kept in step with the folder.

    from index import ImageIndex, build_index, update_index
    build_index("~/Pictures", "backbone.safetensors", "my_index")
    idx = ImageIndex.open("my_index")
    hits = idx.search(vectors, k=10)        # hits.ids, hits.scores, hits.paths
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what editors and type checkers see; at run time __getattr__ imports each name when first used
    from index.build import build_index, update_index
    from index.dedup import find_duplicates
    from index.image_index import ImageIndex, SearchResult
    from index.store import VectorStore

__all__ = ["ImageIndex", "SearchResult", "build_index", "update_index", "find_duplicates", "VectorStore"]

_WHERE = {
    "ImageIndex": "index.image_index", "SearchResult": "index.image_index", "build_index": "index.build",
    "update_index": "index.build", "find_duplicates": "index.dedup", "VectorStore": "index.store",
}  # fmt: skip


def __getattr__(name: str) -> Any:  # lazy: `import index` stays cheap (no faiss/torch until used)
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'index' has no attribute {name!r}")
