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
:data:`BUSY_TONE_WEIGHT` times for whole frames with content nearly everywhere (:func:`busy_share`), which it does
not lift; a refined crop window's counts :data:`WINDOW_TONE_WEIGHT` times, busy or not.

A small photo re-encoded at a low JPEG quality, or shrunk and enlarged again, loses its finest detail: its whole
frame correlates with the photo's at 0.989-0.995, where distinct photos of one shape can score too. What it keeps is
every coarser detail, exactly. A pair whose whole frames reach :data:`LOW_FROM` is scored again on both frames shrunk
to :data:`LOW_SIDE` pixels (:func:`_low`), where such a copy scores 0.9976 and more and distinct photos rarely
reach that: the misfit there counts :data:`LOW_WEIGHT` times.

The grey is blind to colour: two smooth pictures of one pattern in other hues, or a garment in two dyes, can match
as a copy does. A copy keeps its photo's hues (a change of brightness, contrast or tone scales the chroma and keeps
its direction), so a pair the grey calls a copy is one only where its colours agree too: the cosine of the two
photos' chroma where the best hypothesis aligns them (:func:`colour_agreement`) is at least :data:`COLOUR_AGREE`.
A photo with too little colour (:data:`COLOUR_FROM`: a grey photo, or a grey copy of a colour one) tells nothing,
and the pair is decided by its grey alone. The colours are compared first where the screen (below) aligns the pair:
one whose colours disagree there is not checked further (in a colourful library, most pairs the screen passes).
Colour is evidence for a copy too: a brightened or contrasted copy of a busy small picture can fall just under
:data:`COPY_SCORE` by its grey (its clipped highlights), and a pair that scores :data:`COLOUR_COPY_FROM` there is a
copy where the pattern of its colours (their chroma less each photo's mean: :func:`colour_pattern`, blind to a cast
both share, a blue sky) agrees at least :data:`COLOUR_PATTERN`. Alike distinct photos of one colour pattern taken
apart by their files (two shots a second apart) are never checked.

Most pairs a search proposes are distinct photos, and the search over every window is most of a check's cost. So
every pair is first screened by the same search on frames of half the side (:func:`_screen`: a quarter of the
pixels and of the places, each pixel the sum of four): a copy stays a near match there (the lowest of both choose
splits' copies scored 0.88), and a pair under :data:`SCREEN_FROM` is not checked further.

A crop of a large photo with fine texture (a wallpaper of icons on a ground of fine stripes) is the hard case: the
thumbnail (256 pixels, JPEG) and the 48-pixel frame alias the texture, each chain of resampling differently, and a
crop's share between two of :data:`SCALES` (80%, between 78% and 85%) leaves a template off by a few percent, which a
fine texture does not forgive; the refinement starts too low to climb. So a pair of large photos (both at least
:data:`FINE_MIN` pixels on their short side) that the check scores at least :data:`FINE_FROM` and not a copy is
checked again from the photos themselves (decoded at a reduced scale, no thumbnail between), at the shares of
:data:`FINE_SCALES` (every 1%), on their frames and on frames of :data:`FINE_SIDE` pixels, and where those come near
a copy (:data:`FINER_FROM`) on frames of :data:`FINER_SIDE` pixels too (:func:`fine_scores`), and scores the best.
A texture of dots or tiles a few pixels wide in the frame's image aliases so badly that a crop of it may score
anything on thumbnails: a pair of large photos one of which is such a texture (:func:`fine_texture` at least
:data:`TEXTURE_SHARE`; a crop's texture is coarser by its share, so the photo it was cut from tells) is checked again
from :data:`TEXTURE_FINE_FROM`. (Chosen on `bench/large_crops.py`: the bench's choose split of wallpapers and
seeded textures.)
"""

from __future__ import annotations

import functools
import logging
import os
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

__all__ = ["Frame", "frame_of", "frames", "copy_scores", "fine_scores", "FineCheck", "unit_patches", "tone_score",
           "busy_share", "fine_texture", "ncc_brute", "colour_agreement", "colour_pattern", "SIDE", "SCALES",
           "COPY_SCORE", "COLOUR_AGREE", "FINE_SIDE", "FINE_MIN", "FINE_FROM", "FINE_SCALES", "FINER_SIDE",
           "FINER_FROM", "TEXTURE_SHARE", "TEXTURE_FINE_FROM"]

logger = logging.getLogger(__name__)

SIDE = 48  # pixels a side of a photo's grey frame
SCALES = (1.0, 0.96, 0.92, 0.85, 0.78, 0.7)  # the share of a side a crop may keep
REFINE_FROM = 0.85  # a crop window scoring this much on whole pixels is refined by fractions of a pixel ...
REFINE_GAP = 0.5  # ... where it closes this share of the whole frames' gap to 1 (a crop, not alike photos)
COPY_SCORE = 0.995  # a pair scoring at least this is a copy
TONE_FROM = 0.97  # a pair whose NCC reaches this (and not COPY_SCORE) is scored again through a tone curve
TONE_WEIGHT = 6.0  # a tone curve fits all a line fits and more: its misfit (1 - tone score) counts this many times
_EPS = 1e-6
HYPOTHESES_AT_ONCE = 128  # ordered pairs of one crop size correlated at once (arrays of 2 MB at most)
SCREEN_SIDE = 24  # pixels a side of the frames every pair is screened on first (:func:`_screen`) ...
SCREEN_FROM = 0.8  # ... and checked in full only where it scores this much (the lowest copy scored 0.88 there)
SCREEN_AT_ONCE = 512  # hypotheses screened at once (a quarter of the pixels: arrays as small)
FINE_SIDE = 96  # pixels a side of the finer frames a pair of large photos is checked again on (:func:`fine_scores`) ...
FINE_MIN = 2 * FINE_SIDE  # ... both photos at least this many pixels on their short side ...
FINE_FROM = 0.8  # ... where the check scored it this much, and not a copy ...
FINE_SCALES = tuple(round(1.0 - 0.01 * k, 2) for k in range(31))  # ... at these crop shares (every 1%) ...
FINER_SIDE = 192  # ... and on frames of this side where it scored at least FINER_FROM on those, and not a copy
FINER_FROM = 0.94
TEXTURE_SHARE = 0.2  # a frame whose image has this share of its variance in its finest detail is a fine texture ...
TEXTURE_FINE_FROM = 0.5  # ... and a pair of large photos, one of them such, is checked again from this score
FLAT = 0.5  # grey levels: a window whose pixels spread less than this is flat
BUSY_SHARE = 0.9  # a pair whose frames hold content on this share of their pixels (away from a flat background) ...
BUSY_TONE_WEIGHT = 1.25  # ... counts a tone curve's misfit this many times, not TONE_WEIGHT (the choose split's)
WINDOW_TONE_WEIGHT = TONE_WEIGHT  # a refined crop window's tone curve misfit counts this many times, busy or not
FLAT_LEVELS = 2  # grey levels from a frame's most common one: its flat background (a studio's black, a page's white)
LOW_FROM = 0.98  # a pair whose whole frames reach this (and not COPY_SCORE) is scored again on coarse pixels
LOW_SIDE = 16  # pixels a side of those coarse frames
LOW_WEIGHT = 2.5  # their misfit (1 - NCC) counts this many times: 0.998 there is a copy (chosen on the choose split)
COLOUR_SIDE = 16  # pixels a side of a frame's colours (its chroma, Cb and Cr: the picture squeezed as the grey is) ...
COLOUR_GRID = 8  # ... compared on this many cells a side where two photos align
COLOUR_FROM = 4.0  # chroma levels (root mean square from grey) each photo needs for its colours to tell anything
COLOUR_AGREE = 0.6  # a copy's colours: their cosine with its photo's at least this, where the screen aligns them and
# where the check does (chosen on the choose splits: bench/NOTES.md, sixteenth session)
COLOUR_COPY_FROM = 0.985  # a pair whose grey scores this (not COPY_SCORE) is a copy where its colours' pattern ...
COLOUR_PATTERN = 0.95  # ... agrees this much (chosen on a choose split: bench/NOTES.md, sixteenth session)


@dataclass(frozen=True)
class Frame:
    """One photo's grey frame (``SIDE x SIDE`` uint8), its aspect ratio (width / height) and its grey image (at most
    twice ``SIDE`` a side), kept for templates of other shapes and windows between pixels."""

    grey: np.ndarray
    aspect: float
    image: Image.Image
    colour: np.ndarray | None = None  # 2 x COLOUR_SIDE x COLOUR_SIDE uint8: Cb and Cr (128: grey); None: a grey photo


def _colour(img: Image.Image) -> np.ndarray | None:
    """A photo's colours (:attr:`Frame.colour`) from a decoded image: its chroma shrunk to :data:`COLOUR_SIDE` a side
    by a box filter; None for a grey image."""
    if img.mode not in ("RGB", "RGBA", "YCbCr", "P", "CMYK"):
        return None
    ycc = img if img.mode == "YCbCr" else img.convert("RGB").convert("YCbCr")
    small = ycc.resize((COLOUR_SIDE, COLOUR_SIDE), Image.Resampling.BOX)
    return np.ascontiguousarray(np.asarray(small, np.uint8)[:, :, 1:].transpose(2, 0, 1))  # 2 x C x C


def frame_of(img: Image.Image, side: int = SIDE) -> Frame:
    """A photo's :class:`Frame` (``side`` pixels a side) from a decoded image (a thumbnail is plenty)."""
    colour = _colour(img)
    grey = img.convert("L")
    w, h = grey.size
    if min(w, h) < 2 * side:  # every frame shrunk from twice its side: a small photo and its enlarged copy alike
        grey = grey.resize((max(2 * side, round(2 * side * w / h)), max(2 * side, round(2 * side * h / w))),
                           Image.Resampling.BICUBIC)
    small = grey.resize((side, side), Image.Resampling.BILINEAR, reducing_gap=2.0)
    kept = grey.copy()
    kept.thumbnail((2 * side, 2 * side), Image.Resampling.BILINEAR)  # enough for a window's fractions of a pixel
    return Frame(np.asarray(small, np.uint8), w / max(h, 1), kept, colour)


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
                    im.draft("YCbCr", (2 * SIDE, 2 * SIDE))  # a JPEG's luma exactly as a grey draft, and its chroma
                    img = im.convert(im.mode if im.mode in ("L", "YCbCr") else "RGB")
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
    levels) is all zero: it matches nothing. Worked as rows of h x w (a reduction over one axis: several times faster
    than over two, the same numbers)."""
    n = x.shape[-2] * x.shape[-1]
    y = x.reshape(-1, n)  # (...) x hw
    y = y - y.mean(axis=1, keepdims=True)
    norm = np.sqrt((y * y).sum(axis=1, keepdims=True))  # (...) x 1
    y /= np.maximum(norm, _EPS)
    y[norm[:, 0] < FLAT * np.sqrt(n)] = 0.0
    return y.reshape(x.shape).astype(x.dtype, copy=False)


def _crop_size(s: float, aspect_big: float, aspect_small: float, side: int = SIDE) -> tuple[int, int] | None:
    """(width, height) in pixels of a crop of the frame (``side`` a side) of a photo of ``aspect_big`` that another
    photo of ``aspect_small`` could be, keeping the share ``s`` of its more-cut side; None where it would not fit."""
    if s >= 1.0:
        return side, side  # the whole frame: a resize that changed the shape (squeezed, stretched) is a copy too
    rho = aspect_small / aspect_big  # = share of width kept / share of height kept
    sx, sy = (s, s / rho) if rho <= 1.0 else (s * rho, s)
    if sx > 1.0 + 1e-6 or sy > 1.0 + 1e-6:
        return None
    return max(2, min(side, round(sx * side))), max(2, min(side, round(sy * side)))


def _shrunk(f: Frame, size: tuple[int, int]) -> np.ndarray:
    """A photo shrunk to ``size`` (w, h): h x w float32 (the frame itself at its own side)."""
    if size == f.grey.shape[::-1]:
        return f.grey.astype(np.float32)
    return np.asarray(f.image.resize(size, Image.Resampling.BILINEAR, reducing_gap=2.0), np.float32)


@dataclass(frozen=True)
class _Hit:
    """The best coarse hypothesis of one ordered pair: its score, the window (x, y, w, h, in frame pixels) of the
    larger photo, and whether the other was mirrored."""

    score: float
    box: tuple[int, int, int, int]
    mirror: bool


Aligned = tuple[int, int, tuple[int, int, int, int] | None, bool]  # big, small, its window in big (None: whole), mirror


def _coarse(pairs: list[tuple[int, int]], frames_: Mapping[int, Frame], scales: Sequence[float] | None = None
            ) -> tuple[dict[tuple[int, int], np.ndarray], dict[tuple[int, int, bool], _Hit]]:
    """The best whole-pixel hypotheses of each ordered pair (big, small), both ways round for every pair: ``{(big,
    small): 4 scores}`` (the whole frame, ``small`` plain and mirrored, then the best crop, plain and mirrored) and
    the crops that :func:`_refine` may lift (at least :data:`REFINE_FROM`): ``{(big, small, mirrored): hit}``
    (:func:`_hypotheses` on the frames, each photo shrunk to a crop's size from its image as PIL shrinks it)."""
    photos = sorted({i for p in pairs for i in p})
    row = {p: n for n, p in enumerate(photos)}
    ordered = [(a, b) for a, b in pairs] + [(b, a) for a, b in pairs]  # H hypotheses
    grey = np.stack([frames_[p].grey for p in photos]).astype(np.float32) if photos else np.zeros((0, SIDE, SIDE),
                                                                                                   np.float32)
    best, where = _hypotheses(np.array([(row[a], row[b]) for a, b in ordered], np.int64).reshape(-1, 2), grey,
                              np.array([frames_[p].aspect for p in photos]),
                              lambda ks, size: np.stack([_shrunk(frames_[photos[k]], size) for k in ks.tolist()]),
                              scales=scales)
    scores: dict[tuple[int, int], np.ndarray] = {}
    crops: dict[tuple[int, int, bool], _Hit] = {}
    for n, (big, small) in enumerate(ordered):
        scores[big, small] = best[n]
        for f in (0, 1):
            if best[n, 2 + f] >= REFINE_FROM:
                crops[big, small, bool(f)] = _Hit(float(best[n, 2 + f]), tuple(where[n, f].tolist()), bool(f))
    return scores, crops


def _hypotheses(ordered: np.ndarray, grey: np.ndarray, aspects: np.ndarray,
                template: Callable[[np.ndarray, tuple[int, int]], np.ndarray], at_once: int = HYPOTHESES_AT_ONCE,
                scales: Sequence[float] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The best whole-pixel hypotheses of ordered pairs of frames (``ordered``: H x 2 rows of ``grey``, big then
    small; ``grey``: P x side x side float32; ``aspects``: P): H x 4 scores (the whole frame, small plain and
    mirrored, then the best crop, plain and mirrored; -2 where none fits) and H x 2 x 4 the best crop's window per
    mirror (x, y, w, h). ``template(rows, (w, h))``: those photos shrunk to a crop's size (T x h x w). ``scales``:
    the crop shares tried (None: :data:`SCALES`).

    The hypotheses are worked through together, a crop size at a time: each frame is taken to its spectrum once,
    each photo shrunk to a size is a template once, and a template is correlated with a frame over all its places
    at once as a product of their spectra (the template zero-padded to the frame's size: the places where it fits
    whole never wrap round), ``at_once`` hypotheses in one inverse transform. A template has mean 0, so a window's
    mean drops out of the product; only its norm divides (from summed-area tables)."""
    side = grey.shape[1]
    spectra = _rfft2(grey)  # P x side x (side // 2 + 1) complex64
    tables = _summed_areas(grey)  # 2 x P x (side + 1)^2
    by_size: dict[tuple[int, int], list[int]] = {}
    shapes = aspects.tolist()
    sizes: dict[tuple[float, float], list[tuple[int, int]]] = {}  # the crop sizes of two photos' shapes
    for n, (big, small) in enumerate(ordered.tolist()):
        shape = shapes[big], shapes[small]
        if shape not in sizes:
            sizes[shape] = [z for z in dict.fromkeys(_crop_size(s, *shape, side) for s in scales or SCALES)
                            if z is not None]
        for size in sizes[shape]:
            by_size.setdefault(size, []).append(n)
    best = np.full((len(ordered), 4), -2.0, np.float32)  # H x (whole plain, whole mirrored, crop plain, mirrored)
    where = np.zeros((len(ordered), 2, 4), np.int64)  # the best crop window per mirror: x, y, w, h
    for (w, h), hyp_ in by_size.items():
        crop = (w, h) != (side, side)
        y_, x_ = side - h + 1, side - w + 1
        hyp = np.asarray(hyp_)
        hyp = hyp[np.argsort(ordered[hyp, 1], kind="stable")]  # M: a template's hypotheses together
        smalls_, bigs_ = ordered[hyp, 1], ordered[hyp, 0]  # M each
        for start in range(0, len(hyp), at_once):  # small arrays: this machine's caches, no new pages
            rows = hyp[start : start + at_once]  # m
            kinds, smalls = np.unique(smalls_[start : start + at_once], return_inverse=True)  # T; m
            used, bigs = np.unique(bigs_[start : start + at_once], return_inverse=True)  # B; m
            t = unit_patches(template(kinds, (w, h)))  # T x h x w
            norms = _window_norms(tables[:, used], h, w)  # B x W (W = Y x X)
            if crop:
                product = spectra[used[bigs], None] * _spectra_of_templates(t, side)[smalls]  # m x 2 x side x (s//2+1)
                got = _places(product.reshape(-1, side, side // 2 + 1), y_, x_).reshape(len(rows), 2, -1)  # m x 2 x W
            else:
                t = np.stack([t, t[:, :, ::-1]], axis=1).reshape(len(kinds), 2, -1)  # T x 2 x side^2
                got = np.einsum("mfk,mk->mf", t[smalls], grey[used[bigs]].reshape(len(rows), -1))[..., None]
            got = got / norms[bigs, None, :]  # m x 2 x W
            at = got.argmax(axis=2)  # m x 2
            top = np.take_along_axis(got, at[..., None], axis=2)[..., 0]  # m x 2
            for f in (0, 1):
                col = 2 * crop + f
                better = top[:, f] > best[rows, col]  # m
                best[rows[better], col] = top[better, f]
                if crop:
                    y, x = np.divmod(at[better, f], x_)
                    where[rows[better], f] = np.stack([x, y, np.full_like(x, w), np.full_like(x, h)], axis=1)
    return best, where


def _screen(pairs: list[tuple[int, int]], frames_: Mapping[int, Frame]) -> np.ndarray:
    """Each pair's best hypothesis (:func:`_hypotheses`, both ways round) on its frames shrunk to
    :data:`SCREEN_SIDE` a side (sums of whole blocks of pixels; each photo shrunk to a crop's size from its frame by
    a triangle filter): P scores. A quarter of the pixels (or less) and of the places: a few times cheaper than
    :func:`_coarse`, and blurred frames correlate at least as well, so a copy's screen score stays high (on both
    choose splits the lowest was 0.88) while most distinct pairs fall under :data:`SCREEN_FROM`."""
    return _screened(pairs, frames_)[0]


def _screened(pairs: list[tuple[int, int]], frames_: Mapping[int, Frame]) -> tuple[np.ndarray, list[Aligned]]:
    """:func:`_screen`'s scores (P) and where each pair's best hypothesis puts one photo in the other (P, its window
    in :data:`SCREEN_SIDE` pixels)."""
    photos = sorted({i for p in pairs for i in p})
    row = {p: n for n, p in enumerate(photos)}
    grey = np.stack([frames_[p].grey for p in photos]).astype(np.float32)  # P x SIDE x SIDE
    f = SIDE // SCREEN_SIDE
    low = grey.reshape(len(grey), SCREEN_SIDE, f, SCREEN_SIDE, f).sum(axis=(2, 4))  # P x S x S, whole numbers

    def template(ks: np.ndarray, size: tuple[int, int]) -> np.ndarray:  # T x h x w
        w, h = size
        across = grey[ks].reshape(-1, SIDE) @ _shrink(w).T  # (T SIDE) x w
        return _shrink(h) @ across.reshape(len(ks), SIDE, w)  # T x h x w

    ordered = np.array([(row[a], row[b]) for a, b in pairs] + [(row[b], row[a]) for a, b in pairs],
                       np.int64).reshape(-1, 2)  # 2P x 2
    best, where = _hypotheses(ordered, low, np.array([frames_[p].aspect for p in photos]), template, SCREEN_AT_ONCE)
    top = best.max(axis=1)  # 2P
    n = len(pairs)
    flip = top[n:] > top[:n]  # P: the best hypothesis has the second photo as the big one
    at = np.where(flip, np.arange(n) + n, np.arange(n))  # P: its row of ordered
    col = best[at].argmax(axis=1)  # P: whole plain, whole mirrored, crop plain, crop mirrored
    aligned: list[Aligned] = []
    for (a, b), fl, c, h in zip(pairs, flip.tolist(), col.tolist(), at.tolist()):
        big, small = (b, a) if fl else (a, b)
        aligned.append((big, small, tuple(where[h, c - 2].tolist()) if c >= 2 else None, c % 2 == 1))
    return np.maximum(top[:n], top[n:]), aligned


def _rfft2(x: np.ndarray) -> np.ndarray:
    """The spectra of frames (N x side x side float32): N x side x (side // 2 + 1) complex64, worked a few hundred
    frames at a time (numpy's transform of many small frames at once slows down by up to ten times)."""
    out = np.empty((len(x), x.shape[1], x.shape[2] // 2 + 1), np.complex64)
    for start in range(0, len(x), 256):
        out[start : start + 256] = np.fft.rfft2(x[start : start + 256])
    return out


def _spectra_of_templates(t: np.ndarray, side: int = SIDE) -> np.ndarray:
    """What a frame's spectrum (``side`` a side) is multiplied by to correlate it with templates (T x h x w, mean
    0), plain and mirrored: the conjugate spectra of the templates zero-padded to side x side,
    T x 2 x side x (side // 2 + 1) complex64. The mirrored template's comes from the plain one's: mirroring the
    first w columns of a padded frame turns its spectrum S(u, v) into exp(-2 pi i v (w - 1) / side) conj(S(-u, v))."""
    n, h, w = t.shape
    padded = np.zeros((n, side, side), np.float32)
    padded[:, :h, :w] = t
    spec = _rfft2(padded)  # T x side x (side // 2 + 1)
    shift = np.exp(2j * np.pi * np.arange(side // 2 + 1) * (w - 1) / side).astype(np.complex64)  # side // 2 + 1
    return np.stack([np.conj(spec), spec[:, (-np.arange(side)) % side] * shift], axis=1)


def _places(spectra: np.ndarray, y: int, x: int) -> np.ndarray:
    """The first ``y`` x ``x`` values (the places where a crop fits) of the inverse real transform of ``spectra``
    (N x side x (side // 2 + 1)), as numpy's ``irfft2`` gives them: N x y x x float32. Only those are computed, by
    two products of matrices (the columns' inverse transform at ``y`` rows, then the rows' at ``x`` columns): half
    the time of the whole transform or less."""
    side = spectra.shape[1]
    rows, cols = _inverse_matrices(y, x, side)  # y x side complex64, 2 (side // 2 + 1) x x float32
    n = len(spectra)
    q = (rows @ spectra.transpose(1, 0, 2).reshape(side, -1)).reshape(y, n, -1)  # y x N x (side // 2 + 1)
    q = np.concatenate([q.real, q.imag], axis=2).transpose(1, 0, 2).reshape(n * y, -1)  # Ny x 2 (side // 2 + 1)
    return (q @ cols).reshape(n, y, x)


@functools.cache
def _inverse_matrices(y: int, x: int, side: int = SIDE) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_places`'s matrices: the inverse transform's first ``y`` rows over the columns' frequencies
    (y x side), and its first ``x`` columns over the rows' half spectrum, real part then imaginary
    (2 (side // 2 + 1) x x; the frequencies between 0 and side / 2 count twice, for their conjugates)."""
    half = np.arange(side // 2 + 1)  # side // 2 + 1
    rows = np.exp(2j * np.pi * np.outer(np.arange(y), np.arange(side)) / side) / side  # y x side
    twice = np.where((half == 0) | (half == side // 2), 1.0, 2.0)[:, None]  # (side // 2 + 1) x 1
    angle = 2 * np.pi * np.outer(half, np.arange(x)) / side  # (side // 2 + 1) x x
    cols = np.concatenate([twice * np.cos(angle), -twice * np.sin(angle)]) / side  # 2 (side // 2 + 1) x x
    return rows.astype(np.complex64), cols.astype(np.float32)


def _summed_areas(grey: np.ndarray) -> np.ndarray:
    """Summed-area tables of frames (P x side x side, whole numbers: grey levels, or sums of a few) and of their
    squares, a zero row and column first: 2 x P x (side + 1) x (side + 1) int32 (exact: a frame's squares sum to
    under 2^31)."""
    side = grey.shape[1]
    out = np.zeros((2, len(grey), side + 1, side + 1), np.int32)
    for start in range(0, len(grey), 128):  # a few frames at a time: numpy's sums over many at once are far slower
        x = grey[start : start + 128].astype(np.int32)  # b x side x side
        out[0, start : start + 128, 1:, 1:] = x.cumsum(1).cumsum(2)
        out[1, start : start + 128, 1:, 1:] = (x * x).cumsum(1).cumsum(2)
    return out


def _window_norms(tables: np.ndarray, h: int, w: int) -> np.ndarray:
    """The norm of every h x w window less its mean, from frames' :func:`_summed_areas` (2 x B x ...): B x (Y x X)
    float32, infinite for a flat window (it matches nothing: score 0)."""
    t = tables.astype(np.int64)
    one, two = t[:, :, h:, w:] - t[:, :, :-h, w:] - t[:, :, h:, :-w] + t[:, :, :-h, :-w]  # B x Y x X each
    norms = np.sqrt(np.maximum(two - one.astype(np.float64) ** 2 / (h * w), 0.0)).reshape(len(one), -1)
    norms = norms.astype(np.float32)
    norms[norms < FLAT * np.sqrt(h * w)] = np.inf
    return norms


def _refine(big: Frame, small: Frame, hit: _Hit) -> tuple[float, np.ndarray | None, np.ndarray]:
    """The best NCC of ``small``'s whole frame with the window of ``big`` that ``hit`` found, the window's four sides
    moved by fractions of a pixel (coordinate ascent, steps halved from half a frame pixel): a crop's edges rarely
    fall on the frame's pixels, and its size rarely on one of :data:`SCALES`. With it, the two aligned frames
    (SIDE x SIDE uint8: the window, None where no tone curve is to look at it, and ``small`` mirrored where the hit
    was)."""
    px = small.grey.shape[0]  # the frames' side
    aligned = small.grey[:, ::-1] if hit.mirror else small.grey  # px x px
    target = unit_patches(aligned.astype(np.float64)).ravel()  # px^2
    iw, ih = big.image.size
    fx, fy = iw / px, ih / px  # image pixels per frame pixel
    x, y, w, h = hit.box
    box = [x * fx, y * fy, (x + w) * fx, (y + h) * fy]

    def window(b: list[float]) -> np.ndarray:
        return np.frombuffer(big.image.resize((px, px), Image.Resampling.BILINEAR, box=tuple(b)).tobytes(),
                             np.uint8)  # px^2

    def score(b: list[float]) -> float:
        win = window(b).astype(np.float64)  # px^2; ``target`` has mean 0, so the window's mean drops out
        total = float(win.sum())
        spread = float(win @ win) - total * total / win.size  # its squared norm less its mean
        return float(win @ target) / np.sqrt(spread) if spread >= (FLAT * px) ** 2 else 0.0

    def result(b: list[float], ncc: float) -> tuple[float, np.ndarray | None, np.ndarray]:
        toned = TONE_FROM <= ncc < COPY_SCORE  # the window only where a tone curve will look at it
        return ncc, window(b).reshape(px, px) if toned else None, aligned

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


def _toned(x: np.ndarray, y: np.ndarray, whole: bool = True) -> float:
    """The copy score of two aligned frames through a tone curve: its misfit counted :data:`TONE_WEIGHT` times, or
    :data:`BUSY_TONE_WEIGHT` times where two ``whole`` frames hold content nearly everywhere (:func:`busy_share` at
    least :data:`BUSY_SHARE`). A tone curve lifts distinct things of one shape on a flat background (two plain
    trousers, silhouettes); where every part of both frames has its own shading, one frame is a non-decreasing
    function of the other's grey only when it is that photo brightened, given contrast or a gamma. A crop window
    (not ``whole``) counts :data:`WINDOW_TONE_WEIGHT` times, busy or not: a tone edit is made to a whole photo, and a
    window of a smooth picture, refined to fit, is mapped onto another smooth picture by some tone curve."""
    weight = (BUSY_TONE_WEIGHT if busy_share(x, y) >= BUSY_SHARE else TONE_WEIGHT) if whole else WINDOW_TONE_WEIGHT
    return 1.0 - weight * (1.0 - tone_score(x, y))


def _low(x: np.ndarray, y: np.ndarray) -> float:
    """The copy score of two aligned whole frames by their coarse pixels alone: the NCC of both shrunk to
    :data:`LOW_SIDE` a side, its misfit counted :data:`LOW_WEIGHT` times."""
    shrink = _shrink(LOW_SIDE, x.shape[0])  # LOW_SIDE x side
    a, b = (unit_patches(shrink @ f.astype(np.float32) @ shrink.T).ravel() for f in (x, y))
    return 1.0 - LOW_WEIGHT * (1.0 - float(a @ b))


def copy_scores(pairs: Iterable[tuple[int, int]], frames_: Mapping[int, Frame], at_least: float | None = None,
                chunk: int = 32768, step: Callable[[int], object] | None = None,
                screen: bool = True, scales: Sequence[float] | None = None) -> dict[tuple[int, int], float]:
    """The copy score (module docstring) of each pair of photos that both have a frame: ``{(a, b): score}``.

    Every pair is first screened (``screen``) on its frames shrunk to :data:`SCREEN_SIDE` a side (:func:`_screen`): a
    pair whose best hypothesis there is under :data:`SCREEN_FROM` scores that (no copy comes near it), and one whose
    colours disagree where that hypothesis aligns it (:func:`colour_agreement` under :data:`COLOUR_AGREE`) scores
    their agreement; neither is checked further. A pair the check finds a copy by its grey scores the agreement of
    its colours instead where that is under :data:`COLOUR_AGREE`. ``scales``: the crop shares tried (None:
    :data:`SCALES`).

    A pair under :data:`COPY_SCORE` whose best whole-pixel crop window (plain or mirrored, either way round) scores
    at least :data:`REFINE_FROM` and closes at least :data:`REFINE_GAP` of the gap between its whole frames' score
    and 1 has that window refined by fractions of a pixel (:func:`_refine`). Whole frames are not refined: a
    re-encoded, resized, brightened or mirrored copy scores high on whole pixels, and refining would only lift
    distinct photos of one shape (two plain trousers), which match best whole, towards the copies. A crop matches
    far better in its window than whole (its whole frames are out of register by the crop), alike distinct photos
    about as well (bench/NOTES.md, fourteenth session). A pair still under it whose whole frames or refined window
    reach :data:`TONE_FROM` is scored again through a tone curve (:func:`tone_score`; its misfit counts
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
            out.update(_scores(part, frames_, at_least, screen, scales))
            if step is not None:
                step(seen)
            part, seen = [], 0
    out.update(_scores(part, frames_, at_least, screen, scales))
    if step is not None and seen:
        step(seen)
    return out


def fine_scores(pairs: Iterable[tuple[int, int]], frames_: Mapping[int, Frame], fine: Mapping[int, Frame],
                finer: Mapping[int, Frame] | None = None) -> dict[tuple[int, int], float]:
    """The copy scores of pairs of large photos from their photos' own pixels (module docstring): the best of the
    check at the crop shares of :data:`FINE_SCALES` on their frames (``frames_``), on their frames of
    :data:`FINE_SIDE` a side (``fine``) and, for a pair that scores at least :data:`FINER_FROM` there and is not a
    copy, on their frames of :data:`FINER_SIDE` a side (``finer``, where given), none screened: ``{(a, b): score}``."""
    pairs = list(pairs)
    coarse = copy_scores(pairs, frames_, screen=False, scales=FINE_SCALES)
    finest = copy_scores(pairs, fine, screen=False, scales=FINE_SCALES)
    out = {p: max(coarse[p], finest[p]) for p in coarse}
    again = [p for p, s in out.items() if FINER_FROM <= s < COPY_SCORE]
    if finer is not None and again:
        for p, s in copy_scores(again, finer, screen=False, scales=FINE_SCALES).items():
            out[p] = max(out[p], s)
    return out


def fine_texture(f: Frame) -> float:
    """The share of the variance of a frame's image (:attr:`Frame.image`) in its finest detail: what a Gaussian blur
    of one pixel takes away. A wallpaper of dots or tiles a few pixels wide at that size holds a fifth to a half of
    it there, a smooth picture a tenth or less; at :data:`TEXTURE_SHARE` or more the frame is a fine texture, which
    every thumbnail aliases anew."""
    from PIL import ImageFilter

    g = np.asarray(f.image, np.float64)  # h x w
    rest = g - np.asarray(f.image.filter(ImageFilter.GaussianBlur(1.0)), np.float64)  # h x w
    spread = float(((g - g.mean()) ** 2).sum())
    return float((rest * rest).sum()) / spread if spread > (FLAT**2) * g.size else 0.0


FINE_KEPT = 128  # photos whose frames for the fine check are kept at once (about 250 kB each)
FINE_AT_ONCE = 64  # pairs checked again together (their photos' frames held at once: 32 MB at most)
TEXTURES_KEPT = 1 << 16  # photos whose fine_texture is kept at once (about 100 bytes each)


class FineCheck:
    """The fine check of a search's large photos (module docstring): ``large`` maps each photo at least
    :data:`FINE_MIN` pixels on its short side to its file's path under ``root``. :meth:`rescore` gives a pair of two
    of them that the check scored at least :data:`FINE_FROM` (:data:`TEXTURE_FINE_FROM` where one is a fine
    texture: :func:`fine_texture`) and not a copy the better of that and its :func:`fine_scores`, from the photos
    decoded anew (at a reduced scale; a photo that cannot be decoded keeps the score; the frames of the last
    :data:`FINE_KEPT` photos kept). Picklable, and small: the check's workers each hold one, the paths packed into one
    string (a library of a million photos: about 70 MB, not a dict of paths)."""

    def __init__(self, root: str | Path, large: Mapping[int, str]) -> None:
        order = sorted(large)
        encoded = [os.fsencode(large[i]) for i in order]
        self.root = Path(root)
        self._ids = np.array(order, np.int64)  # L, sorted
        self._ends = np.cumsum([len(e) for e in encoded], dtype=np.int64)  # L: where each path ends in _blob
        self._blob = b"".join(encoded)
        self._kept: OrderedDict[int, tuple[Frame, Frame, Frame] | None] = OrderedDict()
        self._textures: OrderedDict[int, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._ids)

    def __getstate__(self) -> dict[str, object]:
        return {"root": self.root, "ids": self._ids, "ends": self._ends, "blob": self._blob}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.root, self._ids, self._ends, self._blob = state["root"], state["ids"], state["ends"], state["blob"]
        self._kept, self._textures = OrderedDict(), OrderedDict()

    def path(self, i: int) -> Path | None:
        """Photo ``i``'s file where it is a large photo; None where it is not."""
        if not self._large(i):
            return None
        n = int(np.searchsorted(self._ids, i))
        return self.root / os.fsdecode(self._blob[int(self._ends[n - 1]) if n else 0 : int(self._ends[n])])

    def _frames(self, i: int) -> tuple[Frame, Frame, Frame] | None:
        """Photo ``i``'s frames (SIDE, :data:`FINE_SIDE` and :data:`FINER_SIDE` a side) from its file, decoded to four
        times the finer side at least (a JPEG's DCT draft to twice it aliases fine textures anew: on
        `bench/large_crops.py`'s choose set 38 crops found against 43); None where it cannot be decoded."""
        from moco.data.photos import ImageDecodeError, load_rgb

        if i not in self._kept:
            try:
                img = load_rgb(self.path(i), min_short=2 * FINER_SIDE)
                self._kept[i] = frame_of(img), frame_of(img, FINE_SIDE), frame_of(img, FINER_SIDE)
            except ImageDecodeError as e:
                logger.debug("%s: no fine check (%s)", self.path(i), e)
                self._kept[i] = None
            while len(self._kept) > FINE_KEPT:
                self._kept.popitem(last=False)
        self._kept.move_to_end(i)
        return self._kept[i]

    def applies(self, a: int, b: int, score: float, frames_: Mapping[int, Frame] | None = None) -> bool:
        """Whether a pair the check scored ``score`` is checked again: two large photos, not a copy, and at least
        :data:`FINE_FROM`, or :data:`TEXTURE_FINE_FROM` where one of their ``frames_`` is a fine texture (the photo a
        crop was cut from: the crop's own texture is coarser by its share)."""
        if not TEXTURE_FINE_FROM <= score < COPY_SCORE or not (self._large(a) and self._large(b)):
            return False  # most pairs: two numbers compared, no path made
        return score >= FINE_FROM or (frames_ is not None and a in frames_ and b in frames_
                                      and max(self._texture(a, frames_), self._texture(b, frames_)) >= TEXTURE_SHARE)

    def _large(self, i: int) -> bool:
        n = int(np.searchsorted(self._ids, i))
        return n < len(self._ids) and int(self._ids[n]) == i

    def _texture(self, i: int, frames_: Mapping[int, Frame]) -> float:
        """:func:`fine_texture` of photo ``i``'s frame, that of the last :data:`TEXTURES_KEPT` photos kept (in a
        library of large photos most pairs ask it: one blur a photo, not one a pair)."""
        if i not in self._textures:
            self._textures[i] = fine_texture(frames_[i])
            while len(self._textures) > TEXTURES_KEPT:
                self._textures.popitem(last=False)
        self._textures.move_to_end(i)
        return self._textures[i]

    def rescore(self, pairs: np.ndarray, scores: np.ndarray, frames_: Mapping[int, Frame] | None = None
                ) -> np.ndarray:
        """The scores (P) of ``pairs`` (P x 2) with the fine check's where it :meth:`applies` (``scores``: the
        check's; ``frames_``: the check's frames, which tell the fine textures)."""
        out = scores.copy()
        listed = pairs.tolist()
        due = [n for n, ((a, b), s) in enumerate(zip(listed, scores.tolist())) if self.applies(a, b, s, frames_)]
        for start in range(0, len(due), FINE_AT_ONCE):  # together: a photo's spectra and crops made once for all
            batch = due[start : start + FINE_AT_ONCE]
            own = {i: self._frames(i) for n in batch for i in listed[n]}  # 2 x FINE_AT_ONCE photos at most
            rows = [n for n in batch if all(own[i] is not None for i in listed[n])]
            if rows:
                got = fine_scores([tuple(listed[n]) for n in rows],
                                  *({i: f[k] for i, f in own.items() if f is not None} for k in range(3)))
                for n in rows:
                    out[n] = max(float(scores[n]), got[tuple(listed[n])])
        return out


def _scores(pairs: list[tuple[int, int]], frames_: Mapping[int, Frame], at_least: float | None,
            screen: bool = True, scales: Sequence[float] | None = None) -> dict[tuple[int, int], float]:
    """:func:`copy_scores` of one chunk of pairs."""
    screened = np.full(len(pairs), np.inf, np.float32)  # P
    if pairs and screen:  # the screen, then the colours where it puts one photo in the other
        screened, aligned = _screened(pairs, frames_)
        screened = np.array([s if s < SCREEN_FROM or (c := colour_agreement(frames_, *al, side=SCREEN_SIDE))
                             >= COLOUR_AGREE else min(c, s) for s, al in zip(screened.tolist(), aligned)], np.float32)
    coarse, crops = _coarse([p for p, s in zip(pairs, screened.tolist()) if s >= SCREEN_FROM], frames_, scales)
    out = {}
    for (a, b), first in zip(pairs, screened.tolist()):
        if first < SCREEN_FROM:  # no hypothesis comes near a copy's, even blurred, or their colours disagree
            if at_least is None or first >= at_least:
                out[a, b] = first
            continue
        ab, ba = coarse[a, b], coarse[b, a]  # 4 scores each
        score = float(max(ab.max(), ba.max()))
        whole = float(max(ab[:2].max(), ba[:2].max()))
        if score < COPY_SCORE:
            found = [(big, small, crops.get((big, small, f))) for big, small in ((a, b), (b, a)) for f in (False, True)]
            refined = [_refine(frames_[big], frames_[small], hit) for big, small, hit in found
                       if hit is not None and hit.score - whole >= REFINE_GAP * (1.0 - whole)]
            score = max([score, *(r[0] for r in refined)])
            if score < COPY_SCORE and whole >= TONE_FROM:
                mirror = max(ab[1], ba[1]) > max(ab[0], ba[0])
                x, y = frames_[a].grey, frames_[b].grey[:, ::-1] if mirror else frames_[b].grey  # SIDE x SIDE each
                score = max(score, _toned(x, y))
                if score < COPY_SCORE and whole >= LOW_FROM:
                    score = max(score, _low(x, y))
            for _, window, aligned in refined:
                if score < COPY_SCORE and window is not None:
                    score = max(score, _toned(window, aligned, whole=False))
        if score >= COLOUR_COPY_FROM:  # a copy by its grey, or nearly: its colours tell, where both photos have some
            agree, pattern = _colour_cosines(_colour_cells(frames_, *_alignment(a, b, ab, ba, crops)))
            if agree < COLOUR_AGREE:  # other colours: no copy
                score = agree
            elif score < COPY_SCORE and pattern is not None and pattern >= COLOUR_PATTERN:  # the same pattern: a copy
                score = COPY_SCORE
        if at_least is None or score >= at_least:
            out[a, b] = score
    return out


def _alignment(a: int, b: int, ab: np.ndarray, ba: np.ndarray, crops: Mapping[tuple[int, int, bool], _Hit]
               ) -> Aligned:
    """Where the best whole-pixel hypothesis of pair ``(a, b)`` puts one photo in the other (``ab``, ``ba``: their
    :func:`_coarse` scores; ``crops``: its crop windows): ``(big, small, box, mirrored)``, ``box`` None for the whole
    frames."""
    whole = float(max(ab[:2].max(), ba[:2].max()))
    hits = [(h.score, big, small, h) for big, small in ((a, b), (b, a)) for f in (False, True)
            if (h := crops.get((big, small, f))) is not None]
    if hits and max(hits)[0] > whole:
        _, big, small, hit = max(hits, key=lambda t: t[0])
        return big, small, hit.box, hit.mirror
    return a, b, None, bool(max(ab[1], ba[1]) > max(ab[0], ba[0]))


def _most_colour(colour: np.ndarray) -> int:
    """The largest chroma of any pixel of a frame's colours (levels from grey): no mean over cells exceeds it."""
    return int(np.abs(colour.astype(np.int16) - 128).max())


def colour_agreement(frames_: Mapping[int, Frame], big: int, small: int, box: tuple[int, int, int, int] | None,
                     mirrored: bool, side: int | None = None) -> float:
    """How well the colours of photo ``small`` (``mirrored`` or not) agree with those of photo ``big`` where it
    lies in it (``box``: x, y, w, h in ``big``'s frame pixels; None: the whole frame): the cosine of their chroma
    (:attr:`Frame.colour`, less grey) over :data:`COLOUR_GRID` x :data:`COLOUR_GRID` cells. A change of brightness,
    contrast or tone scales a photo's chroma and keeps its hues: a copy's cosine stays near 1. Two distinct pictures
    of one pattern in other colours (smooth gradients, a garment in two dyes) score far lower, under
    :data:`COLOUR_AGREE`. 1.0 where either photo has too little colour to tell (:data:`COLOUR_FROM`: a grey photo, or
    a grey copy of a colour one). ``side``: the frames' side that ``box`` counts pixels of (None: ``big``'s grey)."""
    return _colour_cosines(_colour_cells(frames_, big, small, box, mirrored, side))[0]


def colour_pattern(frames_: Mapping[int, Frame], big: int, small: int, box: tuple[int, int, int, int] | None,
                   mirrored: bool, side: int | None = None) -> float | None:
    """:func:`colour_agreement`'s cosine of the two photos' chroma less each one's mean chroma: how well the pattern
    of their colours agrees, blind to a colour cast that both share (a blue sky); None where either photo's colours
    vary too little to tell (:data:`COLOUR_FROM`)."""
    return _colour_cosines(_colour_cells(frames_, big, small, box, mirrored, side))[1]


def _colour_cosines(cells: tuple[np.ndarray, np.ndarray] | None) -> tuple[float, float | None]:
    """:func:`colour_agreement` and :func:`colour_pattern` of two photos' aligned chroma (:func:`_colour_cells`)."""
    if cells is None:
        return 1.0, None

    def cosine(x: np.ndarray, y: np.ndarray) -> float | None:  # None: either one's chroma under COLOUR_FROM
        nx, ny = float(np.sqrt((x * x).mean())), float(np.sqrt((y * y).mean()))  # root mean square chroma
        return None if min(nx, ny) < COLOUR_FROM else float((x * y).mean() / (nx * ny))

    x, y = cells  # 2 x G x G each
    agree = cosine(x, y)
    pattern = cosine(*(c - c.mean(axis=(1, 2), keepdims=True) for c in cells))
    return 1.0 if agree is None else agree, pattern


def _colour_cells(frames_: Mapping[int, Frame], big: int, small: int, box: tuple[int, int, int, int] | None,
                  mirrored: bool, side: int | None = None) -> tuple[np.ndarray, np.ndarray] | None:
    """The chroma of ``big`` where ``small`` lies in it and of ``small`` (mirrored or not), less grey, each over
    :data:`COLOUR_GRID` x :data:`COLOUR_GRID` cells (2 x G x G); None where either photo has no chroma of
    :data:`COLOUR_FROM` anywhere (a grey photo: no cell can reach it, no resizes made)."""
    fb, fs = frames_[big], frames_[small]
    if fb.colour is None or fs.colour is None or min(_most_colour(fb.colour), _most_colour(fs.colour)) < COLOUR_FROM:
        return None
    f = COLOUR_SIDE / (side or fb.grey.shape[0])
    region = None if box is None else (box[0] * f, box[1] * f, (box[0] + box[2]) * f, (box[1] + box[3]) * f)

    def cells(colour: np.ndarray, where: tuple[float, float, float, float] | None) -> np.ndarray:  # 2 x G x G
        x0, y0, x1, y1 = where or (0.0, 0.0, float(COLOUR_SIDE), float(COLOUR_SIDE))
        across, _, _ = _box_weights(x0, x1)  # G x S
        down, first, last = _box_weights(y0, y1)  # G x S; the rows PIL reads
        rows = (colour[:, first:last].astype(np.float64) @ across.T).astype(np.float32)  # 2 x (last - first) x G
        return (down[:, first:last] @ rows).astype(np.float32).astype(np.float64) - 128.0  # as PIL's two passes

    y = cells(fs.colour, None)  # 2 x G x G
    return cells(fb.colour, region), y[:, :, ::-1] if mirrored else y


@functools.lru_cache(maxsize=4096)  # the boxes of a search are whole pixels of a frame, scaled: a few hundred
def _box_weights(start: float, end: float, n_in: int = COLOUR_SIDE, n_out: int = COLOUR_GRID
                 ) -> tuple[np.ndarray, int, int]:
    """How PIL's BOX filter resizes the pixels ``start`` to ``end`` of a row of ``n_in`` to ``n_out`` (its
    ``precompute_coeffs``, the box's ends in float32 as PIL takes them): n_out x n_in float64 weights (each row
    sums to 1) and the first and one past the last pixel it reads. A float image resized by PIL is these weights
    applied across, kept in float32, then down (:func:`_colour_cells`: the same numbers as PIL's resize, without
    four images a pair)."""
    start32, end32 = np.float32(start), np.float32(end)
    scale = float(np.float32(end32 - start32)) / n_out
    wide = max(scale, 1.0)  # the filter stretched to a step when shrinking
    support = 0.5 * wide
    centre = float(start32) + (np.arange(n_out) + 0.5) * scale  # n_out
    lo = np.maximum(np.trunc(centre - support + 0.5), 0).astype(np.int64)  # n_out: C's (int) casts
    hi = np.minimum(np.trunc(centre + support + 0.5), n_in).astype(np.int64)  # n_out
    p = np.arange(n_in)[None, :]  # 1 x n_in
    at = (p - centre[:, None] + 0.5) * (1.0 / wide)  # n_out x n_in
    w = ((at > -0.5) & (at <= 0.5) & (p >= lo[:, None]) & (p < hi[:, None])).astype(np.float64)  # n_out x n_in
    total = w.sum(axis=1, keepdims=True)  # n_out x 1
    w = np.divide(w, total, out=w, where=total != 0.0)
    w.flags.writeable = False  # shared by every call (the cache)
    return w, int(lo[0]), int(hi[-1])


def _shrink_matrix(n_out: int, n_in: int) -> np.ndarray:
    """n_out x n_in: a row of ``n_in`` pixels shrunk to ``n_out`` by a triangle filter as wide as a step (bilinear
    with antialiasing, as PIL's BILINEAR shrinks, without its rounding to whole grey levels); each row sums to 1."""
    scale = n_in / n_out
    centre = (np.arange(n_out) + 0.5) * scale  # n_out
    weight = np.maximum(0.0, 1.0 - np.abs(np.arange(n_in)[None, :] + 0.5 - centre[:, None]) / max(scale, 1.0))
    return (weight / weight.sum(axis=1, keepdims=True)).astype(np.float32)  # n_out x n_in


@functools.cache
def _shrink(n_out: int, n_in: int = SIDE) -> np.ndarray:
    return _shrink_matrix(n_out, n_in)  # n_out x n_in


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
