"""Is one photo a copy of another? A check of a candidate pair on their pixels, as copy detection verifies the
candidates of a nearest-neighbour search.

Each photo becomes a small grey frame (:data:`SIDE` pixels a side, its whole picture squeezed into the square, from
the index's thumbnail, or from the photo where that is small; :func:`frames`). A copy of a photo is the same pixels
after a re-encode, a resize, a crop, a change of brightness or contrast, or a mirror. So for two photos ``a`` and
``b`` the check takes the best normalized cross-correlation (NCC: the Pearson correlation of pixels, blind to
brightness and contrast) of ``b``, shrunk to a crop's size, over every place of ``a`` it could have been cut from,
and the same with the two swapped and with ``b`` mirrored (:func:`copy_scores`)::

    score(a, b) = max over s in SCALES, mirror, a<->b, offset of NCC(window of a at offset, b shrunk to s)

A crop that changes the shape (a 4:3 photo cut square) shrinks ``b`` by the two sides' own shares, from the two
photos' aspect ratios; whole frames are compared whatever the shapes (a squeezed copy). The best crop window is then
refined by fractions of a pixel. Two distinct photos of alike things (two t-shirts, two tiles of one texture, planes
against blue sky) differ in their pixels wherever an embedding finds them alike: their score stays under
:data:`COPY_SCORE`; a copy scores above it. A flat window (a clear sky) matches nothing.

NCC is blind to a change of brightness or contrast only while it is linear. A copy brightened until its highlights
clip, or given a gamma, is a non-decreasing function of the photo's grey, not a line: a pair whose best NCC reaches
:data:`TONE_FROM` is scored again by how well such a function (a tone curve, fitted by isotonic regression) maps
one's aligned grey onto the other's (:func:`tone_score`). Such a curve has more freedom than a line, and lifts
distinct photos of one shape on a flat background too: its misfit counts :data:`TONE_WEIGHT` times a line's, or
:data:`BUSY_TONE_WEIGHT` times for frames with content nearly everywhere (:func:`busy_share`), which it does not lift.

A small photo re-encoded at a low JPEG quality, or shrunk and enlarged again, loses its finest detail: its whole
frame correlates with the photo's at 0.989-0.995, where distinct photos of one shape can score too. What it keeps is
every coarser detail, exactly. A pair whose whole frames reach :data:`LOW_FROM` is scored again on both frames shrunk
to :data:`LOW_SIDE` pixels (:func:`_low`), where such a copy scores 0.9976 and more and distinct photos rarely
reach that: the misfit there counts :data:`LOW_WEIGHT` times.
"""

from __future__ import annotations

import functools
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view
from PIL import Image

__all__ = ["Frame", "frame_of", "frames", "copy_scores", "unit_patches", "tone_score", "busy_share", "ncc_brute",
           "SIDE", "SCALES", "COPY_SCORE"]

logger = logging.getLogger(__name__)

SIDE = 48  # pixels a side of a photo's grey frame
SCALES = (1.0, 0.96, 0.92, 0.85, 0.78, 0.7)  # the share of a side a crop may keep
REFINE_FROM = 0.85  # a pair scoring this much on whole pixels is refined by fractions of a pixel
COPY_SCORE = 0.995  # a pair scoring at least this is a copy
TONE_FROM = 0.97  # a pair whose NCC reaches this (and not COPY_SCORE) is scored again through a tone curve
TONE_WEIGHT = 6.0  # a tone curve fits all a line fits and more: its misfit (1 - tone score) counts this many times
_EPS = 1e-6
TEMPLATES_KEPT = 8192  # shrunk frames the pixel check keeps for reuse at once (at most 150 MB)
FLAT = 0.5  # grey levels: a window whose pixels spread less than this is flat
BUSY_SHARE = 0.9  # a pair whose frames hold content on this share of their pixels (away from a flat background) ...
BUSY_TONE_WEIGHT = 1.25  # ... counts a tone curve's misfit this many times, not TONE_WEIGHT (the choose split's)
FLAT_LEVELS = 2  # grey levels from a frame's most common one: its flat background (a studio's black, a page's white)
LOW_FROM = 0.98  # a pair whose whole frames reach this (and not COPY_SCORE) is scored again on coarse pixels
LOW_SIDE = 16  # pixels a side of those coarse frames
LOW_WEIGHT = 2.5  # their misfit (1 - NCC) counts this many times: 0.998 there is a copy (chosen on the choose split)


@dataclass(frozen=True)
class Frame:
    """One photo's grey frame (``SIDE x SIDE`` uint8), its aspect ratio (width / height) and its grey image (at most
    twice ``SIDE`` a side), kept for templates of other shapes and windows between pixels."""

    grey: np.ndarray
    aspect: float
    image: Image.Image


def frame_of(img: Image.Image) -> Frame:
    """A photo's :class:`Frame` from a decoded image (a thumbnail is plenty)."""
    grey = img.convert("L")
    w, h = grey.size
    if min(w, h) < 2 * SIDE:  # every frame shrunk from twice its side: a small photo and its enlarged copy alike
        grey = grey.resize((max(2 * SIDE, round(2 * SIDE * w / h)), max(2 * SIDE, round(2 * SIDE * h / w))),
                           Image.Resampling.BICUBIC)
    small = grey.resize((SIDE, SIDE), Image.Resampling.BILINEAR, reducing_gap=2.0)
    kept = grey.copy()
    kept.thumbnail((2 * SIDE, 2 * SIDE), Image.Resampling.BILINEAR)  # enough for a window's fractions of a pixel
    return Frame(np.asarray(small, np.uint8), w / max(h, 1), kept)


def frames(paths: Mapping[int, Path | None], fallback: Callable[[int], Image.Image | None],
           step: Callable[[int], object] | None = None) -> dict[int, Frame]:
    """Frames of photos ``{id: thumbnail path}``. A photo whose thumbnail is missing or unreadable is decoded with
    ``fallback(id)`` (None: it has no frame, and no pair of it can be checked), and so is a small photo (a thumbnail
    under twice the frame's side: the photo is as cheap to read, and its thumbnail's JPEG would blur fine dots).
    ``step(1)`` is called after each photo (a progress bar)."""
    out: dict[int, Frame] = {}
    for i, path in paths.items():
        img = None
        if path is not None:
            try:
                with Image.open(path) as im:
                    im.draft("L", (2 * SIDE, 2 * SIDE))
                    img = im.convert("L")
            except OSError as e:
                logger.debug("thumbnail %s unreadable (%s): decoding the photo", path, e)
        if img is None or min(img.size) < 2 * SIDE:
            img = fallback(i) or img
        if img is not None:
            out[i] = frame_of(img)
        if step is not None:
            step(1)
    return out


def unit_patches(x: np.ndarray) -> np.ndarray:
    """Patches (... x h x w) less their mean, over their norm; a flat patch (pixels spread under :data:`FLAT` grey
    levels) is all zero: it matches nothing."""
    x = x - x.mean(axis=(-2, -1), keepdims=True)
    norm = np.sqrt((x * x).sum(axis=(-2, -1), keepdims=True))
    flat = norm < FLAT * np.sqrt(x.shape[-2] * x.shape[-1])
    return np.where(flat, 0.0, x / np.maximum(norm, _EPS)).astype(x.dtype)


def _crop_size(s: float, aspect_big: float, aspect_small: float) -> tuple[int, int] | None:
    """(width, height) in frame pixels of a crop of the frame of a photo of ``aspect_big`` that another photo of
    ``aspect_small`` could be, keeping the share ``s`` of its more-cut side; None where the crop would not fit."""
    if s >= 1.0:
        return SIDE, SIDE  # the whole frame: a resize that changed the shape (squeezed, stretched) is a copy too
    rho = aspect_small / aspect_big  # = share of width kept / share of height kept
    sx, sy = (s, s / rho) if rho <= 1.0 else (s * rho, s)
    if sx > 1.0 + 1e-6 or sy > 1.0 + 1e-6:
        return None
    return max(2, min(SIDE, round(sx * SIDE))), max(2, min(SIDE, round(sy * SIDE)))


def _template(f: Frame, size: tuple[int, int]) -> np.ndarray:
    """A photo shrunk to ``size`` (w, h), plain and mirrored, each normalized: 2 x h x w."""
    if size == (SIDE, SIDE):
        t = f.grey.astype(np.float32)
    else:
        t = np.asarray(f.image.resize(size, Image.Resampling.BILINEAR, reducing_gap=2.0), np.float32)
    u = unit_patches(t)  # h x w: mirroring keeps a patch's mean and norm
    return np.stack([u, u[:, ::-1]])


@dataclass(frozen=True)
class _Hit:
    """The best coarse hypothesis of one ordered pair: its score, the window (x, y, w, h, in frame pixels) of the
    larger photo, and whether the other was mirrored."""

    score: float
    box: tuple[int, int, int, int]
    mirror: bool


def _summed_areas(grey: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The summed-area tables of ``grey`` and of its square, a zero row and column first: 2 x (H+1) x (W+1)."""
    pad = np.zeros((grey.shape[0] + 1, grey.shape[1] + 1))
    pad[1:, 1:] = grey
    return pad.cumsum(0).cumsum(1), (pad * pad).cumsum(0).cumsum(1)


def _window_norms(tables: tuple[np.ndarray, np.ndarray], h: int, w: int) -> np.ndarray:
    """The norm of every h x w window less its mean, from a frame's :func:`_summed_areas`: (Y x X) flattened."""

    def box(t: np.ndarray) -> np.ndarray:
        return t[h:, w:] - t[:-h, w:] - t[h:, :-w] + t[:-h, :-w]  # Y x X

    one, two = tables
    return np.sqrt(np.maximum(box(two) - box(one) ** 2 / (h * w), 0.0)).ravel()


def _coarse(pairs: list[tuple[int, int]], frames_: Mapping[int, Frame]
            ) -> tuple[dict[tuple[int, int], np.ndarray], dict[tuple[int, int, bool], _Hit]]:
    """The best whole-pixel hypotheses of each ordered pair (big, small), both ways round for every pair: ``{(big,
    small): 4 scores}`` (the whole frame, ``small`` plain and mirrored, then the best crop, plain and mirrored) and
    the crops that :func:`_refine` may lift (at least :data:`REFINE_FROM`): ``{(big, small, mirrored): hit}``.

    Pairs are worked through by their larger photo: its windows of one crop size are cut once and scored against the
    templates of every photo paired with it in one product. A template has mean 0, so a window's mean drops out of
    the product; only its norm divides."""
    partners: dict[int, list[int]] = {}
    for a, b in pairs:
        partners.setdefault(a, []).append(b)
        partners.setdefault(b, []).append(a)
    scores: dict[tuple[int, int], np.ndarray] = {}
    crops: dict[tuple[int, int, bool], _Hit] = {}
    templates: OrderedDict[tuple[int, tuple[int, int]], np.ndarray] = OrderedDict()  # (photo, size) -> 2 x hw
    for big, smalls in partners.items():
        while len(templates) > TEMPLATES_KEPT:  # memory bounded: the least recently used go (each at most 18 kB)
            templates.popitem(last=False)
        fb = frames_[big]
        grey = fb.grey.astype(np.float32)  # SIDE x SIDE
        tables = _summed_areas(grey)  # one for every window size
        best = np.full((len(smalls), 4), -2.0, np.float32)  # S x (whole plain, whole mirrored, crop plain, mirrored)
        where = np.zeros((len(smalls), 2, 4), np.int64)  # the best crop window per mirror: x, y, w, h
        for s in SCALES:
            by_size: dict[tuple[int, int], list[int]] = {}
            for n, small in enumerate(smalls):
                size = _crop_size(s, fb.aspect, frames_[small].aspect)
                if size is not None:
                    by_size.setdefault(size, []).append(n)
            for (w, h), group in by_size.items():
                view = sliding_window_view(grey, (h, w))  # Y x X x h x w
                norms = _window_norms(tables, h, w).astype(np.float32)  # W
                norms[norms < FLAT * np.sqrt(h * w)] = np.inf  # a flat window matches nothing (score 0)
                for n in group:
                    if (smalls[n], (w, h)) in templates:
                        templates.move_to_end((smalls[n], (w, h)))
                    else:
                        templates[smalls[n], (w, h)] = _template(frames_[smalls[n]], (w, h)).reshape(2, h * w)
                t = np.concatenate([templates[smalls[n], (w, h)] for n in group])  # 2G x hw
                got = (view.reshape(-1, h * w) @ t.T) / norms[:, None]  # W x 2G
                at = got.argmax(axis=0)  # 2G
                top = got[at, np.arange(len(at))].reshape(len(group), 2)  # G x 2
                crop = (w, h) != (SIDE, SIDE)
                rows = np.asarray(group)
                for f in (0, 1):
                    col = 2 * crop + f
                    better = top[:, f] > best[rows, col]  # G
                    best[rows[better], col] = top[better, f]
                    if crop:
                        y, x = np.divmod(at.reshape(len(group), 2)[better, f], view.shape[1])
                        where[rows[better], f] = np.stack([x, y, np.full_like(x, w), np.full_like(x, h)], axis=1)
        for n, small in enumerate(smalls):
            scores[big, small] = best[n]
            for f in (0, 1):
                if best[n, 2 + f] >= REFINE_FROM:
                    crops[big, small, bool(f)] = _Hit(float(best[n, 2 + f]), tuple(where[n, f].tolist()), bool(f))
    return scores, crops


def _refine(big: Frame, small: Frame, hit: _Hit) -> tuple[float, np.ndarray | None, np.ndarray]:
    """The best NCC of ``small``'s whole frame with the window of ``big`` that ``hit`` found, the window's four sides
    moved by fractions of a pixel (coordinate ascent, steps halved from half a frame pixel): a crop's edges rarely
    fall on the frame's pixels, and its size rarely on one of :data:`SCALES`. With it, the two aligned frames
    (SIDE x SIDE uint8: the window, None where no tone curve is to look at it, and ``small`` mirrored where the hit
    was)."""
    aligned = small.grey[:, ::-1] if hit.mirror else small.grey  # SIDE x SIDE
    target = unit_patches(aligned.astype(np.float64)).ravel()  # SIDE^2
    iw, ih = big.image.size
    fx, fy = iw / SIDE, ih / SIDE  # image pixels per frame pixel
    x, y, w, h = hit.box
    box = [x * fx, y * fy, (x + w) * fx, (y + h) * fy]

    def window(b: list[float]) -> np.ndarray:
        return np.frombuffer(big.image.resize((SIDE, SIDE), Image.Resampling.BILINEAR, box=tuple(b)).tobytes(),
                             np.uint8)  # SIDE^2

    def score(b: list[float]) -> float:
        win = window(b).astype(np.float64)  # SIDE^2; ``target`` has mean 0, so the window's mean drops out
        total = float(win.sum())
        spread = float(win @ win) - total * total / win.size  # its squared norm less its mean
        return float(win @ target) / np.sqrt(spread) if spread >= (FLAT * SIDE) ** 2 else 0.0

    def result(b: list[float], ncc: float) -> tuple[float, np.ndarray | None, np.ndarray]:
        toned = TONE_FROM <= ncc < COPY_SCORE  # the window only where a tone curve will look at it
        return ncc, window(b).reshape(SIDE, SIDE) if toned else None, aligned

    best, passes = score(box), 0
    for step, reach in ((0.5, 0.03), (0.25, 0.015), (0.125, 0.006)):
        moved = True
        while moved:
            if best >= COPY_SCORE or (passes and best < COPY_SCORE - reach):
                return result(box, best)  # a copy already, or too far below one for more passes to reach
            passes += 1
            moved = False
            for side, limit in ((0, fx), (1, fy), (2, fx), (3, fy)):
                for sign in (-1.0, 1.0):
                    b = list(box)
                    b[side] = min(max(b[side] + sign * step * limit, 0.0), float(iw if side % 2 == 0 else ih))
                    if b[2] - b[0] < 2 or b[3] - b[1] < 2:
                        continue
                    got = score(b)
                    if got > best + 1e-6:
                        best, box, moved = got, b, True
    return result(box, best)


def _isotonic(y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The non-decreasing sequence closest to ``y`` in the ``w``-weighted least squares (pool adjacent violators)."""
    means: list[float] = []
    weights: list[float] = []
    counts: list[int] = []
    for v, u in zip(y.tolist(), w.tolist()):
        means.append(v)
        weights.append(u)
        counts.append(1)
        while len(means) > 1 and means[-2] > means[-1]:
            u2 = weights[-2] + weights[-1]
            means[-2:] = [(means[-2] * weights[-2] + means[-1] * weights[-1]) / u2]
            weights[-2:] = [u2]
            counts[-2:] = [counts[-2] + counts[-1]]
    return np.repeat(means, counts)


def tone_score(x: np.ndarray, y: np.ndarray) -> float:
    """How well one of two aligned grey frames (uint8, one shape) is the other through a tone curve (brightness,
    contrast, gamma, highlights clipped to white): the correlation of ``y`` with the best non-decreasing function of
    ``x``'s grey levels, or the other way round, whichever is higher. It is never under their NCC (a line is such a
    function); a pair that differs in where things are, not in their tones, stays where its NCC puts it."""
    grey = [f.ravel().astype(np.int64) for f in (x, y)]
    spreads = [float(((g - g.mean()) ** 2).sum()) for g in grey]
    if min(spreads) < FLAT**2 * x.size:  # a flat frame matches nothing
        return 0.0
    best = 0.0
    for (a, b), spread in zip(((grey[0], grey[1]), (grey[1], grey[0])), spreads[::-1]):
        count = np.bincount(a, minlength=256).astype(np.float64)  # 256
        levels = np.flatnonzero(count)
        curve = np.zeros(256)
        curve[levels] = _isotonic(np.bincount(a, weights=b, minlength=256)[levels] / count[levels], count[levels])
        rest = b - curve[a]
        best = max(best, float(np.sqrt(max(1.0 - (rest @ rest) / spread, 0.0))))
    return best


def busy_share(x: np.ndarray, y: np.ndarray) -> float:
    """The share of pixels of two aligned frames (uint8, one shape) where either frame is off its own flat
    background: more than :data:`FLAT_LEVELS` grey levels from its most common level."""
    flat = [np.abs(f.astype(np.int16) - int(np.bincount(f.ravel(), minlength=256).argmax())) <= FLAT_LEVELS
            for f in (x, y)]
    return 1.0 - float((flat[0] & flat[1]).mean())


def _toned(x: np.ndarray, y: np.ndarray) -> float:
    """The copy score of two aligned frames through a tone curve: its misfit counted :data:`TONE_WEIGHT` times, or
    :data:`BUSY_TONE_WEIGHT` times where the frames hold content nearly everywhere (:func:`busy_share` at least
    :data:`BUSY_SHARE`). A tone curve lifts distinct things of one shape on a flat background (two plain trousers,
    silhouettes); where every part of both frames has its own shading, one frame is a non-decreasing function of the
    other's grey only when it is that photo brightened, given contrast or a gamma."""
    weight = BUSY_TONE_WEIGHT if busy_share(x, y) >= BUSY_SHARE else TONE_WEIGHT
    return 1.0 - weight * (1.0 - tone_score(x, y))


def _low(x: np.ndarray, y: np.ndarray) -> float:
    """The copy score of two aligned whole frames by their coarse pixels alone: the NCC of both shrunk to
    :data:`LOW_SIDE` a side, its misfit counted :data:`LOW_WEIGHT` times."""
    a, b = (unit_patches(_shrink(LOW_SIDE) @ f.astype(np.float32) @ _shrink(LOW_SIDE).T).ravel() for f in (x, y))
    return 1.0 - LOW_WEIGHT * (1.0 - float(a @ b))


def copy_scores(pairs: Iterable[tuple[int, int]], frames_: Mapping[int, Frame], at_least: float | None = None,
                chunk: int = 32768, step: Callable[[int], object] | None = None) -> dict[tuple[int, int], float]:
    """The copy score (module docstring) of each pair of photos that both have a frame: ``{(a, b): score}``.

    A pair under :data:`COPY_SCORE` whose best whole-pixel crop window (plain or mirrored, either way round) scores
    at least :data:`REFINE_FROM` and more than its whole frames do has that window refined by fractions of a pixel
    (:func:`_refine`). Whole frames are not refined: a re-encoded, resized, brightened or mirrored copy scores high
    on whole pixels, and refining would only lift distinct photos of one shape (two plain trousers), which match
    best whole, towards the copies. A pair still under it whose whole frames or refined window reach
    :data:`TONE_FROM` is scored again through a tone curve (:func:`tone_score`; its misfit counts
    :data:`TONE_WEIGHT` times): a copy brightened until its highlights clip is no longer a linear function of the
    photo's grey, but still a non-decreasing one.

    With ``at_least``, only the pairs scoring that much are returned. The pairs are checked ``chunk`` at a time (in
    the order given: sorted pairs keep a photo's partners together), so memory does not grow with their number;
    ``step(n)`` is called after each (a progress bar), ``n`` the pairs it held."""
    out: dict[tuple[int, int], float] = {}
    part: list[tuple[int, int]] = []
    seen = 0  # pairs since the last step (with those that lack a frame)
    for a, b in pairs:
        seen += 1
        if a in frames_ and b in frames_:
            part.append((a, b))
        if len(part) == chunk:
            out.update(_scores(part, frames_, at_least))
            if step is not None:
                step(seen)
            part, seen = [], 0
    out.update(_scores(part, frames_, at_least))
    if step is not None and seen:
        step(seen)
    return out


def _scores(pairs: list[tuple[int, int]], frames_: Mapping[int, Frame],
            at_least: float | None) -> dict[tuple[int, int], float]:
    """:func:`copy_scores` of one chunk of pairs."""
    coarse, crops = _coarse(pairs, frames_)
    out = {}
    for a, b in pairs:
        ab, ba = coarse[a, b], coarse[b, a]  # 4 scores each
        score = float(max(ab.max(), ba.max()))
        whole = float(max(ab[:2].max(), ba[:2].max()))
        if score < COPY_SCORE:
            found = [(big, small, crops.get((big, small, f))) for big, small in ((a, b), (b, a)) for f in (False, True)]
            refined = [_refine(frames_[big], frames_[small], hit) for big, small, hit in found
                       if hit is not None and hit.score > whole]
            score = max([score, *(r[0] for r in refined)])
            if score < COPY_SCORE and whole >= TONE_FROM:
                mirror = max(ab[1], ba[1]) > max(ab[0], ba[0])
                x, y = frames_[a].grey, frames_[b].grey[:, ::-1] if mirror else frames_[b].grey  # SIDE x SIDE each
                score = max(score, _toned(x, y))
                if score < COPY_SCORE and whole >= LOW_FROM:
                    score = max(score, _low(x, y))
            for _, window, aligned in refined:
                if score < COPY_SCORE and window is not None:
                    score = max(score, _toned(window, aligned))
        if at_least is None or score >= at_least:
            out[a, b] = score
    return out


def _shrink_matrix(n_out: int, n_in: int) -> np.ndarray:
    """n_out x n_in: a row of ``n_in`` pixels shrunk to ``n_out`` by a triangle filter as wide as a step (bilinear
    with antialiasing, as PIL's BILINEAR shrinks, without its rounding to whole grey levels); each row sums to 1."""
    scale = n_in / n_out
    centre = (np.arange(n_out) + 0.5) * scale  # n_out
    weight = np.maximum(0.0, 1.0 - np.abs(np.arange(n_in)[None, :] + 0.5 - centre[:, None]) / max(scale, 1.0))
    return (weight / weight.sum(axis=1, keepdims=True)).astype(np.float32)  # n_out x n_in


@functools.cache
def _shrink(n_out: int) -> np.ndarray:
    return _shrink_matrix(n_out, SIDE)  # n_out x SIDE


def ncc_brute(big: np.ndarray, small: np.ndarray) -> float:
    """The best NCC of ``small`` (h x w) over every window of ``big`` by plain loops: the reference the tests hold
    :func:`copy_scores` to."""
    h, w = small.shape
    s = small - small.mean()
    best = -1.0
    for y in range(big.shape[0] - h + 1):
        for x in range(big.shape[1] - w + 1):
            win = big[y : y + h, x : x + w]
            d = win - win.mean()
            den = max(float(np.sqrt((d * d).sum())), _EPS) * max(float(np.sqrt((s * s).sum())), _EPS)
            best = max(best, float((d * s).sum()) / den)
    return best
