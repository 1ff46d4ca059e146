"""Groups of duplicates, each of one kind, in which every photo is a duplicate of its group's representative.

Kinds: **exact** (every member has the same bytes: the catalog's content hash), **near** (the same shot re-encoded,
resized, cropped, recoloured: a copy by its pixels, see below) and **similar** (bursts,
the same scene: at least the lower similar threshold, among the photos no exact or near group holds; only when
asked). Photos with the same bytes are always neighbours; two photos the user said are not duplicates
(the catalog's ``not_duplicates``) never are.

Groups are picked greedily (:func:`tight_groups`): the photo with the most ungrouped neighbours (ties: the smallest
id) is a representative, its group is it and those neighbours, and the rest is grouped the same way until no
ungrouped photo has an ungrouped neighbour. A chain a~b~c~d of photos each a small step from the last is therefore
never one group: a photo joins a group only by being close to its representative, not to any member (single
linkage once merged 90 different airplane photos of one collection). A near group holding photos of two contents
is ``near`` (its byte-identical members are marked), one of a single content ``exact``.

Near links are copies by their pixels. The model proposes pairs: those at the near threshold, the index's own
(:func:`index.calibrate.dedup_threshold`, calibrated on copies of its photos at build time), raised above the
collection's crowd level where a weak model or a collection of very alike photos puts distinct photos that close
(:func:`index.calibrate.near_threshold`; its rule is reported), each photo's closest photo by the model, and its
closest by the NCC of their pixels (a brighter copy, which a model may not see as close) and the photo it could have
been cut from (:func:`index.duplicates.propose.proposals`).
A proposed pair is a near link only where :func:`index.duplicates.verify.copy_scores` finds one photo to be the other
re-encoded, resized, cropped, brightened or mirrored (copy score at least :data:`~index.duplicates.verify.COPY_SCORE`,
:func:`verify_links`), and whose files do not say they are two captures (EXIF dates taken a second or more apart, or
two cameras: :mod:`index.duplicates.captures`; such a pair is not checked at all). A pair of large photos that the
check puts near a copy is checked again from the photos themselves (:func:`_fine_check`). A large photo whose crop
search found a copy first has the other photos that search found checked after it (its family of crops, which meet
its crop windows less well the more they are cut: :func:`index.duplicates.propose.crop_families`), and those its
windows at finer places find (:func:`index.duplicates.propose.family_crops`: a crop cut between the proposals'
places). Distinct photos
of alike things (a crowd of t-shirts, planes against blue sky, tiles of one texture) sit as close to each other as
copies to a weak model; their pixels differ, so no threshold a model sets can group them: the pixel check is the
guard, and it does not depend on the model. Where pixels cannot tell either (a
photo that is a copy by pixels of :data:`~index.calibrate.CROWD` others or more: a clear sky, a gradient, a blank
page), the photo keeps no near link, so no near group holds more than that many distinct photos.

The copy score :data:`~index.duplicates.verify.COPY_SCORE` was chosen on planted copies of one split of Fashion-MNIST
(``bench/dedup_copies.py --split choose``, with the crop proposals and the tone curve) and is reported on the other:
its figures (pair precision, the copies kept of each kind, the scores tried beside it) are in BENCHMARKS.md and
bench/NOTES.md ("Choosing the score"), which a later run updates.

Each group has a stable id (its kind, its smallest member id and a digest of its member ids), a suggested keeper and
the reason (:mod:`index.duplicates.keeper`), and its members' pixels, size, date taken and age.
"""

from __future__ import annotations

import contextlib
import datetime
import heapq
import json
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from index.calibrate import (  # the threshold: re-exported here, where its users look for it
    CROWD,
    GUARD_SAMPLE,
    dedup_threshold,
    describe_threshold,
    near_threshold,
    neighbour_levels,
    threshold_source,
)
from index.catalog import Row, sample_ids
from index.duplicates.captures import Captures
from index.duplicates.check_workers import PART, check_workers, checked_parts, core_workers
from index.duplicates.dedup_cache import (
    CHECKED_FILE,
    FRAMES_FILE,
    LINKS_FILE,
    NEIGHBOURS_FILE,
    CheckedPairs,
    FrameFile,
    LinkFile,
    NeighbourFile,
    photo_version,
)
from index.duplicates.groups import (
    DEFAULT_KINDS,
    EXACT,
    KINDS,
    NEAR,
    SIMILAR,
    Group,
    Member,
    Ref,
    SavedSearch,
    group_id,
)
from index.duplicates.keeper import photo_facts, suggest_keeper
from index.duplicates.propose import (
    MODEL_DEPTH,
    PIXEL_DEPTH,
    PROPOSE_K,
    ModelFound,
    crop_families,
    family_crops,
    family_heads,
    model_search,
    proposals,
)
from index.duplicates.verify import COPY_SCORE, FINE_MIN, SIDE, FineCheck
from index.search.image_index import ImageIndex, row_filter
from index.search.index_dir import DEDUP_FILE, DEDUP_LAST_KEY
from moco.data.photos import ImageDecodeError, load_rgb
from moco.data.workers import exit_if_importing_main
from moco.errors import NotFoundError, UserError
from moco.files import atomic_write

__all__ = ["find_duplicates", "search_duplicates", "Search", "load_duplicates", "save_duplicates", "write_duplicates",
           "find_group", "tight_groups", "verify_links"]


def _neighbours(index: ImageIndex, ids: np.ndarray, vecs: np.ndarray, at: np.ndarray, threshold: float, chunk: int,
                live: set[int], graph: dict[int, dict[int, float]]) -> None:
    """Add to ``graph`` the neighbours of the photos at places ``at`` of ``ids`` (vectors ``vecs`` in the index's
    space, :meth:`ImageIndex.to_space`) among the photos ``live`` at centred cosine >= ``threshold`` (a range search):
    ``{id: {other id: cosine}}``, symmetric (a pair an approximate index finds one way only is kept both ways); photos
    without one are left out."""
    for start in range(0, len(at), chunk):
        part = at[start : start + chunk]  # B
        lims, scores, found = index.store.range_search(np.ascontiguousarray(vecs[part]), threshold)
        for q in range(len(lims) - 1):
            _link(graph, int(ids[part[q]]), found[lims[q] : lims[q + 1]].tolist(),
                  scores[lims[q] : lims[q + 1]].tolist(), threshold, live)


def _link(graph: dict[int, dict[int, float]], own: int, found: list[int], scores: list[float], threshold: float,
          live: set[int]) -> None:
    """Add photo ``own``'s neighbours ``found`` (with their cosines ``scores``) at ``threshold`` or more to
    ``graph``, both ways (the higher cosine where the pair is there already)."""
    for j, s in zip(found, scores):
        if j == own or j not in live or s < threshold:
            continue
        s = max(s, graph.get(j, {}).get(own, -1.0))
        graph.setdefault(own, {})[j] = graph.setdefault(j, {})[own] = s


LINK_MARGIN = 0.02  # the model's links are kept this far under the threshold: a later search's, measured anew, may dip
WIDE_DEPTH = 256  # a photo whose closest photos are all links is searched this deep before a range search among all
WIDE_CHUNK = 64  # photos searched that deep at a time (their candidates' vectors: 64 x 256 x D floats)


def _deeper(search: Callable[[np.ndarray, int], tuple[np.ndarray, np.ndarray]], ntotal: int, ids: np.ndarray,
            vecs: np.ndarray, at: np.ndarray, width: int, threshold: float, live: set[int],
            graph: dict[int, dict[int, float]]) -> np.ndarray:
    """Link the photos at places ``at`` of ``ids`` (whose ``width`` closest photos were all links) to their
    :data:`WIDE_DEPTH` closest by ``search`` (the closest photos' own search); the places of those whose last is
    still a link, for a range search. A range search of a flat index reads every vector, so that range-searching
    every such photo grew with the square of the photos; most have far fewer links than this depth."""
    depth = min(WIDE_DEPTH, ntotal)
    if depth <= width or not len(at):
        return at
    wider: list[int] = []
    for start in range(0, len(at), WIDE_CHUNK):
        part = at[start : start + WIDE_CHUNK]  # B
        sims, near = search(np.ascontiguousarray(vecs[part]), depth)  # B x depth
        for n, row, sim in zip(part.tolist(), near.tolist(), sims.tolist()):
            _link(graph, int(ids[n]), row, sim, threshold, live)
            if depth < ntotal and row[-1] >= 0 and sim[-1] >= threshold:
                wider.append(n)
    return np.array(wider, np.int64)


def _model_links(index: ImageIndex, ids: np.ndarray, vecs: np.ndarray, threshold: float, chunk: int,
                 versions: Mapping[int, int], progress: bool
                 ) -> tuple[dict[int, dict[int, float]], int, ModelFound]:
    """The model's links: every pair of photos ``ids`` at centred cosine >= ``threshold``; how many photos were
    searched for them; and those photos' :data:`~index.duplicates.propose.MODEL_DEPTH` closest photos, which the
    proposals take instead of searching again.

    A photo's links are among its closest photos (the near threshold is above the crowd level of nearly every
    photo: :func:`index.calibrate.near_threshold`), so each photo is searched once for its closest, as the proposals
    search; a photo whose last one is still at the threshold is searched deeper (:func:`_deeper`), and only one whose
    last is still at it there is range-searched for the rest: the same
    links as a range search of every photo where the search is exact (on a flat index of many photos the closest come
    from an inverted file, :func:`~index.duplicates.propose.model_search`: a link may be missed). The links are kept
    in the index directory (:class:`~index.duplicates.dedup_cache.LinkFile`, at :data:`LINK_MARGIN` under the
    threshold): a later search
    takes the links among the photos that are as they were, and searches only the others (new or changed since)
    among all, which finds their links to the rest too."""
    live = set(ids.tolist())
    kept_file = None if index.catalog.read_only else LinkFile(index.dir / LINKS_FILE, _space_key(index))
    kept = kept_file.load(versions, threshold) if kept_file is not None else None
    graph: dict[int, dict[int, float]] = {}
    known: set[int] = set()
    floor = round(threshold - LINK_MARGIN, 4)
    if kept is not None:
        floor, known = kept.floor, set(kept.photos.tolist()) & live
        for (a, b), s in zip(kept.pairs.tolist(), kept.cosines.tolist()):
            if a in known and b in known:
                graph.setdefault(a, {})[b] = graph.setdefault(b, {})[a] = s
    at = np.flatnonzero([i not in known for i in ids.tolist()])  # T: the photos searched
    width = max(1, min(MODEL_DEPTH, index.store.ntotal))
    found = ModelFound(ids[at], np.full((len(at), width), -1, np.int64), np.full((len(at), width), -np.inf, np.float32))
    wide: list[int] = []  # places of the photos whose last closest photo is still a link
    with _stage("model links", len(at), "photo", progress) as bar:
        search = model_search(index.store, ids, vecs, len(at))
        for start in range(0, len(at), chunk):
            part = at[start : start + chunk]  # B
            sims, near = search(np.ascontiguousarray(vecs[part]), width)  # B x width
            found.sims[start : start + len(part)], found.near[start : start + len(part)] = sims, near
            for n, row, sim in zip(part.tolist(), near.tolist(), sims.tolist()):
                _link(graph, int(ids[n]), row, sim, floor, live)
                if width < index.store.ntotal and row[-1] >= 0 and sim[-1] >= floor:
                    wide.append(n)
            bar.update(len(part))
        wider = _deeper(search, index.store.ntotal, ids, vecs, np.array(wide, np.int64), width, floor, live, graph)
        _neighbours(index, ids, vecs, wider, floor, chunk, live, graph)
    if kept_file is not None:
        kept_file.save(floor, ids.tolist(), versions, graph)
    links = {i: {j: s for j, s in nb.items() if s >= threshold} for i, nb in graph.items()}
    return {i: nb for i, nb in links.items() if nb}, len(at), found


def tight_groups(graph: Mapping[int, Mapping[int, float]]) -> list[tuple[int, list[int]]]:
    """Greedy groups of a symmetric neighbour graph: ``[(representative, [representative, *members]), ...]``.

    The ungrouped photo with the most ungrouped neighbours (ties: the smallest id) represents a group of itself and
    those neighbours (sorted by id); repeated until no ungrouped photo has an ungrouped neighbour. Every member is
    a neighbour of its representative: any two members are at most two steps apart through it, never a chain.
    """
    left = {i: len(n) for i, n in graph.items() if n}  # ungrouped photo -> its ungrouped neighbours
    heap = [(-d, i) for i, d in left.items()]  # counts only fall: a stale entry is pushed again when popped
    heapq.heapify(heap)
    groups = []
    while heap:
        d, i = heapq.heappop(heap)
        if i not in left:
            continue
        if -d != left[i]:
            if left[i]:
                heapq.heappush(heap, (-left[i], i))
            continue
        members = [i, *sorted(j for j in graph[i] if j in left)]
        for m in members:
            del left[m]
        for m in members:
            for j in graph[m]:
                if j in left:
                    left[j] -= 1
        groups.append((i, members))
    return groups


def _content(ids: np.ndarray, rows: Mapping[int, Row]) -> np.ndarray:
    """N ints, equal where photos have the same bytes (the same content hash; a photo without one: its own)."""
    hashes = [rows[int(i)].hash if int(i) in rows else None for i in ids]
    codes = {h: n for n, h in enumerate(sorted({h for h in hashes if h}))}
    return np.array([codes[h] if h else len(codes) + n for n, h in enumerate(hashes)], np.int64)


def _frame_fallback(index: ImageIndex, rows: Mapping[int, Row]) -> Callable[[int], Image.Image | None]:
    """A photo decoded from its file, for a frame where its thumbnail is missing; None where it cannot be."""
    def decode(i: int) -> Image.Image | None:
        try:
            return load_rgb(index.root / rows[i].path, min_short=2 * SIDE)
        except (ImageDecodeError, KeyError):
            return None
    return decode


def _frame_source(index: ImageIndex, row: Row) -> Path | None:
    """Where a photo's frame is made from: its thumbnail, or None (the photo itself, through the frames' fallback)
    where the catalog says the photo is smaller than twice a frame's side (its thumbnail would be read for nothing)."""
    if row.width and row.height and min(row.width, row.height) < 2 * SIDE:
        return None
    return index.thumb_path(row)


def _large(rows: Mapping[int, Row], unknown: bool = True) -> set[int]:
    """The photos at least :data:`~index.duplicates.verify.FINE_MIN` pixels on their short side by the catalog, and
    with ``unknown`` those of a size it does not know: their crops are proposed by the model's closest photos more
    than by their frames, and the fine check can look at their pixels."""
    return {i for i, r in rows.items()
            if (min(r.width, r.height) >= FINE_MIN if r.width and r.height else unknown)}


def _fine_check(index: ImageIndex, rows: Mapping[int, Row]) -> FineCheck:
    """The fine check of the photos at least :data:`~index.duplicates.verify.FINE_MIN` pixels on their short side (by
    the catalog; a photo whose size it does not know is left out): a pair of two of them near a copy is checked again
    from the photos themselves."""
    return FineCheck(index.root, {i: rows[i].path for i in _large(rows, unknown=False)})


def verify_links(index: ImageIndex, ids: np.ndarray, vecs: np.ndarray, content: Mapping[int, int],
                 rows: Mapping[int, Row], links: Mapping[int, Mapping[int, float]], chunk: int = 1024,
                 progress: bool = False, versions: Mapping[int, int] | None = None, workers: int | None = None,
                 found: ModelFound | None = None
                 ) -> tuple[dict[int, dict[int, float]], dict[tuple[int, int], float], dict[str, int]]:
    """The near links: the pairs of :func:`index.duplicates.propose.proposals`
    that :func:`index.duplicates.verify.copy_scores` finds to be
    copies (score at least :data:`~index.duplicates.verify.COPY_SCORE`), each with its centred cosine (``{id: {other:
    cosine}}``,
    symmetric), their copy scores ``{(a, b): score}`` (a < b), and counts: ``proposed``, ``taken_apart`` (pairs
    whose files say they are two captures, :func:`index.duplicates.captures.taken_apart`: never checked, never
    copies), ``verified``,
    ``turned_down`` (the model's links at the near threshold that are no copies), ``unchecked`` (photos without
    a frame: no thumbnail and no decodable file), ``crowded``: photos that are copies by pixels of
    :data:`~index.calibrate.CROWD` or more other photos (a clear sky, a gradient, a blank page has too little of its
    own to tell a copy from another such photo), whose near links are all dropped; ``checked`` (pairs the pixel check
    scored in this search), ``reused`` (pairs scored by an earlier one), ``frames_made``, ``windows_made`` (photos
    whose crop windows this search made: the others' were kept) and ``looked_up`` (photos
    whose proposals were looked up among all photos; the others, as they were in the last search, only among the
    photos new since: :func:`index.duplicates.propose.proposals`).

    The frames and the scored pairs are kept in the index directory (:mod:`index.duplicates.dedup_cache`; a read-only
    index:
    in a temporary folder, for this search alone), so a search checks only the pairs no earlier one scored at their
    photos' current versions: after an ``index update`` that added a few photos, the pairs that hold one of them; after
    a kill, those it had not reached. ``versions``: every photo's version
    (:func:`index.duplicates.dedup_cache.photo_version`;
    None: ``rows``'). ``workers``: the pixel check's processes (:func:`index.duplicates.check_workers.check_workers`
    for None), and the frames' (every core for None, where there are many frames to make). ``found``: the model's
    closest photos of the photos searched for the links (:class:`~index.duplicates.propose.ModelFound`), not
    searched again."""
    if index.catalog.read_only:
        with tempfile.TemporaryDirectory(prefix="moco-dedup-") as scratch:
            return _verify_links(index, Path(scratch), ids, vecs, content, rows, links, chunk, progress, versions,
                                 workers, found)
    return _verify_links(index, index.dir, ids, vecs, content, rows, links, chunk, progress, versions, workers,
                         found)


CHECK_BLOCK = 1 << 16  # pairs looked up among those scored before at a time (memory: 25 bytes a pair)


def _verify_links(index: ImageIndex, where: Path, ids: np.ndarray, vecs: np.ndarray, content: Mapping[int, int],
                  rows: Mapping[int, Row], links: Mapping[int, Mapping[int, float]], chunk: int, progress: bool,
                  versions: Mapping[int, int] | None, workers: int | None, found: ModelFound | None
                  ) -> tuple[dict[int, dict[int, float]], dict[tuple[int, int], float], dict[str, int]]:
    """:func:`verify_links`, its frames and scored pairs kept in the folder ``where``."""
    pos = {int(i): n for n, i in enumerate(ids.tolist())}
    versions = versions if versions is not None else {i: _version(r) for i, r in rows.items()}
    photos = {int(i): (versions[int(i)], _frame_source(index, rows[int(i)])) for i in ids if int(i) in rows}
    with _stage("frames", len(ids), "photo", progress) as bar:
        bar.update(len(ids) - len(photos))
        frames_ = FrameFile(where / FRAMES_FILE).update(
            photos, _frame_fallback(index, rows), bar.update, versions,
            originals=lambda i: index.root / rows[i].path if i in rows else None,
            workers=workers if workers is not None else core_workers())  # every core, for many photos
    del photos  # a path a photo: about 0.3 GB at 1,000,000 photos
    kept_neighbours = NeighbourFile(where / NEIGHBOURS_FILE, _space_key(index))
    captures = Captures.of(rows)  # the files' dates and cameras
    with _stage("proposals", 5 * len(ids), "search", progress) as bar:
        large = _large(rows)
        proposed = proposals(index.store, ids, vecs, content, frames_, links, chunk, step=bar.update,
                             before=kept_neighbours.load(versions, frames_), found=found, apart=captures.apart,
                             large=large)
    kept_neighbours.save(proposed.neighbours, versions, frames_)
    apart = captures.pairs_apart(proposed.pairs)  # P: two captures by their files' dates or cameras
    pairs = proposed.pairs[~apart]  # P' x 2, for the pixel check
    checked = CheckedPairs(where / CHECKED_FILE, versions)
    scores: dict[tuple[int, int], float] = {}
    reused = 0
    if workers is None:  # as many as the pairs no earlier search scored (not a guess from the kept file's length:
        # after the proposals changed, a file of as many pairs may hold few of these)
        workers = check_workers(sum(int((~checked.known(pairs[n : n + CHECK_BLOCK])[0]).sum())
                                    for n in range(0, len(pairs), CHECK_BLOCK)))
    fine = _fine_check(index, rows)

    def check(pairs: np.ndarray, bar: Any) -> None:  # scores of ``pairs`` (P x 2): kept ones, or checked now
        def parts() -> Iterator[np.ndarray]:  # the pairs no earlier search scored, PART at a time, in order
            nonlocal reused
            for start in range(0, len(pairs), CHECK_BLOCK):
                block = pairs[start : start + CHECK_BLOCK]  # B x 2
                hit, before = checked.known(block)  # B, B
                reused += int(hit.sum())
                scores.update({q: s for q, s in zip(map(tuple, block[hit].tolist()), before[hit].tolist())
                               if s >= COPY_SCORE})
                bar.update(int(hit.sum()))
                todo = block[~hit]  # T x 2
                yield from (todo[n : n + PART] for n in range(0, len(todo), PART))

        for part, got in checked_parts(parts(), frames_, workers, fine):
            new = {(a, b): s for (a, b), s in zip(part.tolist(), got.tolist()) if s == s}  # NaN: a photo without one
            checked.add(new)  # kept at once: a search killed after this goes on from here
            scores.update({q: s for q, s in new.items() if s >= COPY_SCORE})
            bar.update(len(part))

    with _stage("pixel check", len(pairs), "pair", progress) as bar:
        check(pairs, bar)
    heads = family_heads(proposed.neighbours, large, scores)  # H: large photos a verified crop was cut from
    with _stage("family search", 2 * len(heads), "search", progress and len(heads) > 0) as bar:
        finer = family_crops(heads, frames_, ids.tolist(), step=bar.update)  # F' x 2: by finer windows
    family = np.unique(np.concatenate([crop_families(proposed.neighbours, large, scores), finer]), axis=0)  # F x 2
    if len(family) and len(proposed.pairs):  # not proposed already (the proposed pairs are sorted by their keys)
        keys = (proposed.pairs[:, 0] << 32) | proposed.pairs[:, 1]  # P: 8 bytes a pair, no sorting
        wanted = (family[:, 0] << 32) | family[:, 1]  # F
        family = family[keys[np.minimum(np.searchsorted(keys, wanted), len(keys) - 1)] != wanted]
    if len(family):  # other bytes (the same: exact), not two captures
        family = family[[content[a] != content[b] for a, b in family.tolist()]]
        family = family[~captures.pairs_apart(family)]
    if len(family):
        with _stage("crop families", len(family), "pair", progress) as bar:
            check(family, bar)
    pairs = np.concatenate([pairs, family.reshape(-1, 2)])  # every pair scored
    near: dict[int, dict[int, float]] = {}
    kept: dict[tuple[int, int], float] = {}
    for (a, b), s in scores.items():
        cos = float(vecs[pos[a]] @ vecs[pos[b]])
        near.setdefault(a, {})[b] = near.setdefault(b, {})[a] = cos
        kept[a, b] = round(s, 5)
    same: dict[int, list[int]] = {}
    for i in ids.tolist():
        same.setdefault(content[i], []).append(i)
    for (a, b), s in list(kept.items()):  # the same bytes score the same: a copy of one is a copy of each
        for x in same[content[a]]:
            for y in same[content[b]]:
                if (min(x, y), max(x, y)) not in kept:
                    cos = float(vecs[pos[x]] @ vecs[pos[y]])
                    near.setdefault(x, {})[y] = near.setdefault(y, {})[x] = cos
                    kept[min(x, y), max(x, y)] = s
    crowded = {i for i, nb in near.items() if len({content[j] for j in nb}) >= CROWD}  # no group over CROWD
    for i in crowded:  # too little of its own to tell a copy from another such photo: no near link
        for j in near.pop(i):
            near.get(j, {}).pop(i, None)
            kept.pop((min(i, j), max(i, j)), None)
    turned = sum(1 for i, nb in links.items() for j in nb
                 if i < j and content[i] != content[j] and (i, j) not in kept)
    return near, kept, {"proposed": len(proposed.pairs) + len(family), "taken_apart": int(apart.sum()),
                        "crop_families": len(family), "verified": len(kept),
                        "turned_down": turned,
                        "unchecked": len(ids) - len(frames_), "crowded": len(crowded),
                        "checked": len(pairs) - reused, "reused": reused, "frames_made": frames_.made,
                        "windows_made": frames_.windows_made, "looked_up": proposed.searched}


def _space_key(index: ImageIndex) -> str:
    """What the model's neighbours of a photo are found in: the index's backbone, space and dimension."""
    space = index.space.digest if index.space is not None else "raw"
    return f"{index.meta.get('backbone_sha256')}|{space}|{index.dim}"


def _version(row: Row) -> int:
    """A photo's version (:func:`index.duplicates.dedup_cache.photo_version`)."""
    return photo_version(row.hash, row.thumb, row.path, row.size, row.mtime_ns)


STAGE_SECONDS: dict[str, float] = {}  # each stage's wall time in the last search of this process (for benches)
STAGE_MEMORY: dict[str, tuple[int, int]] = {}  # at each stage's end: (resident bytes, peak resident bytes so far)


def _note_memory(name: str) -> None:
    """Note this process's resident and peak resident memory at the end of stage ``name`` in
    :data:`STAGE_MEMORY` (where the system tells them: Linux's /proc), for benches to say where the peak is."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    try:
        STAGE_MEMORY[name] = (int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024)
    except (KeyError, ValueError, IndexError):
        return


@contextlib.contextmanager
def _stage(name: str, total: int, unit: str, enabled: bool) -> Iterator[Any]:
    """A progress bar of one stage of a search (its rate and time left), shown only when ``enabled``; the stage's
    wall time goes to :data:`STAGE_SECONDS`."""
    from tqdm.auto import tqdm

    start = time.perf_counter()
    with tqdm(total=total, desc=name, unit=unit, disable=not enabled, dynamic_ncols=True, leave=True,
              mininterval=1.0) as bar:
        yield bar
    STAGE_SECONDS[name] = round(time.perf_counter() - start, 2)
    _note_memory(name)


def _graph(index: ImageIndex, ids: np.ndarray, vecs: np.ndarray, content: np.ndarray, low: float,
           chunk: int, versions: Mapping[int, int], progress: bool
           ) -> tuple[dict[int, dict[int, float]], int, ModelFound]:
    """Neighbours at centred cosine >= ``low`` (:func:`_model_links`), photos of the same bytes linked (1.0), the
    user's "not duplicates" pairs unlinked; how many photos were searched for them, and their closest photos."""
    graph, searched, found = _model_links(index, ids, vecs, low, chunk, versions, progress)
    by_content: dict[int, list[int]] = {}
    for i, c in zip(ids.tolist(), content.tolist()):
        by_content.setdefault(c, []).append(i)
    for same in by_content.values():
        for a in same:
            for b in same:
                if a != b:
                    graph.setdefault(a, {})[b] = 1.0
    for a, b in index.catalog.not_duplicate_pairs():
        graph.get(a, {}).pop(b, None)
        graph.get(b, {}).pop(a, None)
    return graph, searched, found


def _centred(index: ImageIndex, raw: np.ndarray, chunk: int = 8192) -> np.ndarray:
    """``index.to_space(raw)``, in place a chunk at a time where it keeps the dimension: one copy of the vectors at a
    time (2 GB a copy at 1,000,000 photos of 512 dimensions), the temporaries of a chunk small (17 MB a copy)."""
    raw = np.ascontiguousarray(raw, np.float32)  # N x D
    for start in range(0, len(raw), chunk):
        part = index.to_space(raw[start : start + chunk])  # B x D'
        if part.shape[1] != raw.shape[1]:
            return index.to_space(raw)
        raw[start : start + chunk] = part
    return raw


def _decide(index: ImageIndex, vecs: np.ndarray, content: np.ndarray, ids: np.ndarray, threshold: float | None,
            similar: float | None) -> dict[str, Any]:
    """The thresholds of a search (:func:`index.calibrate.near_threshold`), ``threshold`` given or not."""
    sample = sample_ids(np.arange(len(ids)), GUARD_SAMPLE, np.random.default_rng(0))
    first, kth = neighbour_levels(vecs, content, sample)
    base_rule = "calibrated" if isinstance(index.meta.get("dedup_calibration"), dict) else "default"
    decision = near_threshold(dedup_threshold(index), base_rule, first, kth, similar)
    decision["base_source"] = threshold_source(index)
    if threshold is not None:
        if decision["similar_threshold"] >= threshold and similar is None:
            decision["similar_threshold"] = round(threshold - 0.05, 4)
        decision.update(threshold=float(threshold), rule="given")
    if decision["similar_threshold"] > decision["threshold"]:
        raise UserError(f"--similar-threshold {decision['similar_threshold']} is above the near threshold "
                        f"{decision['threshold']}: similar photos are further apart than near-duplicates; give a "
                        "lower one")
    return decision


def _check_kinds(kinds: Iterable[str]) -> tuple[str, ...]:
    kinds = tuple(dict.fromkeys(kinds))
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        raise UserError(f"kind {', '.join(map(repr, bad)) or '(none)'}: choose among {', '.join(KINDS)}")
    return kinds


@dataclass
class Search:
    """A search for duplicates: its groups, its thresholds with their rule (:func:`index.calibrate.near_threshold`,
    with ``kinds`` and the pixel check's ``copy_score``, ``proposed``, ``verified``, ``turned_down``, ``unchecked``
    and ``crowded``) and the photos searched."""

    groups: list[Group]
    decision: dict[str, Any]
    images: int


def find_duplicates(index: ImageIndex, threshold: float | None = None, save: bool = True, chunk: int = 1024,
                    kinds: Iterable[str] = DEFAULT_KINDS, similar_threshold: float | None = None,
                    exclude_folders: Sequence[str] = ()) -> list[Group]:
    """The groups of :func:`search_duplicates`."""
    return search_duplicates(index, threshold, kinds, similar_threshold, save, chunk, exclude_folders).groups


def search_duplicates(index: ImageIndex, threshold: float | None = None, kinds: Iterable[str] = DEFAULT_KINDS,
                      similar_threshold: float | None = None, save: bool = True, chunk: int = 1024,
                      exclude_folders: Sequence[str] = (), progress: bool = False,
                      workers: int | None = None) -> Search:
    """Groups of duplicates of ``kinds`` (:data:`~index.duplicates.groups.KINDS`), each group in the order exact,
    near, similar, then largest first.

    Each group a :class:`~index.duplicates.groups.Group`: ``id`` (:func:`~index.duplicates.groups.group_id`),
    ``kind``, ``size``, ``representative`` (id, path), ``tightest`` and ``loosest`` (the highest and lowest cosine of
    a member to the representative), ``keep`` and ``keep_id`` (the suggested keeper, :mod:`index.duplicates.keeper`),
    ``reason`` (why that one), and ``members`` (the representative first, then by that cosine), each a
    :class:`~index.duplicates.groups.Member`. ``threshold``: the near threshold (None: the
    index's, guarded, see the module docstring); ``similar_threshold``: None: measured. ``exclude_folders``: the
    photos under these sub-folders are left out (never grouped, never moved). Written to ``dedup.json`` in the index
    directory with the thresholds and their rule when ``save`` (:func:`save_duplicates`). ``progress``: a bar for
    each stage of the pixel check (frames, proposals, the check), with its rate and time left, on stderr.
    ``workers``: processes of the pixel check (None: every core; 0: this process alone;
    :mod:`index.duplicates.check_workers`).
    """
    exit_if_importing_main()  # a script's top-level call, run again by a pixel-check worker: that worker stops there
    STAGE_SECONDS.clear()
    STAGE_MEMORY.clear()
    kinds = _check_kinds(kinds)
    if workers is not None and workers < 0:
        raise UserError(f"--workers {workers}: give the pixel check's processes, 0 or more (0: none besides this one)")
    if threshold is not None and not -1.0 <= threshold <= 1.0:
        raise UserError(f"--threshold {threshold} must be a cosine similarity in [-1, 1] (e.g. "
                        f"{dedup_threshold(index)})")
    if similar_threshold is not None and not -1.0 <= similar_threshold <= 1.0:
        raise UserError(f"--similar-threshold {similar_threshold} must be a cosine similarity in [-1, 1]")
    ids, raw = index.catalog.vectors(dim=index.dim)  # N, N x D
    rows = index.catalog.rows_by_id(ids)
    versions = {i: _version(r) for i, r in rows.items()}  # every photo's, excluded ones too (their kept work stays)
    keep = row_filter(exclude_folders=exclude_folders)
    if keep is not None:
        mask = np.array([int(i) in rows and keep(rows[int(i)]) for i in ids], bool)  # N
        ids, raw = ids[mask], raw[mask]  # M, M x D
    content = _content(ids, rows)
    vecs = _centred(index, raw)  # N x D, as search scores
    del raw
    decision = _decide(index, vecs, content, ids, threshold, similar_threshold)
    _note_memory("vectors")
    near_t, similar_t = decision["threshold"], decision["similar_threshold"]
    graph, linked, found = _graph(index, ids, vecs, content, similar_t if SIMILAR in kinds else near_t, chunk,
                                  versions, progress)
    by_id = dict(zip(ids.tolist(), content.tolist()))
    model_links = {i: {j: s for j, s in nb.items() if s >= near_t and by_id[j] != by_id[i]} for i, nb in graph.items()}
    near, copy_of, counts = verify_links(index, ids, vecs, by_id, rows, model_links, chunk, progress, versions,
                                         workers, found)
    del found
    for i, nb in graph.items():  # the same bytes: always near
        for j, s in nb.items():
            if by_id[j] == by_id[i]:
                near.setdefault(i, {})[j] = s
    for a, b in index.catalog.not_duplicate_pairs():
        near.get(a, {}).pop(b, None)
        near.get(b, {}).pop(a, None)
    decision.update(copy_score=COPY_SCORE, propose_k=PROPOSE_K, pixel_depth=PIXEL_DEPTH, linked=linked, **counts)
    found = [(rep, members, EXACT if len({by_id[m] for m in members}) == 1 else NEAR, near)
             for rep, members in tight_groups(near)]
    if SIMILAR in kinds:
        taken = {m for _, members, _, _ in found for m in members}
        rest = {i: {j: s for j, s in nb.items() if j not in taken} for i, nb in graph.items() if i not in taken}
        found += [(rep, members, SIMILAR, rest) for rep, members in tight_groups(rest)]
    chosen = index.catalog.chosen_keepers()
    groups = []
    for rep, members, kind, links in found:
        live = [m for m in members if m in rows]
        if kind not in kinds or rep not in rows or len(live) < 2:
            continue  # not asked for, or deleted since the vectors were read
        groups.append(_group(index, kind, rep, live, links, rows, chosen, copy_of))
    rank = {k: n for n, k in enumerate(KINDS)}
    groups.sort(key=lambda g: (rank[g.kind], -g.size, g.representative.path))  # type: ignore[union-attr]
    decision["kinds"] = list(kinds)
    decision["given"] = {"threshold": threshold, "similar_threshold": similar_threshold,
                         "exclude_folders": list(exclude_folders)}
    if save:
        save_duplicates(index, groups, decision, len(ids))
    return Search(groups, decision, len(ids))


def _group(index: ImageIndex, kind: str, rep: int, live: list[int], links: Mapping[int, Mapping[int, float]],
           rows: Mapping[int, Row], chosen: set[int], copy_of: Mapping[tuple[int, int], float]) -> Group:
    """One group as :func:`find_duplicates` returns it."""
    sim = {m: 1.0 if m == rep else round(links[rep][m], 5) for m in live}
    same = {m for m in live if rows[m].hash and rows[m].hash == rows[rep].hash}
    copy = {m: 1.0 if m in same else copy_of.get((min(m, rep), max(m, rep))) for m in live}
    others = [sim[m] for m in live if m != rep]
    facts = {m: photo_facts(index.root, rows[m]) for m in live}
    keep, reason = suggest_keeper(list(facts.values()), chosen)
    members = tuple(Member(id=m, path=rows[m].path, thumb=rows[m].thumb, hash=rows[m].hash, similarity=sim[m],
                           copy_score=copy[m], best_similarity=round(max(links[m].values()), 5), **facts[m].as_dict())
                    for m in sorted(live, key=lambda m: (m != rep, -sim[m], rows[m].path)))
    return Group(id=group_id(kind, live), kind=kind, size=len(live), representative=Ref(rep, rows[rep].path),
                 tightest=max(others), loosest=min(others), keep=rows[keep].path, keep_id=keep, reason=reason,
                 members=members)


def save_duplicates(index: ImageIndex, groups: Sequence[Group], decision: dict[str, Any], images: int) -> None:
    """Write ``dedup.json`` (the groups, the thresholds and their rule, the settings asked for) and the thresholds in
    the catalog's meta (for ``stats``; a read-only catalog keeps its last)."""
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    saved = SavedSearch(threshold=decision["threshold"], similar_threshold=decision["similar_threshold"],
                        rule=decision["rule"], threshold_source=describe_threshold(decision), decision=decision,
                        kinds=tuple(decision.get("kinds", DEFAULT_KINDS)),
                        grouping="every member within the threshold of its representative", groups=tuple(groups),
                        images=images, created=now)
    write_duplicates(index.dir, saved)
    if not index.catalog.read_only:
        index.catalog.set_meta(DEDUP_LAST_KEY, json.dumps({**decision, "created": now, "groups": len(groups)}))


def write_duplicates(index_dir: str | Path, saved: SavedSearch) -> None:
    """Replace ``dedup.json`` with ``saved`` (atomically: a reader sees the old or the new one)."""
    data = (json.dumps(saved.to_json(), indent=1) + "\n").encode()
    atomic_write(Path(index_dir) / DEDUP_FILE, lambda f: f.write(data))


def find_group(saved: SavedSearch, gid: str, index_dir: str | Path) -> Group:
    """The group ``gid`` of a saved search; a NotFoundError naming it and the fix when it has none."""
    group = saved.group(gid)
    if group is None:
        raise NotFoundError(f"no group {gid!r} in the last search ({Path(index_dir) / DEDUP_FILE}, {saved.created}): "
                            f"find the duplicates again (`moco index dedup {index_dir}`) and use one of its group ids")
    return group


def load_duplicates(index_dir: str | Path) -> SavedSearch | None:
    """The last saved search (``dedup.json``), or None when there is none; a file that is not what
    :func:`search_duplicates` writes (unreadable, not JSON, a key missing, a value of the wrong type) is a UserError
    naming it and the fix. A file of an older version loads (:meth:`~index.duplicates.groups.Group.from_json`)."""
    path = Path(index_dir) / DEDUP_FILE
    if not path.is_file():
        return None
    try:
        return SavedSearch.from_json(json.loads(path.read_text()))
    except ValueError as e:
        problem = str(e) if not isinstance(e, (json.JSONDecodeError, UnicodeDecodeError)) else \
            f"not readable as JSON: {type(e).__name__}"
    except (OSError, RecursionError) as e:
        problem = f"not readable as JSON: {type(e).__name__}"
    raise UserError(f"{path} is damaged ({problem}): find the near-duplicates again (`moco index dedup "
                    f"{Path(index_dir)}` or the page's Find near-duplicates) to write it anew")
