"""The JSON API's request and response models: the OpenAPI schema and the docs page are generated from them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from app.search.scope import FOLDER_PATTERN, MAX_RESULTS
from index.catalog import date_text, display_path
from index.duplicates.groups import DEFAULT_KINDS, KINDS

if TYPE_CHECKING:
    from app.search.scope import Scope
    from app.search.service import Found, SearchService

__all__ = ["Filters", "json_path", "FOLDER_FIELD", "EXCLUDE_FIELD", "TAKEN_FROM_FIELD", "TAKEN_TO_FIELD", "IMAGE_TYPES",
           "BASE64_PATTERN",
           "Hit", "SearchResponse", "Base64Query", "QueryImage", "MultiQuery", "MAX_QUERY_PHOTOS", "Stats", "Member",
           "Group", "Duplicates", "Kind", "MAX_ID", "KeeperRequest", "MoveRequest", "UndoRequest", "DEDUPLICATE",
           "Moved",
           "NotMoved", "MoveResult", "ErrorResponse", "CollectionMap", "PhotoRef", "FolderCount", "ThemeCard",
           "ThemesResponse", "ThemePhoto", "ThemePage", "UnusualPhoto", "UnusualPage", "BrowsePhoto", "PhotosPage",
           "Sort", "INCLUDE_QUERIES"]


# The folder filter's field, everywhere: '' or a sub-folder written as FOLDER_PATTERN says (else 400; one that is
# not in the collection: 404). Only described in the schema: the page's own check answers, with the page's message.
FOLDER_FIELD = {"description": "only photos under this sub-folder of the collection ('': all); no `.` or `..` part, "
                "no control character", "json_schema_extra": {"pattern": FOLDER_PATTERN}}
# The folders left out, and the date range: the same checks as ``folder``; dates as the page and the CLI take them.
EXCLUDE_FIELD = {"description": "no photos under these sub-folders of the collection (repeat the field in a form or a "
                 "query string); each written as `folder`", "json_schema_extra": {"items": {"pattern": FOLDER_PATTERN}}}
_DATE = (r"^(\d{4}-\d{2}-\d{2}([T ]\d{2}:\d{2}(:\d{2})?)?)?$")
TAKEN_FROM_FIELD = {"description": "only photos taken on or after this day, `YYYY-MM-DD` (or `YYYY-MM-DDTHH:MM`), "
                    "on the camera's clock: EXIF DateTimeOriginal, else the file's date ('': no bound)",
                    "json_schema_extra": {"pattern": _DATE}}
TAKEN_TO_FIELD = {"description": "only photos taken on or before this day, `YYYY-MM-DD` (the whole day; or "
                  "`YYYY-MM-DDTHH:MM`, that moment excluded) ('': no bound)", "json_schema_extra": {"pattern": _DATE}}
IMAGE_TYPES = ("image/jpeg, image/png, image/webp, image/gif, image/bmp, image/tiff, image/avif, image/heic, "
               "image/heif")  # what an upload may be (HEIC with the heic extra)

DEDUPLICATE = ("hide a result within the index's near-copy threshold (`dedup_threshold` of /stats) of a better result "
               "kept (more are fetched, so a page still holds `k`)")

INCLUDE_QUERIES = ("keep the query photos among the results: the photo searched by id, and indexed files with an "
                   "uploaded image's very bytes (left out by default; a near-copy with other bytes is a result as any "
                   "other). With it a photo of the collection finds itself first")

# Padded standard base64 of at least one byte: what `image_base64` must be (anything else is a 400).
BASE64_PATTERN = r"^(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{4}|[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)$"


class Hit(BaseModel):
    """One result: the page's rank, id, path (relative to the collection root), score and weak-match flag."""

    rank: int = Field(description="1 for the best match; continues after `offset`")
    id: int = Field(description="the photo's id in the index (for /photos/{id}/...)")
    path: str = Field(description="the photo's path relative to the collection root")
    score: float = Field(description="centred cosine similarity in the index's space, as the page shows it")
    weak: bool = Field(description="under the collection's weak-match threshold: no close match")
    taken: str | None = Field(description="when the photo was taken, ISO 8601 on the camera's clock (no zone): EXIF "
                              "DateTimeOriginal, else the file's date; null until `moco index update` reads it")


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


class SearchResponse(BaseModel):
    """A page of results for one query."""

    results: list[Hit]
    k: int = Field(description=f"results asked for (capped at the index's size and at {MAX_RESULTS})")
    offset: int = Field(description="results skipped before the first one")
    folder: str | None = Field(description="the sub-folder searched, or null for the whole collection")
    exclude_folders: list[str] = Field(description="the sub-folders left out")
    taken_from: str | None = Field(description="the date range searched (null: no bound)")
    taken_to: str | None = Field(description="the date range searched (null: no bound)")
    next_offset: int | None = Field(description="`offset` of the next page, or null when this one was the last")
    weak_below: float | None = Field(description="scores under this are weak matches (null: an older index)")
    images: int = Field(description="photos in the index")
    took_ms: float = Field(description="time in the server, decoding and queueing included")

    @classmethod
    def of(cls, found: Found, filters: Filters) -> SearchResponse:
        """A search's answer (:class:`~app.search.service.Found`) as the API gives it, with the ``filters`` it
        kept as they were asked."""
        index, n = found.scope.index, found.n
        weak = index.weak_below
        hits = found.hits
        results = [Hit(rank=found.offset + r + 1, id=int(i), path=json_path(p), score=float(s),
                       weak=weak is not None and float(s) < weak, taken=date_text(row.date))
                   for r, (i, s, p, row) in enumerate(zip(hits.ids[n], hits.scores[n], hits.paths[n], hits.rows[n]))]
        return cls(results=results, k=found.scope.k, offset=found.offset, folder=filters.folder.strip("/") or None,
                   exclude_folders=[f.strip("/") for f in filters.exclude_folders if f.strip("/")],
                   taken_from=filters.taken_from or None, taken_to=filters.taken_to or None,
                   next_offset=None if found.last else found.offset + len(results), weak_below=weak,
                   images=len(index), took_ms=found.took_ms)


class EmbedResponse(BaseModel):
    """A photo's vector in the index's space."""

    vector: list[float] = Field(description="unit length, in the index's space: what `Embedder.load(B, "
                                "space=IDX).embed` gives; /search/multi takes it as `vector`")
    dim: int = Field(description="its length")
    took_ms: float = Field(description="time in the server, decoding and queueing included")


def _one_of(*names: str) -> dict:
    """A schema rule: at least one of the list fields ``names`` given, with an item."""
    return {"anyOf": [{"required": [n], "properties": {n: {"minItems": 1}}} for n in names]}


def _check_one_of(model: BaseModel, names: tuple[str, ...], why: str) -> None:
    if not any(getattr(model, n) for n in names):
        raise ValueError(why)


class Base64Query(BaseModel):
    """A search by an image sent as base64 in JSON."""

    image_base64: str = Field(description="the image file's bytes, base64 (standard alphabet, padded)",
                              json_schema_extra={"minLength": 4, "pattern": BASE64_PATTERN})  # checked by the route
    filename: str = Field("upload", description="a name for the image in messages")
    k: int = Field(12, ge=1, le=MAX_RESULTS, description="results per page")
    folder: str = Field("", **FOLDER_FIELD)  # type: ignore[arg-type]
    exclude_folders: list[str] = Field(default_factory=list, **EXCLUDE_FIELD)  # type: ignore[arg-type]
    taken_from: str = Field("", **TAKEN_FROM_FIELD)  # type: ignore[arg-type]
    taken_to: str = Field("", **TAKEN_TO_FIELD)  # type: ignore[arg-type]
    offset: int = Field(0, ge=0, description="results to skip (the next page: `next_offset`)")
    deduplicate: bool = Field(False, description=DEDUPLICATE)
    include_queries: bool = Field(False, description=INCLUDE_QUERIES)


MAX_QUERY_PHOTOS = 32  # images, and ids, on each side of a query at most
MAX_ID = 2**53 - 1  # ids in requests: the largest integer every JSON reader holds exactly (JavaScript's safe integers)
PhotoId = Annotated[int, Field(ge=0, le=MAX_ID)]


class QueryImage(BaseModel):
    """An image of a query, its file's bytes as base64."""

    image_base64: str = Field(description="the image file's bytes, base64 (standard alphabet, padded)",
                              json_schema_extra={"minLength": 4, "pattern": BASE64_PATTERN})  # checked by the route
    filename: str = Field("upload", description="a name for the image in messages")


class MultiQuery(BaseModel):
    """A search with several photos: more like ``images`` and ``ids``, less like ``not_images`` and ``not_ids``; or
    with a raw ``vector`` of the index's space. The positives and negatives become one query of the index's space (the
    mean of the positives minus a tenth of the mean of the negatives, each photo mapped into the space as a one-photo
    search maps it), searched as one photo is. One image alone, without negatives, searches as /search/base64 does.
    The query photos are left out of the results unless ``include_queries``."""

    model_config = ConfigDict(json_schema_extra=_one_of("images", "ids", "vector"))

    images: list[QueryImage] = Field([], max_length=MAX_QUERY_PHOTOS, description="photos to search with")
    ids: list[PhotoId] = Field([], max_length=MAX_QUERY_PHOTOS, description="indexed photos to search with (their ids)")
    not_images: list[QueryImage] = Field([], max_length=MAX_QUERY_PHOTOS, description="photos to be less like")
    not_ids: list[PhotoId] = Field([], max_length=MAX_QUERY_PHOTOS, description="indexed photos to be less like")
    vector: list[float] | None = Field(None, min_length=1, max_length=65536, description="instead of photos: a query "
                                       "vector in the "
                                       "index's space (`dim` numbers of /stats, finite, not all zero; normalized "
                                       "here), as `ImageIndex.to_space` or `Embedder.load(B, space=INDEX_DIR)` give "
                                       "them")
    k: int = Field(12, ge=1, le=MAX_RESULTS, description="results per page")
    folder: str = Field("", **FOLDER_FIELD)  # type: ignore[arg-type]
    exclude_folders: list[str] = Field(default_factory=list, **EXCLUDE_FIELD)  # type: ignore[arg-type]
    taken_from: str = Field("", **TAKEN_FROM_FIELD)  # type: ignore[arg-type]
    taken_to: str = Field("", **TAKEN_TO_FIELD)  # type: ignore[arg-type]
    offset: int = Field(0, ge=0, description="results to skip (the next page: `next_offset`)")
    deduplicate: bool = Field(False, description=DEDUPLICATE)
    include_queries: bool = Field(False, description=INCLUDE_QUERIES)

    @model_validator(mode="after")
    def _something(self) -> MultiQuery:
        _check_one_of(self, ("images", "ids", "vector"), "a search needs a photo to search with: images (base64) "
                      "or ids of indexed photos (or a vector)")
        return self


class Stats(BaseModel):
    """The collection and its index."""

    images: int = Field(description="searchable photos")
    unreadable: int
    pending: int = Field(description="embedded, not yet searchable")
    kind: str = Field(description="FAISS index kind: flat, ivf, ivfpq or hnsw")
    on_gpu: bool = Field(description="the index searches on a GPU (faiss-gpu and a CUDA device)")
    dim: int
    weak_below: float | None
    dedup_threshold: float
    dedup_rule: str | None = Field(None, description="what set the near threshold of the last search for duplicates "
                                   "(calibrated, default, crowd or given); null before one")
    dedup_last_threshold: float | None = Field(None, description="the near threshold of that search")
    backbone_arch: str | None
    backbone_sha256: str
    space: str = Field(description="what the index's vectors are")
    updated: str | None
    folders: list[str] = Field(description="the folder filter's choices")


class Member(BaseModel):
    """A photo of a group of duplicates."""

    id: int
    path: str
    score: float = Field(description="centred cosine to the group's representative")
    copy_score: float | None = Field(None, description="near and exact groups: how well its pixels match the "
                                     "representative's, cropped, mirrored, brightened (a near member: at least the "
                                     "search's copy score); null in similar groups")
    width: int | None = Field(None, description="pixels across (null: its header could not be read)")
    height: int | None = None
    bytes: int | None = Field(None, description="the file's size")
    taken: str | None = Field(None, description="when it was taken, ISO 8601 on the camera's clock (no zone): EXIF "
                              "DateTimeOriginal; null without one (a search result's `taken` falls back to the "
                              "file's date)")
    mtime: float | None = Field(None, description="the file's modification time (seconds since the epoch)")
    identical: bool = Field(False, description="the same bytes as the group's keeper")


Kind = Literal[KINDS]  # type: ignore[valid-type]  # index.duplicates.groups.KINDS, the one list
MovableKind = Literal[DEFAULT_KINDS]  # type: ignore[valid-type]  # similar groups are moved only by id


class Group(BaseModel):
    """A group of duplicates: every member a copy of its representative by its pixels (near), the same bytes
    (exact), or within the similar threshold of it (similar)."""

    id: str = Field("", description="stable while the group keeps its photos: `kind-smallest id-digest`")
    kind: Kind = Field(description="exact (the same bytes), near (the same shot re-encoded, resized, cropped, "
                      "recoloured) or similar (bursts, the same scene)")
    size: int
    representative: Member | None
    keep: Member | None = Field(None, description="the suggested keeper (or the one chosen)")
    reason: str = Field("", description="why that one: most pixels, then a date taken (the earliest), then the "
                        "oldest file, then the largest; or chosen by you")
    members: list[Member]


class Duplicates(BaseModel):
    """A page of the groups of the last search, exact first, then near, then similar, each kind largest first."""

    threshold: float = Field(description="near: the centred cosine at which the model proposed pairs to the pixel "
                             "check (each photo's 5 closest by the model and by pixels are proposed too)")
    similar_threshold: float | None = None
    rule: str | None = Field(None, description="what set the near threshold: calibrated (on copies of the "
                             "collection's photos), default, crowd (raised above the collection's crowd of alike "
                             "photos) or given")
    threshold_source: str | None = Field(None, description="the rule in words")
    created: str | None
    total: int = Field(0, description="groups of the kinds asked for")
    offset: int = 0
    limit: int = 0
    next_offset: int | None = Field(None, description="`offset` of the next page, or null after the last")
    groups: list[Group]




class KeeperRequest(BaseModel):
    """The photo to keep of a group."""

    photo_id: int = Field(ge=0, le=MAX_ID, description="a member's id")


class MoveRequest(BaseModel):
    """Groups whose photos but the keeper move to the collection's hidden `.moco-duplicates` folder."""

    model_config = ConfigDict(json_schema_extra=_one_of("groups", "kinds"))

    groups: list[str] = Field([], description="group ids; or:", max_length=10_000)
    kinds: list[MovableKind] = Field([], description="every group of these kinds (similar groups are "
                                                  "moved only by id)", max_length=2)
    keepers: dict[str, int] = Field({}, description="{group id: photo id} to keep instead of the suggested one")
    dry_run: bool = Field(False, description="say what would move, move nothing")

    @model_validator(mode="after")
    def _named(self) -> MoveRequest:
        _check_one_of(self, ("groups", "kinds"), "name the groups to move (their ids) or their kinds (exact, near)")
        return self


class UndoRequest(BaseModel):
    """Moves to undo."""

    batch: str | None = Field(None, description="one action's id (a move's `batch`); null: every move not yet undone",
                              max_length=100)


class Moved(BaseModel):
    group: str
    id: int
    source: str = Field(alias="from", description="where the photo was (relative to the collection, or absolute)")
    to: str = Field(description="where it is now")


class NotMoved(BaseModel):
    group: str
    path: str
    reason: str


class MoveResult(BaseModel):
    """What a move or an undo did (or, dry_run, would do)."""

    action: str = Field(description="move or undo")
    dry_run: bool
    batch: str | None = Field(description="the action's id in the journal (for an undo of it alone)")
    destination: str | None
    done: list[Moved]
    skipped: list[NotMoved]
    finished: int = Field(description="moves a kill had cut off, finished first")
    updated: bool = Field(description="the index was updated (the moved photos left it)")
    groups: int | None = Field(description="groups found by the search made again afterwards")


# ------------------------------------------------------------------------------- the whole collection
# The documents of index.overview.documents (the CLI's --json prints the same), typed.
class CollectionMap(BaseModel):
    """Every indexed photo once, a point of the map: one array per field, in the order of ``ids``."""

    method: Literal["pca", "umap"] = Field(description="pca (the two directions of most spread) or umap")
    version: str = Field(description="the index version the map was computed for (it changes with every update)")
    count: int = Field(description="photos on the map")
    ids: list[int] = Field(description="photo ids, ascending (for /photos/{id}/...)")
    x: list[float] = Field(description="in [0, 1]; both axes scaled by one factor, the shorter centred")
    y: list[float] = Field(description="in [0, 1]")
    theme: list[int] = Field(description="each photo's theme id (GET /api/v1/themes)")


class PhotoRef(BaseModel):
    id: int
    path: str | None = Field(description="relative to the collection root")


class FolderCount(BaseModel):
    folder: str = Field(description="a folder relative to the collection root ('': its top folder)")
    count: int = Field(description="the theme's photos in it")


class ThemeCard(BaseModel):
    """A theme: its size, its most central photos, its top folders."""

    id: int = Field(description="0 for the largest theme")
    size: int
    central: list[PhotoRef] = Field(description="its most central photos, most central first")
    folders: list[FolderCount] = Field(description="its top folders, most photos first")


class ThemesResponse(BaseModel):
    """The collection's themes (spherical k-means on the index's centred features), largest first."""

    k: int = Field(description="the number of themes")
    version: str = Field(description="the index version they were computed for")
    count: int = Field(description="photos in the themes (every indexed photo, each in one theme)")
    themes: list[ThemeCard]


class ThemePhoto(BaseModel):
    id: int
    path: str | None
    centrality: float = Field(description="the photo's cosine to its theme's centre")


class ThemePage(BaseModel):
    """A page of one theme's photos, most central first."""

    id: int
    size: int = Field(description="the theme's photos")
    offset: int
    limit: int
    next_offset: int | None = Field(description="`offset` of the next page, or null after the last")
    photos: list[ThemePhoto]


class UnusualPhoto(BaseModel):
    id: int
    path: str | None
    closest: float = Field(description="the photo's centred cosine to its closest other photo (1: it has a copy)")


class UnusualPage(BaseModel):
    """A page of the photos farthest from any other, the most unusual first."""

    total: int = Field(description="photos ranked (all, in a collection of two or more)")
    offset: int
    limit: int
    next_offset: int | None = Field(description="`offset` of the next page, or null after the last")
    photos: list[UnusualPhoto]


class BrowsePhoto(BaseModel):
    id: int
    path: str
    taken: str | None = Field(description="when it was taken, ISO 8601 on the camera's clock: EXIF "
                              "DateTimeOriginal, else the file's date")
    width: int | None = None
    height: int | None = None


Sort = Literal["name", "date", "-date"]


class PhotosPage(BaseModel):
    """A page of the collection's photos, by folder or theme."""

    total: int = Field(description="photos that pass the filters")
    offset: int
    limit: int
    next_offset: int | None = Field(description="`offset` of the next page, or null after the last")
    folder: str | None = Field(description="the sub-folder listed (null: all)")
    theme: int | None = Field(description="the theme listed (null: all)")
    sort: Sort = Field(description="name (the path), date (taken, oldest first), -date (newest first); photos "
                       "without a date last")
    photos: list[BrowsePhoto]


class ErrorResponse(BaseModel):
    detail: str = Field(description="what went wrong and what to do, in one line (the page's message)")


def json_path(path: str) -> str:
    """A catalog path as JSON text: itself, or escaped as the page shows it when it is not valid UTF-8."""
    try:
        path.encode("utf-8")
        return path
    except UnicodeEncodeError:
        return display_path(path)
