"""What every router of the JSON API serves from: the :class:`Api` (the collection's
:class:`~app.collection.library.Library`, the batched searches the page's Search shares, the gate of the views of the
whole collection, the settings), a search's :class:`Filters`, and how a catalog path reads in JSON."""

from __future__ import annotations

from dataclasses import dataclass

from app.api.gate import Gate
from app.collection.library import Library
from app.guard.access import ApiSettings
from app.search.scope import Scope
from app.search.service import SearchService
from index.catalog import display_path

__all__ = ["Api", "Filters", "json_path"]

VIEWS_RUNNING, VIEWS_WAITING = 1, 4  # views of the collection computed at once, and waiting (app/api/gate.py)


@dataclass(frozen=True)
class Filters:
    """What a search keeps, besides its ``k``: the folder, the folders left out, the dates taken (as given)."""

    folder: str = ""
    exclude_folders: tuple[str, ...] = ()
    taken_from: str = ""
    taken_to: str = ""

    def check(self, search: SearchService, k: int) -> Scope:
        """The search's :class:`~app.search.scope.Scope` (every value checked once: its 400, or a 404 for a folder
        the collection does not have)."""
        return search.check(k, self.folder, self.exclude_folders, self.taken_from, self.taken_to)


class Api:
    """What the routes serve: the collection (``library``: its index, groups of duplicates, originals), its searches
    (``search``, a :class:`~app.search.service.SearchService` the page's Search shares), the gate of the views of the
    whole collection (``views``) and the ``settings``."""

    def __init__(self, library: Library, settings: ApiSettings | None = None) -> None:
        self.library, self.settings = library, settings or ApiSettings()
        s = self.settings
        self.search = SearchService(library.searcher, s.window_ms, s.max_batch, s.max_pending)
        self.views = Gate(VIEWS_RUNNING, VIEWS_WAITING)  # the map, themes, unusual: one computed at a time

    def close(self) -> None:
        """Stop the worker threads and remove the uploads folder."""
        self.search.close()
        self.views.close()


def json_path(path: str) -> str:
    """A catalog path as JSON text: itself, or escaped as the page shows it when it is not valid UTF-8."""
    try:
        path.encode("utf-8")
        return path
    except UnicodeEncodeError:
        return display_path(path)
