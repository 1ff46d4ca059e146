"""The pixel check of near-duplicates (index/duplicates/verify.py): its whole-pixel search against a brute-force loop
over every
window, copies of a generated photo (re-encoded, resized, cropped off-centre and to another shape, brightened,
mirrored) scoring at least COPY_SCORE and every other photo of the collection under it, and frames taken from
thumbnails, from the photo where a thumbnail is missing, and none where neither can be read."""

from __future__ import annotations

import dataclasses
import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageEnhance, ImageOps

from index.duplicates.verify import (
    BUSY_SHARE,
    COLOUR_AGREE,
    COLOUR_COPY_FROM,
    COLOUR_GRID,
    COLOUR_PATTERN,
    COLOUR_SIDE,
    COPY_SCORE,
    SCALES,
    SCREEN_FROM,
    SCREEN_SIDE,
    SIDE,
    Frame,
    _coarse,
    _crop_size,
    _screen,
    _shrink,
    busy_share,
    colour_agreement,
    colour_pattern,
    copy_scores,
    frame_of,
    frames,
    ncc_brute,
)
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


def test_the_screen_against_brute_force():
    """Every pair's screen score is the best NCC, by a loop over every window, of either photo shrunk to a crop's
    size (from its frame, by the triangle filter) over the other's frame at SCREEN_SIDE a side, plain or mirrored."""
    rng = np.random.default_rng(1)
    photos = {0: _frame(rng, 80, 80), 1: _frame(rng, 96, 72), 2: _frame(rng, 72, 96), 3: _frame(rng, 90, 90)}
    pairs = [(0, 1), (0, 2), (1, 2), (0, 3), (1, 3), (2, 3)]
    f = SIDE // SCREEN_SIDE

    def low(p: int) -> np.ndarray:
        return photos[p].grey.astype(np.float64).reshape(SCREEN_SIDE, f, SCREEN_SIDE, f).sum(axis=(1, 3))

    got = _screen(pairs, photos)
    for n, (a, b) in enumerate(pairs):
        want = -1.0
        for big, small in ((a, b), (b, a)):
            for s in SCALES:
                size = _crop_size(s, photos[big].aspect, photos[small].aspect, SCREEN_SIDE)
                if size is None:
                    continue
                t = _shrink(size[1]) @ photos[small].grey.astype(np.float32) @ _shrink(size[0]).T  # h x w
                want = max(want, ncc_brute(low(big), t), ncc_brute(low(big), t[:, ::-1]))
        assert got[n] == pytest.approx(want, abs=1e-4), (a, b)


def test_the_screen_changes_no_decision_and_turns_most_distinct_pairs_away(monkeypatch):
    """Smooth pictures (as bench/dedup_scale.py makes them) with copies of every kind the check finds: the same
    copies with the screen as without it, the same score for every pair that passes it, and most distinct pairs
    turned away by it (they are not checked in full)."""
    import index.duplicates.verify as verify

    rng = np.random.default_rng(11)
    fr: dict[int, Frame] = {}
    copies = []
    for n in range(30):
        cells = int(rng.integers(3, 8))
        img = Image.fromarray(rng.integers(0, 256, (cells, cells, 3), dtype=np.uint8)).resize(
            (32, 32), Image.Resampling.BICUBIC)
        fr[n] = frame_of(img)
        edit = n % 5
        copy = (_jpeg(img, 50) if edit == 0 else img.resize((26, 26), Image.Resampling.BICUBIC).resize((32, 32))
                if edit == 1 else ImageOps.mirror(img) if edit == 2 else ImageEnhance.Contrast(img).enhance(1.3)
                if edit == 3 else img.crop((2, 2, 30, 30)))
        fr[100 + n] = frame_of(copy)
        copies.append((n, 100 + n))
    photo = Image.open(io.BytesIO(_picture_bytes())).convert("RGB")
    fr[200], fr[201] = frame_of(photo), frame_of(_crop(photo, 0.75, 0.75, 0.2, 0.7))
    copies.append((200, 201))
    distinct = [(a, b) for a in range(30) for b in range(a + 1, 30)]
    pairs = copies + distinct
    screened = _screen(pairs, fr)
    with_screen = copy_scores(pairs, fr)
    monkeypatch.setattr(verify, "SCREEN_FROM", -np.inf)
    without = copy_scores(pairs, fr)
    assert {p for p in pairs if with_screen[p] >= COPY_SCORE} == {p for p in pairs if without[p] >= COPY_SCORE}
    assert sum(without[p] >= COPY_SCORE for p in copies) >= len(copies) - 1  # the copies are found
    passed = [p for p, s in zip(pairs, screened.tolist()) if s >= SCREEN_FROM]
    coloured = [p for p in passed if with_screen[p] < COLOUR_AGREE]  # turned away by their colours there
    assert len(coloured) >= 0.5 * len(set(passed) - set(copies)) and not set(coloured) & set(copies)
    assert all(with_screen[p] == without[p] for p in passed if p not in coloured)
    away = [p for p, s in zip(pairs, screened.tolist()) if s < SCREEN_FROM]
    assert len(away) >= 0.5 * len(distinct) and not set(away) & set(copies)
    assert all(with_screen[p] == pytest.approx(s) for p, s in zip(pairs, screened.tolist()) if s < SCREEN_FROM)


def _picture_bytes() -> bytes:
    """A busy 400 x 300 photo-like picture (smooth noise at two scales) as PNG bytes."""
    rng = np.random.default_rng(7)
    coarse = Image.fromarray(rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)).resize((400, 300),
                                                                                      Image.Resampling.BICUBIC)
    fine = Image.fromarray(rng.integers(0, 256, (60, 80, 3), dtype=np.uint8)).resize((400, 300),
                                                                                    Image.Resampling.BICUBIC)
    buf = io.BytesIO()
    Image.blend(coarse, fine, 0.35).save(buf, "PNG")
    return buf.getvalue()


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
        "gamma 1.5": photo.point(lambda v: round(255 * (v / 255) ** 1.5)),
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


def _isotonic_brute(y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The weighted least-squares non-decreasing fit by trying every cut into runs of constant value (its solution is
    one: each run at its weighted mean, the means non-decreasing)."""
    import itertools

    best, fit = np.inf, None
    for cuts in itertools.product((False, True), repeat=len(y) - 1):
        edges = [0, *(n + 1 for n, c in enumerate(cuts) if c), len(y)]
        means = [float(y[a:b] @ w[a:b] / w[a:b].sum()) for a, b in zip(edges, edges[1:])]
        if any(m2 < m1 - 1e-12 for m1, m2 in zip(means, means[1:])):
            continue
        f = np.concatenate([np.full(b - a, m) for (a, b), m in zip(zip(edges, edges[1:]), means)])
        sse = float(((y - f) ** 2) @ w)
        if sse < best:
            best, fit = sse, f
    return fit


def test_tone_score_fits_a_tone_curve_and_nothing_else():
    """The isotonic fit matches a brute force over every cut; a frame brightened until it clips, or through a gamma,
    scores ~1 through its tone curve where its NCC is lower; tone is never under NCC; a shifted or mirrored frame
    (the same tones, moved) stays near its NCC; a flat frame scores 0."""
    from index.duplicates.verify import _isotonic, tone_score

    rng = np.random.default_rng(3)
    for _ in range(30):
        y, w = rng.normal(size=7), rng.uniform(0.5, 3.0, 7)
        assert np.allclose(_isotonic(y, w), _isotonic_brute(y, w))
    x = np.asarray(_frame(rng, 64, 64).grey)
    ncc = lambda a, b: float(np.corrcoef(a.ravel().astype(float), b.ravel().astype(float))[0, 1])
    clipped = np.clip(x.astype(float) * 1.6, 0, 255).astype(np.uint8)
    gamma = (255 * (x / 255.0) ** 2.2).astype(np.uint8)
    for y in (clipped, gamma):
        assert ncc(x, y) < 0.99 and tone_score(x, y) > 0.999 and tone_score(y, x) == tone_score(x, y)
    for y in (np.roll(x, 3, axis=1), x[:, ::-1], np.asarray(_frame(rng, 64, 64).grey)):
        assert ncc(x, y) - 1e-9 <= tone_score(x, y) <= max(ncc(x, y), 0) + 0.5 * (1 - ncc(x, y))
    assert tone_score(x, np.full_like(x, 7)) == 0.0


def test_a_copy_brightened_until_it_clips_is_found_through_its_tone_curve(monkeypatch):
    """A product shot on black (a garment, as Fashion-MNIST's) brightened x1.5-2 clips its highlights: no longer a
    linear function of the photo's grey, so NCC alone misses it; through the tone curve it is a copy, and its
    mirror image too. Distinct photos of the same shape stay under COPY_SCORE either way."""
    from PIL import ImageFilter

    import index.duplicates.verify as verify

    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:96, 0:96]
    body = ((abs(xx - 48) < 22) & (abs(yy - 50) < 38)).astype(float)

    def shot(seed: int) -> Image.Image:
        tex = np.asarray(Image.fromarray(np.random.default_rng(seed).integers(0, 256, (12, 12), dtype=np.uint8))
                         .resize((96, 96), Image.Resampling.BICUBIC), float)
        grey = np.clip(body * (120 + 0.5 * tex), 0, 255).astype(np.uint8)
        return Image.fromarray(grey).filter(ImageFilter.GaussianBlur(1)).convert("RGB")

    photo = shot(int(rng.integers(1000)))
    fr = {0: frame_of(photo), 1: frame_of(ImageEnhance.Brightness(photo).enhance(1.5)),
          2: frame_of(ImageEnhance.Brightness(photo).enhance(2.0)),
          3: frame_of(ImageOps.mirror(ImageEnhance.Brightness(photo).enhance(1.7)))}
    fr |= {10 + n: frame_of(shot(n)) for n in range(6)}  # the same garment's shape, other cloth
    pairs = [(0, 1), (0, 2), (0, 3), *((0, o) for o in range(10, 16))]
    toned = copy_scores(pairs, fr)
    monkeypatch.setattr(verify, "TONE_FROM", 1.1)  # no tone curve
    lined = copy_scores(pairs, fr)
    for n in (1, 2, 3):
        assert lined[0, n] < COPY_SCORE <= toned[0, n], (n, lined[0, n], toned[0, n])
    assert all(toned[0, o] < COPY_SCORE for o in range(10, 16)), toned


def test_busy_small_photos_given_contrast_or_a_gamma_are_copies_and_other_busy_photos_are_not(monkeypatch):
    """Small photos with shading everywhere (no flat background: a sky, a wall, skin), given more contrast (x1.3,
    clipping) or a gamma (0.8): their tone curve fits them almost exactly, and where content fills the frames
    (busy_share >= BUSY_SHARE) its misfit counts BUSY_TONE_WEIGHT times, which finds them; with TONE_WEIGHT for every
    pair (the rule before) some are missed. Other busy photos stay under COPY_SCORE either way, and a silhouette on
    black is not busy."""
    import index.duplicates.verify as verify


    def smooth(seed: int) -> Image.Image:  # as bench/dedup_scale.py makes its small photos
        r = np.random.default_rng(seed)
        cells = int(r.integers(3, 8))
        noise = r.integers(0, 256, (cells, cells, 3), dtype=np.uint8)
        return Image.fromarray(noise).resize((32, 32), Image.Resampling.BICUBIC)

    photos = {n: smooth(100 + n) for n in range(40)}
    fr, pairs = {}, []
    for n, img in photos.items():  # their grey alone (colour evidence has a test of its own)
        fr[n] = dataclasses.replace(frame_of(img), colour=None)
        fr[1000 + n] = dataclasses.replace(frame_of(ImageEnhance.Contrast(img).enhance(1.3)), colour=None)
        fr[2000 + n] = dataclasses.replace(frame_of(img.point(lambda v: round(255 * (v / 255) ** 0.8))), colour=None)
        pairs += [(n, 1000 + n), (n, 2000 + n)]
    others = [(a, b) for a in range(40) for b in range(a + 1, 40)]
    assert all(busy_share(fr[a].grey, fr[b].grey) >= BUSY_SHARE for a, b in pairs)
    now = copy_scores(pairs + others, fr)
    found = sum(now[p] >= COPY_SCORE for p in pairs)
    assert found >= 0.98 * len(pairs), sorted(now[p] for p in pairs)[:3]  # the recall aim
    assert all(now[p] < COPY_SCORE for p in others), max(now[p] for p in others)
    monkeypatch.setattr(verify, "BUSY_TONE_WEIGHT", verify.TONE_WEIGHT)  # the rule before
    before = copy_scores(pairs, fr)
    assert sum(before[p] >= COPY_SCORE for p in pairs) < found  # copies only this rule finds
    silhouette = np.zeros((48, 48), np.uint8)
    silhouette[8:40, 14:34] = 150
    assert busy_share(silhouette, silhouette) < 0.5


def test_a_crop_window_of_a_smooth_picture_gets_no_busy_allowance(monkeypatch):
    """Two distinct smooth pictures (the 31st and the 2,820th of bench/dedup_scale.py's choose split with --smooth,
    seed 5): a crop window of one, refined to fit, is mapped onto the other by a tone curve well enough to pass with
    the busy allowance (BUSY_TONE_WEIGHT), which a whole busy pair gets. A tone edit is made to a whole photo, so a
    window's misfit counts WINDOW_TONE_WEIGHT times, busy or not, and the pair stays apart."""
    import index.duplicates.verify as verify

    rng = np.random.default_rng(5)
    pictures = []
    for _ in range(2820):  # as bench/dedup_scale.py makes its smooth pictures, in its order
        cells = int(rng.integers(3, 8))
        noise = rng.integers(0, 256, (cells, cells, 3), dtype=np.uint8)
        pictures.append(Image.fromarray(noise).resize((32, 32), Image.Resampling.BICUBIC))
    fr = {0: frame_of(pictures[30]), 1: frame_of(pictures[2819])}
    grey = {i: dataclasses.replace(f, colour=None) for i, f in fr.items()}  # their grey alone
    assert busy_share(fr[0].grey, fr[1].grey) >= BUSY_SHARE
    assert copy_scores([(0, 1)], grey)[0, 1] < COPY_SCORE
    monkeypatch.setattr(verify, "WINDOW_TONE_WEIGHT", verify.BUSY_TONE_WEIGHT)  # windows given the busy allowance
    assert copy_scores([(0, 1)], grey)[0, 1] >= COPY_SCORE
    assert copy_scores([(0, 1)], fr)[0, 1] < COLOUR_AGREE  # (their colours tell them apart even then)


def test_the_shrink_matrix_is_pils_bilinear_shrink():
    """The coarse-pixel rule's shrink (a triangle filter as wide as a step) gives PIL's BILINEAR resize of the frame
    to within PIL's rounding to whole grey levels."""
    from index.duplicates.verify import _shrink

    grey = np.asarray(_picture(np.random.default_rng(4), SIDE, SIDE).convert("L"))  # SIDE x SIDE
    for side in (32, 27, 16, 23):
        want = np.asarray(Image.fromarray(grey).resize((side, side), Image.Resampling.BILINEAR), np.float32)
        got = _shrink(side) @ grey.astype(np.float32) @ _shrink(side).T
        assert np.abs(got - want).max() <= 1.0, side


def test_small_photos_reencoded_or_shrunk_are_copies_by_their_coarse_pixels():
    """A 32-px photo re-encoded at JPEG quality 50, or shrunk to 26 px and back, loses its finest detail (whole
    frames at 0.989-0.995): scored on coarse pixels it is a copy; distinct alike photos (the same shape, another
    texture) stay under COPY_SCORE."""
    from index.duplicates.verify import LOW_FROM, _low

    rng = np.random.default_rng(7)
    photos, edits = [], []
    for _ in range(6):
        small = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
        photo = Image.fromarray(small).resize((32, 32), Image.Resampling.BICUBIC)
        photo = Image.fromarray(np.clip(np.asarray(photo, np.int16) + rng.integers(-24, 25, (32, 32, 3)), 0,
                                        255).astype(np.uint8))  # detail at the finest scale too
        photos.append(photo)
        edits += [_jpeg(photo, 50), photo.resize((26, 26), Image.Resampling.BICUBIC).resize(
            (32, 32), Image.Resampling.BICUBIC)]
    fr = {n: frame_of(p) for n, p in enumerate(photos)} | {100 + n: frame_of(e) for n, e in enumerate(edits)}
    pairs = [(n, 100 + 2 * n + k) for n in range(len(photos)) for k in (0, 1)]
    scores = copy_scores(pairs, fr)
    assert min(scores.values()) >= COPY_SCORE, scores
    lifted = [p for p in pairs if _coarse([p], fr)[0][p][:2].max() < COPY_SCORE]
    assert lifted  # some needed the coarse pixels: the whole frames alone were under COPY_SCORE
    assert all(_coarse([p], fr)[0][p][:2].max() >= LOW_FROM for p in lifted)
    # the same coarse shape with other fine detail: not a copy (its whole frames stay under LOW_FROM, or coarse
    # pixels differ)
    base = np.asarray(photos[0], np.int16)
    other = Image.fromarray(np.clip(base + rng.integers(-40, 41, base.shape), 0, 255).astype(np.uint8))
    fr[999] = frame_of(other)
    assert copy_scores([(0, 999)], fr)[0, 999] < COPY_SCORE
    assert _low(fr[0].grey, fr[0].grey) == pytest.approx(1.0, abs=1e-5)


def _trousers(rng: np.random.Generator) -> Image.Image:
    """A pair of trousers on black, 28 px drawn and 32 px stored (as Fashion-MNIST's in bench/dedup_scale.py): alike
    shapes, each drawn with its own waist, legs and grey."""
    from PIL import ImageDraw, ImageFilter

    img = Image.new("L", (28, 28), 0)
    d = ImageDraw.Draw(img)
    top, bottom = int(rng.integers(1, 4)), int(rng.integers(24, 28))
    left, right = int(rng.integers(6, 10)), int(rng.integers(18, 22))
    gap = int(rng.integers(0, 3))
    mid = (left + right) // 2
    tone = int(rng.integers(90, 230))
    d.rectangle([left, top, right, top + 5], fill=tone)
    d.polygon([(left, top + 5), (mid - gap, top + 5), (mid - gap - int(rng.integers(0, 2)), bottom),
               (left - int(rng.integers(0, 3)), bottom)], fill=tone)
    d.polygon([(mid + gap, top + 5), (right, top + 5), (right + int(rng.integers(0, 3)), bottom),
               (mid + gap + int(rng.integers(0, 2)), bottom)], fill=tone)
    img = img.filter(ImageFilter.GaussianBlur(0.6))
    return img.resize((32, 32), Image.Resampling.BILINEAR).convert("RGB")


def test_alike_trousers_are_not_refined_into_a_copy_and_a_crop_of_them_still_is(monkeypatch):
    """Two distinct trousers (the 8th and the 169th drawn from seed 0) match at 0.948 whole; a crop window of one
    fits the other barely better, and refined by fractions of a pixel it reached a copy's score. A crop window is
    refined only where it closes REFINE_GAP of the whole frames' gap to 1, as a crop's does (its whole frames are
    out of register): the pair stays apart, while a crop of two pixels of each trouser is still found."""
    import index.duplicates.verify as verify

    rng = np.random.default_rng(0)
    drawn = [_trousers(rng) for _ in range(169)]
    a, b = drawn[7], drawn[168]
    fr = {0: frame_of(a), 1: frame_of(b), 2: frame_of(a.crop((2, 0, 32, 30))), 3: frame_of(b.crop((0, 2, 30, 32)))}
    scores = copy_scores([(0, 1), (0, 2), (1, 3)], fr)
    assert scores[0, 1] < 0.95  # the whole frames' score: not refined
    assert scores[0, 2] >= COPY_SCORE and scores[1, 3] >= COPY_SCORE  # crops: refined and found
    monkeypatch.setattr(verify, "REFINE_GAP", 0.0)  # every window that beats the whole frames refined, as before
    assert copy_scores([(0, 1)], fr)[0, 1] >= COPY_SCORE
    monkeypatch.setattr(verify, "REFINE_FROM", 2.0)  # no window refined: the crops are not found whole
    assert max(copy_scores([(0, 2), (1, 3)], fr).values()) < COPY_SCORE


def _recoloured(img: Image.Image, other: Image.Image) -> Image.Image:
    """``img``'s luma (its grey, exactly) with the chroma of ``other``: the same picture in other colours."""
    y = img.convert("YCbCr").getchannel(0)
    _, cb, cr = other.convert("YCbCr").split()
    return Image.merge("YCbCr", (y, cb, cr))


def _cells(colour: np.ndarray) -> np.ndarray:
    """A frame's colours (2 x COLOUR_SIDE^2) as the mean chroma of COLOUR_GRID^2 square blocks, less grey."""
    f = COLOUR_SIDE // COLOUR_GRID
    return colour.astype(np.float64).reshape(2, COLOUR_GRID, f, COLOUR_GRID, f).mean(axis=(2, 4)) - 128.0


def test_colour_agreement_is_the_cosine_of_the_aligned_chroma_by_hand():
    """Whole frames, plain and mirrored: the cosine of the two photos' block-mean chroma, by numpy; a grey photo has
    no colour to tell by (1.0)."""
    rng = np.random.default_rng(3)
    pics = [Image.fromarray(rng.integers(0, 256, (5, 5, 3), dtype=np.uint8)).resize((64, 48), Image.Resampling.BICUBIC)
            for _ in range(2)]
    fr = {0: frame_of(pics[0]), 1: frame_of(pics[1]), 2: frame_of(pics[1].convert("L"))}
    x, y = _cells(fr[0].colour), _cells(fr[1].colour)  # 2 x G x G each
    for mirrored, yy in ((False, y), (True, y[:, :, ::-1])):
        want = float((x * yy).sum() / np.sqrt((x * x).sum() * (yy * yy).sum()))
        assert colour_agreement(fr, 0, 1, None, mirrored) == pytest.approx(want, abs=1e-6)
    assert fr[2].colour is None and colour_agreement(fr, 0, 2, None, False) == 1.0
    fr[3] = frame_of(pics[1].convert("L").convert("RGB"))  # grey pixels in a colour image: chroma 0 everywhere
    assert fr[3].colour is not None and colour_agreement(fr, 0, 3, (4, 4, 30, 30), True) == 1.0


def test_colour_cells_are_what_pil_resizes_them_to_for_any_box():
    """The aligned chroma by matrix products gives PIL's numbers: each photo's colours resized to COLOUR_GRID a side
    by PIL's BOX filter from a float image, over the whole frame and over windows of every size and place (whole
    and fractional pixels of 24-px and 48-px frames), mirrored or not, to the last bit."""
    import index.duplicates.verify as verify

    rng = np.random.default_rng(8)

    def pil(colour: np.ndarray, where: tuple[float, ...] | None) -> np.ndarray:  # 2 x G x G
        return np.stack([np.asarray(Image.fromarray(c.astype(np.float32), "F").resize(
            (COLOUR_GRID, COLOUR_GRID), Image.Resampling.BOX, box=where), np.float64) for c in colour]) - 128.0

    pics = [Image.fromarray(rng.integers(0, 256, (6, 6, 3), dtype=np.uint8)).resize((40, 30), Image.Resampling.BICUBIC)
            for _ in range(2)]
    fr = {0: frame_of(pics[0]), 1: frame_of(pics[1])}
    for trial in range(300):
        side = (SIDE, SCREEN_SIDE)[trial % 2]
        w, h = (int(v) for v in rng.integers(2, side + 1, 2))
        x, y = int(rng.integers(0, side - w + 1)), int(rng.integers(0, side - h + 1))
        box = None if trial % 10 == 0 else (x, y, w, h)
        mirrored = bool(trial % 3 == 0)
        got = verify._colour_cells(fr, 0, 1, box, mirrored, side)
        f = COLOUR_SIDE / side
        region = None if box is None else (x * f, y * f, (x + w) * f, (y + h) * f)
        want_small = pil(fr[1].colour, None)
        assert np.array_equal(got[0], pil(fr[0].colour, region)), (trial, box)
        assert np.array_equal(got[1], want_small[:, :, ::-1] if mirrored else want_small), trial


def test_one_pattern_in_other_colours_is_no_copy_and_every_copy_of_a_colour_photo_still_is():
    """A picture with another's chroma keeps its grey exactly (the grey check alone calls it a copy, 1.0), and is
    turned down by its colours; copies brightened, given contrast or a gamma, re-encoded at JPEG quality 50, mirrored,
    cropped (a small photo by 2 pixels, a large one to 75% off-centre: the colours compared where the crop lies) and
    a grey copy are still copies."""
    import index.duplicates.verify as verify

    rng = np.random.default_rng(21)
    pics = [Image.fromarray(rng.integers(0, 256, (c, c, 3), dtype=np.uint8)).resize((32, 32), Image.Resampling.BICUBIC)
            for c in (4, 5, 6, 4, 5, 6)]
    photo = Image.open(io.BytesIO(_picture_bytes())).convert("RGB")
    edits = {"bright": lambda im: ImageEnhance.Brightness(im).enhance(1.15),
             "contrast": lambda im: ImageEnhance.Contrast(im).enhance(1.3),
             "gamma": lambda im: im.point(lambda v: round(255 * (v / 255) ** 0.8)),
             "jpeg50": lambda im: _jpeg(im, 50), "mirrored": ImageOps.mirror,
             "crop2px": lambda im: im.crop((2, 2, im.width - 2, im.height - 2)),
             "grey": lambda im: im.convert("L")}
    fr: dict[int, Frame] = {}
    copies, recoloured = [], []
    for n, img in enumerate(pics):
        fr[n] = frame_of(img)
        fr[100 + n] = frame_of(_recoloured(img, pics[(n + 1) % len(pics)]))
        recoloured.append((n, 100 + n))
        for k, edit in enumerate(edits.values()):
            fr[1000 + 10 * n + k] = frame_of(edit(img))
            copies.append((n, 1000 + 10 * n + k))
    fr[200], fr[201] = frame_of(photo), frame_of(_crop(photo, 0.75, 0.75, 0.2, 0.7))
    copies.append((200, 201))
    got = copy_scores(copies + recoloured, fr, screen=False)
    assert all(got[p] >= COPY_SCORE for p in copies), {p: got[p] for p in copies if got[p] < COPY_SCORE}
    assert all(got[p] < COLOUR_AGREE for p in recoloured), [got[p] for p in recoloured]
    grey_only = {i: dataclasses.replace(f, colour=None) for i, f in fr.items()}
    assert all(s >= COPY_SCORE for s in copy_scores(recoloured, grey_only, screen=False).values())  # the grey alone
    coarse, crops = _coarse([(200, 201)], fr)
    big, small, box, mirrored = verify._alignment(200, 201, coarse[200, 201], coarse[201, 200], crops)
    assert (big, small, mirrored) == (200, 201, False) and box is not None  # the crop's window, not the whole frame
    assert colour_agreement(fr, big, small, box, False) > colour_agreement(fr, big, small, None, False)


def test_the_pattern_of_colours_is_the_cosine_of_the_chroma_less_its_mean_by_hand():
    rng = np.random.default_rng(4)
    pics = [Image.fromarray(rng.integers(0, 256, (5, 5, 3), dtype=np.uint8)).resize((40, 40), Image.Resampling.BICUBIC)
            for _ in range(2)]
    fr = {0: frame_of(pics[0]), 1: frame_of(pics[1]), 2: frame_of(pics[1].convert("L").convert("RGB"))}
    x, y = _cells(fr[0].colour), _cells(fr[1].colour)[:, :, ::-1]  # 2 x G x G each, the second mirrored
    x, y = x - x.mean(axis=(1, 2), keepdims=True), y - y.mean(axis=(1, 2), keepdims=True)
    assert colour_pattern(fr, 0, 1, None, True) == pytest.approx(float((x * y).sum() / np.sqrt((x * x).sum()
                                                                                           * (y * y).sum())), abs=1e-6)
    assert colour_pattern(fr, 0, 2, None, False) is None  # no colours to tell


def test_copies_just_under_the_copy_score_by_their_grey_are_found_by_the_pattern_of_their_colours(monkeypatch):
    """Busy smooth pictures given contrast (x1.3) or a gamma, scored by the tone rule before the busy allowance: some
    fall just under COPY_SCORE by their grey; with their colours, every one of those at COLOUR_COPY_FROM or more is
    a copy (its colour pattern agrees), and no pair of distinct pictures becomes one."""
    import index.duplicates.verify as verify

    def smooth(seed: int) -> Image.Image:  # as bench/dedup_scale.py makes its small photos
        r = np.random.default_rng(seed)
        cells = int(r.integers(3, 8))
        return Image.fromarray(r.integers(0, 256, (cells, cells, 3), dtype=np.uint8)).resize(
            (32, 32), Image.Resampling.BICUBIC)

    fr, pairs = {}, []
    for n in range(40):
        img = smooth(100 + n)
        fr[n] = frame_of(img)
        fr[1000 + n] = frame_of(ImageEnhance.Contrast(img).enhance(1.3))
        fr[2000 + n] = frame_of(img.point(lambda v: round(255 * (v / 255) ** 0.8)))
        pairs += [(n, 1000 + n), (n, 2000 + n)]
    others = [(a, b) for a in range(40) for b in range(a + 1, 40)]
    monkeypatch.setattr(verify, "BUSY_TONE_WEIGHT", verify.TONE_WEIGHT)  # grey scores that miss some copies
    grey = {i: dataclasses.replace(f, colour=None) for i, f in fr.items()}
    by_grey = copy_scores(pairs + others, grey)
    with_colour = copy_scores(pairs + others, fr)
    near = [p for p in pairs if COLOUR_COPY_FROM <= by_grey[p] < COPY_SCORE]
    assert near and all(with_colour[p] >= COPY_SCORE for p in near)  # each of them found by its colours
    assert all(with_colour[p] >= COPY_SCORE for p in pairs if by_grey[p] >= COPY_SCORE)
    assert all(with_colour[p] < COPY_SCORE for p in others)
    for a, b in near:
        coarse, crops = _coarse([(a, b)], fr)
        assert colour_pattern(fr, *verify._alignment(a, b, coarse[a, b], coarse[b, a], crops)) >= COLOUR_PATTERN
