"""Acting on duplicates with real files: three kinds of groups, a keeper chosen, moves out of the collection and back
through the real CLI (a real subprocess SIGKILLed in the middle of a move), a name taken at the destination, a move
across file systems (a real tmpfs), "not duplicates" kept through `moco index update`, and the refusals (a folder
inside the collection, a link out of it, a read-only collection or index). After every step every photo is
byte-identical at exactly one place. Real SQLite, FAISS and a real (randomly initialized) ResNet-18.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageEnhance, ImageOps

from app.cli.commands import main
from index.building.plan import file_hash
from index.building.runner import build_index, update_index
from index.calibrate import CROWD, MIN_PHOTOS, near_threshold, neighbour_levels
from index.duplicates.dedup import KINDS, load_duplicates, search_duplicates
from index.duplicates.keeper import CHOSEN, Facts, format_rank, named_as_copy, suggest_keeper
from index.duplicates.propose import (
    ALIKE_TIE,
    CROP_SIDE,
    MODEL_FIRST,
    PIXEL_ALIKE,
    PIXEL_DEPTH,
    PIXEL_SIDE,
    crop_windows,
    proposals,
)
from index.duplicates.resolve.actions import DUPLICATES_DIR, PAUSE_ENV, destination, move_duplicates, undo_moves
from index.duplicates.resolve.journal import MARK_FILE, Journal
from index.duplicates.resolve.transfer import PARTIAL_SUFFIX, TransferError, free_name, transfer
from index.duplicates.verify import COPY_SCORE, frames
from index.search.image_index import ImageIndex
from moco.data.sample import make_sample_collection
from moco.errors import UserError

from .mounts import remount_ro, tmpfs

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------- the collection
def _collection(root: Path) -> dict[str, list[str]]:
    """4 families x 4 photos of 64 px; in ``inbox/``: an exact copy of one photo (newer) and a 75% JPEG q80 copy of
    another (as PNG). Returns the expected groups by kind: their paths."""
    make_sample_collection(root, per_family=4, size=64, seed=1)
    shutil.rmtree(root / "stars")  # near-uniform star fields: a random network cannot tell them apart
    photos = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.jpg"))
    (root / "inbox").mkdir()
    exact, near = photos[0], photos[6]
    shutil.copyfile(root / exact, root / "inbox" / "exact.jpg")
    old = (root / exact).stat().st_mtime
    os.utime(root / "inbox" / "exact.jpg", (old + 100, old + 100))  # the copy is the newer file
    img = Image.open(root / near).convert("RGB")
    buf = io.BytesIO()
    img.resize((48, 48), Image.Resampling.BICUBIC).save(buf, "JPEG", quality=80)
    Image.open(io.BytesIO(buf.getvalue())).save(root / "inbox" / "small.png")
    return {"exact": [exact, "inbox/exact.jpg"], "near": [near, "inbox/small.png"]}


def _bytes(root: Path) -> dict[str, str]:
    """Every file under ``root`` (hidden ones too, but a destination's mark): relative path -> blake2b of its bytes."""
    return {p.relative_to(root).as_posix(): hashlib.blake2b(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != MARK_FILE}


def _where(before: dict[str, str], photos: Path, dest: Path) -> dict[str, str]:
    """Where each photo of ``before`` is now: "root" or "dest" (the same relative path), each at exactly one place
    with its bytes; nothing else under either (no partial copy, no stray file)."""
    now_dest = _bytes(dest) if dest.exists() else {}
    now_root = {p: d for p, d in _bytes(photos).items() if dest not in (photos / p).parents}  # dest may be inside
    out = {}
    for path, digest in before.items():
        places = [w for w, files in (("root", now_root), ("dest", now_dest)) if files.get(path) == digest]
        assert len(places) == 1, (path, places)
        out[path] = places[0]
    assert set(now_root) | set(now_dest) == set(before) and not set(now_root) & set(now_dest)
    return out


def _indexed(idx: Path) -> set[str]:
    index = ImageIndex.open(idx)
    paths = set(index.catalog.rows())
    assert len(index) == len(paths)  # index.faiss holds what the catalog lists
    return paths


@pytest.fixture()
def coll(backbone, tmp_path) -> dict:
    photos = tmp_path / "photos"
    expected = _collection(photos)
    build_index(photos, backbone, tmp_path / "idx", progress=False, device="cpu")
    return {"photos": photos, "idx": tmp_path / "idx", "dest": tmp_path / "dups", "expected": expected,
            "before": _bytes(photos), "tmp": tmp_path}


def _groups(idx: Path, kinds=("exact", "near")) -> list[dict]:
    return search_duplicates(ImageIndex.open(idx), kinds=kinds).groups


# ---------------------------------------------------------------------------------------------- the kinds
def test_exact_near_and_similar_groups(coll):
    index = ImageIndex.open(coll["idx"])
    found = search_duplicates(index)
    by_kind = {g.kind: sorted(m.path for m in g.members) for g in found.groups}
    assert [g.kind for g in found.groups] == ["exact", "near"]
    assert by_kind == {k: sorted(v) for k, v in coll["expected"].items()}
    exact, near = found.groups
    assert exact.keep == coll["expected"]["exact"][0] and exact.reason.startswith("oldest file")
    assert near.keep == coll["expected"]["near"][0] and near.reason == "most pixels (64 x 64)"
    assert exact.id.startswith(f"exact-{min(m.id for m in exact.members)}-")
    d = found.decision
    assert d["rule"] in ("calibrated", "crowd") and d["threshold"] >= d["base"] and d["similar_threshold"] < \
        d["threshold"]
    saved = load_duplicates(coll["idx"])
    assert list(saved.groups) == found.groups and saved.rule == d["rule"] and saved.kinds == ("exact", "near")
    assert index.stats()["dedup_last"]["rule"] == d["rule"]  # stats say which rule set the threshold
    # similar groups only when asked, never holding a photo of an exact or near group, each member within the
    # similar threshold of its representative (brute force)
    again = search_duplicates(index, kinds=KINDS)
    assert again.groups[:2] == found.groups  # the same ids: stable across searches
    similar = [g for g in again.groups if g.kind == "similar"]
    assert similar, "the families of the sample give similar photos"
    taken = {m.id for g in found.groups for m in g.members}
    ids, raw = index.catalog.vectors(dim=index.dim)
    vecs = dict(zip(ids.tolist(), index.to_space(raw)))
    for g in similar:
        rep = g.representative.id
        assert not taken & {m.id for m in g.members}
        assert all(vecs[rep] @ vecs[m.id] >= again.decision["similar_threshold"] - 1e-5 for m in g.members)
        assert any(vecs[rep] @ vecs[m.id] < again.decision["threshold"] for m in g.members)  # not near


def test_the_crowd_level_against_brute_force_and_its_guard():
    rng = np.random.default_rng(0)
    v = rng.standard_normal((300, 8)).astype(np.float32)
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    content = np.arange(300)
    content[10:13] = 10  # three photos of the same bytes: not other photos of each other
    sample = np.array([0, 10, 11, 50, 299])
    first, kth = neighbour_levels(v, content, sample, k=CROWD)
    for n, i in enumerate(sample):
        other = sorted((float(v[i] @ v[j]) for j in range(300) if content[j] != content[i]), reverse=True)
        assert first[n] == pytest.approx(other[0], abs=1e-5) and kth[n] == pytest.approx(other[CROWD - 1], abs=1e-5)
    # alike photos (8 dimensions): the crowd is closer than the calibrated threshold, which is raised above it
    all_first, all_kth = neighbour_levels(v, content, np.arange(300))
    d = near_threshold(0.5, "calibrated", all_first, all_kth)
    crowd = np.quantile(all_kth, 0.99)
    assert d["rule"] == "crowd" and d["crowd_level"] >= crowd - 1e-4 and d["threshold"] > d["crowd_level"] > 0.5
    assert np.mean(all_kth >= d["threshold"]) <= 0.01  # above it, 99 photos in 100 have fewer than CROWD others
    kept = near_threshold(0.999, "calibrated", all_first, all_kth)
    assert kept["rule"] == "calibrated" and kept["threshold"] == 0.999
    assert near_threshold(0.9, "default", all_first[: MIN_PHOTOS - 1], all_kth[: MIN_PHOTOS - 1])["crowd_level"] is None


def _first(others: list[int], ncc: Callable[[int], float], k: int = 2, depth: int = PIXEL_DEPTH,
           large: bool = False) -> list[int]:
    """What a search proposes of its k closest photos, by hand: of a small photo's, the first ``depth`` (a pixel
    search's PIXEL_DEPTH, the model's MODEL_FIRST) and those at PIXEL_ALIKE or more within ALIKE_TIE of the first;
    of a large photo's, the first ``depth`` of those under PIXEL_ALIKE, and every one at PIXEL_ALIKE or more."""
    near = sorted(others, key=lambda j: -ncc(j))[:k]
    if not large:
        return [j for n, j in enumerate(near)
                if n < depth or (ncc(j) >= PIXEL_ALIKE and ncc(near[0]) - ncc(j) <= ALIKE_TIE)]
    return [j for n, j in enumerate(near) if ncc(j) >= PIXEL_ALIKE
            or sum(ncc(o) < PIXEL_ALIKE for o in near[:n]) < depth]


def test_a_model_that_links_every_pair_groups_only_copies(backbone, tmp_path):
    """At a threshold of -1 every pair of photos is a link of the model (the weakest model there is, or a collection
    of very alike photos): the pixel check turns down every pair of distinct photos and keeps the copies, a
    brightened one and one cropped off-centre among them; proposals brute-forced by hand agree."""
    root = tmp_path / "photos"
    make_sample_collection(root, per_family=3, size=96, seed=2)
    paths = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.jpg"))
    (root / "copies").mkdir()
    a, b, c = (Image.open(root / paths[n]).convert("RGB") for n in (0, 4, 8))
    ImageEnhance.Brightness(a).enhance(1.3).save(root / "copies" / "brighter.png")
    b.crop((2, 11, 2 + 82, 11 + 82)).save(root / "copies" / "cropped.png")  # 85%, off-centre
    ImageOps.mirror(c).save(root / "copies" / "mirrored.png")
    build_index(root, backbone, tmp_path / "idx", progress=False, device="cpu")
    index = ImageIndex.open(tmp_path / "idx")
    found = search_duplicates(index, threshold=-1.0, save=False)
    got = sorted(sorted(m.path for m in g.members) for g in found.groups)
    assert got == sorted([sorted([paths[0], "copies/brighter.png"]), sorted([paths[4], "copies/cropped.png"]),
                          sorted([paths[8], "copies/mirrored.png"])])
    assert all(g.kind == "near" and all(m.copy_score >= COPY_SCORE for m in g.members)
               for g in found.groups)
    d = found.decision
    n = len(paths) + 3
    assert d["rule"] == "given" and d["proposed"] == n * (n - 1) // 2 and d["verified"] == 3
    assert d["turned_down"] == d["proposed"] - 3 and d["unchecked"] == 0
    # without the model's links, the proposals are what _first keeps of each photo's 2 closest by the model, by whole
    # pixels and by crops (the photos whose frames match one of its windows best), by hand
    ids, raw = index.catalog.vectors(dim=index.dim)
    rows = index.catalog.rows_by_id(ids)
    content = {int(i): int(i) for i in ids}
    fr = frames({int(i): index.thumb_path(rows[int(i)]) for i in ids}, lambda i: None)
    vecs = index.to_space(raw)
    got = proposals(index.store, ids, vecs, content, fr, {}, chunk=4, k=2).pairs
    sim = vecs @ vecs.T  # N x N
    np.fill_diagonal(sim, -np.inf)
    flat: dict[int, dict[int, list[np.ndarray]]] = {PIXEL_SIDE: {}, CROP_SIDE: {}}
    for side, i in ((side, i) for side in flat for i in ids.tolist()):
        g = np.asarray(Image.fromarray(fr[i].grey).resize((side, side), Image.Resampling.BOX), np.float32)
        flat[side][i] = [(x - x.mean()) / np.linalg.norm(x - x.mean()) for x in (g.ravel(), g[:, ::-1].ravel())]
    windows = {i: crop_windows(fr[i]) for i in ids.tolist()}
    col = {j: c for c, j in enumerate(ids.tolist())}  # a photo's row and column of sim

    def by_hand(large: set[int]) -> set[tuple[int, int]]:
        want = set()
        for n, i in enumerate(ids.tolist()):
            others = [j for j in ids.tolist() if j != i]
            big = i in large
            near = _first(others, lambda j, n=n: float(sim[n, col[j]]), depth=2 if big else MODEL_FIRST, large=big)
            want |= {(min(i, j), max(i, j)) for j in near}
            for q in flat[PIXEL_SIDE][i]:
                near = _first(others, lambda j, q=q: float(q @ flat[PIXEL_SIDE][j][0]), large=big)
                want |= {(min(i, j), max(i, j)) for j in near}
            for mirrored in (False, True):  # the photos whose whole frames match one of i's windows best
                w = windows[i].reshape(-1, CROP_SIDE, CROP_SIDE)
                w = (w[:, :, ::-1] if mirrored else w).reshape(len(w), -1)
                near = _first(others, lambda j, w=w: float((w @ flat[CROP_SIDE][j][0]).max()), large=big)
                want |= {(min(i, j), max(i, j)) for j in near}
        return want

    want = by_hand(set())
    assert {(int(a), int(b)) for a, b in got} == want and len(got) == len(want)
    # a large photo (its crops seen at a few pixels by the pixel searches) puts forward all 2 of the model's closest,
    # and every neighbour of its searches at PIXEL_ALIKE or more
    large = set(ids[::2].tolist())
    got = proposals(index.store, ids, vecs, content, fr, {}, chunk=4, k=2, large=large).pairs
    deep = {(min(i, j), max(i, j)) for i in large for j in ids[np.argsort(-sim[col[i]])[:2]].tolist()}
    assert deep - want  # the model's second closest of some photos: proposed by no other search
    assert {(int(a), int(b)) for a, b in got} == by_hand(large) and deep <= by_hand(large)


def test_a_photo_that_matches_crowd_others_by_pixels_has_no_near_link(backbone, tmp_path):
    """Eleven shades of one smooth picture (a sky, a gradient: each a copy by pixels of every other) are a crowd, not
    copies: none of them is grouped; a photo and three shades of it are one near group."""
    root = tmp_path / "photos"
    make_sample_collection(root, per_family=2, size=64, seed=4)
    (root / "shades").mkdir()
    ramp = np.linspace(40, 200, 64, dtype=np.float32)[None, :] + np.linspace(0, 30, 64, dtype=np.float32)[:, None]
    for n in range(CROWD + 1):  # 11 shades of the gradient: 10 others each, CROWD
        Image.fromarray(np.clip(ramp * (0.7 + 0.05 * n), 0, 255).astype(np.uint8)).convert("RGB").save(
            root / "shades" / f"sky{n:02d}.png")
    first = sorted(root.rglob("*.jpg"))[0]
    other = Image.open(first).convert("RGB")
    for n in range(3):
        ImageEnhance.Brightness(other).enhance(0.9 + 0.1 * n).save(root / "shades" / f"photo{n}.png")
    build_index(root, backbone, tmp_path / "idx", progress=False, device="cpu")
    found = search_duplicates(ImageIndex.open(tmp_path / "idx"), threshold=-1.0, save=False)
    near = [sorted(m.path for m in g.members) for g in found.groups if g.kind == "near"]
    assert near == [sorted([first.relative_to(root).as_posix(), *(f"shades/photo{n}.png" for n in range(3))])]
    assert found.decision["crowded"] == CROWD + 1


def test_photos_of_the_same_bytes_share_their_copies(backbone, tmp_path, monkeypatch):
    """Only the pair (brighter copy, photo) is proposed; the photo's exact copy is linked to the brighter copy too, so
    greedy grouping can never put a photo and its exact copy in two groups."""
    import index.duplicates.dedup as dedup

    root = tmp_path / "photos"
    make_sample_collection(root, per_family=2, size=96, seed=6)
    photo = sorted(root.rglob("*.jpg"))[0]
    shutil.copyfile(photo, root / "same.jpg")
    ImageEnhance.Brightness(Image.open(photo).convert("RGB")).enhance(1.2).save(root / "brighter.png")
    build_index(root, backbone, tmp_path / "idx", progress=False, device="cpu")
    index = ImageIndex.open(tmp_path / "idx")
    ids, raw = index.catalog.vectors(dim=index.dim)
    rows = index.catalog.rows_by_id(ids)
    by_path = {r.path: i for i, r in rows.items()}
    p, same, b = by_path[photo.relative_to(root).as_posix()], by_path["same.jpg"], by_path["brighter.png"]
    content = {int(i): int(i) for i in ids}
    content[same] = content[p]
    monkeypatch.setattr(dedup, "proposals", functools.partial(dedup.proposals, k=0))  # no k-NN proposals: links
    near, copy_of, counts = dedup.verify_links(index, ids, index.to_space(raw), content, rows,
                                                {b: {p: 0.5}, p: {b: 0.5}})
    assert counts["proposed"] == 1 and set(near[b]) == {p, same} and set(near[same]) == {b}
    assert copy_of[min(b, same), max(b, same)] == copy_of[min(b, p), max(b, p)] >= COPY_SCORE


KEEPER_CASES = [  # (width, height, bytes, taken, mtime) per member, the keeper's position, the reason's start
    ([(64, 64, 10, None, 5), (48, 48, 99, 1.0, 1)], 0, "most pixels (64 x 64)"),
    ([(64, 64, 10, None, 5), (64, 64, 11, None, 9)], 0, "oldest file"),  # a larger copy made later: not kept
    ([(64, 64, 10, None, 8), (64, 64, 11, None, 9)], 1, "largest file"),  # one 2-second step of file time
    ([(64, 64, 10, None, 8.5), (64, 64, 10, None, 8.2)], 1, "oldest file"),  # the same bytes: the older, exactly
    ([(64, 64, 99, None, 1), (64, 64, 10, 7.0, 9)], 1, "has a date taken"),  # the camera's file over a larger one
    ([(64, 64, 10, None, 1), (64, 64, 10, 7.0, 9)], 1, "has a date taken"),
    ([(64, 64, 10, 9.0, 1), (64, 64, 10, 7.0, 9)], 1, "earliest date taken"),
    ([(64, 64, 10, None, 9), (64, 64, 10, None, 3), (64, 64, 10, None, 4)], 1, "oldest file"),
    ([(64, 64, 10, None, 3), (64, 64, 10, None, 3)], 0, "the same pixels"),
    ([(None, None, 10, None, 3), (2, 2, 1, None, 9)], 1, "most pixels (2 x 2)"),
]


@pytest.mark.parametrize("members, want, reason", KEEPER_CASES)
def test_the_keeper_rule(members, want, reason):
    facts = [Facts(i, f"p{i}.jpg", w, h, b, t, m) for i, (w, h, b, t, m) in enumerate(members)]
    # by hand: most pixels, then with a date, then earliest date, then oldest (2-s steps), largest, smallest id (one
    # format, and names too short to be a copy's: those rules tie)
    ref = min(facts, key=lambda f: (-f.pixels, f.taken is None, f.taken or 0, f.mtime // 2, -f.bytes, f.mtime, f.id))
    keep, why = suggest_keeper(facts)
    assert keep == ref.id == want and why.startswith(reason)
    assert suggest_keeper(facts, chosen={facts[-1].id}) == (facts[-1].id, CHOSEN)


def _edited(img: Image.Image, edit: str) -> tuple[Image.Image, str, dict]:
    """An edited copy of ``img``: the image, the format it is saved in and the save settings."""
    if edit == "jpeg50":
        return img, "JPEG", {"quality": 50}
    if edit == "webp":
        return img, "WEBP", {"quality": 75}
    if edit == "shrunk":
        return img.resize((26, 26), Image.Resampling.BICUBIC).resize(img.size, Image.Resampling.BICUBIC), "PNG", {}
    if edit == "cropped":
        return img.crop((2, 2, img.width - 2, img.height - 2)), "PNG", {}
    if edit == "brightened":
        return ImageEnhance.Brightness(img).enhance(1.15), "PNG", {}
    if edit == "contrast":
        return ImageEnhance.Contrast(img).enhance(1.3), "PNG", {}
    if edit == "gamma":
        return img.point(lambda v: round(255 * (v / 255) ** 0.8)), "PNG", {}
    return ImageOps.mirror(img), "PNG", {}


COPY_NAMES = ("{} (1)", "{}-edited", "{} - Copy", "Copy of {}", "{}_copy")  # what apps name a copy


@pytest.mark.parametrize("edit", ["jpeg50", "webp", "shrunk", "cropped", "brightened", "contrast", "gamma", "mirror"])
@pytest.mark.parametrize("original_format", ["PNG", "JPEG"])
def test_the_keeper_is_the_original_over_each_kind_of_edited_copy(tmp_path, edit, original_format):
    """Real files, as a copy is made: the same second, the copy often larger (a brightened PNG of a JPEG photo);
    whatever the order of the members, the original is kept, for the reason that tells them apart."""
    rng = np.random.default_rng(3)
    img = Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).resize((32, 32), Image.Resampling.BICUBIC)
    suffix = {"PNG": ".png", "JPEG": ".jpg", "WEBP": ".webp"}
    original = tmp_path / f"IMG_0042{suffix[original_format]}"
    img.save(original, original_format, **({"quality": 92} if original_format == "JPEG" else {}))
    copy_img, fmt, kw = _edited(img, edit)
    for name in COPY_NAMES:
        copy = tmp_path / (name.format("IMG_0042") + suffix[fmt])
        copy_img.save(copy, fmt, **kw)
        os.utime(copy, ns=(original.stat().st_mtime_ns,) * 2)  # one second: the file times do not tell them apart
        for order in ((original, copy), (copy, original)):
            facts = [Facts(i, p.name, *Image.open(p).size, p.stat().st_size, None, p.stat().st_mtime)
                     for i, p in enumerate(order)]
            keep, why = suggest_keeper(facts)
            assert order[keep] == original, (edit, copy.name, why)
        copy.unlink()


def test_a_copys_name_and_a_formats_rank():
    assert named_as_copy("a/IMG_1 (1).jpg", ["b/IMG_1.jpg"]) and named_as_copy("Copy of IMG_1.png", ["IMG_1.jpg"])
    assert named_as_copy("img_1-EDITED.jpg", ["IMG_1.JPG"])  # case aside
    assert not named_as_copy("IMG_12.jpg", ["IMG_1.jpg"])  # another photo's number, not a copy's name
    assert not named_as_copy("IMG_1.jpg", ["IMG_1.png", "IMG_1 (1).jpg"])  # the same name: no copy of itself
    assert not named_as_copy("ab (1).jpg", ["ab.jpg"])  # a name this short is inside too many others
    assert [format_rank(p) for p in ("a.NEF", "a.png", "a.tiff", "a.jpg", "a.heic", "a.webp", "a.gif")] == [
        2, 1, 1, 1, 1, 0, 0]
    facts = [Facts(0, "IMG_5.webp", 64, 64, 999, None, 1.0), Facts(1, "IMG_5 (2).jpg", 64, 64, 10, None, 9.0)]
    assert suggest_keeper(facts) == (1, "least processed format (a camera's or an editor's format)")  # before names


# ------------------------------------------------------------------------------------------ the file layer
def test_a_transfer_finishes_wherever_a_kill_cut_it(tmp_path):
    src, dst = tmp_path / "a" / "p.jpg", tmp_path / "d" / "a" / "p.jpg"
    src.parent.mkdir()
    src.write_bytes(b"photo")
    digest = hashlib.blake2b(b"photo", digest_size=16).hexdigest()
    dst.parent.mkdir(parents=True)
    os.link(src, dst)  # cut after the link, before the unlink
    transfer(src, dst, digest)
    assert not src.exists() and dst.read_bytes() == b"photo"
    transfer(src, dst, digest)  # done already: nothing to do
    shutil.copyfile(dst, src)  # a copy across file systems, cut before the unlink: both complete
    transfer(src, dst, digest)
    assert not src.exists() and dst.read_bytes() == b"photo"
    transfer(dst, src, digest)  # and back, with a partial copy of an earlier try left beside it
    partial = dst.with_name(f".{dst.name}{PARTIAL_SUFFIX}")
    partial.write_bytes(b"pho")
    transfer(src, dst, digest)
    assert dst.read_bytes() == b"photo" and not src.exists() and not partial.exists()


def test_a_transfer_never_overwrites_nor_moves_a_changed_file_or_a_link(tmp_path):
    src, dst = tmp_path / "p.jpg", tmp_path / "d" / "p.jpg"
    src.write_bytes(b"photo")
    digest = hashlib.blake2b(b"photo", digest_size=16).hexdigest()
    dst.parent.mkdir()
    dst.write_bytes(b"another photo")
    with pytest.raises(TransferError, match="taken by another file"):
        transfer(src, dst, digest)
    assert src.read_bytes() == b"photo" and dst.read_bytes() == b"another photo"
    assert free_name(dst) == dst.with_name("p (2).jpg")
    with pytest.raises(TransferError, match="changed since it was indexed"):
        transfer(src, free_name(dst), hashlib.blake2b(b"x", digest_size=16).hexdigest())
    link = tmp_path / "link.jpg"
    link.symlink_to(src)
    with pytest.raises(TransferError, match="symbolic link"):
        transfer(link, tmp_path / "d" / "link.jpg", digest)
    assert src.read_bytes() == b"photo" and link.is_symlink() and not (tmp_path / "d" / "link.jpg").exists()


# ------------------------------------------------------------------------------------------ moves and undo
def test_move_and_undo_through_the_cli(coll, capsys):
    idx, photos, dest = str(coll["idx"]), coll["photos"], coll["dest"]
    capsys.readouterr()
    assert main(["index", "dedup", idx, "--move-to", str(dest), "--dry-run", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    moving = sorted(d["from"] for d in plan["done"])
    assert plan["dry_run"] and moving == ["inbox/exact.jpg", "inbox/small.png"]  # the keepers stay
    assert _bytes(photos) == coll["before"] and not dest.exists()  # a dry run moves nothing
    assert main(["index", "dedup", idx, "--move-to", str(dest), "--kind", "exact"]) == 0
    out = capsys.readouterr().out
    assert "1 photo moved" in out and "index updated" in out
    where = _where(coll["before"], photos, dest)
    assert [p for p, w in where.items() if w == "dest"] == ["inbox/exact.jpg"]  # its path kept under DIR
    assert "inbox/exact.jpg" not in _indexed(coll["idx"]) and "inbox/small.png" in _indexed(coll["idx"])
    assert main(["index", "dedup", idx, "--move-to", str(dest), "--json"]) == 0
    done = json.loads(capsys.readouterr().out)
    assert [d["from"] for d in done["done"]] == ["inbox/small.png"] and done["groups"] == 0
    assert _indexed(coll["idx"]) == set(coll["before"]) - set(moving)
    assert load_duplicates(coll["idx"]).groups == ()  # searched again: nothing left
    states = [e.state for e in Journal(ImageIndex.open(idx).catalog).outstanding()]
    assert states == ["moved", "moved"]
    assert main(["index", "dedup", idx, "--undo", "--json"]) == 0
    back = json.loads(capsys.readouterr().out)
    assert sorted(d["to"] for d in back["done"]) == moving and back["updated"]
    assert set(_where(coll["before"], photos, dest).values()) == {"root"}
    assert sorted(p.name for p in dest.rglob("*")) == [MARK_FILE]  # no empty inbox/ left behind; the mark stays
    assert _indexed(coll["idx"]) == set(coll["before"])
    assert sorted(sorted(m.path for m in g.members) for g in _groups(coll["idx"])) == sorted(
        map(sorted, coll["expected"].values()))  # the groups are back
    assert main(["index", "dedup", idx, "--undo"]) == 0 and "0 photos put back" in capsys.readouterr().out


@pytest.mark.parametrize("then", ["undo", "rerun"])
def test_a_kill_in_the_middle_of_a_move_is_finished_by_undo_or_a_rerun(coll, then, capsys):
    """`moco index dedup --move-to` in a real process, SIGKILLed after its first file (the test hook pauses it
    there): the journal has one move done and one planned; --undo puts back all, a re-run finishes the move."""
    idx, photos, dest = coll["idx"], coll["photos"], coll["dest"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **{PAUSE_ENV: "600"})
    proc = subprocess.Popen([sys.executable, "-m", "app.cli", "index", "dedup", str(idx), "--move-to", str(dest),
                             "--device", "cpu"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 600  # a guard against a hang, not a measurement
        while not (dest.exists() and any(p.is_file() for p in dest.rglob("*"))):
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "no file moved"
            time.sleep(0.2)
        journal = Journal(ImageIndex.open(idx).catalog)
        while [e.state for e in journal.outstanding()[::-1]] != ["moved", "planned"]:  # its commit after the file
            assert time.monotonic() < deadline
            time.sleep(0.1)
        capsys.readouterr()
        assert main(["index", "dedup", str(idx), "--undo"]) == 2  # one action at a time: the other is named
        assert f"is in use by another moco run (PID {proc.pid})" in capsys.readouterr().err
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    where = _where(coll["before"], photos, dest)  # killed: every photo whole, at one place
    assert sum(w == "dest" for w in where.values()) == 1
    batch = journal.last_batch()
    capsys.readouterr()
    if then == "undo":
        assert main(["index", "dedup", str(idx), "--undo", "--device", "cpu"]) == 0
        assert set(_where(coll["before"], photos, dest).values()) == {"root"}
        assert _indexed(idx) == set(coll["before"])
        assert [e.state for e in Journal(ImageIndex.open(idx).catalog).batch(batch)] == ["undone", "undone"]
    else:
        assert main(["index", "dedup", str(idx), "--move-to", str(dest), "--device", "cpu"]) == 0
        where = _where(coll["before"], photos, dest)
        assert sorted(p for p, w in where.items() if w == "dest") == ["inbox/exact.jpg", "inbox/small.png"]
        assert _indexed(idx) == set(coll["before"]) - {"inbox/exact.jpg", "inbox/small.png"}
        assert main(["index", "dedup", str(idx), "--move-to", str(dest)]) == 0  # nothing moved twice
        assert "0 photos moved" in capsys.readouterr().out
        assert main(["index", "dedup", str(idx), "--undo"]) == 0
        assert set(_where(coll["before"], photos, dest).values()) == {"root"}
    states = {e.state for e in Journal(ImageIndex.open(idx).catalog).outstanding()}
    assert states == set()


def test_a_name_taken_at_the_destination_gets_a_suffix(coll):
    dest = coll["dest"]
    (dest / "inbox").mkdir(parents=True)
    (dest / "inbox" / "small.png").write_bytes(b"somebody else's file")
    index = ImageIndex.open(coll["idx"])
    out = move_duplicates(index, _groups(coll["idx"]), dest)
    assert sorted(d["to"] for d in out.done) == sorted([str(dest / "inbox" / "exact.jpg"),
                                                        str(dest / "inbox" / "small (2).png")])
    assert (dest / "inbox" / "small.png").read_bytes() == b"somebody else's file"  # never overwritten
    moved = _bytes(dest)
    assert moved["inbox/small (2).png"] == coll["before"]["inbox/small.png"]
    (coll["photos"] / "inbox" / "exact.jpg").write_bytes(b"a new file where the moved one was")
    back = undo_moves(index)
    assert sorted(d["to"] for d in back.done) == ["inbox/exact (2).jpg", "inbox/small.png"]  # not over the new one
    assert (coll["photos"] / "inbox" / "exact.jpg").read_bytes() == b"a new file where the moved one was"
    assert _bytes(coll["photos"])["inbox/exact (2).jpg"] == coll["before"]["inbox/exact.jpg"]


def test_a_move_across_file_systems_copies_then_removes(coll):
    with tmpfs(coll["tmp"] / "mnt", "16m") as mnt:
        index = ImageIndex.open(coll["idx"])
        out = move_duplicates(index, _groups(coll["idx"]), mnt / "dups")
        assert len(out.done) == 2 and not out.skipped
        where = _where(coll["before"], coll["photos"], mnt / "dups")
        assert sorted(p for p, w in where.items() if w == "dest") == ["inbox/exact.jpg", "inbox/small.png"]
        assert not list((mnt / "dups").rglob(f"*{PARTIAL_SUFFIX}"))
        undo_moves(index)
        assert set(_where(coll["before"], coll["photos"], mnt / "dups").values()) == {"root"}


# ------------------------------------------------------------------------------------------- the user's say
def test_not_duplicates_and_a_chosen_keeper_survive_an_update(coll, capsys):
    idx = str(coll["idx"])
    exact, near = _groups(coll["idx"])
    assert main(["index", "dedup", idx, "--not-duplicates", near.id]) == 0
    assert "never grouped again" in capsys.readouterr().out
    assert [g.id for g in load_duplicates(idx).groups] == [exact.id]  # it left the saved search
    other = next(m for m in exact.members if m.id != exact.keep_id)
    assert main(["index", "dedup", idx, "--keep", str(other.id), "--json"]) == 0
    kept = json.loads(capsys.readouterr().out)
    assert [(g["id"], g["keep_id"], g["reason"]) for g in kept] == [(exact.id, other.id, CHOSEN)]
    (coll["photos"] / "new.jpg").write_bytes((coll["photos"] / sorted(coll["before"])[3]).read_bytes())
    update_index(idx, progress=False, device="cpu")  # a new photo (an exact copy of another), every row kept
    groups = _groups(coll["idx"])
    assert near.id not in [g.id for g in groups]
    assert not any({m.path for m in g.members} >= set(coll["expected"]["near"]) for g in groups)
    kept = next(g for g in groups if g.kind == "exact" and other.path in [m.path for m in g.members])
    assert kept.keep_id == other.id and kept.reason == CHOSEN
    assert any("new.jpg" in [m.path for m in g.members] for g in groups)  # new photos still group
    assert main(["index", "dedup", idx, "--not-duplicates", "near-0-000000"]) == 2
    assert "no group 'near-0-000000' in the last search" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------- refusals
def test_destinations_links_and_read_only_places_are_refused(coll, capsys):
    index = ImageIndex.open(coll["idx"])
    photos = coll["photos"]
    assert destination(index) == photos.resolve() / DUPLICATES_DIR
    for bad, words in ((photos / "kept", "inside the collection"), (coll["idx"] / "x", "inside the index directory")):
        with pytest.raises(UserError, match=words):
            destination(index, bad)
    outside = coll["tmp"] / "elsewhere"
    outside.mkdir()
    (photos / DUPLICATES_DIR).symlink_to(outside)
    with pytest.raises(UserError, match="leads outside the collection"):
        destination(index)  # the default: never out of the collection through a link
    assert destination(index, outside) == outside.resolve()  # named: allowed
    (photos / DUPLICATES_DIR).unlink()
    # a member that is a symbolic link is not moved (nor what it points to)
    target = photos / "inbox" / "small.png"
    moved_aside = coll["tmp"] / "small.png"
    shutil.move(target, moved_aside)
    target.symlink_to(moved_aside)
    capsys.readouterr()
    out = move_duplicates(index, _groups(coll["idx"]), coll["dest"], search=False)
    assert [s["reason"] for s in out.skipped if s["path"] == "inbox/small.png"] == [
        "a symbolic link: not moved (links are never followed)"]
    assert target.is_symlink() and moved_aside.is_file()


def test_a_read_only_collection_or_index_refuses_and_nothing_moves(backbone, tmp_path, capsys):
    with tmpfs(tmp_path / "mnt", "16m") as mnt:
        photos = mnt / "photos"
        _collection(photos)
        build_index(photos, backbone, tmp_path / "idx", progress=False, device="cpu")
        before = _bytes(photos)
        remount_ro(mnt)
        capsys.readouterr()
        assert main(["index", "dedup", str(tmp_path / "idx"), "--move-to", str(tmp_path / "dups")]) == 2
        err = capsys.readouterr().err
        assert f"{photos / 'inbox'} is read-only (a read-only file system)" in err and "nothing was moved" in err
        assert _bytes(photos) == before and not list((tmp_path / "dups").rglob("*.*"))
    with tmpfs(tmp_path / "mnt2", "16m") as mnt:
        photos = tmp_path / "photos2"
        _collection(photos)
        build_index(photos, backbone, mnt / "idx", progress=False, device="cpu")
        remount_ro(mnt)
        for argv in (["--move-to", str(tmp_path / "dups2")], ["--undo"], ["--not-duplicates", "exact-0-000000"]):
            assert main(["index", "dedup", str(mnt / "idx"), *argv]) == 2
            assert f"{mnt / 'idx'} is read-only" in capsys.readouterr().err
        assert not (tmp_path / "dups2").exists()


# ------------------------------------------------------------------------------------ a journal changed on disk
def forge(idx: Path, path: str, dest: Path | str, digest: str, size: int, state: str = "moved",
          back: str | None = None) -> int:
    """A row written into the catalog's journal by something other than moco (as an attacker with the file would);
    its seq."""
    with sqlite3.connect(idx / "catalog.sqlite") as db:
        cur = db.execute("INSERT INTO dedup_moves(batch, group_id, photo, path, dest, back, hash, size, state, "
                         "updated) VALUES ('forged', 'exact-0-000000', 1, ?, ?, ?, ?, ?, ?, 0)",
                         (os.fsencode(path), os.fsencode(str(dest)), None if back is None else os.fsencode(back),
                          digest, size, state))
        return cur.lastrowid


def test_a_changed_journal_moves_no_file_outside_the_collection_or_its_destination(coll, capsys):
    """Rows made up in ``dedup_moves`` (paths with ``..`` or absolute, a destination naming any file with its hash and
    size, a ``planned`` move of a photo to an unmarked folder, a way back out of the collection): --undo and the next
    --move-to refuse each, name it, and move nothing; a real move's own rows still go both ways."""
    idx, photos, dest, tmp = coll["idx"], coll["photos"], coll["dest"], coll["tmp"]
    assert main(["index", "dedup", str(idx), "--move-to", str(dest), "--kind", "exact"]) == 0
    assert json.loads((dest / MARK_FILE).read_text())["indexes"]  # the destination carries the index's mark
    outside = tmp / "outside"
    outside.mkdir()
    secret = outside / "secret.jpg"
    shutil.copyfile(photos / sorted(coll["before"])[2], secret)
    digest, size = file_hash(secret), secret.stat().st_size
    moved = dest / "inbox" / "exact.jpg"
    forged = [forge(idx, "secret.jpg", secret, digest, size),  # pulls an outside file in
              forge(idx, "../outside/secret.jpg", dest / "x.jpg", digest, size),  # writes outside the collection
              forge(idx, str(secret), dest / "secret.jpg", digest, size),  # an absolute path
              forge(idx, "secret.jpg", f"{dest}/../outside/secret.jpg", digest, size),  # dest through ..
              forge(idx, "inbox/exact.jpg", moved, file_hash(moved), 1, state="undoing", back="../escape.jpg")]
    capsys.readouterr()
    assert main(["index", "dedup", str(idx), "--undo", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    refused = [s for s in out["skipped"] if "is refused" in s["reason"]]
    assert sorted(int(s["reason"].split("entry ")[1].split(" ")[0]) for s in refused) == forged
    assert any("holds no mark" in s["reason"] for s in refused)
    assert [d["from"] for d in out["done"]] == [str(dest / "inbox" / "exact.jpg")]  # the real move: put back
    assert secret.is_file() and file_hash(secret) == digest and sorted(p.name for p in outside.iterdir()) == [
        "secret.jpg"]
    assert not (tmp / "escape.jpg").exists() and not (photos / "secret.jpg").exists()
    assert _bytes(photos) == coll["before"] and "secret.jpg" not in _indexed(idx)
    victim = sorted(coll["before"])[5]  # a photo of the collection that a forged plan moves to an unmarked folder
    plan = forge(idx, victim, outside / victim, file_hash(photos / victim), 1, state="planned")
    capsys.readouterr()
    assert main(["index", "dedup", str(idx), "--move-to", str(dest), "--kind", "exact", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)  # the forged plan is not finished: the victim stays
    assert (photos / victim).is_file() and not (outside / victim).exists()
    assert [d["from"] for d in out["done"]] == ["inbox/exact.jpg"] and out["finished"] == 0
    assert plan in {int(s["reason"].split("entry ")[1].split(" ")[0]) for s in out["skipped"]}
    assert main(["index", "dedup", str(idx), "--undo"]) == 0  # its own rows still go back
    assert set(_where(coll["before"], photos, dest).values()) == {"root"}


def test_an_unmarked_destination_is_taken_back_from_once_named(coll, capsys):
    """A folder moved into before destinations were marked (its mark removed here): --undo refuses it and says how;
    --undo --move-to DIR takes the photos back and marks it."""
    idx, photos, dest = coll["idx"], coll["photos"], coll["dest"]
    assert main(["index", "dedup", str(idx), "--move-to", str(dest)]) == 0
    (dest / MARK_FILE).unlink()
    capsys.readouterr()
    assert main(["index", "dedup", str(idx), "--undo"]) == 0
    captured = capsys.readouterr()
    assert "0 photos put back" in captured.out and f"say so with `--undo --move-to {dest.resolve()}`" in captured.err
    assert main(["index", "dedup", str(idx), "--undo", "--move-to", str(dest)]) == 0
    assert "2 photos put back" in capsys.readouterr().out and (dest / MARK_FILE).is_file()
    assert set(_where(coll["before"], photos, dest).values()) == {"root"}


def test_a_destination_that_holds_the_collection_or_a_link_out_is_refused(coll, capsys):
    idx, photos, tmp = coll["idx"], coll["photos"], coll["tmp"]
    capsys.readouterr()
    for holder in (tmp, tmp.parent):  # the collection's parent, and above: photos would land in or beside it
        assert main(["index", "dedup", str(idx), "--move-to", str(holder)]) == 2
        assert f"holds the collection {photos.resolve()}" in capsys.readouterr().err
    alias = tmp / "alias"
    alias.symlink_to(tmp)  # the parent through a link: the same folder
    assert main(["index", "dedup", str(idx), "--move-to", str(alias)]) == 2
    assert "holds the collection" in capsys.readouterr().err
    dest, elsewhere = coll["dest"], tmp / "elsewhere"
    (dest).mkdir()
    elsewhere.mkdir()
    (dest / "inbox").symlink_to(elsewhere)  # a folder inside the destination that leads out of it
    out = move_duplicates(ImageIndex.open(idx), _groups(idx), dest, search=False)
    assert not out.done and {s["path"] for s in out.skipped} == {"inbox/exact.jpg", "inbox/small.png"}
    assert all("leads out of it" in s["reason"] for s in out.skipped)
    assert list(elsewhere.iterdir()) == [] and _bytes(photos) == coll["before"]


def test_the_crowd_level_is_the_same_a_few_rows_at_a_time(monkeypatch):
    """At a million photos a sample's scores with every photo are read a few rows at a time (their memory bounded):
    the same levels as 64 rows at a time."""
    import index.calibrate as calibrate

    rng = np.random.default_rng(1)
    v = rng.standard_normal((500, 8)).astype(np.float32)
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    content = np.arange(500)
    content[20:25] = 20
    sample = np.arange(0, 500, 7)
    whole = neighbour_levels(v, content, sample)
    monkeypatch.setattr(calibrate, "LEVEL_SCORES_AT_ONCE", 3 * 500)  # 3 rows at a time
    few = neighbour_levels(v, content, sample)
    assert np.array_equal(whole[0], few[0]) and np.array_equal(whole[1], few[1])
