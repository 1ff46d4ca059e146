"""index.overview: views of the whole collection, computed from the index's own vectors and kept with its version.

    from index import ImageIndex
    from index.overview import collection_map, collection_themes, unusual_photos
    idx = ImageIndex.open("my_index")
    m = collection_map(idx)              # m.ids, m.xy (N x 2 in [0, 1]), m.theme
    themes = collection_themes(idx)      # themes.themes: [Theme(id, size, central, folders), ...]
    page, total = unusual_photos(idx)    # [(photo id, cosine to its closest other photo), ...], lowest first

Rooms: ``cache`` (the index's version, its vectors, the views' files), ``themes`` (spherical k-means),
``layout`` (the map), ``unusual`` (the photos farthest from any other), ``documents`` (the views as JSON documents;
a page of the collection by folder and theme: :func:`browse_photos`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from moco._lazy import lazy_face

if TYPE_CHECKING:  # what editors and type checkers see; at run time each name is imported when first used
    from index.overview.cache import index_version as index_version
    from index.overview.documents import browse_photos as browse_photos
    from index.overview.layout import CollectionMap as CollectionMap
    from index.overview.layout import collection_map as collection_map
    from index.overview.themes import Theme as Theme
    from index.overview.themes import Themes as Themes
    from index.overview.themes import collection_themes as collection_themes
    from index.overview.themes import theme_members as theme_members
    from index.overview.unusual import unusual_photos as unusual_photos

__all__, __getattr__, __dir__ = lazy_face(__name__, {
    "index_version": "cache", "CollectionMap": "layout", "collection_map": "layout", "Theme": "themes",
    "Themes": "themes", "collection_themes": "themes", "theme_members": "themes", "unusual_photos": "unusual",
    "browse_photos": "documents",
})
