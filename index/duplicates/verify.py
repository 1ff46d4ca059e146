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
photos' aspect ratios; whole frames are compared whatever the shapes (a squeezed copy). The offsets are searched
coarse to fine (:func:`_coarse`): every one on frames of :data:`SCREEN_SIDE` pixels, then the best of those on the
frames themselves, a pixel each way; a copy's best window is where the coarse frames put it, and a distinct photo's
best one, where it is missed, only scores less. The best crop window is then refined by fractions of a pixel. Two
distinct photos of alike things (two t-shirts, two tiles of one texture, planes against blue sky) differ in their
pixels wherever an embedding finds them alike: their score stays under
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
from collections.abc import Callable, Iterable, Mapping, Sequence
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
SCREEN_SIDE = 24  # pixels a side of the frames every crop window is first scored on (SIDE over a whole number)
FINE_SCALES = 1  # the crop shares the screen scores best that are scored again on the frames themselves ...
FINE_REACH = 1  # ... at the screen's best place and this many frame pixels each way
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


def _crop_sizes(s: float | np.ndarray, aspect_big: np.ndarray, aspect_small: np.ndarray,
                side: int = SIDE) -> np.ndarray:
    """(width, height) in pixels of frames of ``side`` of the crop of each photo of ``aspect_big`` that the other of
    ``aspect_small`` could be, keeping the share ``s`` (one, or one a pair) of its more-cut side: N x 2 ints, (0, 0)
    where the crop would not fit; the whole frame for ``s`` 1 (a resize that changed the shape, squeezed or
    stretched, is a copy too)."""
    rho = np.asarray(aspect_small, np.float64) / np.asarray(aspect_big, np.float64)  # = width kept / height kept
    s = np.broadcast_to(np.asarray(s, np.float64), rho.shape)
    sx = np.where(rho <= 1.0, s, s * rho)
    sy = np.where(rho <= 1.0, s / rho, s)
    fits = (sx <= 1.0 + 1e-6) & (sy <= 1.0 + 1e-6)
    out = np.clip(np.round(np.stack([sx, sy], axis=1) * side), 2, side).astype(np.int64)  # N x 2
    out[~fits] = 0
    out[s >= 1.0] = side
    return out


def _crop_size(s: float, aspect_big: float, aspect_small: float, side: int = SIDE) -> tuple[int, int] | None:
    """:func:`_crop_sizes` of one pair: (width, height), or None where the crop would not fit."""
    w, h = _crop_sizes(s, np.array([aspect_big]), np.array([aspect_small]), side)[0].tolist()
    return (w, h) if w else None


@dataclass(frozen=True)
class _Hit:
    """The best coarse hypothesis of one ordered pair: its score, the window (x, y, w, h, in frame pixels) of the
    larger photo, and whether the other was mirrored."""

    score: float
    box: tuple[int, int, int, int]
    mirror: bool


def _shrunk(frames_: Sequence[Frame], size: tuple[int, int]) -> np.ndarray:
    """Photos shrunk to ``size`` (w, h), normalized (:func:`unit_patches`): N x h x w (mirrored: ``[..., ::-1]``)."""
    if size == (SIDE, SIDE):
        t = np.stack([f.grey for f in frames_]).astype(np.float32)  # N x h x w
    else:
        t = np.stack([np.asarray(f.image.resize(size, Image.Resampling.BILINEAR, reducing_gap=2.0), np.float32)
                      for f in frames_])
    return unit_patches(t)


def _shrunk_frames(greys: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """Frames ``greys`` (N x SIDE x SIDE float32) shrunk to ``size`` (w, h) by :func:`_shrink_matrix` and normalized
    (:func:`unit_patches`): N x h x w. For the screen's templates, a few pixels a side fewer than a frame's: cheaper
    than shrinking each photo's image, and as good at that size."""
    w, h = size
    return unit_patches(_shrink_matrix(h, SIDE) @ (greys @ _shrink_matrix(w, SIDE).T))


def _norms(win: np.ndarray) -> np.ndarray:
    """The norm less its mean of each window (... x hw), infinite for a flat one (spread under :data:`FLAT`): it
    then scores 0 against any template."""
    n = win.shape[-1]
    norm = np.sqrt(np.maximum(np.einsum("...q,...q->...", win, win) - win.sum(-1) ** 2 / n, 0.0))
    norm[norm < FLAT * np.sqrt(n)] = np.inf
    return norm


def _summed_areas(greys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The summed-area tables of frames ``greys`` (N x S x S) and of their squares, a zero row and column first:
    two N x (S+1) x (S+1)."""
    pad = np.zeros((len(greys), greys.shape[1] + 1, greys.shape[2] + 1))
    pad[:, 1:, 1:] = greys
    return pad.cumsum(1).cumsum(2), (pad * pad).cumsum(1).cumsum(2)


def _window_norms(tables: tuple[np.ndarray, np.ndarray], h: int, w: int) -> np.ndarray:
    """The norm less its mean of every h x w window of the frames of :func:`_summed_areas`: N x W (places flattened
    y * X + x), infinite for a flat window (:func:`_norms`)."""

    def box(t: np.ndarray) -> np.ndarray:
        return t[:, h:, w:] - t[:, :-h, w:] - t[:, h:, :-w] + t[:, :-h, :-w]  # N x Y x X

    one, two = tables
    norm = np.sqrt(np.maximum(box(two) - box(one) ** 2 / (h * w), 0.0)).reshape(len(one), -1).astype(np.float32)
    norm[norm < FLAT * np.sqrt(h * w)] = np.inf
    return norm


_CHUNK_FLOATS = 1 << 22  # windows gathered at once (16 MB)


def _screen(greys: np.ndarray, norms: np.ndarray, bigs: np.ndarray, size: tuple[int, int], t: np.ndarray,
            which: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every window of ``size`` (w, h) of frames ``greys`` (N x S x S float32; ``norms``: their
    :func:`_window_norms`) scored against templates: row r's windows of ``greys[bigs[r]]`` against
    ``t[which[r]]`` (h x w), plain and mirrored. Returns the best score (R x 2) and its place (R x 2, flattened
    y * X + x)."""
    w, h = size
    view = sliding_window_view(greys, (h, w), axis=(1, 2))  # N x Y x X x h x w, no copy
    score = np.empty((len(bigs), 2), np.float32)
    top = np.empty((len(bigs), 2), np.int64)
    step = max(1, _CHUNK_FLOATS // (view[0].size))
    for at in range(0, len(bigs), step):
        r = slice(at, at + step)
        win = view[bigs[r]].reshape(len(bigs[r]), -1, h * w)  # R' x W x hw
        own = t[which[r]]  # R' x h x w
        pair = np.stack([own, own[:, :, ::-1]], axis=-1).reshape(len(own), h * w, 2)  # R' x hw x 2
        got = np.matmul(win, pair) / norms[bigs[r], :, None]  # R' x W x 2
        top[r] = got.argmax(axis=1)
        score[r] = np.take_along_axis(got, top[r][:, None, :], axis=1)[:, 0]
    return score, top


def _placed(greys: np.ndarray, bigs: np.ndarray, ys: np.ndarray, xs: np.ndarray, size: tuple[int, int],
            t: np.ndarray) -> np.ndarray:
    """The NCC of chosen windows of ``size`` (w, h) of frames ``greys`` (N x S x S float32): row r's windows of
    ``greys[bigs[r]]`` at (``ys[r, k]``, ``xs[r, k]``) against ``t[r]`` (hw, mean 0, norm 1): R x K."""
    w, h = size
    view = sliding_window_view(greys, (h, w), axis=(1, 2))  # N x Y x X x h x w, no copy
    out = np.empty(ys.shape, np.float32)  # R x K
    step = max(1, _CHUNK_FLOATS // (ys.shape[1] * h * w))
    for at in range(0, len(bigs), step):
        r = slice(at, at + step)
        win = view[bigs[r, None], ys[r], xs[r]].reshape(-1, ys.shape[1], h * w)  # R' x K x hw
        out[r] = np.matmul(win, t[r, :, None])[..., 0] / _norms(win)  # a template has mean 0: the window's drops out
    return out


def _coarse(pairs: list[tuple[int, int]], frames_: Mapping[int, Frame]
            ) -> tuple[dict[tuple[int, int], np.ndarray], dict[tuple[int, int, bool], _Hit]]:
    """The best whole-pixel hypotheses of each ordered pair (big, small), both ways round for every pair: ``{(big,
    small): 4 scores}`` (the whole frame, ``small`` plain and mirrored, then the best crop, plain and mirrored) and
    the crops that :func:`_refine` may lift (at least :data:`REFINE_FROM`): ``{(big, small, mirrored): hit}``.

    The whole frames are one product a pair. Crops are looked for coarse to fine, as an image pyramid does: every
    window of every crop share on frames of :data:`SCREEN_SIDE` pixels (a quarter of the pixels at a quarter of the
    places: a sixteenth of the work), then on the frames themselves around the :data:`FINE_SCALES` best shares'
    best places, :data:`FINE_REACH` pixels each way. A copy's best window is where the coarse frames put it; a
    distinct photo's may be missed, which only lowers its score. All pairs of a chunk go through each step at once,
    grouped by the crop's size."""
    if not pairs:
        return {}, {}
    ids = sorted({i for p in pairs for i in p})
    at = {i: n for n, i in enumerate(ids)}
    own = [frames_[i] for i in ids]
    greys = np.stack([f.grey for f in own]).astype(np.float32)  # N x SIDE x SIDE
    k = SIDE // SCREEN_SIDE
    screen = sum(greys[:, i::k, j::k] for i in range(k) for j in range(k)) / (k * k)  # N x s x s
    tables = _summed_areas(screen)
    aspect = np.array([f.aspect for f in own])  # N
    pa = np.array([at[a] for a, _ in pairs], np.int64)  # P
    pb = np.array([at[b] for _, b in pairs], np.int64)  # P
    big, small = np.concatenate([pa, pb]), np.concatenate([pb, pa])  # D = 2P ordered pairs (big, small)
    d = len(big)
    whole = _shrunk(own, (SIDE, SIDE))  # N x SIDE x SIDE
    best = np.full((d, 4), -2.0, np.float32)  # D x (whole plain, whole mirrored, crop plain, crop mirrored)
    plain = np.einsum("pyx,pyx->p", whole[pa], whole[pb])  # P: the same both ways round
    mirrored = np.einsum("pyx,pyx->p", whole[pa], whole[pb][:, :, ::-1])  # P
    best[:, :2] = np.tile(np.stack([plain, mirrored], axis=1), (2, 1))
    where = np.zeros((d, 2, 4), np.int64)  # the best crop window per mirror: x, y, w, h

    def templates(photos: np.ndarray, size: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
        """The templates of ``photos`` (G) at ``size``: U x 2 x hw, and which is each photo's (G)."""
        uniq, which = np.unique(photos, return_inverse=True)
        return _shrunk([own[j] for j in uniq.tolist()], size), which

    crops = [s for s in SCALES if s < 1.0]
    found = np.full((d, len(crops), 2), -np.inf, np.float32)  # the screen's best score per share and mirror
    place = np.zeros((d, len(crops), 2, 2))  # ... its window's centre on the frame (x, y)
    for n, s in enumerate(crops):
        sizes = _crop_sizes(s, aspect[big], aspect[small], SCREEN_SIDE)  # D x 2
        for w, h in np.unique(sizes[sizes[:, 0] > 0], axis=0).tolist():
            rows = np.flatnonzero((sizes[:, 0] == w) & (sizes[:, 1] == h))  # G
            uniq, which = np.unique(small[rows], return_inverse=True)
            score, top = _screen(screen, _window_norms(tables, h, w), big[rows], (w, h),
                                 _shrunk_frames(greys[uniq], (w, h)), which)
            found[rows, n] = score
            y, x = np.divmod(top, SCREEN_SIDE - w + 1)  # G x 2
            place[rows, n] = np.stack([k * x + k * w / 2, k * y + k * h / 2], axis=-1)
    order = np.argsort(-found, axis=1)[:, :FINE_SCALES]  # D x F x 2: the best shares per mirror
    row, _, mirror = np.indices(order.shape).reshape(3, -1)  # C candidates: (row, share, mirror)
    share = order.ravel()
    keep = np.isfinite(found[row, share, mirror])
    row, share, mirror = row[keep], share[keep], mirror[keep]
    sizes = _crop_sizes(np.asarray(crops)[share], aspect[big[row]], aspect[small[row]])  # C x 2
    reach = np.arange(-FINE_REACH, FINE_REACH + 1)
    got_rows, got_mirror, got_score, got_box = [], [], [], []
    for w, h in np.unique(sizes[sizes[:, 0] > 0], axis=0).tolist():
        c = np.flatnonzero((sizes[:, 0] == w) & (sizes[:, 1] == h))  # G
        cx = np.round(place[row[c], share[c], mirror[c], 0] - w / 2).astype(np.int64)  # G: the window's corner
        cy = np.round(place[row[c], share[c], mirror[c], 1] - h / 2).astype(np.int64)
        xs = np.clip(cx[:, None, None] + reach[None, None, :], 0, SIDE - w)  # G x 1 x R
        ys = np.clip(cy[:, None, None] + reach[None, :, None], 0, SIDE - h)  # G x R x 1
        xs, ys = (v.reshape(len(c), -1) for v in np.broadcast_arrays(xs, ys))  # G x R^2 each
        t, which = templates(small[row[c]], (w, h))
        t = t[which]  # G x h x w
        flip = mirror[c] == 1
        t[flip] = t[flip][:, :, ::-1]
        t = t.reshape(len(c), -1)  # G x hw
        got = _placed(greys, big[row[c]], ys, xs, (w, h), t)  # G x R^2
        top = got.argmax(axis=1)  # G
        on = np.arange(len(c))
        got_rows.append(row[c])
        got_mirror.append(mirror[c])
        got_score.append(got[on, top])
        got_box.append(np.stack([xs[on, top], ys[on, top], np.full(len(c), w), np.full(len(c), h)], axis=1))
    if got_rows:
        r, f, score, box = (np.concatenate(v) for v in (got_rows, got_mirror, got_score, got_box))
        last = np.lexsort((score, 2 * r + f))  # each (row, mirror)'s candidates, its best last
        first = np.r_[(2 * r + f)[last][1:] != (2 * r + f)[last][:-1], True]  # the last of each
        pick = last[first]
        best[r[pick], 2 + f[pick]] = score[pick]
        where[r[pick], f[pick]] = box[pick]
    scores: dict[tuple[int, int], np.ndarray] = {}
    hits: dict[tuple[int, int, bool], _Hit] = {}
    for r in range(d):
        key = (ids[big[r]], ids[small[r]])
        scores[key] = best[r]
        for f in (0, 1):
            if best[r, 2 + f] >= REFINE_FROM:
                hits[key[0], key[1], bool(f)] = _Hit(float(best[r, 2 + f]), tuple(where[r, f].tolist()), bool(f))
    return scores, hits


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
                chunk: int = 2048, step: Callable[[int], object] | None = None) -> dict[tuple[int, int], float]:
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
