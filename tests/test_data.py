"""Tests for moco.data: scanning, decoding every image kind, bad files, and the uint8 cache."""

from __future__ import annotations

import io
import json
import logging
import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageFile

from moco.data import cache as data
from moco.data.cache import ImageCache, build_cache
from moco.data.photos import (
    DEFAULT_MAX_PIXELS,
    IMAGE_EXTENSIONS,
    ImageDecodeError,
    load_rgb,
    load_square_u8,
    scan_images,
)
from moco.errors import UserError

RED = (220, 30, 40)
BLUE = (20, 40, 210)


def _solid(
    path: Path, color: tuple[int, ...] = RED, size: tuple[int, int] = (24, 16), mode: str = "RGB", **save: object
) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new(mode, size, color).save(path, **save)
    return path


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name.startswith("moco.data")]


def _close(rgb: np.ndarray, color: tuple[int, int, int], tol: float) -> bool:
    return bool(np.abs(rgb.reshape(-1, 3).mean(0) - np.array(color)).max() <= tol)


# ------------------------------------------------------------------------------------ scanning


def test_extensions_constant() -> None:
    assert {".jpg", ".jpeg", ".png", ".webp", ".bmp", ".tif", ".tiff", ".gif", ".avif", ".heic", ".heif", ".dng",
            ".cr2", ".nef", ".arw"} == IMAGE_EXTENSIONS


def test_scan_recursive_sorted_case_insensitive_hidden_skipped(tmp_path: Path) -> None:
    for rel in [
        "b.jpg",
        "a/z.PNG",
        "a/c.Jpeg",
        "a/deep/d.tiff",
        "e.GIF",
        "f.webp",
        "g.bmp",
        "h.tif",
        ".hidden.jpg",
        ".cache/x.jpg",
        "a/.thumbs/y.png",
        "x.jpg/inner.png",
    ]:
        _solid(tmp_path / rel, format="PNG")
    (tmp_path / "notes.txt").write_text("hi")
    (tmp_path / "a" / "movie.mov").write_bytes(b"x")
    got = scan_images(tmp_path)
    # directories are never listed, even when named like an image; they are searched instead
    assert got == sorted(
        ["b.jpg", "a/z.PNG", "a/c.Jpeg", "a/deep/d.tiff", "e.GIF", "f.webp", "g.bmp", "h.tif", "x.jpg/inner.png"]
    )
    assert got == sorted(got)
    assert scan_images(str(tmp_path)) == got


def test_scan_bad_root(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="nope"):
        scan_images(tmp_path / "nope")
    f = _solid(tmp_path / "file.png", format="PNG")
    with pytest.raises(UserError, match="file.png"):
        scan_images(f)


# ------------------------------------------------------------------------------------ decoding


@pytest.mark.parametrize(
    ("name", "save", "tol"),
    [
        ("a.jpg", {"format": "JPEG", "quality": 95}, 6),
        ("a.png", {"format": "PNG"}, 0),
        ("a.webp", {"format": "WEBP", "lossless": True}, 0),
        ("a.bmp", {"format": "BMP"}, 0),
        ("a.tiff", {"format": "TIFF"}, 0),
        ("a.gif", {"format": "GIF"}, 0),
    ],
)
def test_formats_decode_to_rgb(tmp_path: Path, name: str, save: dict, tol: float) -> None:
    img = load_rgb(_solid(tmp_path / name, **save))
    assert img.mode == "RGB" and img.size == (24, 16)
    assert _close(np.asarray(img), RED, tol)


def _save_mode(path: Path, img: Image.Image, fmt: str = "PNG") -> Path:
    img.save(path, format=fmt)
    return path


def test_mode_l_la_p_rgba(tmp_path: Path) -> None:
    gray = load_rgb(_save_mode(tmp_path / "l.png", Image.new("L", (8, 8), 100)))
    assert np.all(np.asarray(gray) == 100)

    la = Image.new("LA", (8, 8), (50, 255))
    la.paste((50, 0), (0, 0, 4, 8))  # left half fully transparent -> white
    out = np.asarray(load_rgb(_save_mode(tmp_path / "la.png", la)))
    assert np.all(out[:, :4] == 255) and np.all(out[:, 4:] == 50)

    pal = Image.new("RGB", (8, 8), BLUE).convert("P", palette=Image.Palette.ADAPTIVE)
    out = np.asarray(load_rgb(_save_mode(tmp_path / "p.png", pal)))
    assert _close(out, BLUE, 2)

    rgba = Image.new("RGBA", (8, 8), (255, 0, 0, 128))
    out = np.asarray(load_rgb(_save_mode(tmp_path / "rgba.png", rgba)))
    assert _close(out, (255, 127, 127), 2)  # composited on white

    bilevel = Image.new("1", (8, 8), 1)
    assert np.all(np.asarray(load_rgb(_save_mode(tmp_path / "one.png", bilevel))) == 255)


def test_mode_cmyk(tmp_path: Path) -> None:
    cmyk = Image.new("CMYK", (16, 16), (0, 255, 255, 0))  # pure red
    for fmt, name in [("JPEG", "c.jpg"), ("TIFF", "c.tif")]:
        out = np.asarray(load_rgb(_save_mode(tmp_path / name, cmyk, fmt)))
        assert _close(out, (255, 0, 0), 8), name


def test_mode_i16_scaled_not_clipped(tmp_path: Path) -> None:
    arr = np.array([[0, 32768, 65535, 257]], dtype=np.uint16)
    path = tmp_path / "deep.png"
    Image.fromarray(arr).save(path)
    assert Image.open(path).mode.startswith("I;16")
    out = np.asarray(load_rgb(path))
    assert out.shape == (1, 4, 3)
    assert out[0, :, 0].tolist() == [0, 128, 255, 1]
    assert np.all(out[..., 0] == out[..., 2])


def test_mode_float_tiff(tmp_path: Path) -> None:
    arr = np.array([[0.0, 0.5, 1.0]], dtype=np.float32)
    path = tmp_path / "f.tif"
    Image.fromarray(arr, "F").save(path)
    assert np.asarray(load_rgb(path))[0, :, 1].tolist() == [0, 128, 255]


def test_animated_gif_first_frame(tmp_path: Path) -> None:
    frames = [Image.new("RGB", (10, 10), c) for c in [(255, 0, 0), (0, 255, 0), (0, 0, 255)]]
    path = tmp_path / "anim.gif"
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=50, loop=0)
    assert Image.open(path).n_frames == 3
    out = np.asarray(load_rgb(path))
    assert out.shape == (10, 10, 3) and _close(out, (255, 0, 0), 1)


def test_animated_webp_first_frame(tmp_path: Path) -> None:
    frames = [Image.new("RGB", (10, 10), c) for c in [(0, 255, 0), (255, 0, 0)]]
    path = tmp_path / "anim.webp"
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=50, lossless=True)
    assert _close(np.asarray(load_rgb(path)), (0, 255, 0), 1)


@pytest.mark.parametrize(("orientation", "corner"), [(6, "top_right"), (8, "bottom_left"), (1, "top_left")])
def test_exif_orientation(tmp_path: Path, orientation: int, corner: str) -> None:
    img = Image.new("RGB", (40, 20), BLUE)
    img.paste(RED, (0, 0, 8, 8))  # mark the stored top-left corner
    exif = img.getexif()
    exif[0x0112] = orientation
    path = tmp_path / "o.jpg"
    img.save(path, format="JPEG", quality=95, exif=exif)
    out = np.asarray(load_rgb(path))
    h, w = out.shape[:2]
    assert (w, h) == ((40, 20) if orientation == 1 else (20, 40))
    corners = {"top_left": out[1, 1], "top_right": out[1, w - 2], "bottom_left": out[h - 2, 1]}
    for name, px in corners.items():
        assert _close(px, RED if name == corner else BLUE, 25), (name, px)


def test_load_square_u8_shapes_and_content(tmp_path: Path) -> None:
    wide = Image.new("RGB", (90, 30), RED)
    wide.paste(BLUE, (0, 0, 30, 30))  # left third blue: cropped away by the center crop
    p = tmp_path / "wide.png"
    wide.save(p)
    out = load_square_u8(p, 16)
    assert out.shape == (16, 16, 3) and out.dtype == np.uint8 and out.flags.c_contiguous
    assert _close(out[:, 3:], RED, 3)

    tall = _solid(tmp_path / "tall.png", BLUE, size=(5, 9), format="PNG")
    up = load_square_u8(tall, 32)  # smaller than size: upscaled
    assert up.shape == (32, 32, 3) and _close(up, BLUE, 1)


def test_load_square_u8_large_jpeg_draft(tmp_path: Path) -> None:
    img = Image.new("RGB", (800, 600), RED)
    img.paste(BLUE, (0, 0, 400, 600))
    p = tmp_path / "big.jpg"
    img.save(p, quality=92)
    out = load_square_u8(p, 32)
    assert out.shape == (32, 32, 3)
    assert _close(out[:, :8], BLUE, 8) and _close(out[:, -8:], RED, 8)


# -------------------------------------------------------------------------------- bad files


def _make_bad_files(root: Path) -> dict[str, str]:
    """Create one file of each bad kind; return {relative path: expected reason prefix}."""
    (root / "empty.jpg").write_bytes(b"")
    (root / "text.png").write_text("this is not a png\n" * 20)
    buf = io.BytesIO()
    noise = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    Image.fromarray(noise).save(buf, format="JPEG", quality=90)
    raw = buf.getvalue()
    (root / "truncated.jpg").write_bytes(raw[: len(raw) // 2])
    os.symlink(root / "does-not-exist.jpg", root / "broken.jpg")
    (root / "bomb.png").parent.mkdir(exist_ok=True)
    Image.new("1", (12000, 8000)).save(root / "bomb.png")
    return {
        "empty.jpg": "empty file (0 bytes)",
        "text.png": "not an image (cannot identify format)",
        "truncated.jpg": "truncated or corrupt: ",
        "broken.jpg": "unreadable: ",
        "bomb.png": f"decompression bomb: 12000 x 8000 pixels exceeds limit {DEFAULT_MAX_PIXELS}",
    }


def test_load_rgb_reasons(tmp_path: Path) -> None:
    expected = _make_bad_files(tmp_path)
    (tmp_path / "dir.jpg").mkdir()
    expected["dir.jpg"] = "unreadable: Is a directory"
    expected["missing.png"] = "unreadable: No such file or directory"
    for rel, reason in expected.items():
        with pytest.raises(ImageDecodeError) as info:
            load_rgb(tmp_path / rel)
        assert info.value.reason.startswith(reason), (rel, info.value.reason)
        assert isinstance(info.value, UserError) and rel in str(info.value)


def test_bomb_rejected_before_decoding(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bomb = tmp_path / "bomb.png"
    Image.new("1", (12000, 8000)).save(bomb)
    assert bomb.stat().st_size < 100_000
    saved_limit = Image.MAX_IMAGE_PIXELS

    def no_decode(self: object) -> None:
        raise AssertionError("pixels were decoded")

    monkeypatch.setattr(ImageFile.ImageFile, "load", no_decode)
    with pytest.raises(ImageDecodeError, match="decompression bomb: 12000 x 8000 pixels"):
        load_rgb(bomb)
    with pytest.raises(ImageDecodeError, match="decompression bomb: 12000 x 8000 pixels"):
        load_square_u8(bomb, 32)
    assert Image.MAX_IMAGE_PIXELS == saved_limit  # global PIL setting untouched


def test_custom_max_pixels(tmp_path: Path) -> None:
    p = _solid(tmp_path / "a.png", size=(100, 100), format="PNG")
    with pytest.raises(ImageDecodeError, match="100 x 100 pixels exceeds limit 5000"):
        load_rgb(p, max_pixels=5000)
    assert load_rgb(p, max_pixels=None).size == (100, 100)
    assert load_rgb(p, max_pixels=10_000).size == (100, 100)


def test_a_photo_opened_past_pils_limit_leaves_other_threads_a_limit(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """While a photo is opened with our limit governing, PIL's own limit is lifted out of reach, never None: a crop
    in another thread reads it twice (``is None``, then ``2 * limit``), and None between the reads was a TypeError
    that ended an index build of 100,000 photos."""
    p = _solid(tmp_path / "a.png", size=(100, 100), format="PNG")
    seen: list[object] = []
    real_open = Image.open

    def open_and_look(*args: object, **kwargs: object) -> Image.Image:  # what another thread's crop reads meanwhile
        seen.append(Image.MAX_IMAGE_PIXELS)
        Image._decompression_bomb_check((4000, 3000))
        return real_open(*args, **kwargs)

    monkeypatch.setattr(Image, "open", open_and_look)
    saved = Image.MAX_IMAGE_PIXELS
    assert load_rgb(p, max_pixels=None).size == (100, 100)
    assert seen and all(isinstance(v, int) and v > 10**12 for v in seen), seen
    assert Image.MAX_IMAGE_PIXELS == saved


def test_decode_error_pickles() -> None:
    import pickle

    err = pickle.loads(pickle.dumps(ImageDecodeError("x.jpg", "empty file (0 bytes)")))
    assert err.path == "x.jpg" and err.reason == "empty file (0 bytes)"


def test_build_cache_skips_each_bad_file_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "photos"
    root.mkdir()
    expected = _make_bad_files(root)
    (root / "folder.jpg").mkdir()  # a directory named like an image: scanned into, not listed
    _solid(root / "good.png", format="PNG")
    _solid(root / "folder.jpg" / "inner.jpg", BLUE, format="JPEG")
    caplog.set_level(logging.DEBUG, logger="moco.data")
    cache = build_cache(root, 16, tmp_path / "cache")
    assert cache.files == ["folder.jpg/inner.jpg", "good.png"]
    reasons = dict(cache.skipped)
    assert set(reasons) == set(expected)
    for rel, reason in expected.items():
        assert reasons[rel].startswith(reason), (rel, reasons[rel])
    warns = _warnings(caplog)
    assert len(warns) == len(expected)
    for rel in expected:
        assert sum(w.startswith(f"skipping {rel}: ") for w in warns) == 1

    # a directory named in an explicit file list is skipped with a reason
    caplog.clear()
    cache = build_cache(root, 16, tmp_path / "cache2", files=["good.png", "folder.jpg"])
    assert cache.files == ["good.png"]
    assert cache.skipped == [("folder.jpg", "unreadable: Is a directory")]
    assert _warnings(caplog) == ["skipping folder.jpg: unreadable: Is a directory"]


def test_empty_folder(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("no photos here")
    (tmp_path / ".hidden.jpg").write_bytes(b"x")
    with pytest.raises(UserError, match=r"no images found in .*: expected files with extensions"):
        build_cache(tmp_path, 16, tmp_path / "cache")


def test_only_bad_files(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "photos"
    root.mkdir()
    (root / "a.jpg").write_bytes(b"")
    (root / "b.png").write_text("nope")
    with pytest.raises(UserError) as info:
        build_cache(root, 16, tmp_path / "cache")
    msg = str(info.value)
    assert str(root) in msg and "2" in msg and "empty file (0 bytes)" in msg and "a.jpg" in msg
    assert len(_warnings(caplog)) == 2
    assert not list((tmp_path / "cache").glob("images-*"))  # nothing half-written left behind


def test_missing_cache_root(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="missing"):
        build_cache(tmp_path / "missing", 16, tmp_path / "cache")


# -------------------------------------------------------------------------------------- cache


def _photo_folder(root: Path, n: int = 6) -> list[str]:
    rng = np.random.default_rng(1)
    rels = []
    for i in range(n):
        arr = rng.integers(0, 256, (20 + 3 * i, 30, 3), dtype=np.uint8)
        rel = f"sub{i % 2}/img{i}.{'png' if i % 2 else 'jpg'}"
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(arr).save(root / rel)
        rels.append(rel)
    return sorted(rels)


def _forbid_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args: object, **kwargs: object) -> np.ndarray:
        raise AssertionError("decoded although the cache should be reused")

    monkeypatch.setattr(data, "load_square_u8", boom)


def test_build_cache_writes_and_reuses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "photos"
    rels = _photo_folder(root)
    cache_dir = tmp_path / "cache"
    cache = build_cache(root, 24, cache_dir)
    assert isinstance(cache, ImageCache) and len(cache) == 6 and cache.files == rels
    assert cache.root == root.resolve() and cache.size == 24 and cache.skipped == []
    assert isinstance(cache.array, np.memmap) and cache.array.shape == (6, 24, 24, 3)
    assert cache.array.dtype == np.uint8 and not cache.array.flags.writeable
    for i, rel in enumerate(rels):
        np.testing.assert_array_equal(cache.array[i], load_square_u8(root / rel, 24))

    data_file, manifest_file = cache_dir / "images-24.u8", cache_dir / "images-24.json"
    assert data_file.stat().st_size == 6 * 24 * 24 * 3
    manifest = json.loads(manifest_file.read_text())
    assert manifest["version"] == 1 and manifest["root"] == str(root.resolve())
    assert manifest["size"] == 24 and manifest["files"] == rels and manifest["skipped"] == []
    st = (root / rels[0]).stat()
    assert manifest["stats"][0] == [st.st_size, st.st_mtime_ns]
    assert not [p for p in cache_dir.iterdir() if p.name.endswith(".tmp")]

    before = np.array(cache.array)
    _forbid_decoding(monkeypatch)
    caplog.set_level(logging.INFO, logger="moco.data")
    again = build_cache(root, 24, cache_dir)
    assert any("reusing image cache" in r.getMessage() for r in caplog.records)
    assert again.files == rels
    np.testing.assert_array_equal(np.asarray(again.array), before)


def test_modified_or_added_file_triggers_rebuild(tmp_path: Path) -> None:
    root = tmp_path / "photos"
    rels = _photo_folder(root)
    cache_dir = tmp_path / "cache"
    build_cache(root, 16, cache_dir)

    target = root / rels[1]
    Image.new("RGB", (30, 30), RED).save(target)  # new content
    st = target.stat()
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
    cache = build_cache(root, 16, cache_dir)
    assert _close(np.asarray(cache.array[1]), RED, 1)

    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns + 9_000_000_000))  # touch only
    mtime_before = (cache_dir / "images-16.json").stat().st_mtime_ns
    cache = build_cache(root, 16, cache_dir)
    manifest = json.loads((cache_dir / "images-16.json").read_text())
    assert manifest["stats"][1][1] == st.st_mtime_ns + 9_000_000_000
    assert (cache_dir / "images-16.json").stat().st_mtime_ns >= mtime_before

    _solid(root / "aaa.png", BLUE, format="PNG")
    cache = build_cache(root, 16, cache_dir)
    assert cache.files[0] == "aaa.png" and len(cache) == 7
    assert _close(np.asarray(cache.array[0]), BLUE, 1)


def test_touch_rebuilds_without_reuse_log(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "photos"
    rels = _photo_folder(root, 3)
    build_cache(root, 16, tmp_path / "c")
    st = (root / rels[0]).stat()
    os.utime(root / rels[0], ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    caplog.set_level(logging.INFO, logger="moco.data")
    build_cache(root, 16, tmp_path / "c")
    msgs = [r.getMessage() for r in caplog.records]
    assert not any("reusing" in m for m in msgs) and any("rebuilding" in m for m in msgs)


def test_skipped_files_are_part_of_reuse_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "photos"
    _photo_folder(root, 2)
    (root / "bad.jpg").write_bytes(b"")
    build_cache(root, 16, tmp_path / "c")
    with monkeypatch.context() as m:
        _forbid_decoding(m)
        caplog.clear()
        cache = build_cache(root, 16, tmp_path / "c")
        assert cache.skipped == [("bad.jpg", "empty file (0 bytes)")]
        assert _warnings(caplog) == ["skipping bad.jpg: empty file (0 bytes)"]
    # fixing the bad file changes its stats: rebuilt and now included
    _solid(root / "bad.jpg", format="JPEG")
    cache = build_cache(root, 16, tmp_path / "c")
    assert "bad.jpg" in cache.files and cache.skipped == []


def test_workers_match_in_process(tmp_path: Path) -> None:
    root = tmp_path / "photos"
    _photo_folder(root, 9)
    (root / "bad.png").write_text("x")
    serial = build_cache(root, 20, tmp_path / "c0", workers=0)
    parallel = build_cache(root, 20, tmp_path / "c2", workers=2)
    assert parallel.files == serial.files and parallel.skipped == serial.skipped
    np.testing.assert_array_equal(np.asarray(parallel.array), np.asarray(serial.array))


def test_explicit_files_order_and_strict(tmp_path: Path) -> None:
    root = tmp_path / "photos"
    rels = _photo_folder(root, 4)
    order = [rels[2], rels[0], rels[3]]
    cache = build_cache(root, 16, tmp_path / "c", files=order, strict=True)
    assert cache.files == order
    np.testing.assert_array_equal(cache.array[0], load_square_u8(root / rels[2], 16))

    (root / rels[0]).unlink()
    with pytest.raises(UserError, match=rels[0]):
        build_cache(root, 16, tmp_path / "c", files=order, strict=True)
    lenient = build_cache(root, 16, tmp_path / "c", files=order)
    assert lenient.files == [rels[2], rels[3]] and lenient.skipped[0][0] == rels[0]
    with pytest.raises(UserError, match=rels[0]):  # also when the cache itself is reused
        build_cache(root, 16, tmp_path / "c", files=order, strict=True)
    with pytest.raises(UserError, match="twice"):
        build_cache(root, 16, tmp_path / "c", files=[rels[1], rels[1]])


@pytest.mark.parametrize("damage", ["truncate", "extend", "delete", "bad_manifest"])
def test_corrupt_cache_is_rebuilt(tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "photos"
    rels = _photo_folder(root, 3)
    cache_dir = tmp_path / "cache"
    good = np.array(build_cache(root, 16, cache_dir).array)
    data_file, manifest = cache_dir / "images-16.u8", cache_dir / "images-16.json"
    if damage == "truncate":
        raw = data_file.read_bytes()
        data_file.write_bytes(raw[: len(raw) // 2])
    elif damage == "extend":
        with data_file.open("ab") as fh:
            fh.write(b"\0" * 10)
    elif damage == "delete":
        data_file.unlink()
    else:
        manifest.write_text("{not json")
    caplog.set_level(logging.INFO, logger="moco.data")
    cache = build_cache(root, 16, cache_dir)
    assert not any("reusing" in r.getMessage() for r in caplog.records)
    assert cache.files == rels and data_file.stat().st_size == 3 * 16 * 16 * 3
    np.testing.assert_array_equal(np.asarray(cache.array), good)


def test_other_root_or_size_not_reused(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    _photo_folder(a, 2)
    _solid(b / "sub0/img0.jpg", RED, format="JPEG")
    _solid(b / "sub1/img1.png", RED, format="PNG")
    cache_dir = tmp_path / "cache"
    build_cache(a, 16, cache_dir)
    other = build_cache(b, 16, cache_dir)
    assert _close(np.asarray(other.array), RED, 3)
    assert build_cache(a, 8, cache_dir).array.shape == (2, 8, 8, 3)
    assert (cache_dir / "images-16.json").exists() and (cache_dir / "images-8.json").exists()


def test_progress_bar_on_stderr(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "photos"
    _photo_folder(root, 2)
    build_cache(root, 8, tmp_path / "c", progress=True)
    captured = capsys.readouterr()
    assert captured.out == "" and "2/2" in captured.err


WORKERS_SCRIPT = """from moco.data.workers import in_workers

{call}print(sum(in_workers(abs, range(-20, 0), 2, "test", init=len, init_args=(b"x" * {size},))))
"""


@pytest.mark.parametrize("size", [100, 1_000_000])
def test_a_script_that_starts_workers_at_its_top_level_is_told_why_it_fails(tmp_path, size):
    """A script that starts worker processes at its top level (no `if __name__ == "__main__":`): each spawned worker
    imports it again. With init arguments larger than a pipe's buffer (the pixel check's frame placement of 30,000
    photos), the parent waited forever writing them to a worker that had exited without reading them; now they go
    through a file (removed after), and either way the worker stops at once and the parent names the fix."""
    import subprocess
    import sys

    temp = tmp_path / "temp"
    temp.mkdir()
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]), OMP_NUM_THREADS="1", TMPDIR=str(temp))
    for guarded in (False, True):
        script = tmp_path / "mine.py"
        script.write_text(WORKERS_SCRIPT.format(size=size, call='if __name__ == "__main__":\n    ' if guarded else ""))
        proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=120)
        if guarded:
            assert proc.returncode == 0 and proc.stdout.split() == ["210"], proc.stderr[-3000:]
        else:
            assert proc.returncode == 1, proc.stderr[-3000:]
            last = proc.stderr.strip().splitlines()[-1]
            assert last.startswith("moco.errors.UserError: ") and 'if __name__ == "__main__":' in last, last
        assert not list(temp.glob("moco-workers-*")), list(temp.iterdir())
