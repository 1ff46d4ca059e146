"""The candidates of the pixel check (index/duplicates/propose.py): whole-pixel and crop neighbours against brute-force
NCC
rankings (flat and HNSW indexes), crop windows against the photo's own crops, and crops of photos, off-centre and
of any share the check tests, found among alike photos."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

import index.duplicates.propose as propose
from index.duplicates.verify import Frame, frame_of
from index.search.store import VectorStore


def _frame(rng: np.random.Generator, w: int, h: int) -> Frame:
    """A frame of a smooth random picture of w x h pixels (noise, blurred by shrinking and enlarging)."""
    return frame_of(_picture(rng, w, h))


def _picture(rng: np.random.Generator, w: int, h: int) -> Image.Image:
    small = rng.integers(0, 256, (max(2, h // 6), max(2, w // 6)), dtype=np.uint8)
    return Image.fromarray(small).resize((w, h), Image.Resampling.BICUBIC).convert("RGB")


def _flat(grey: np.ndarray, side: int, mirror: bool) -> np.ndarray:
    g = np.asarray(Image.fromarray(grey).resize((side, side), Image.Resampling.BOX), np.float64)
    g = (g[:, ::-1] if mirror else g).ravel()
    g = g - g.mean()
    return g / np.linalg.norm(g)


def test_pixel_neighbours_exact_and_approximate(monkeypatch):
    """The whole-pixel proposals: the flat index's neighbours are the brute-force NCC top k of the 16-px frames
    (plain and mirrored queries); above PIXEL_EXACT_UP_TO photos an inverted file finds nearly the same, unless the
    queries are few (a search after an update): then the flat index's."""
    rng = np.random.default_rng(5)
    fr = {100 + n: _frame(rng, 48, 48) for n in range(150)}
    ids = list(fr)
    got = list(propose.pixel_neighbours(ids, fr, 4, chunk=32))
    keys = [(i, mirror) for s in range(0, len(ids), 32) for mirror in (False, True) for i in ids[s : s + 32]]
    assert len(got) == len(keys) == 2 * len(ids)  # each chunk: its plain queries, then its mirrored ones
    for (i, mirror), (j, flip, row, _) in zip(keys, got):
        assert flip == mirror
        q = _flat(fr[i].grey, propose.PIXEL_SIDE, mirror)
        assert j == i and row == sorted(ids, key=lambda o: -float(q @ _flat(fr[o].grey, propose.PIXEL_SIDE, False)))[:4]
    monkeypatch.setattr(propose, "PIXEL_EXACT_UP_TO", 10)
    monkeypatch.setattr(propose, "FLAT_PAIRS", 0)
    approx = list(propose.pixel_neighbours(ids, fr, 4, chunk=32))
    hits = sum(len(set(a) & set(b)) for (_, _, a, _), (_, _, b, _) in zip(approx, got))
    assert hits >= 0.9 * 4 * len(got)
    monkeypatch.setattr(propose, "FLAT_PAIRS", 2 * 3 * len(ids))  # a few queries among many: searched exactly
    few = list(propose.pixel_neighbours(ids[:3], fr, 4, 32, ids))
    assert [row for _, _, row, _ in few] == [row for i, _, row, _ in got if i in ids[:3]]


def test_an_inverted_file_for_a_few_queries_has_fewer_cells_and_finds_as_much(monkeypatch):
    """Above PIXEL_EXACT_UP_TO vectors the proposals search an inverted file of at most IVF_CELLS_PER_ROOT x sqrt(n)
    cells; for a few queries (after an update) the cells that make training and searching cheapest, fewer: each
    query looks at a larger share of the vectors, so its closest vector (by brute force) is found at least as
    often."""
    monkeypatch.setattr(propose, "PIXEL_EXACT_UP_TO", 10)
    monkeypatch.setattr(propose, "FLAT_PAIRS", 0)
    rng = np.random.default_rng(3)
    centres = rng.normal(size=(40, 16))
    vecs = centres[rng.integers(0, 40, 3000)] + 0.5 * rng.normal(size=(3000, 16))  # 3000 x 16
    vecs = (vecs / np.linalg.norm(vecs, axis=1, keepdims=True)).astype(np.float32)
    queries = vecs[rng.choice(3000, 200, replace=False)] + 0.05 * rng.normal(size=(200, 16)).astype(np.float32)
    truth = (queries @ vecs.T).argmax(axis=1)  # 200: numpy's closest
    found = {}
    for asked in (10**7, 50):
        store = propose._inner_product_index(lambda a, b: vecs[a:b], len(vecs), 16, "test", asked, probe=4)
        found[asked] = (store.nlist, float((store.search(np.ascontiguousarray(queries), 1)[1][:, 0] == truth).mean()))
    cheapest = int(np.cbrt(50 * 4 * 3000 / (128 * propose.KMEANS_ROUNDS)))
    assert found[10**7][0] == 3000 // 39 and found[50][0] == cheapest < found[10**7][0]
    assert found[50][1] >= found[10**7][1] and found[50][1] >= 0.95, found


def _overlap(lo: float, hi: float, n: int) -> np.ndarray:
    """How much of each of n unit pixels lies in [lo, hi]."""
    p = np.arange(n)
    return np.clip(np.minimum(p + 1, hi) - np.maximum(p, lo), 0, None)


@pytest.mark.parametrize("grids", [propose.CROP_GRIDS, propose.FAMILY_GRIDS])
def test_crop_windows_are_the_photos_own_crops(grids):
    """Each window is the photo's crop at its share and place (both sides' share, from corner to corner or at the
    centre alone), its mean grey over each cell of a CROP_SIDE grid, pixels cut by a cell's edge counted by the share
    inside: the same as a brute-force sum over every pixel's overlap with every cell; a flat photo's windows are all
    zero. The proposals' places and a crop family's finer ones."""
    rng = np.random.default_rng(1)
    S = propose.CROP_SIDE
    for w, h in ((96, 96), (96, 60), (40, 96)):
        f = frame_of(_picture(rng, 3 * w, 3 * h))
        win = propose.crop_windows_of([np.asarray(f.image, np.uint8)], grids)[0]
        grey = np.asarray(f.image, np.float64)
        H, W = grey.shape
        n = 0
        for s, grid in zip(propose.CROP_SHARES, grids, strict=True):
            places = np.linspace(0, 1, grid) if grid > 1 else [0.5]  # corner to corner, or the centre alone
            for gy in places:
                for gx in places:
                    x0, y0 = (1 - s) * W * gx, (1 - s) * H * gy
                    want = np.empty((S, S))
                    for r in range(S):
                        wy = _overlap(y0 + s * H * r / S, y0 + s * H * (r + 1) / S, H)
                        for c in range(S):
                            wx = _overlap(x0 + s * W * c / S, x0 + s * W * (c + 1) / S, W)
                            want[r, c] = wy @ grey @ wx / (wy.sum() * wx.sum())
                    want = want.ravel() - want.mean()
                    assert np.allclose(win[n], want / np.linalg.norm(want), atol=1e-5), (w, h, s, gx, gy)
                    n += 1
        assert n == len(win)
    assert not propose.crop_windows(frame_of(Image.new("RGB", (64, 64), (90, 90, 90)))).any()


def test_crop_windows_of_many_photos_are_each_photo_s_own():
    """Photos of several image sizes worked together give each photo's windows, the very numbers of one at a time
    (which the test above holds to a brute-force sum)."""
    rng = np.random.default_rng(3)
    frames_ = [frame_of(_picture(rng, w, h)) for w, h in ((96, 96), (150, 90), (96, 96), (40, 100), (96, 96))]
    assert len({f.image.size for f in frames_}) == 3
    many = propose.crop_windows_of([np.asarray(f.image) for f in frames_])
    assert many.shape == (5, propose.CROP_WINDOWS, propose.CROP_SIDE**2)
    for f, got in zip(frames_, many):
        assert np.array_equal(got, propose.crop_windows(f)) and got.any()
    assert propose.crop_windows_of([]).shape[0] == 0


def _brute_crop_neighbours(ids: list[int], fr: dict[int, Frame], k: int, mirror: bool,
                           grids: tuple[int, ...] = propose.CROP_GRIDS, queries: list[int] | None = None
                           ) -> dict[int, list[int]]:
    """Each photo's (of ``queries``, None: ``ids``) k other photos of ``ids`` by the NCC of their whole CROP_SIDE
    frame with its best window (mirrored or not), by hand."""
    whole = {o: _flat(fr[o].grey, propose.CROP_SIDE, False) for o in ids}
    out = {}
    for i in ids if queries is None else queries:
        windows = propose.crop_windows_of([np.asarray(fr[i].image, np.uint8)], grids)[0].astype(np.float64)
        windows = windows.reshape(-1, propose.CROP_SIDE, propose.CROP_SIDE)
        windows = (windows[:, :, ::-1] if mirror else windows).reshape(len(windows), -1)
        best = {o: float((windows @ whole[o]).max()) for o in ids if o != i}
        out[i] = [o for o in sorted(best, key=lambda o: -best[o]) if best[o] > 0][:k]
    return out


def test_crop_neighbours_exact_and_approximate(monkeypatch):
    """Crop proposals are, for each photo (its windows plain and mirrored), the k photos whose whole frame matches
    one of its windows most, by brute force; every crop of a photo (off-centre, any share the check tests,
    mirrored) is put forward by its photo among alike photos; an inverted file (above PIXEL_EXACT_UP_TO photos)
    finds nearly the same."""
    rng = np.random.default_rng(7)
    pictures = [_picture(rng, 90, 72) for _ in range(60)]
    fr = {n: frame_of(p) for n, p in enumerate(pictures)}
    crops = {}  # the crop's id -> its photo's id
    for n, (s, fx, fy, mirror) in enumerate([(0.9, 0.1, 0.8, False), (0.82, 0.95, 0.3, False), (0.75, 0.4, 0.0, True),
                                             (0.7, 0.6, 0.6, False), (0.87, 0.0, 1.0, True)]):
        src = pictures[n * 7]
        x0, y0 = round((1 - s) * 90 * fx), round((1 - s) * 72 * fy)
        c = src.crop((x0, y0, x0 + round(s * 90), y0 + round(s * 72)))
        fr[1000 + n] = frame_of(c.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if mirror else c)
        crops[1000 + n] = n * 7
    ids = list(fr)
    got = list(propose.crop_neighbours(ids, fr, 3, chunk=16))
    plain, mirrored = (_brute_crop_neighbours(ids, fr, 3, m) for m in (False, True))
    keys = [(i, m) for s in range(0, len(ids), 16) for m in (False, True) for i in ids[s : s + 16]]
    assert [(i, flip) for i, flip, _, _ in got] == keys
    for (i, m), (_, _, row, _) in zip(keys, got):
        assert row == (mirrored if m else plain)[i], (i, m)
    for c, photo in crops.items():
        assert c in {row[0] for i, _, row, _ in got if i == photo}, c  # first, plain or mirrored
    monkeypatch.setattr(propose, "PIXEL_EXACT_UP_TO", 10)
    monkeypatch.setattr(propose, "FLAT_PAIRS", 0)
    approx = list(propose.crop_neighbours(ids, fr, 3, chunk=16))
    hits = sum(len(set(a) & set(b)) for (_, _, a, _), (_, _, b, _) in zip(approx, got))
    assert hits >= 0.9 * sum(len(b) for _, _, b, _ in got)


def test_many_frames_shrunk_at_once_are_those_pil_shrinks_one_at_a_time(tmp_path, monkeypatch):
    """The pixel searches' vectors made for many frames at once (read at once from a frames file) equal those of PIL's
    box filter, frame by frame (random greys: every rounding of both passes is met)."""
    from index.duplicates import dedup_cache
    from index.duplicates.dedup_cache import FrameFile
    from index.duplicates.verify import SIDE

    rng = np.random.default_rng(3)
    greys = rng.integers(0, 256, (300, SIDE, SIDE), dtype=np.uint8)
    greys[0] = 7  # a flat frame: all zero
    for side in (propose.PIXEL_SIDE, propose.CROP_SIDE):
        want = np.stack([propose._flat(g, side, False) for g in greys])
        assert np.allclose(propose.flats_of(greys, side), want, atol=1e-6)
        monkeypatch.setattr(propose, "FLATS_AT_ONCE", 7)  # a few frames at a time: the same
        assert np.allclose(propose.flats_of(greys, side), want, atol=1e-6)
        monkeypatch.undo()
    pictures = {i: _picture(rng, int(rng.integers(30, 90)), int(rng.integers(30, 90))) for i in range(40)}
    photos = {i: (i, None) for i in pictures}
    made = FrameFile(tmp_path / "frames.bin").update(photos, pictures.get)
    kept = FrameFile(tmp_path / "frames.bin").update(photos, pictures.get)  # read back from the file
    assert made.made == 40 and kept.made == 0
    ids = [31, 5, 2, 39, 0, 17]
    assert np.array_equal(kept.greys(ids), np.stack([made[i].grey for i in ids]))
    assert np.array_equal(kept.greys(ids), np.stack([frame_of(pictures[i]).grey for i in ids]))
    monkeypatch.setattr(dedup_cache, "GREYS_SPAN", 4)  # read a few records at a time
    assert np.array_equal(kept.greys(ids + list(range(8))), np.stack([made[i].grey for i in ids + list(range(8))]))
    images = kept.images(ids + list(range(8)))  # the crop windows' images, of every shape, read the same way
    assert len({im.shape for im in images}) > 3
    want = [np.asarray(frame_of(pictures[i]).image) for i in ids + list(range(8))]
    assert all(np.array_equal(im, w) for im, w in zip(images, want))
    held = FrameFile(tmp_path / "held.bin")  # frames held only in memory (a file that could not be written)
    held._memory.update({i: made[i] for i in ids[:3]})
    assert all(np.array_equal(a, b) for a, b in zip(held.images(ids[:3]), kept.images(ids[:3])))
    with pytest.raises(KeyError):
        kept.images([999])


def test_a_clean_photo_among_a_few_new_ones_gets_the_neighbours_a_search_finds_at_its_floor():
    """Among a few new photos, each photo's whole-pixel and crop neighbours are scored at once (matrix products) and
    only those at its floor (its k-th earlier neighbour) or more kept: the same photos, in the same order, with the
    same scores, as the search among them finds over its floor; under it, none; crops of photos among the new ones
    are found."""
    rng = np.random.default_rng(11)
    pictures = [_picture(rng, 90, 72) for _ in range(50)]
    fr = {n: frame_of(p) for n, p in enumerate(pictures)}
    for n in range(6):  # new photos cut from old ones
        fr[100 + n] = frame_of(pictures[n * 3].crop((5 + n, 4, 80, 66)))
    old, new = [i for i in fr if i < 40], [i for i in fr if i >= 40]
    floors = {(i, m): float(rng.choice([-np.inf, 0.3, 0.6, 0.9])) for i in old for m in (False, True)}
    floor = lambda i, m: floors[i, m]  # noqa: E731
    for search, k in ((propose.pixel_neighbours, 14), (propose.crop_neighbours, 13)):
        plain = list(search(old, fr, k, 16, new))
        few = list(search(old, fr, k, 16, new, floor))
        assert [(i, m) for i, m, _, _ in few] == [(i, m) for i, m, _, _ in plain]
        for (i, m, row, sims), (_, _, got, got_sims) in zip(plain, few):
            keep = [n for n, s in enumerate(sims) if s >= floors[i, m]]
            assert got == [row[n] for n in keep], (search.__name__, i, m)
            assert np.allclose(got_sims, [sims[n] for n in keep], atol=1e-5)
        if search is propose.crop_neighbours:
            assert all(100 + n in next(r for i, m, r, _ in few if i == n * 3 and not m) for n in range(6)
                       if floors[n * 3, False] < 0.9)
        # new photos taken apart from an earlier one (its files' dates or cameras) are not its neighbours: the same as
        # scoring only the others, photo by photo; a part of photos apart from every new one is not scored at all
        away = rng.random((len(old), len(new))) < 0.6  # old x new
        away[: len(old) // 2] = True
        apart = lambda a, b, away=away: away[np.searchsorted(old, a)][:, np.searchsorted(new, b)]  # noqa: E731
        got = list(search(old, fr, k, 16, new, floor, apart))
        assert [(i, m) for i, m, _, _ in got] == [(i, m) for i, m, _, _ in few]
        for i, m, row, sims in got:
            alone = [new[j] for j in np.flatnonzero(~away[old.index(i)])]
            want = next((r, s_) for i_, m_, r, s_ in search([i], fr, k, 16, alone, floor) if m_ == m) if alone else (
                [], [])
            assert row == want[0] and np.allclose(sims, want[1], atol=1e-5), (search.__name__, i, m)
        assert all(not row for i, m, row, _ in got if old.index(i) < len(old) // 2)


def test_the_model_s_closest_photos_on_a_flat_index_of_many_come_from_an_inverted_file_scored_exactly(monkeypatch):
    """On a flat index of more than MODEL_EXACT_UP_TO photos, every photo searched, the model's closest photos come
    from an inverted file of their own (an exact search of all among all grows with the square of the photos): each
    cosine it gives is the exact one (numpy's dot product, the best first), each planted copy is its photo's first as
    by brute force, and a few queries (after an update) still search the index itself."""
    monkeypatch.setattr(propose, "MODEL_EXACT_UP_TO", 10)
    rng = np.random.default_rng(5)
    vecs = rng.normal(size=(3000, 32)).astype(np.float32)  # 3000 x 32
    vecs[2800:] = vecs[:200] + 0.3 * rng.normal(size=(200, 32)).astype(np.float32)  # copies of the first 200
    vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
    ids = np.arange(3000, dtype=np.int64) * 7 + 1  # photo ids, not places
    store = VectorStore.create("flat", 32, len(ids), use_gpu="no")
    store.add(ids, vecs)
    monkeypatch.setattr(propose, "FLAT_PAIRS", 10 * len(ids))
    assert propose.model_search(store, ids, vecs, 10) == store.search  # a few queries: the index's exact search
    search = propose.model_search(store, ids, vecs, len(ids))
    assert search != store.search
    sims, near = search(vecs, 6)  # 3000 x 6
    place = {int(i): n for n, i in enumerate(ids.tolist())}
    exact = np.array([[vecs[q] @ vecs[place[j]] if j >= 0 else -np.inf for j in row] for q, row in enumerate(near)])
    assert np.allclose(sims, exact, atol=1e-5) and np.all(np.diff(sims, axis=1) <= 1e-6)
    cos = vecs @ vecs.T  # 3000 x 3000, brute force
    np.fill_diagonal(cos, -np.inf)
    truth = ids[cos.argmax(axis=1)]  # each photo's closest
    self_first = near[:, 0] == ids
    first = np.where(self_first, near[:, 1], near[:, 0])
    planted = np.r_[0:200, 2800:3000]
    assert np.array_equal(truth[planted], ids[np.r_[2800:3000, 0:200]])  # the copies are each other's closest ...
    assert np.array_equal(first[planted], truth[planted])  # ... and the inverted file finds every one


def _jpeg(img: Image.Image, quality: int) -> Image.Image:
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=quality)
    return Image.open(buf).convert("RGB")


def test_a_small_photo_proposes_its_first_and_their_ties_a_large_one_every_alike_neighbour():
    """Of a small photo's searches, the pixel check gets each one's first and the neighbours that tie with it (at
    PIXEL_ALIKE or more, within ALIKE_TIE of the first: two copies of one photo); an alike photo further down (a
    picture blended into another, at PIXEL_ALIKE but not a tie) is left out, as alike garments were (it brought no
    copy on the choose splits). A large photo's searches keep every alike neighbour and the first under them.
    Brute force from the searches' own neighbours: both rules by hand."""
    rng = np.random.default_rng(12)
    x, other = _picture(rng, 48, 48), _picture(rng, 48, 48)
    y = Image.blend(x, other, 0.12)  # alike x, not a copy
    pics = {1: x, 2: _jpeg(x, 95), 3: _jpeg(x, 93), 4: y, 5: _jpeg(y, 95)}
    pics |= {10 + n: _picture(rng, 48, 48) for n in range(40)}
    fr = {i: frame_of(p) for i, p in pics.items()}
    ids = np.array(sorted(fr), np.int64)
    vecs = rng.normal(size=(len(ids), 16)).astype(np.float32)  # N x 16
    vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
    store = VectorStore.create("flat", 16, len(ids), use_gpu="no")
    store.add(ids, vecs)
    content = {int(i): int(i) for i in ids}
    k, alike, tie = propose.PROPOSE_K, propose.PIXEL_ALIKE, propose.ALIKE_TIE

    def by_hand(nb: propose.Neighbours, large: set[int]) -> set[tuple[int, int]]:
        want = set()
        for r, i in enumerate(nb.ids.tolist()):
            for s in range(len(propose.SOURCES)):
                row, sc = nb.near[r, s].tolist(), nb.scores[r, s].tolist()
                depth = k if i in large and s == 0 else min(propose.SOURCE_DEPTH[s], k)
                for n, (j, v) in enumerate(zip(row, sc)):
                    if j < 0:
                        continue
                    if i in large:
                        keep = v >= alike or sum(u < alike for u, o in zip(sc[:n], row[:n]) if o >= 0) < depth
                    else:
                        keep = n < depth or (v >= alike and sc[0] - v <= tie)
                    want |= {(min(i, j), max(i, j))} if keep else set()
        return want

    small = propose.proposals(store, ids, vecs, content, fr, {})
    big = propose.proposals(store, ids, vecs, content, fr, {}, large=set(ids.tolist()))
    got_small = {(int(a), int(b)) for a, b in small.pairs}
    got_big = {(int(a), int(b)) for a, b in big.pairs}
    assert got_small == by_hand(small.neighbours, set()) and got_big == by_hand(big.neighbours, set(ids.tolist()))
    whole = small.neighbours.near[0, 1].tolist(), small.neighbours.scores[0, 1].tolist()  # x's whole-pixel search
    assert whole[0][:2] in ([2, 3], [3, 2]) and whole[1][0] - whole[1][1] <= tie  # its two copies tie ...
    assert {(1, 2), (1, 3)} <= got_small  # ... and both are proposed
    assert 4 in whole[0] and whole[1][whole[0].index(4)] >= alike  # the alike picture: at PIXEL_ALIKE, not a tie
    assert (1, 4) in got_big and (1, 4) not in got_small and got_small < got_big


def test_a_verified_crop_brings_its_family_the_photos_further_down_its_crop_search():
    """Of a large photo whose crop search (plain or mirrored) found a verified copy first, every other photo that
    search found is paired with it (each pair once, a < b); nothing for a small photo, for a large photo whose first
    is no copy, or for the other searches. By hand from the rows."""
    k, crops = 5, propose.SOURCES.index("crops")
    ids = np.array([3, 8, 11, 20], np.int64)
    nb = propose.Neighbours.empty(ids, k)
    nb.near[0, crops] = [8, 11, 20, -1, -1]  # 3 (large): its 80% crop 8 first, a verified copy; then 11 and 20
    nb.near[0, crops + 1] = [20, 8, -1, -1, -1]  # mirrored: 20 first, no copy: nothing
    nb.near[0, 1] = [8, 11, 20, -1, -1]  # whole pixels: not a crop search
    nb.near[1, crops] = [3, 11, -1, -1, -1]  # 8 (small): nothing, though 3 is a copy of it
    nb.near[2, crops + 1] = [20, 3, 8, -1, -1]  # 11 (large), mirrored: 20 first, a copy: 3 and 8 (3 already)
    nb.near[3, crops] = [11, -1, -1, -1, -1]  # 20 (large): 11 first, a copy, and no other
    copies = {(3, 8), (11, 20)}
    got = propose.crop_families(nb, {3, 11, 20}, copies)
    assert got.dtype == np.int64 and got.tolist() == [[3, 11], [3, 20], [8, 11]]
    assert propose.crop_families(nb, set(), copies).shape == (0, 2)
    assert propose.crop_families(nb, {3, 11, 20}, set()).shape == (0, 2)
    assert propose.crop_families(propose.Neighbours.empty(ids, 0), {3, 11, 20}, copies).shape == (0, 2)  # k = 0
    assert propose.family_heads(nb, {3, 11, 20}, copies).tolist() == [3, 11, 20]
    assert propose.family_heads(nb, {8, 20}, copies).tolist() == [8, 20]  # those of large photos alone
    assert propose.family_heads(nb, {3, 11, 20}, {(3, 8)}).tolist() == [3]  # 11's first (20) is no copy then
    assert propose.family_heads(nb, {3, 11, 20}, set()).tolist() == []


def test_a_crop_cut_between_the_proposals_places_is_found_by_its_family_s_finer_windows():
    """A 70% crop of a large textured photo, cut half-way between two of the proposals' places, among alike
    textures: the proposals' windows (CROP_GRIDS) put other photos before it, a crop family's windows
    (FAMILY_GRIDS, a few pixels apart) put it first, and family_crops pairs each head with the same photos as a
    brute-force NCC of every finer window with every whole frame, plain and mirrored (each pair once, a < b)."""
    rng = np.random.default_rng(11)

    def texture(w: int, h: int) -> Image.Image:  # detail of 6 pixels: a window a cell off matches badly
        small = rng.integers(0, 256, (h // 6, w // 6), dtype=np.uint8)
        return Image.fromarray(small).resize((w, h), Image.Resampling.BILINEAR).convert("RGB")

    big = texture(400, 400)
    fr = {n: frame_of(texture(400, 400)) for n in range(1, 40)}  # alike textures
    fr[0] = frame_of(big)
    s, at = 0.7, 0.25  # the proposals' places of 0.7 are 0, 0.5 and 1 of the free side: this is half-way
    x0 = y0 = round((1 - s) * 400 * at)
    fr[100] = frame_of(big.crop((x0, y0, x0 + round(s * 400), y0 + round(s * 400))))
    ids = sorted(fr)
    coarse = list(propose.crop_neighbours([0], fr, 3, 16, ids))
    assert 100 not in {row[0] for _, _, row, _ in coarse if row}, coarse  # not first by the proposals' windows
    plain = next(propose.crop_neighbours([0], fr, 3, 16, ids, grids=propose.FAMILY_GRIDS))
    assert plain[2][0] == 100 and plain[3][0] >= 0.99, plain  # first by the finer windows, nearly exact
    finer = {m: _brute_crop_neighbours(ids, fr, 3, m, propose.FAMILY_GRIDS, [0, 5]) for m in (False, True)}
    got = propose.family_crops([0, 5], fr, ids, k=3)
    want = sorted({(min(i, o), max(i, o)) for m in (False, True) for i, row in finer[m].items() for o in row})
    assert got.dtype == np.int64 and got.tolist() == [list(p) for p in want]
    assert propose.family_crops([], fr, ids).shape == (0, 2)
