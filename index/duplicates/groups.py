"""A search for duplicates as values: its groups (:class:`Group`), their photos (:class:`Member`), the search saved
(:class:`SavedSearch`, ``dedup.json``) and the kinds of groups (:data:`KINDS`, the one list).

The search (:mod:`index.duplicates.dedup`) makes them; the actions (:mod:`index.duplicates.resolve`), the CLI, the
JSON API, the page and the benchmarks read their attributes. ``to_json`` writes and ``from_json`` reads the form of
``dedup.json`` exactly, a file of an older version too (near groups, the representative kept: filled in on reading).
This module imports nothing heavy: ``moco index dedup --help`` and the API's schema read :data:`KINDS` from it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

__all__ = ["Member", "Ref", "Group", "SavedSearch", "group_id", "KINDS", "EXACT", "NEAR", "SIMILAR",
           "DEFAULT_KINDS"]

KINDS = ("exact", "near", "similar")  # the kinds of groups: the one list
EXACT, NEAR, SIMILAR = KINDS
DEFAULT_KINDS = (EXACT, NEAR)  # similar groups only when asked

OLD_REASON = "the representative (a search of an older version)"  # the reason of a group saved before keepers


def group_id(kind: str, members: Iterable[int]) -> str:
    """A group's id: its kind, its smallest member id and a digest of all its member ids (``near-17-3fa9c0``): the
    same group gets the same id in every search; a group that gained or lost a photo gets another."""
    ids = sorted(int(i) for i in members)
    digest = hashlib.blake2b(",".join(map(str, ids)).encode(), digest_size=3).hexdigest()
    return f"{kind}-{ids[0]}-{digest}"


@dataclass(frozen=True)
class Member:
    """A photo of a group: ``similarity`` (centred cosine to the representative; 1.0 for itself), ``copy_score``
    (how well its pixels match the representative's; None in similar groups), ``best_similarity`` (to its closest
    neighbour, in the group or not), its pixels, file size, date taken (EXIF, seconds; None without one) and
    modification time."""

    id: int
    path: str
    thumb: str | None = None
    hash: str | None = None
    similarity: float | None = None
    copy_score: float | None = None
    best_similarity: float | None = None
    width: int | None = None
    height: int | None = None
    bytes: int | None = None
    taken: float | None = None
    mtime: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "path": self.path, "thumb": self.thumb, "hash": self.hash,
                "similarity": self.similarity, "copy_score": self.copy_score,
                "best_similarity": self.best_similarity, "width": self.width, "height": self.height,
                "bytes": self.bytes, "taken": self.taken, "mtime": self.mtime}

    @classmethod
    def from_json(cls, m: dict[str, Any]) -> Member:
        """A member as ``dedup.json`` holds it (an older one without ``similarity``: its ``best_similarity``)."""
        return cls(id=m["id"], path=m["path"], thumb=m.get("thumb"), hash=m.get("hash"),
                   similarity=m.get("similarity", m.get("best_similarity")), copy_score=m.get("copy_score"),
                   best_similarity=m.get("best_similarity"), width=m.get("width"), height=m.get("height"),
                   bytes=m.get("bytes"), taken=m.get("taken"), mtime=m.get("mtime"))


@dataclass(frozen=True)
class Ref:
    """A photo named by its id and path (a group's representative)."""

    id: int
    path: str | None


@dataclass(frozen=True)
class Group:
    """A group of duplicates of one ``kind`` (:data:`KINDS`): ``id`` (stable while it keeps its photos,
    :func:`index.duplicates.dedup.group_id`), ``size``, the ``representative`` every member is close to,
    ``tightest`` and ``loosest`` (the highest and lowest cosine of a member to it), the suggested keeper (``keep``:
    its path, ``keep_id``) and the ``reason``, and its ``members`` (the representative first)."""

    id: str
    kind: str
    size: int
    representative: Ref | None
    tightest: float | None
    loosest: float | None
    keep: str | None
    keep_id: int | None
    reason: str
    members: tuple[Member, ...]

    def __post_init__(self) -> None:
        assert self.kind in KINDS, self.kind

    @property
    def ids(self) -> list[int]:
        """Its members' ids, in its order."""
        return [m.id for m in self.members]

    def member(self, photo: int | None) -> Member | None:
        """Its member ``photo``; None when it has none."""
        return next((m for m in self.members if m.id == photo), None)

    @property
    def keeper(self) -> Member | None:
        return self.member(self.keep_id)

    def identical(self, m: Member) -> bool:
        """Whether member ``m`` is not the keeper and has the keeper's bytes (its content hash)."""
        keep = self.keeper
        return bool(keep and keep.hash) and m.hash == keep.hash and m.id != self.keep_id

    def with_keeper(self, photo: int, reason: str) -> Group:
        """This group keeping its member ``photo`` for ``reason``."""
        return replace(self, keep_id=photo, keep=self.member(photo).path, reason=reason)  # type: ignore[union-attr]

    def to_json(self) -> dict[str, Any]:
        rep = self.representative
        return {"id": self.id, "kind": self.kind, "size": self.size,
                "representative": {"id": rep.id, "path": rep.path} if rep else None, "tightest": self.tightest,
                "loosest": self.loosest, "keep": self.keep, "keep_id": self.keep_id, "reason": self.reason,
                "members": [m.to_json() for m in self.members]}

    @classmethod
    def from_json(cls, g: dict[str, Any]) -> Group:
        """A group as ``dedup.json`` holds it; one of an older version: a near group, its id made from its members,
        its representative kept."""
        members = tuple(Member.from_json(m) for m in g["members"])
        kind = g.get("kind", NEAR)
        r = g.get("representative") or {}
        rep = Ref(r["id"], r.get("path")) if "id" in r else None
        fallback = rep.id if rep else members[0].id if members else None
        keep_id = g.get("keep_id", fallback)
        gid = g["id"] if "id" in g else group_id(kind, [m.id for m in members] or [0])
        keep = g["keep"] if "keep" in g else next((m.path for m in members if m.id == keep_id), None)
        return cls(id=gid, kind=kind, size=g["size"], representative=rep, tightest=g.get("tightest"),
                   loosest=g.get("loosest"), keep=keep, keep_id=keep_id, reason=g.get("reason", OLD_REASON),
                   members=members)


_OPTIONAL = ("similar_threshold", "rule", "threshold_source", "decision", "kinds", "grouping")


@dataclass(frozen=True)
class SavedSearch:
    """The last search, as ``dedup.json`` keeps it: the near and similar thresholds, the ``rule`` that set the near
    one and that rule in words (``threshold_source``), the search's whole ``decision`` (its rule's figures, the
    settings given), the ``kinds`` searched, its ``groups``, the photos searched (``images``) and when (``created``).
    What a file of an older version lacks is None (and stays out of the file when written again)."""

    threshold: float
    groups: tuple[Group, ...]
    created: str | None
    similar_threshold: float | None = None
    rule: str | None = None
    threshold_source: str | None = None
    decision: dict[str, Any] | None = None
    kinds: tuple[str, ...] | None = None
    grouping: str | None = None
    images: int | None = None

    @property
    def given(self) -> dict[str, Any]:
        """The settings the search was asked for (thresholds, folders left out): ``{}`` when unknown."""
        return dict((self.decision or {}).get("given") or {})

    def group(self, gid: str) -> Group | None:
        return next((g for g in self.groups if g.id == gid), None)

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"threshold": self.threshold}
        for key in _OPTIONAL:
            value = getattr(self, key)
            if value is not None:
                doc[key] = list(value) if key == "kinds" else value
        doc["groups"] = [g.to_json() for g in self.groups]
        if self.images is not None:
            doc["images"] = self.images
        doc["created"] = self.created
        return doc

    @classmethod
    def from_json(cls, doc: Any) -> SavedSearch:
        """The saved search ``doc`` (``dedup.json`` read as JSON); a ValueError saying what is wrong when it is not
        one (a key missing, a value of the wrong type)."""
        problem = _problem(doc)
        if problem:
            raise ValueError(problem)
        kinds = doc.get("kinds")
        return cls(threshold=doc["threshold"], groups=tuple(Group.from_json(g) for g in doc["groups"]),
                   created=doc.get("created"), similar_threshold=doc.get("similar_threshold"), rule=doc.get("rule"),
                   threshold_source=doc.get("threshold_source"), decision=doc.get("decision"),
                   kinds=tuple(kinds) if kinds is not None else None, grouping=doc.get("grouping"),
                   images=doc.get("images"))


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x  # not NaN


def _problem(doc: Any) -> str | None:
    """What makes ``doc`` something else than a saved search (None: nothing)."""
    if not isinstance(doc, dict):
        return f"a {type(doc).__name__}, not an object"
    if not _number(doc.get("threshold")):
        return "no number 'threshold'"
    if not isinstance(doc.get("created"), (str, type(None))) or not isinstance(doc.get("groups"), list):
        return "'created' is not text or 'groups' is not a list"
    if not isinstance(doc.get("kinds", []), list) or not all(k in KINDS for k in doc.get("kinds", [])):
        return f"'kinds' is not a list of {', '.join(KINDS)}"
    for n, g in enumerate(doc["groups"]):
        where = f"group {n}"
        if not isinstance(g, dict) or isinstance(g.get("size"), bool) or not isinstance(g.get("size"), int):
            return f"{where} has no whole 'size'"
        if not isinstance(g.get("members"), list) or not isinstance(g.get("representative", {}), (dict, type(None))):
            return f"{where}: 'members' is not a list or 'representative' is not an object"
        if not all(_number(g[key]) for key in ("tightest", "loosest") if key in g):
            return f"{where}: 'tightest' or 'loosest' is not a number"
        if g.get("kind", "near") not in KINDS or not isinstance(g.get("id", ""), str):
            return f"{where}: 'kind' is not one of {', '.join(KINDS)} or 'id' is not text"
        if isinstance(g.get("keep_id", 0), bool) or not isinstance(g.get("keep_id", 0), (int, type(None))):
            return f"{where}: 'keep_id' is not a whole number"
        for m in g["members"]:
            if not isinstance(m, dict) or isinstance(m.get("id"), bool) or not isinstance(m.get("id"), int):
                return f"{where}: a member without a whole 'id'"
            if not isinstance(m.get("path"), str) or not _number(m.get("similarity", m.get("best_similarity"))):
                return f"{where}: member {m['id']} has no text 'path' or no number 'similarity'"
            if "best_similarity" in m and not _number(m["best_similarity"]):
                return f"{where}: member {m['id']}'s 'best_similarity' is not a number"
    return None
