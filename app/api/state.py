"""What every router of the JSON API serves from: the :class:`Api` (the collection's
:class:`~app.collection.library.Library`, the batched searches the page's Search shares, the gate of the views of the
whole collection, the settings), and how a route is put on a router (:func:`serve`)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter

from app.api.errors import ERRORS
from app.api.gate import Gate
from app.collection.library import Library
from app.guard.access import ApiSettings
from app.search.service import SearchService

__all__ = ["Api", "serve"]

VIEWS_RUNNING, VIEWS_WAITING = 1, 4  # views of the collection computed at once, and waiting (app/api/gate.py)


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


def serve(router: APIRouter, api: Api, endpoint: Callable[..., Any], path: str, method: str, **route: Any) -> None:
    """Put ``endpoint`` (a module's function of ``api`` first, then the request's fields) on ``router`` at ``path``
    for ``method``, answered from ``api``: its name and docstring as the route's, the rest of ``route``
    (``response_model``, ``summary``, ...) as :meth:`APIRouter.add_api_route` takes it, the errors of ``ERRORS``
    documented unless ``responses`` says otherwise."""
    route.setdefault("responses", ERRORS)
    router.add_api_route(path, functools.partial(endpoint, api), methods=[method], name=endpoint.__name__,
                         description=inspect.getdoc(endpoint) or "", **route)
