"""Crops of large photos with fine texture (index/duplicates/verify.py's fine check): in the thumbnail's 48-pixel frame
the texture aliases and a crop's share between two of the check's scales leaves it under the copy score; the pair of
large photos is checked again from the photos themselves, at a crop share every 1%, and found; a texture of tiles a
few pixels wide in the frame's image aliases so badly that its crop scores anything on thumbnails, and a pair of two
such photos is checked again from a lower score. Real FAISS, SQLite and a real (randomly initialized) ResNet-18 on
generated photos."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image, ImageDraw

from index.building.runner import build_index
from index.duplicates import verify
from index.duplicates.dedup import search_duplicates
from index.duplicates.dedup_cache import CHECKED_FILE
from index.duplicates.verify import (
    COPY_SCORE,
    FINE_FROM,
    FINE_SIDE,
    TEXTURE_SHARE,
    FineCheck,
    copy_scores,
    fine_scores,
    fine_texture,
    frame_of,
)
from index.search.image_index import ImageIndex
from moco.data.photos import load_rgb


def _icons(seed: int, side: int = 1024) -> Image.Image:
    """A large picture of small shapes scattered on a background of fine diagonal stripes (as a wallpaper of icons
    on a textured ground: its 48-pixel frame aliases the stripes and shrinks the shapes to a pixel or two)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:side, 0:side]
    ground = rng.integers(40, 200, 3)[None, None, :] + 18 * np.sin(2 * np.pi * (x + y) / 5.0)[..., None]
    img = Image.fromarray(np.clip(ground, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(img)
    for _ in range(40):
        cx, cy, r = (int(v) for v in (rng.integers(0, side), rng.integers(0, side), rng.integers(20, 45)))
        fill = tuple(int(v) for v in rng.integers(0, 256, 3))
        if rng.random() < 0.5:
            draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill, outline=(20, 20, 20), width=4)
        else:
            draw.rectangle((cx - r, cy - r, cx + r, cy + r), fill=fill, outline=(240, 240, 240), width=4)
    return img


def _tiles(seed: int, side: int = 1024) -> Image.Image:
    """A large picture of bevelled square tiles of random colours, 18 to 30 pixels each (as a mosaic wallpaper: in
    a 96-pixel image a tile is two or three pixels)."""
    rng = np.random.default_rng(seed)
    cell = int(rng.integers(18, 31))
    img = Image.new("RGB", (side, side), (20, 20, 20))
    draw = ImageDraw.Draw(img)
    for y in range(0, side, cell):
        for x in range(0, side, cell):
            c = tuple(int(v) for v in rng.integers(40, 256, 3))
            draw.rectangle((x, y, x + cell - 2, y + cell - 2), fill=c)
            draw.line((x, y + cell - 2, x + cell - 2, y + cell - 2), fill=tuple(v // 2 for v in c), width=3)
    return img


def _smooth(seed: int, side: int = 1024) -> Image.Image:
    """A large smooth picture (a scene's shapes and shading, no fine detail)."""
    small = np.random.default_rng(seed).integers(0, 256, (6, 6, 3), dtype=np.uint8)
    return Image.fromarray(small).resize((side, side), Image.Resampling.BICUBIC)


def _off_centre(img: Image.Image, share: float, fx: float, fy: float) -> Image.Image:
    w, h = img.size
    cw, ch = round(w * share), round(h * share)
    x, y = round((w - cw) * fx), round((h - ch) * fy)
    return img.crop((x, y, x + cw, y + ch))


def _centre(img: Image.Image, share: float) -> Image.Image:
    w, h = img.size
    cw, ch = round(w * share), round(h * share)
    return img.crop(((w - cw) // 2, (h - ch) // 2, (w - cw) // 2 + cw, (h - ch) // 2 + ch))


def _thumb(img: Image.Image) -> Image.Image:
    """The index's thumbnail of a photo: 256 pixels on its long side, as JPEG at quality 85."""
    t = img.copy()
    t.thumbnail((256, 256))
    buf = io.BytesIO()
    t.save(buf, "JPEG", quality=85)
    return Image.open(io.BytesIO(buf.getvalue())).convert("RGB")


def test_the_fine_check_finds_an_80_percent_crop_that_the_check_of_thumbnails_misses(tmp_path):
    """Three such pictures and the centre 80% of each (a share between two of SCALES): the check of their thumbnails'
    frames leaves every crop under COPY_SCORE; from the photos themselves (decoded as the search decodes them), at a
    crop share every 3%, each is a copy; distinct pictures stay far under it either way."""
    thumbs, own, fine = {}, {}, {}
    for n in (1, 3, 4):
        for i, img in ((n, _icons(n)), (10 + n, _centre(_icons(n), 0.8))):
            img.save(tmp_path / f"{i}.png")
            decoded = load_rgb(tmp_path / f"{i}.png", min_short=2 * FINE_SIDE)
            thumbs[i], own[i], fine[i] = frame_of(_thumb(img)), frame_of(decoded), frame_of(decoded, FINE_SIDE)
    copies = [(n, 10 + n) for n in (1, 3, 4)]
    distinct = [(a, b) for a in thumbs for b in thumbs if a < b and a % 10 != b % 10]
    checked = copy_scores(copies + distinct, thumbs)
    again = fine_scores(copies + distinct, own, fine)
    assert max(checked[p] for p in copies) < COPY_SCORE, [checked[p] for p in copies]
    assert min(again[p] for p in copies) >= COPY_SCORE, [again[p] for p in copies]
    assert max(max(checked[p], again[p]) for p in distinct) < 0.8


def test_a_search_finds_a_large_photo_s_crop_by_the_fine_check_and_not_without_it(backbone, tmp_path, monkeypatch):
    """A search of an index of three such photos, the centre 80% of one and a small photo: the crop and its photo are
    one group of near duplicates, in this process and in the check's worker processes alike; with the fine check off
    (FINE_FROM above any score) they are not, and the small photo is never checked again (it is under FINE_MIN)."""
    photos = tmp_path / "photos"
    photos.mkdir()
    for n in range(1, 4):
        _icons(n).save(photos / f"icons{n}.png")
    _centre(_icons(1), 0.8).save(photos / "icons1_crop.png")
    _icons(7, side=96).save(photos / "small.png")
    build_index(photos, backbone, tmp_path / "idx", progress=False)
    checked: list[tuple[int, int]] = []
    fine = verify.fine_scores
    monkeypatch.setattr(verify, "fine_scores", lambda pairs, *fr: (checked.extend(pairs), fine(pairs, *fr))[1])
    found = search_duplicates(ImageIndex.open(tmp_path / "idx"), save=False, workers=0)
    near = [sorted(m.path for m in g.members) for g in found.groups if g.kind == "near"]
    assert near == [["icons1.png", "icons1_crop.png"]]
    small = ImageIndex.open(tmp_path / "idx").catalog.rows()["small.png"].id
    assert checked and all(small not in p for p in checked)

    (tmp_path / "idx" / CHECKED_FILE).unlink()  # checked anew, by two worker processes
    two = search_duplicates(ImageIndex.open(tmp_path / "idx"), save=False, workers=2)
    assert [sorted(m.path for m in g.members) for g in two.groups if g.kind == "near"] == near

    monkeypatch.setattr(verify, "FINE_FROM", 2.0)  # the kept scores are of other settings: checked anew
    again = search_duplicates(ImageIndex.open(tmp_path / "idx"), save=False, workers=0)
    assert again.decision["reused"] == 0
    assert not [g for g in again.groups if g.kind == "near"]


def test_the_fine_check_keeps_its_photos_paths_packed_and_pickles_them(tmp_path):
    """Every large photo's path comes back whole (names of any script, sub-folders), another photo's is None, and a
    worker's pickled copy gives the same."""
    import pickle

    large = {7: "a.jpg", 3: "trips/été/b.png", 12: "日本/c d.JPG", 40: "x" * 300 + ".jpg"}
    fine = FineCheck(tmp_path, large)
    copy = pickle.loads(pickle.dumps(fine))
    for check in (fine, copy):
        assert len(check) == 4
        assert {i: check.path(i) for i in large} == {i: tmp_path / p for i, p in large.items()}
        assert [check.path(i) for i in (0, 4, 8, 13, 41, -1)] == [None] * 6
    assert FineCheck(tmp_path, {}).path(1) is None


def test_the_fine_check_of_many_pairs_together_scores_each_as_alone_and_decodes_each_photo_once(tmp_path,
                                                                                                  monkeypatch):
    """Pairs checked again together (a few at a time, their photos' spectra and crops shared) score exactly what
    each pair's fine_scores alone gives from its photos' frames; a photo whose file cannot be decoded keeps its
    pairs' scores; every photo is decoded once however many pairs hold it; pairs that do not apply are untouched."""
    import moco.data.photos as photos_module

    pictures = {1: _icons(1, side=400), 2: _tiles(2, side=400), 3: _smooth(3, side=400)}
    cut = {11: _off_centre(pictures[1], 0.8, 0.3, 0.6), 12: _centre(pictures[2], 0.75), 13: _centre(pictures[3], 0.9)}
    for i, img in {**pictures, **cut}.items():
        img.save(tmp_path / f"{i}.jpg", "JPEG", quality=90)
    (tmp_path / "9.jpg").write_bytes(b"not a photo")
    large = {i: f"{i}.jpg" for i in (1, 2, 3, 9, 11, 12, 13)}
    ids = sorted(large)
    pairs = np.array([(a, b) for n, a in enumerate(ids) for b in ids[n + 1 :]], np.int64)  # 21 pairs
    scores = np.where(np.arange(len(pairs)) % 5 == 4, 0.3, 0.9).astype(np.float32)  # every fifth: no fine check
    decoded: list[object] = []
    load = photos_module.load_rgb
    monkeypatch.setattr(photos_module, "load_rgb", lambda path, **kw: (decoded.append(path), load(path, **kw))[1])
    monkeypatch.setattr(verify, "FINE_AT_ONCE", 4)  # several batches
    check = FineCheck(tmp_path, large)
    got = check.rescore(pairs, scores)
    assert sorted(decoded) == sorted(tmp_path / f for f in large.values())  # each once
    alone = FineCheck(tmp_path, large)
    for (a, b), s, g in zip(pairs.tolist(), scores.tolist(), got.tolist()):
        fa, fb = alone._frames(a), alone._frames(b)
        if s < 0.5 or fa is None or fb is None:
            assert g == s, (a, b)
        else:
            one = fine_scores([(a, b)], {a: fa[0], b: fb[0]}, {a: fa[1], b: fb[1]}, {a: fa[2], b: fb[2]})[a, b]
            assert g == np.float32(max(s, one)), (a, b, g, one)  # the scores as given: float32
    assert got[pairs.tolist().index([1, 11])] >= COPY_SCORE > got[pairs.tolist().index([1, 2])]


def test_a_fine_texture_is_told_from_a_scene_by_its_finest_detail():
    """Tiles two or three pixels wide in the frame's image hold a large share of its variance in what a one-pixel blur
    takes away (at least TEXTURE_SHARE); a smooth picture and the icons on a striped ground hold little; a flat
    picture none. The share is that of the image by hand (PIL's blur, numpy's sums)."""
    from PIL import ImageFilter

    tiles, smooth = frame_of(_thumb(_tiles(2))), frame_of(_thumb(_smooth(2)))
    g = np.asarray(tiles.image, np.float64)
    rest = g - np.asarray(tiles.image.filter(ImageFilter.GaussianBlur(1.0)), np.float64)
    assert fine_texture(tiles) == ((rest**2).sum() / ((g - g.mean()) ** 2).sum())
    assert fine_texture(tiles) >= TEXTURE_SHARE > 2 * fine_texture(smooth)
    assert fine_texture(frame_of(Image.new("RGB", (512, 512), (90, 90, 90)))) == 0.0


def test_a_crop_of_a_fine_texture_that_thumbnails_put_far_from_a_copy_is_checked_again_and_found(tmp_path):
    """70-85% crops of tile mosaics, off centre: on their thumbnails' frames each scores under FINE_FROM (no pair of
    ordinary photos would be checked again), but the mosaic is a fine texture (its crop, enlarged, may not be), so
    the fine check applies and finds each a copy from the photos; distinct mosaics are checked again too and stay
    distinct; two smooth pictures (scenes) under FINE_FROM and a small photo are not checked again."""
    pictures = {1: _tiles(1), 2: _tiles(2), 3: _tiles(3), 4: _smooth(4), 5: _smooth(5)}
    cuts = {11: (1, 0.7, 0.2, 0.9), 12: (2, 0.8, 0.7, 0.1), 13: (3, 0.85, 0.5, 0.5), 14: (4, 0.75, 0.9, 0.3)}
    photos = dict(pictures)
    photos.update({c: _off_centre(pictures[p], s, fx, fy) for c, (p, s, fx, fy) in cuts.items()})
    photos[20] = _tiles(9, side=150)
    for i, img in photos.items():
        img.save(tmp_path / f"{i}.jpg", "JPEG", quality=92)
    thumbs = {i: frame_of(_thumb(img)) for i, img in photos.items()}
    check = FineCheck(tmp_path, {i: f"{i}.jpg" for i, img in photos.items() if min(img.size) >= 2 * FINE_SIDE})
    copies = [(p, c) for c, (p, *_) in cuts.items() if p != 4]
    distinct = [(1, 2), (2, 13), (1, 3), (1, 4)]
    first = copy_scores(copies + distinct + [(4, 5), (1, 20)], thumbs)
    assert max(first[p] for p in copies) < FINE_FROM, [first[p] for p in copies]
    applies = {p: check.applies(*p, first[p], thumbs) for p in copies + distinct}
    assert applies == {p: first[p] >= 0.5 for p in applies} and all(applies[p] for p in copies), (applies, first)
    assert 0.5 <= first[4, 5] < FINE_FROM and not check.applies(4, 5, first[4, 5], thumbs), first[4, 5]  # scenes
    assert not check.applies(1, 20, first[1, 20], thumbs)  # a small photo
    assert not check.applies(1, 11, first[1, 11], None)  # without the frames, the ordinary gate
    pairs = np.array(copies + distinct, np.int64)
    again = check.rescore(pairs, np.array([first[tuple(p)] for p in pairs.tolist()]), thumbs)
    assert min(again[: len(copies)]) >= COPY_SCORE, again
    assert max(again[len(copies) :]) < COPY_SCORE, again


def test_a_search_checks_the_crop_family_of_every_large_photo_with_a_verified_first_crop(backbone, tmp_path):
    """After the check, a large photo whose crop search found a verified copy first has the other photos that search
    found checked too: a 70% crop off centre that only its photo's crop search finds (fifth, behind the 80% crop, a
    re-encode and two tone curves, one of them not alike), with a model that finds nothing (random vectors, as a
    weak model's), is verified by it; the search counts those pairs, the kept scores hold every one of the family,
    and a search again scores none anew."""
    from index.duplicates import dedup
    from index.duplicates.dedup_cache import NEIGHBOURS_FILE, kept_neighbours, kept_scores
    from index.duplicates.propose import MODEL_DEPTH, ModelFound, crop_families

    photos = tmp_path / "photos"
    photos.mkdir()
    for n in range(1, 41):  # large photos (FINE_MIN a side or more), many: each keeps a few of the others
        _icons(n, side=320).save(photos / f"icons{n}.png")
    img = _icons(1, side=320)
    _centre(img, 0.8).save(photos / "icons1_crop80.png")
    img.crop((0, 90, 224, 314)).save(photos / "icons1_crop70.png")  # 70% of a side, off centre
    img.save(photos / "icons1_q20.jpg", quality=20)
    grey = np.asarray(img, np.float32) / 255.0
    for g in (0.6, 1.6):  # tone curves: in the crop search, under the alike photos and above the 70% crop
        Image.fromarray(np.clip(255.0 * grey**g, 0, 255).astype(np.uint8)).save(photos / f"icons1_gamma{g}.png")
    build_index(photos, backbone, tmp_path / "idx", progress=False)

    rows = ImageIndex.open(tmp_path / "idx").catalog.rows()
    whole, crop = rows["icons1.png"].id, rows["icons1_crop70.png"].id

    def search() -> tuple[dict[tuple[int, int], float], dict[str, int]]:
        idx = ImageIndex.open(tmp_path / "idx")
        ids, _ = idx.catalog.vectors(dim=idx.dim)
        rows = idx.catalog.rows_by_id(ids)
        rng = np.random.default_rng(0)
        vecs = rng.normal(size=(len(ids), 8)).astype(np.float32)  # N x 8: a model that tells nothing
        vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
        near = np.stack([rng.permutation(ids[~np.isin(ids, [i, whole + crop - i] if i in (whole, crop) else [i])])
                         [:MODEL_DEPTH] for i in ids.tolist()])  # N x MODEL_DEPTH: the two never each other's
        sims = np.sort(rng.uniform(0.1, 0.3, near.shape).astype(np.float32), axis=1)[:, ::-1]
        _, kept, counts = dedup.verify_links(idx, ids, vecs, dedup._content(ids, rows), rows, {}, workers=0,
                                             found=ModelFound(ids, near, np.ascontiguousarray(sims)))
        return kept, counts

    kept, counts = search()
    assert (min(whole, crop), max(whole, crop)) in kept and counts["crop_families"] > 0
    nb = kept_neighbours(tmp_path / "idx" / NEIGHBOURS_FILE)
    keys, scores = kept_scores(tmp_path / "idx" / CHECKED_FILE)
    scored = {(int(a), int(b)): float(s) for (a, b), s in zip(keys.tolist(), scores.tolist())}
    family = {tuple(p) for p in crop_families(nb, set(nb.ids.tolist()), {p for p, s in scored.items()
                                                                           if s >= COPY_SCORE}).tolist()}
    assert (min(whole, crop), max(whole, crop)) in family and family <= set(scored)
    again, counts_again = search()
    assert counts_again["checked"] == 0 and counts_again["crop_families"] == counts["crop_families"]
    assert again == kept
