"""Near-duplicate groups that do not chain, at a threshold calibrated on the collection itself.

Checked against numpy brute force: the greedy grouping against a direct transcription of its rule, every member
against its representative, the calibration against copies made and scored by hand. Real FAISS, SQLite and a
real (randomly initialized) ResNet-18 on generated photos.
"""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from app.cli.commands import main
from index.building.runner import build_index
from index.calibrate import DEDUP_THRESHOLD
from index.duplicates.dedup import find_duplicates, load_duplicates, tight_groups
from index.duplicates.verify import COPY_SCORE, SIDE, copy_scores, frames
from index.search.image_index import ImageIndex
from moco.data.photos import load_rgb, square_u8
from moco.data.sample import make_sample_collection
from moco.embed import Embedder, center


# ----------------------------------------------------------------------------------------- references
def _graph(vecs: np.ndarray, threshold: float) -> dict[int, dict[int, float]]:
    """Brute-force neighbours of L2-normalized rows ``vecs`` (N x D) at cosine >= ``threshold``."""
    sim = vecs @ vecs.T  # N x N
    return {i: {j: float(sim[i, j]) for j in np.flatnonzero(sim[i] >= threshold) if j != i}
            for i in range(len(vecs)) if np.sum(sim[i] >= threshold) > 1}


def _greedy_by_hand(graph: dict[int, dict[int, float]]) -> list[tuple[int, list[int]]]:
    """The rule, scanning every photo each round: the most ungrouped neighbours (ties: smallest id) represents."""
    left, groups = set(graph), []
    while True:
        counts = {i: len(set(graph[i]) & left) for i in left}
        best = min(left, key=lambda i: (-counts[i], i), default=None)
        if best is None or counts[best] == 0:
            return groups
        members = [best, *sorted(set(graph[best]) & left)]
        left -= set(members)
        groups.append((best, members))


def _components(graph: dict[int, dict[int, float]]) -> list[set[int]]:
    """Connected components (what single linkage made of the graph)."""
    seen: set[int] = set()
    out = []
    for start in graph:
        if start in seen:
            continue
        comp, todo = set(), [start]
        while todo:
            i = todo.pop()
            if i not in comp:
                comp.add(i)
                todo += list(graph[i])
        seen |= comp
        out.append(comp)
    return out


def _check_groups(groups: list[dict], vecs: dict[int, np.ndarray], idx: ImageIndex) -> None:
    """Disjoint groups; every member of an exact or near group a copy of its representative by its pixels (the same
    bytes, or the copy score recomputed from the thumbnails at least COPY_SCORE); the reported cosines."""
    rows = idx.catalog.rows_by_id(sorted(vecs))
    fr = frames({i: idx.thumb_path(r) for i, r in rows.items()},
                lambda i: load_rgb(idx.root / rows[i].path, min_short=2 * SIDE))
    seen: set[int] = set()
    for g in groups:
        rep = g.representative.id
        ids = [m.id for m in g.members]
        assert ids[0] == rep and g.size == len(ids) == len(set(ids)) >= 2 and not seen & set(ids)
        seen |= set(ids)
        sims = [float(vecs[rep] @ vecs[i]) for i in ids[1:]]
        others = [i for i in ids[1:] if rows[i].hash != rows[rep].hash]
        scores = copy_scores([(min(rep, i), max(rep, i)) for i in others], fr)
        assert g.kind in ("exact", "near") and all(s >= COPY_SCORE for s in scores.values()), (g, scores)
        assert {m.id: m.copy_score for m in g.members if m.id in others} == pytest.approx(
            {i: scores[min(rep, i), max(rep, i)] for i in others}, abs=1e-4)
        assert [m.similarity for m in g.members[1:]] == pytest.approx(sims, abs=1e-4)
        assert (g.tightest, g.loosest) == pytest.approx((max(sims), min(sims)), abs=1e-4)


# ------------------------------------------------------------------------------------ the grouping alone
def _chain_and_copies(step: float = 0.3, n_chain: int = 10, copies: int = 3) -> tuple[np.ndarray, list[set[int]]]:
    """Unit vectors: a chain turning by ``step`` radians in the plane of e0, e1 (each close to the last, the ends
    2.7 radians apart), then 4 photos along e2..e5 with ``copies`` copies each (tiny noise).

    Returns (N x 16, the copy groups)."""
    rng = np.random.default_rng(0)
    a = np.arange(n_chain) * step
    chain = np.zeros((n_chain, 16), np.float32)
    chain[:, 0], chain[:, 1] = np.cos(a), np.sin(a)
    rows, groups = [chain], []
    for k in range(4):
        base = np.zeros(16, np.float32)
        base[2 + k] = 1.0
        block = base + 0.02 * rng.standard_normal((copies + 1, 16)).astype(np.float32)  # the photo and its copies
        start = n_chain + k * (copies + 1)
        groups.append(set(range(start, start + copies + 1)))
        rows.append(block)
    v = np.concatenate(rows)
    return v / np.linalg.norm(v, axis=1, keepdims=True), groups


def test_a_chain_is_cut_into_groups_around_representatives():
    threshold = 0.9  # cos(0.3) = 0.955 links each chain step; cos(0.6) = 0.825 does not reach two steps
    vecs, copy_groups = _chain_and_copies()
    graph = _graph(vecs, threshold)
    chain = set(range(10))
    assert chain in _components(graph)  # single linkage: the whole chain, 10 photos, is one group
    groups = tight_groups(graph)
    assert groups == _greedy_by_hand(graph)
    for rep, members in groups:
        assert members[0] == rep and all(vecs[rep] @ vecs[m] >= threshold for m in members)
    sizes = {len(m) for _, m in groups if set(m) <= chain}
    assert max(sizes) <= 3 < min(len(g) for g in copy_groups)  # no chain group as large as a copy group
    assert [set(m) for _, m in groups if not set(m) <= chain] == copy_groups  # each photo with its copies
    grouped = {i for _, m in groups for i in m}
    assert not any(j in graph.get(i, {}) for i in chain - grouped for j in chain - grouped)  # nothing left to group


@pytest.mark.parametrize("n, dim, threshold", [(20, 3, 0.9), (60, 4, 0.8), (200, 6, 0.7), (200, 3, 0.95)])
def test_tight_groups_equal_the_rule_by_hand_on_random_vectors(n, dim, threshold):
    rng = np.random.default_rng(n + dim)
    v = rng.standard_normal((n, dim)).astype(np.float32)  # few dimensions: dense neighbourhoods, many ties
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    graph = _graph(v, threshold)
    groups = tight_groups(graph)
    assert groups == _greedy_by_hand(graph)
    assert groups == tight_groups(dict(reversed(list(graph.items()))))  # the order of the graph does not matter
    grouped = [i for _, m in groups for i in m]
    assert len(grouped) == len(set(grouped))
    for rep, members in groups:
        assert np.all(v[members] @ v[rep] >= threshold)
    left = set(graph) - set(grouped)
    assert not any(set(graph[i]) & left for i in left)  # stopped only when no two ungrouped photos are neighbours


# ------------------------------------------------------------------------------------------ a real index
def _copy_jpeg(img: Image.Image, scale: float, quality: int) -> Image.Image:
    w, h = img.size
    buf = io.BytesIO()
    img.resize((round(w * scale), round(h * scale)), Image.Resampling.BICUBIC).save(buf, "JPEG", quality=quality)
    return Image.open(io.BytesIO(buf.getvalue())).convert("RGB")


def _crop(img: Image.Image, keep: float) -> Image.Image:
    w, h = img.size
    dx, dy = round(w * (1 - keep) / 2), round(h * (1 - keep) / 2)
    return img.crop((dx, dy, w - dx, h - dy))


def _collection(root: Path) -> Path:
    """5 families x 6 photos of 64 px; no "stars" (near-uniform star fields a random network cannot tell apart)."""
    make_sample_collection(root, per_family=6, size=64, seed=1)
    shutil.rmtree(root / "stars")
    return root


@pytest.fixture(scope="module")
def copied(backbone, tmp_path_factory) -> dict:
    """An index of the collection where 4 photos have an exact copy, a 75% JPEG q80 copy and a JPEG q50 copy.

    No crops: a random network is not crop-invariant as a trained one (here a 95% crop scores 0.83-0.97 with its
    photo, even a 98% one 0.91-0.99, where two photos of a family reach 0.83), so no threshold would group them
    with their photo but not the family; the calibration measures them all the same (its 90% crops)."""
    tmp = tmp_path_factory.mktemp("dedup")
    photos = _collection(tmp / "photos")
    sets = []
    for n, f in enumerate(sorted(photos.rglob("*.jpg"))[::7]):
        img = Image.open(f).convert("RGB")
        shutil.copy(f, photos / f"copy{n}.jpg")
        _copy_jpeg(img, 0.75, 80).save(photos / f"small{n}.png")
        img.save(photos / f"q50_{n}.jpg", quality=50)
        sets.append({f.relative_to(photos).as_posix(), f"copy{n}.jpg", f"small{n}.png", f"q50_{n}.jpg"})
    build_index(photos, backbone, tmp / "idx", progress=False, device="cpu")
    return {"photos": photos, "idx": tmp / "idx", "sets": sets}


def _space(idx: ImageIndex) -> tuple[dict[int, np.ndarray], dict[str, int]]:
    ids, raw = idx.catalog.vectors(dim=idx.dim)
    c = idx.to_space(raw)  # N x D, the search space
    rows = idx.catalog.rows_by_id(ids)
    return {int(i): c[n] for n, i in enumerate(ids)}, {rows[int(i)].path: int(i) for i in ids}


def test_copies_are_grouped_with_their_photo_at_the_index_threshold(copied, capsys):
    idx = ImageIndex.open(copied["idx"])
    threshold = idx.dedup_threshold
    assert threshold == idx.meta["dedup_calibration"]["threshold"] != DEDUP_THRESHOLD  # calibrated, not the default
    groups = find_duplicates(idx)
    assert sorted(sorted(m.path for m in g.members) for g in groups) == sorted(map(sorted, copied["sets"]))
    vecs, _ = _space(idx)
    _check_groups(groups, vecs, idx)
    saved = load_duplicates(idx.dir)
    assert saved.threshold == threshold and list(saved.groups) == groups
    assert main(["index", "dedup", str(copied["idx"])]) == 0
    out = capsys.readouterr().out
    g = groups[0]
    rep, rep_id = g.representative.path, g.representative.id
    assert f"group 1 {g.id} (near, 4 photos, {g.loosest:.4f}-{g.tightest:.4f} to {rep}); keep " in out
    assert f"  1.0000  {rep_id:>6}  {rep}  (representative" in out and f"by the model at cosine >= {threshold} (" in out
    other = g.members[1]
    assert f"{other.id:>6}  {other.path}" in out and f"copy score {other.copy_score:.4f}" in out
    assert "(calibrated on 42 photos of the collection: copies score" in out and "; above the collection's crowd" in out


def test_the_threshold_is_calibrated_between_copies_and_other_photos(copied, backbone, capsys):
    idx = ImageIndex.open(copied["idx"])
    cal = json.loads((copied["idx"] / "index.json").read_text())["dedup_calibration"]
    # by hand: every photo (the sample is the whole collection under 64), its two copies, centred cosines
    emb = Embedder.load(backbone, device="cpu")
    rows = sorted(idx.catalog.rows().values(), key=lambda r: r.id)
    imgs = [load_rgb(copied["photos"] / r.path, min_short=emb.resize) for r in rows if r.status == "ok"]

    def embed(images: list[Image.Image]) -> np.ndarray:
        return idx.to_space(emb.embed_squares(np.stack([square_u8(im, emb.resize) for im in images])))  # N x D

    orig = embed(imgs)
    jpeg, crop = embed([_copy_jpeg(im, 0.75, 60) for im in imgs]), embed([_crop(im, 0.9) for im in imgs])
    copies = np.concatenate([np.sum(orig * jpeg, 1), np.sum(orig * crop, 1)])  # 2N
    sim = orig @ orig.T
    np.fill_diagonal(sim, -1)
    nearest = sim.max(1)  # N
    median = np.median(copies)
    others = nearest[nearest < median]  # photos with a copy-like neighbour (the planted copies) are left out
    assert len(others) < len(nearest) and cal["sample_duplicates"] == len(nearest) - len(others) >= 16
    assert cal["photos"] == len(imgs) and cal["copies_median"] == pytest.approx(median, abs=2e-3)
    assert cal["copies_p10"] == pytest.approx(np.percentile(copies, 10), abs=2e-3)
    assert cal["others_max"] == pytest.approx(others.max(), abs=2e-3)
    upper = cal["copies_p10"] if cal["copies_p10"] > cal["others_max"] else cal["copies_median"]
    assert cal["others_max"] < cal["threshold"] < upper  # between the other photos and the copies
    assert cal["threshold"] == pytest.approx((upper + cal["others_max"]) / 2, abs=1e-4)
    st = idx.stats()
    assert st["dedup_calibration"] == cal and st["dedup_threshold"] == cal["threshold"]
    assert st["dedup_threshold_source"].startswith(f"calibrated on {len(imgs)} photos")
    assert main(["index", "stats", str(copied["idx"])]) == 0
    out = capsys.readouterr().out
    assert any(line.split() == ["dedup_threshold", str(cal["threshold"])] for line in out.splitlines())
    assert any(line.startswith("dedup_threshold_source") and "calibrated on" in line for line in out.splitlines())


def test_too_few_photos_keep_the_default_threshold(backbone, tmp_path, capsys):
    photos = tmp_path / "photos"
    make_sample_collection(photos, per_family=1, size=48, seed=0)  # 6 photos: under the 8 a calibration needs
    build_index(photos, backbone, tmp_path / "idx", progress=False, device="cpu")
    idx = ImageIndex.open(tmp_path / "idx")
    assert "dedup_calibration" not in idx.meta and idx.dedup_threshold == DEDUP_THRESHOLD
    assert idx.stats()["dedup_threshold_source"].startswith("the default for a backbone")
    assert main(["index", "stats", str(tmp_path / "idx")]) == 0
    assert "the default for a backbone" in capsys.readouterr().out


def test_a_chain_of_photos_is_not_one_group(backbone, tmp_path):
    """Morphs of one photo into another and on into a third, each frame a small step from the last."""
    photos = _collection(tmp_path / "photos")
    emb = Embedder.load(backbone, device="cpu")
    sets = []
    for n, f in enumerate(sorted(photos.rglob("*.jpg"))[3::7]):  # photos with an exact and a 75% JPEG copy
        shutil.copy(f, photos / f"copy{n}.jpg")
        _copy_jpeg(Image.open(f).convert("RGB"), 0.75, 90).save(photos / f"small{n}.png")
        sets.append({f.relative_to(photos).as_posix(), f"copy{n}.jpg", f"small{n}.png"})
    other = make_sample_collection(tmp_path / "other", per_family=1, size=64, seed=5)  # not in the collection
    ends = [np.asarray(Image.open(f).convert("RGB"), np.float32) for f in sorted(other)[:3]]
    fine = [(1 - a) * x + a * y for x, y in zip(ends, ends[1:]) for a in np.linspace(0, 1, 40, endpoint=False)]
    fine = [Image.fromarray(np.rint(f).astype(np.uint8)) for f in fine]  # 80 frames
    raw = emb.embed_squares(np.stack([square_u8(Image.open(f).convert("RGB"), emb.resize)
                                      for f in sorted(photos.rglob("*.*"))]))
    v = center(emb.embed_squares(np.stack([square_u8(f, emb.resize) for f in fine])), raw.mean(0))  # 80 x D
    pick = [0]  # each next frame: the last one still at cosine >= 0.94 to the previous pick
    while pick[-1] + 1 < len(v):
        nxt = pick[-1] + 1
        while nxt + 1 < len(v) and v[nxt + 1] @ v[pick[-1]] >= 0.94:
            nxt += 1
        pick.append(nxt)
    (photos / "chain").mkdir()
    for k, p in enumerate(pick):
        fine[p].save(photos / "chain" / f"frame{k:02d}.png")
    build_index(photos, backbone, tmp_path / "idx", progress=False, device="cpu")
    idx = ImageIndex.open(tmp_path / "idx")
    vecs, id_of = _space(idx)
    chain = [id_of[f"chain/frame{k:02d}.png"] for k in range(len(pick))]
    step = [float(vecs[a] @ vecs[b]) for a, b in zip(chain, chain[1:])]
    threshold = round(min(step) - 1e-3, 4)  # every step of the chain links
    two = max(float(vecs[a] @ vecs[b]) for a, b in zip(chain, chain[2:]))
    assert len(chain) >= 12 and two < threshold  # two steps apart are not neighbours
    mat = np.stack([vecs[i] for i in sorted(vecs)])
    single = _components(_graph(mat, threshold))
    assert max(len(c) for c in single) >= len(chain) > 4  # single linkage would make the chain one group
    groups = find_duplicates(idx, threshold)
    _check_groups(groups, vecs, idx)  # every member a copy of its representative by pixels, never of a member
    copy_sets = [{id_of[p] for p in s} for s in sets]
    members = [{m.id for m in g.members} for g in groups]
    assert all(s in members for s in copy_sets)  # each photo with its copies
    # the chain (frames of one photo fading into the next: at its middle, a photo under a faint overlay, which its
    # pixels call copies) is cut into several groups, never one
    assert max(len(m & set(chain)) for m in members) < len(chain) // 2
    assert sum(bool(m & set(chain)) for m in members) >= 2


def test_a_search_shows_each_stage_with_its_rate_and_time_left_only_when_asked(backbone, sample_photos, tmp_path,
                                                                               capsys):
    """``progress=True`` (the CLI on a terminal): a bar for the frames, the proposals and the pixel check, each run
    to its end (its count of photos, searches, pairs); the same groups as without; without, nothing on stderr."""
    from index.duplicates.dedup import search_duplicates

    build_index(sample_photos, backbone, tmp_path / "idx", progress=False)
    idx = ImageIndex.open(tmp_path / "idx")
    capsys.readouterr()
    quiet = search_duplicates(idx, save=False)
    assert capsys.readouterr().err == ""
    shown = search_duplicates(idx, save=False, progress=True)
    err = capsys.readouterr().err
    n, pairs = len(idx), shown.decision["proposed"]
    for stage, total in (("frames", n), ("proposals", 5 * n), ("pixel check", pairs)):
        assert f"{stage}: 100%" in err and f"{total}/{total}" in err, (stage, err[-1500:])
    assert [g.id for g in shown.groups] == [g.id for g in quiet.groups]


def test_a_search_killed_in_the_pixel_check_leaves_the_last_one_and_a_rerun_completes(backbone, sample_photos,
                                                                                     tmp_path):
    """SIGKILL in the middle of the pixel check (after its first chunk of pairs): the last saved search is still
    there, whole, and nothing else is left in the index's folder; the next search completes with the groups of an
    uninterrupted one."""
    from index.duplicates.dedup import search_duplicates
    from index.duplicates.dedup_cache import CHECKED_FILE
    from tests.live import killed_after_first

    build_index(sample_photos, backbone, tmp_path / "idx", progress=False)
    idx = ImageIndex.open(tmp_path / "idx")
    first = search_duplicates(idx)  # saved
    (tmp_path / "idx" / CHECKED_FILE).unlink()  # its scored pairs: else the next search has no pair to check
    saved = (tmp_path / "idx" / "dedup.json").read_bytes()
    before = sorted(p.name for p in (tmp_path / "idx").iterdir())
    killed_after_first("index.duplicates.verify", "_scores", "",
                       "from index.duplicates.dedup import search_duplicates\n"
                       "from index.search.image_index import ImageIndex\n"
                       "search_duplicates(ImageIndex.open(sys.argv[1]), chunk=4)", str(tmp_path / "idx"))
    assert (tmp_path / "idx" / "dedup.json").read_bytes() == saved
    assert sorted(p.name for p in (tmp_path / "idx").iterdir()) == before
    again = search_duplicates(ImageIndex.open(tmp_path / "idx"))
    assert [g.id for g in again.groups] == [g.id for g in first.groups]
