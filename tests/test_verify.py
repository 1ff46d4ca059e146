"""The pixel check of near-duplicates (index/verify.py): its whole-pixel search against a brute-force loop over every
window, copies of a generated photo (re-encoded, resized, cropped off-centre and to another shape, brightened,
mirrored) scoring at least COPY_SCORE and every other photo of the collection under it, and frames taken from
thumbnails, from the photo where a thumbnail is missing, and none where neither can be read."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageEnhance, ImageOps

from index.verify import COPY_SCORE, SCALES, SIDE, Frame, _coarse, _crop_size, copy_scores, frame_of, frames, ncc_brute
from moco.data.sample import make_sample_collection


def _frame(rng: np.random.Generator, w: int, h: int) -> Frame:
    """A frame of a smooth random picture of w x h pixels (noise, blurred by shrinking and enlarging)."""
    small = rng.integers(0, 256, (max(2, h // 6), max(2, w // 6)), dtype=np.uint8)
    return frame_of(Image.fromarray(small).resize((w, h), Image.Resampling.BICUBIC).convert("RGB"))


def _brute_best(big: Frame, small: Frame) -> tuple[float, float]:
    """(best whole-frame NCC, best crop NCC) of ``small`` over ``big``, plain or mirrored, by ncc_brute."""
    whole = crop = -1.0
    for s in SCALES:
        size = _crop_size(s, big.aspect, small.aspect)
        if size is None:
            continue
        t = np.asarray(small.image.resize(size, Image.Resampling.BILINEAR, reducing_gap=2.0), np.float32) \
            if size != (SIDE, SIDE) else small.grey.astype(np.float32)
        got = max(ncc_brute(big.grey.astype(np.float32), t), ncc_brute(big.grey.astype(np.float32), t[:, ::-1]))
        if size == (SIDE, SIDE):
            whole = max(whole, got)
        else:
            crop = max(crop, got)
    return whole, crop


def test_the_whole_pixel_search_against_brute_force():
    """Photos of three shapes (square, 4:3, 3:4): every ordered pair's best whole-frame and crop scores, plain or
    mirrored, are those of a loop over every window of every crop size."""
    rng = np.random.default_rng(0)
    photos = {0: _frame(rng, 80, 80), 1: _frame(rng, 96, 72), 2: _frame(rng, 72, 96), 3: _frame(rng, 90, 90)}
    pairs = [(0, 1), (0, 2), (1, 2), (0, 3), (1, 3)]
    coarse, _ = _coarse(pairs, photos)
    for a, b in pairs:
        for big, small in ((a, b), (b, a)):
            whole, crop = _brute_best(photos[big], photos[small])
            got = coarse[big, small]  # whole plain, whole mirrored, crop plain, crop mirrored
            assert max(got[0], got[1]) == pytest.approx(whole, abs=1e-4)
            assert max(got[2], got[3], -1.0) == pytest.approx(crop, abs=1e-4)
    assert all(max(coarse[a, b][:2]) > -1.0 for a, b in pairs)  # whole frames of every shape (a squeezed copy)
    assert max(coarse[1, 2][2:]) < -1.0  # but no crop of a 4:3 photo is a 3:4 one at 70% or more


def _jpeg(img: Image.Image, quality: int) -> Image.Image:
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=quality)
    return Image.open(io.BytesIO(buf.getvalue())).convert("RGB")


def _crop(img: Image.Image, sx: float, sy: float, fx: float, fy: float) -> Image.Image:
    """The share (sx, sy) of ``img``'s sides, its corner at the share (fx, fy) of the room left."""
    w, h = img.size
    cw, ch = round(w * sx), round(h * sy)
    x, y = round((w - cw) * fx), round((h - ch) * fy)
    return img.crop((x, y, x + cw, y + ch))


def test_copies_score_above_copy_score_and_other_photos_under_it(tmp_path):
    make_sample_collection(tmp_path, per_family=3, size=160, seed=3)
    paths = sorted(tmp_path.rglob("*.jpg"))
    photo = Image.open(paths[0]).convert("RGB")
    w, h = photo.size
    copies = {
        "jpeg q60": _jpeg(photo, 60),
        "resized 60%": photo.resize((w * 6 // 10, h * 6 // 10), Image.Resampling.BICUBIC),
        "cropped 85%, centre": _crop(photo, 0.85, 0.85, 0.5, 0.5),
        "cropped 85%, top left": _crop(photo, 0.85, 0.85, 0.1, 0.0),
        "cropped 80%, bottom right": _crop(photo, 0.8, 0.8, 1.0, 0.9),
        "cropped 88%, off-centre": _crop(photo, 0.88, 0.88, 0.3, 0.8),
        "cropped to 4:3": _crop(photo, 0.9, 0.675, 0.4, 0.6),
        "brightened x1.3": ImageEnhance.Brightness(photo).enhance(1.3),
        "contrast x0.8": ImageEnhance.Contrast(photo).enhance(0.8),
        "mirrored": ImageOps.mirror(photo),
        "mirrored and cropped": ImageOps.mirror(_crop(photo, 0.85, 0.85, 0.7, 0.2)),
        "grey": photo.convert("L").convert("RGB"),
    }
    fr = {0: frame_of(photo)}
    fr |= {n: frame_of(img) for n, img in enumerate(copies.values(), 1)}
    others = {100 + n: frame_of(Image.open(p).convert("RGB")) for n, p in enumerate(paths[1:])}
    scores = copy_scores([(0, n) for n in range(1, len(copies) + 1)] + [(0, o) for o in others], fr | others)
    for n, name in enumerate(copies, 1):
        assert scores[0, n] >= COPY_SCORE, (name, scores[0, n])
    assert all(scores[0, o] < COPY_SCORE for o in others), {o: scores[0, o] for o in others}
    assert max(scores[0, o] for o in others) < 0.95  # not near it either: the check is not balanced on an edge
    # a heavy crop (half of each side) is no longer a copy by pixels: only what SCALES covers is
    assert copy_scores([(0, 1)], {0: fr[0], 1: frame_of(_crop(photo, 0.5, 0.5, 0.5, 0.5))})[0, 1] < COPY_SCORE


def _picture(rng: np.random.Generator, w: int, h: int) -> Image.Image:
    """A smooth random RGB picture of w x h pixels."""
    small = rng.integers(0, 256, (max(2, h // 6), max(2, w // 6), 3), dtype=np.uint8)
    return Image.fromarray(small).resize((w, h), Image.Resampling.BICUBIC)


def test_frames_from_thumbnails_the_photo_or_none(tmp_path):
    img = _picture(np.random.default_rng(1), 150, 100)
    img.save(tmp_path / "thumb.jpg")
    img.resize((60, 40)).save(tmp_path / "small.jpg")  # a small photo's thumbnail: the photo is read instead
    (tmp_path / "broken.jpg").write_bytes(b"not a jpeg")
    decoded: list[int] = []

    def fallback(i: int) -> Image.Image | None:
        decoded.append(i)
        return img if i in (2, 5) else None

    got = frames({1: tmp_path / "thumb.jpg", 2: tmp_path / "broken.jpg", 3: None, 4: tmp_path / "missing.jpg",
                  5: tmp_path / "small.jpg", 6: tmp_path / "small.jpg"}, fallback)
    assert sorted(got) == [1, 2, 5, 6] and decoded == [2, 3, 4, 5, 6]  # 6: the photo unreadable, its thumbnail
    assert got[1].grey.shape == (SIDE, SIDE) and got[1].aspect == pytest.approx(1.5)
    assert max(got[2].image.size) <= 2 * SIDE and got[6].aspect == pytest.approx(1.5)
    assert copy_scores([(1, 2), (1, 3)], got) == {(1, 2): pytest.approx(copy_scores([(1, 2)], got)[1, 2])}
    scores = copy_scores([(1, 2), (1, 5), (1, 6)], got)
    assert min(scores.values()) >= COPY_SCORE  # the JPEG thumbnail of the same pixels, and its small copy


def test_ncc_brute_is_the_pearson_correlation():
    rng = np.random.default_rng(2)
    big = rng.random((9, 9)).astype(np.float32)
    small = big[2:7, 3:8] * 2.5 + 7  # a window, brighter and with more contrast
    assert ncc_brute(big, small) == pytest.approx(1.0, abs=1e-6)
    other = rng.random((5, 5)).astype(np.float32)
    want = max(np.corrcoef(big[y : y + 5, x : x + 5].ravel(), other.ravel())[0, 1]
               for y in range(5) for x in range(5))
    assert ncc_brute(big, other) == pytest.approx(want, abs=1e-6)


def test_a_frame_keeps_a_thumbnail_sized_image(tmp_path: Path):
    f = frame_of(Image.new("RGB", (1000, 500), "white"))
    assert f.grey.dtype == np.uint8 and f.grey.shape == (SIDE, SIDE) and f.aspect == 2.0
    assert f.image.size == (2 * SIDE, SIDE) and f.image.mode == "L"


def test_pixel_neighbours_exact_and_approximate(monkeypatch):
    """The pixel proposals: the flat index's neighbours are the brute-force NCC top k of the 16-px frames (plain and
    mirrored queries); above PIXEL_EXACT_UP_TO photos an HNSW index finds nearly the same."""
    import index.dedup as dedup

    rng = np.random.default_rng(5)
    fr = {100 + n: _frame(rng, 48, 48) for n in range(150)}
    ids = list(fr)

    def flat(i: int, mirror: bool) -> np.ndarray:
        g = np.asarray(Image.fromarray(fr[i].grey).resize((dedup.PIXEL_SIDE,) * 2, Image.Resampling.BOX), np.float32)
        g = (g[:, ::-1] if mirror else g).ravel() - g.mean()
        return g / np.linalg.norm(g)

    got = list(dedup.pixel_neighbours(ids, fr, 4, chunk=32))
    keys = [(i, mirror) for s in range(0, len(ids), 32) for mirror in (False, True) for i in ids[s : s + 32]]
    assert len(got) == len(keys) == 2 * len(ids)  # each chunk: its plain queries, then its mirrored ones
    for (i, mirror), (j, row) in zip(keys, got):
        q = flat(i, mirror)
        assert j == i and row == sorted(ids, key=lambda o: -float(q @ flat(o, False)))[:4]
    monkeypatch.setattr(dedup, "PIXEL_EXACT_UP_TO", 10)
    approx = list(dedup.pixel_neighbours(ids, fr, 4, chunk=32))
    hits = sum(len(set(a) & set(b)) for (_, a), (_, b) in zip(approx, got))
    assert hits >= 0.9 * 4 * len(got)
