"""The collection a server serves, the same for the page and the JSON API: the index and its embedder once attached,
what a search checks (:class:`app.search.scope.Searcher`), the review of duplicates
(:class:`app.collection.review.DuplicateReview`) and an indexed photo's original, opened under one rule.

A :class:`Library` can start without an index (``moco run`` serves the page and the API while training and indexing
still run): every request then says the index is not ready, and :meth:`Library.use` (or :meth:`Library.attach`)
turns search on. The page's :class:`app.page.handlers.SearchApp` is a Library with the page's own concerns added.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, BinaryIO

from app.collection.review import DuplicateReview
from app.search.scope import Searcher
from index.catalog import Row, display_path
from index.search.image_index import ImageIndex
from moco.data.photos import open_regular
from moco.errors import UserError

__all__ = ["Library", "MAX_ORIGINAL_BYTES", "size_text"]

logger = logging.getLogger(__name__)

MAX_ORIGINAL_BYTES = 64 * 1024 * 1024  # "Open original" (the page) and /photos/{id}/original (the API) serve up to this


def size_text(n: int) -> str:
    """A file's size for people: "3.2 MB", "41 kB"."""
    return f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.0f} kB"


class Library:
    """One collection, served by the page and the API alike.

    Args:
        index: the opened index; None: served before the index exists (see :meth:`use`).
        embedder: the index's Embedder (``index.load_embedder()``).
        status: a :class:`app.run.status.RunStatus` whose stage the not-ready message names while ``moco run`` works.
    """

    def __init__(self, index: ImageIndex | None = None, embedder: Any = None, status: Any = None) -> None:
        self.status = status
        self.index: ImageIndex | None = None
        self.embedder: Any = None
        self.searcher = Searcher(self.ready_index, lambda: self.embedder)  # every search's checks, and the search
        self.duplicates = DuplicateReview(self.ready_index)  # the page's Collection tab's review, and the API's
        if index is not None:
            self.use(index, embedder)

    def use(self, index: ImageIndex, embedder: Any) -> None:
        """Serve ``index`` (opened) with ``embedder`` (checked against it): search turns on."""
        index.check_embedder(embedder)
        self.embedder, self.index = embedder, index  # last: `ready` turns true only with everything in place

    def attach(self, index_dir: str | Path, backbone: str | Path | None = None, *, device: str = "auto") -> None:
        """Open the index (built meanwhile), load its backbone and turn search on."""
        index = ImageIndex.open(index_dir)
        self.use(index, index.load_embedder(backbone, device=device))

    @property
    def ready(self) -> bool:
        """True once an index is attached: search works."""
        return self.index is not None

    def ready_index(self) -> ImageIndex:
        """The index searched, or a UserError saying it is not ready yet (``moco run`` still preparing it)."""
        if self.index is None:
            stage = self.status.snapshot()["stage"] if self.status is not None else "starting"
            raise UserError(f"the index is not ready yet ({stage}): search turns on by itself when it is; the Status "
                            "tab shows the progress")
        return self.index

    def folders(self) -> list[str]:
        """Sub-folders of the collection (two levels), for the filters; none before the index is ready."""
        return [] if self.index is None else self.searcher.folders()

    def indexed(self, image_id: int) -> Row | None:
        """Photo ``image_id``'s catalog row when it is an indexed photo (not deleted, read), else None."""
        row = self.ready_index().catalog.rows_by_id([int(image_id)]).get(int(image_id))
        return None if row is None or row.deleted or row.status != "ok" else row

    def open_original(self, image_id: int) -> tuple[BinaryIO, int, str]:
        """An indexed photo's original file, opened: (file, size in bytes, its name); the caller closes the file.

        Only files of the index, inside its root, regular and at most MAX_ORIGINAL_BYTES are opened (the file is
        checked once open, so what is served is what was checked). The JSON API streams it from there; the page
        hands a copy of it to the browser.
        """
        index = self.ready_index()
        row = self.indexed(image_id)
        if row is None:
            raise UserError(f"photo id {image_id} is not an indexed photo: search again")
        root = index.root.resolve()
        source = index.root / row.path
        if root not in source.resolve().parents:
            raise UserError(f"{display_path(row.path)} links outside the collection ({display_path(str(root))}): "
                            "not served")
        try:
            f = open_regular(source)
        except OSError as e:
            raise UserError(f"{display_path(row.path)} cannot be read now ({e.strerror or e}): run "
                            "`moco index update`") from None
        size = os.fstat(f.fileno()).st_size
        if size > MAX_ORIGINAL_BYTES:
            f.close()
            raise UserError(f"{display_path(row.path)} is {size_text(size)}, over the {size_text(MAX_ORIGINAL_BYTES)} "
                            "served by the page: open it from its folder")
        return f, size, Path(row.path).name.encode("utf-8", "replace").decode() or "photo"
