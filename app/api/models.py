"""The JSON API's request and response models: the OpenAPI schema and the docs page are generated from them."""

from __future__ import annotations

from pydantic import BaseModel, Field

from app.page.handlers import FOLDER_PATTERN, MAX_RESULTS

__all__ = ["FOLDER_FIELD", "EXCLUDE_FIELD", "TAKEN_FROM_FIELD", "TAKEN_TO_FIELD", "IMAGE_TYPES", "BASE64_PATTERN",
           "Hit", "SearchResponse", "Base64Query", "Stats", "Member", "Group", "Duplicates", "ErrorResponse"]


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
    backbone_arch: str | None
    backbone_sha256: str
    space: str = Field(description="what the index's vectors are")
    updated: str | None
    folders: list[str] = Field(description="the folder filter's choices")


class Member(BaseModel):
    id: int
    path: str
    score: float = Field(description="centred cosine to the group's representative")


class Group(BaseModel):
    size: int
    representative: Member | None
    members: list[Member]


class Duplicates(BaseModel):
    """Near-duplicate groups (every member within the threshold of its representative), largest first."""

    threshold: float
    created: str | None
    groups: list[Group]


class ErrorResponse(BaseModel):
    detail: str = Field(description="what went wrong and what to do, in one line (the page's message)")
