"""The JSON API's review of duplicates: ``GET /duplicates`` (a page of the groups last saved), ``POST
/duplicates/{id}/keeper``, ``/duplicates/{id}/not-duplicates``, ``/duplicates/move`` and ``/duplicates/undo``, all
through :class:`app.collection.review.DuplicateReview`, the page's Collection tab's own."""

from __future__ import annotations

import functools

from fastapi import APIRouter, Query
from fastapi import Path as PathParam

from app.api.errors import guarded_route
from app.api.models import (
    Duplicates,
    Group,
    KeeperRequest,
    Kind,
    Member,
    MoveRequest,
    MoveResult,
    UndoRequest,
    json_path,
)
from app.api.state import Api, serve
from app.collection.review import MAX_PAGE
from app.guard.access import API_PREFIX
from app.search.service import NotFound
from index.catalog import date_text
from index.duplicates import groups
from index.search.image_index import ImageIndex
from moco.errors import UserError

__all__ = ["duplicates_router", "duplicates", "keeper", "not_duplicates", "move", "undo"]


def _group(index: ImageIndex, g: groups.Group) -> Group:
    """A group of the saved search as the API gives it."""

    def member(m: groups.Member) -> Member:
        return Member(id=m.id, path=json_path(m.path), score=float(m.similarity if m.similarity is not None else 1.0),
                      copy_score=m.copy_score, width=m.width, height=m.height, bytes=m.bytes,
                      taken=date_text(m.taken), mtime=m.mtime, identical=g.identical(m))

    rep, keep = g.member(g.representative.id if g.representative else None), g.keeper
    return Group(id=g.id, kind=g.kind, size=g.size, representative=member(rep) if rep else None,
                 keep=member(keep) if keep else None, reason=g.reason, members=[member(m) for m in g.members])


def duplicates(api: Api, offset: int = Query(0, ge=0), limit: int = Query(100, ge=1, le=MAX_PAGE),
               kind: list[Kind] = Query([], description="exact, near, similar (repeatable; none: those searched)",
                                        max_length=3)) -> Duplicates:
    """A page of the groups last saved by `moco index dedup` or the page's Collection tab: exact, then near, then
    similar groups, each kind largest first; `next_offset` for the next page."""
    api.search.ready()
    index = api.library.ready_index()
    try:
        page = api.library.duplicates.page(kind or None, offset, limit)
    except UserError as e:  # no search yet, or a damaged dedup.json: no groups to give (not the request's fault)
        raise NotFound(str(e)) from None
    search = page.search
    return Duplicates(threshold=float(search.threshold), similar_threshold=search.similar_threshold,
                      rule=search.rule, threshold_source=search.threshold_source,
                      created=search.created, total=page.total, offset=page.offset, limit=page.limit,
                      next_offset=page.next_offset, groups=[_group(index, g) for g in page.groups])


def keeper(api: Api, choice: KeeperRequest, group_id: str = PathParam(max_length=100)) -> Group:
    """Keep this photo of the group (now, and in later searches); the group as it is now."""
    api.search.ready()
    return _group(api.library.ready_index(), api.library.duplicates.keep(group_id, choice.photo_id))


def not_duplicates(api: Api, group_id: str = PathParam(max_length=100)) -> Group:
    """Its photos are never grouped again (the marks live in the catalog and survive index updates); the group
    leaves the saved search."""
    api.search.ready()
    return _group(api.library.ready_index(), api.library.duplicates.not_duplicates(group_id))


def move(api: Api, request: MoveRequest) -> MoveResult:
    """Move every photo of the groups named (or of every group of the kinds named) but its keeper into the
    collection's hidden `.moco-duplicates` folder, keeping its path (a taken name gets a suffix; nothing is
    deleted or overwritten), journalled; then the index is updated and the duplicates are searched again."""
    api.search.ready()
    out = api.library.duplicates.move(request.groups, request.kinds, request.keepers, request.dry_run)
    return MoveResult.model_validate(out.as_dict())


def undo(api: Api, request: UndoRequest) -> MoveResult:
    """Put back the photos moved by one action (`batch`), or every photo moved and not yet put back; then the
    index is updated."""
    api.search.ready()
    return MoveResult.model_validate(api.library.duplicates.undo(request.batch).as_dict())


def duplicates_router(api: Api) -> APIRouter:
    """The duplicates routes, answered from ``api``'s :class:`~app.collection.library.Library`'s review."""
    router = APIRouter(prefix=API_PREFIX, route_class=guarded_route(api.settings), tags=["search"])
    served = functools.partial(serve, router, api)
    served(duplicates, "/duplicates", "GET", response_model=Duplicates, summary="Groups of duplicates, a page")
    served(keeper, "/duplicates/{group_id}/keeper", "POST", response_model=Group,
           summary="Choose the photo a group keeps")
    served(not_duplicates, "/duplicates/{group_id}/not-duplicates", "POST", response_model=Group,
           summary="Say a group is not duplicates")
    served(move, "/duplicates/move", "POST", response_model=MoveResult, summary="Move the photos groups do not keep")
    served(undo, "/duplicates/undo", "POST", response_model=MoveResult, summary="Put moved photos back")
    return router
