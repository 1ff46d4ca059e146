"""Photos as people keep them (issue 42, section 2): HEIC/HEIF, AVIF and RAW read like JPEG; a format whose package
is missing counted and said with its fix; ``--exclude`` folders never read; the date taken in the catalog, and
searches filtered by it (against a brute-force numpy reference).

Real files throughout: photos the tests generate, saved by Pillow, pillow-heif and a minimal DNG writer; real
SQLite, real FAISS; a missing package simulated as tests/test_install.py does (an import blocker in a subprocess).
"""

from __future__ import annotations

import datetime
import json
import os
import sqlite3
import struct
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from app.cli.commands import main
from index.building.runner import build_index, update_index
from index.catalog import Catalog, date_text, taken_bound
from index.search.image_index import ImageIndex
from moco.data.cache import build_cache
from moco.data.photos import (
    ImageDecodeError,
    load_rgb,
    photo_info,
    scan_images,
    scan_photos,
    skipped_notes,
)
from moco.data.sample import make_sample_collection
from moco.errors import UserError
from moco.excludes import Excludes, check_patterns
from moco.extras import install_hint
from tests.test_install import _run

ROOT = Path(__file__).resolve().parents[1]
HEIC, RAW = install_hint("heic"), install_hint("raw")  # the fix a skipped photo's note names
RED, BLUE = (200, 40, 30), (20, 60, 220)
EXIF_IFD, DATE_TAKEN, MAKE, MODEL = 0x8769, 0x9003, 0x010F, 0x0110


def _halves(h: int = 64, w: int = 96) -> np.ndarray:
    """H x W x 3: the left half red, the right half blue."""
    rgb = np.zeros((h, w, 3), np.uint8)
    rgb[:, : w // 2], rgb[:, w // 2 :] = RED, BLUE
    return rgb


def _exif(taken: str | None = None, make: str | None = None, model: str | None = None) -> bytes:
    exif = Image.Exif()
    if make:
        exif[MAKE] = make
    if model:
        exif[MODEL] = model
    if taken:
        exif.get_ifd(EXIF_IFD)[DATE_TAKEN] = taken
    return exif.tobytes()


def write_dng(path: Path, rgb: np.ndarray, make: str = "TestMake", model: str = "TestModel",
              taken: str | None = None) -> Path:
    """A minimal uncompressed LinearRaw DNG (a TIFF with the DNG tags) of an H x W x 3 uint8 image."""
    h, w, _ = rgb.shape
    data = np.ascontiguousarray(rgb, np.uint8).tobytes()
    entries: list[tuple[int, int, int, bytes]] = []

    def add(tag: int, typ: int, values: object) -> None:
        if typ == 2:
            raw = str(values).encode() + b"\0"
            count = len(raw)
        elif typ == 10:  # SRATIONAL
            raw = b"".join(struct.pack("<ii", *v) for v in values)  # type: ignore[union-attr]
            count = len(values)  # type: ignore[arg-type]
        else:
            fmt = {1: "B", 3: "H", 4: "I"}[typ]
            raw = struct.pack(f"<{len(values)}{fmt}", *values)  # type: ignore[arg-type]
            count = len(values)  # type: ignore[arg-type]
        entries.append((tag, typ, count, raw))

    add(254, 4, [0])
    add(256, 4, [w])
    add(257, 4, [h])
    add(258, 3, [8, 8, 8])
    add(259, 3, [1])
    add(262, 3, [34892])  # LinearRaw
    add(271, 2, make)
    add(272, 2, model)
    add(273, 4, [0])  # the strip's offset: set below
    add(274, 3, [1])
    add(277, 3, [3])
    add(278, 4, [h])
    add(279, 4, [len(data)])
    add(284, 3, [1])
    add(50706, 1, [1, 4, 0, 0])  # DNGVersion
    add(50707, 1, [1, 1, 0, 0])
    add(50708, 2, f"{make} {model}")
    add(50721, 10, [(1, 1), (0, 1), (0, 1), (0, 1), (1, 1), (0, 1), (0, 1), (0, 1), (1, 1)])  # ColorMatrix1
    add(50778, 3, [21])  # D65
    if taken:
        add(DATE_TAKEN, 2, taken)  # TIFF/EP: in IFD0
    entries.sort()
    extra_at = 8 + 2 + 12 * len(entries) + 4
    extra, fixed = b"", []
    for tag, typ, count, raw in entries:
        if len(raw) <= 4:
            fixed.append((tag, typ, count, raw.ljust(4, b"\0")))
        else:
            fixed.append((tag, typ, count, struct.pack("<I", extra_at + len(extra))))
            extra += raw + b"\0" * (len(raw) % 2)
    out = [b"II*\0", struct.pack("<IH", 8, len(entries))]
    for tag, typ, count, value in fixed:
        value = struct.pack("<I", extra_at + len(extra)) if tag == 273 else value
        out.append(struct.pack("<HHI", tag, typ, count) + value)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(out) + struct.pack("<I", 0) + extra + data)
    return path


def _red_left_blue_right(img: Image.Image) -> bool:
    a = np.asarray(img).astype(float)
    left, right = a[:, : a.shape[1] // 3].mean((0, 1)), a[:, -a.shape[1] // 3 :].mean((0, 1))
    return bool(left[0] > left[2] + 60 and right[2] > right[0] + 60)


@pytest.fixture(scope="module")
def heif():
    pillow_heif = pytest.importorskip("pillow_heif")
    pillow_heif.register_heif_opener()
    return pillow_heif


# ------------------------------------------------------------------------------------------------ formats
def test_heic_and_avif_decode_like_jpeg_with_their_exif(tmp_path, heif):
    img = Image.fromarray(_halves())
    exif = _exif("2024:03:04 05:06:07", "Apple", "iPhone 15")
    for name in ("a.heic", "b.HEIF", "c.avif"):
        img.save(tmp_path / name, quality=92, exif=exif)
        out = load_rgb(tmp_path / name)
        assert out.mode == "RGB" and out.size == (96, 64)
        assert np.abs(np.asarray(out).astype(int) - _halves()).mean() < 4  # the same pixels, lossy-coded
        info = photo_info(tmp_path / name)
        assert (info.width, info.height, info.camera) == (96, 64, "Apple iPhone 15")
        assert date_text(info.taken) == "2024-03-04T05:06:07"
    assert scan_images(tmp_path) == ["a.heic", "b.HEIF", "c.avif"]


def test_raw_is_developed_to_rgb_with_its_header(tmp_path):
    pytest.importorskip("rawpy")
    path = write_dng(tmp_path / "raw" / "shot.dng", _halves(), taken="2021:05:06 07:08:09")
    img = load_rgb(path)
    assert img.mode == "RGB" and img.size == (96, 64) and _red_left_blue_right(img)
    info = photo_info(path)
    assert (info.width, info.height, info.camera) == (96, 64, "TestMake TestModel")
    assert date_text(info.taken) == "2021-05-06T07:08:09"
    for bad in (b"", b"II*\0" + b"\0" * 64, b"not a raw file at all"):
        (tmp_path / "bad.cr2").write_bytes(bad)
        with pytest.raises(ImageDecodeError, match="bad.cr2"):
            load_rgb(tmp_path / "bad.cr2")


def test_a_heic_photo_is_found_by_its_jpeg_copy(tmp_path, backbone, heif):
    photos = tmp_path / "photos"
    make_sample_collection(photos, per_family=6, size=48, seed=0)
    make_sample_collection(tmp_path / "other", per_family=1, size=64, seed=7)
    original = Image.open(sorted((tmp_path / "other").rglob("*.*"))[0]).convert("RGB")
    (photos / "phone").mkdir()
    original.save(photos / "phone" / "IMG_0001.HEIC", quality=90)
    original.save(tmp_path / "copy.jpg", quality=90)
    summary = build_index(photos, backbone, tmp_path / "idx", progress=False)
    assert summary.errors == [] and summary.unsupported == {}
    index = ImageIndex.open(tmp_path / "idx")
    hits = index.search_image(tmp_path / "copy.jpg", index.load_embedder(), k=3)
    assert hits.paths[0][0] == "phone/IMG_0001.HEIC"
    assert hits.scores[0][0] > hits.scores[0][1]


# ---------------------------------------------------------------------------------- a package that is missing
def _mixed_folder(root: Path) -> Path:
    make_sample_collection(root, per_family=3, size=48, seed=1)
    for i in range(3):
        (root / "phone" / f"IMG_{i}.HEIC").parent.mkdir(exist_ok=True)
        (root / "phone" / f"IMG_{i}.HEIC").write_bytes(b"not read")  # never opened: its package is missing
    write_dng(root / "camera" / "a.cr2", _halves())
    write_dng(root / "camera" / "b.nef", _halves())
    return root


def test_the_scan_counts_each_format_whose_package_is_missing(tmp_path):
    root = _mixed_folder(tmp_path / "photos")
    code = f"""
import json
from moco.data.photos import scan_photos, missing_support
scan = scan_photos({str(root)!r})
print(json.dumps({{"files": scan.files, "counts": scan.unsupported_counts(), "notes": scan.notes(),
                   "jpg": missing_support(".jpg")}}))
"""
    script = tmp_path / "scan.py"
    script.write_text(code)
    r = _run(tmp_path, "pillow_heif,rawpy", str(script))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["counts"] == {".cr2": 1, ".heic": 3, ".nef": 1} and out["jpg"] is None
    assert "3 .heic files skipped: " + HEIC in out["notes"]
    assert "1 .cr2 file skipped: " + RAW in out["notes"]
    assert not any(f.lower().endswith((".heic", ".cr2", ".nef")) for f in out["files"]) and len(out["files"]) == 18



def test_index_build_says_what_it_skipped_for_a_missing_package(tmp_path, backbone):
    root = _mixed_folder(tmp_path / "photos")
    for as_json in (False, True):
        out = tmp_path / f"idx{as_json}"
        r = _run(tmp_path, "pillow_heif,rawpy", "-m", "app.cli", "index", "build", str(root), "--backbone",
                 str(backbone), "-o", str(out), "--quiet", *(["--json"] if as_json else []))
        assert r.returncode == 0, r.stderr
        if as_json:
            summary = json.loads(r.stdout)
            assert summary["unsupported"] == {".cr2": 1, ".heic": 3, ".nef": 1} and summary["vectors"] == 18
            assert summary["errors"] == []  # skipped for their format, not failed
        else:
            assert "  3 .heic files skipped: " + HEIC in r.stdout.splitlines()
            assert "  1 .nef file skipped: " + RAW in r.stdout.splitlines()
    # the same index updated where the packages are installed: the photos join it; back without: they stay
    pytest.importorskip("rawpy")
    pytest.importorskip("pillow_heif").register_heif_opener()
    for i in range(3):
        Image.fromarray(_halves()).rotate(90 * i).save(root / "phone" / f"IMG_{i}.HEIC", quality=80)
    s = update_index(tmp_path / "idxTrue", progress=False)
    assert s.unsupported == {} and s.embedded == 5 and s.vectors == 23 and s.errors == []
    r = _run(tmp_path, "pillow_heif,rawpy", "-m", "app.cli", "index", "update", str(tmp_path / "idxTrue"),
             "--quiet", "--json")
    assert r.returncode == 0, r.stderr
    again = json.loads(r.stdout)
    assert again["vectors"] == 23 and again["removed"] == 0 and again["unsupported"][".heic"] == 3


@pytest.mark.slow
def test_train_and_the_status_tab_say_what_was_skipped_for_a_missing_package(tmp_path):
    from app.run.status import RunStatus, status_markdown
    from tests.conftest import TINY_CLI

    root = _mixed_folder(tmp_path / "photos")
    r = _run(tmp_path, "pillow_heif,rawpy", "-m", "app.cli", "train", str(root), "--out", str(tmp_path / "run"),
             *TINY_CLI, "--max-steps", "1")
    assert r.returncode == 0, r.stderr
    assert "trained 1/1 steps on 18 images" in r.stdout
    assert "3 .heic files skipped: " + HEIC in r.stdout
    assert "1 .cr2 file skipped: " + RAW in r.stdout
    status = RunStatus(tmp_path)
    status.unsupported = {".heic": 412}
    assert "**Not read:** 412 .heic files skipped: " + HEIC in status_markdown(
        status.snapshot())


# ------------------------------------------------------------------------------------------------ --exclude
def test_patterns_match_folders_and_files_and_refuse_what_cannot_be_meant():
    ex = Excludes(["private/**", "*.gif", "2019/trip/", "Screen*"])
    assert ex.folder("private") and ex.excludes("private/deep/a.jpg") and not ex.folder("x/private")
    assert ex.file("a/b/anim.GIF") and ex.excludes("2019/trip/x.jpg") and not ex.excludes("2019/x.jpg")
    assert ex.folder("deep/Screenshots") and not ex.excludes("public/x.jpg")
    assert check_patterns(["./a/**", "a/**", "b"]) == ("a/**", "b")
    for bad in ("../x", "**", "", "a/../b"):
        with pytest.raises(UserError, match="--exclude"):
            check_patterns([bad])


def test_an_absolute_pattern_under_the_collection_is_taken_relative_to_it_and_another_refused(tmp_path, capsys,
                                                                                              backbone):
    """`--exclude '/abs/photos/bubbles/**'` leaves the bubbles out (as given, through a link, with ~); one outside
    the collection, or the collection itself, is refused naming the pattern and the fix (it would leave out
    nothing, and exit 0)."""
    root = tmp_path / "photos"
    make_sample_collection(root, per_family=2, size=48, seed=3)
    (tmp_path / "alias").symlink_to(root)
    assert check_patterns([f"{root}/bubbles/**", f"{tmp_path}/alias/waves/", "*.gif"], root=root) == (
        "bubbles/**", "waves/", "*.gif")
    assert check_patterns([f"{root}/bubbles/**"], root=tmp_path / "alias") == ("bubbles/**",)
    home = Path.home()
    if root.is_relative_to(home):
        assert check_patterns([f"~/{root.relative_to(home)}/x/**"], root=root) == ("x/**",)
    for bad in (f"{tmp_path}/elsewhere/**", "/bubbles/**", f"{root}", f"{root}/"):
        with pytest.raises(UserError, match="--exclude .* (is not under the collection|whole collection)"):
            check_patterns([bad], root=root)
    families = sorted(p.name for p in root.iterdir())
    scan = scan_photos(root, exclude=[f"{root}/bubbles/**"])
    assert scan.excluded == 1 and scan.excludes == ("bubbles/**",) and not [f for f in scan.files if "bubbles" in f]
    assert main(["embed", str(root), "--backbone", str(backbone), "-o", str(tmp_path / "v.npy"),
                 "--exclude", f"{tmp_path}/elsewhere/**"]) == 2
    err = capsys.readouterr().err
    assert f"is not under the collection {root}" in err and "e.g. --exclude" in err and families


def _collection_with_a_private_folder(root: Path) -> Path:
    make_sample_collection(root, per_family=3, size=48, seed=3)
    private = root / "private"
    (private / "deeper").mkdir(parents=True)
    for name in ("a.jpg", "deeper/b.png"):
        os.mkfifo(private / name)  # a reader would block or fail here
    Image.fromarray(_halves()).save(private / "c.jpg")
    os.mkfifo(root / "anim.gif")
    private.chmod(0)  # unreadable too (root reads it anyway: the FIFOs and the spy below tell)
    return root


@pytest.fixture
def spy(monkeypatch):
    """Every path listed or opened through os.scandir, os.open and os.stat in this process."""
    seen: list[str] = []
    for name in ("scandir", "open", "stat"):
        real = getattr(os, name)

        def watch(path, *a, _real=real, **kw):
            seen.append(os.fsdecode(path) if isinstance(path, (str, bytes, os.PathLike)) else str(path))
            return _real(path, *a, **kw)

        monkeypatch.setattr(os, name, watch)
    return seen


def test_an_excluded_folder_is_never_read(tmp_path, backbone, spy):
    root = _collection_with_a_private_folder(tmp_path / "photos")
    spy.clear()  # what making the collection touched
    try:
        summary = build_index(root, backbone, tmp_path / "idx", progress=False,
                              exclude=["private/**", "*.gif"])
        assert [p for p in spy if "private" in p or p.endswith("anim.gif")] == []
        assert summary.errors == [] and summary.vectors == 18 and summary.excluded == 2
        assert summary.exclude == ["private/**", "*.gif"]
        cat = Catalog(tmp_path / "idx" / "catalog.sqlite")
        assert not [p for p in cat.rows() if p.startswith("private") or p.endswith(".gif")]
        cache = build_cache(root, 16, tmp_path / "cache", exclude=("private", "*.gif"))
        assert len(cache.files) == 18 and cache.excluded == 2 and cache.skipped == []
        assert [p for p in spy if "private" in p or p.endswith("anim.gif")] == []
        # the index keeps its patterns: an update without --exclude never reads them either
        os.chmod(root / "private", 0o755)
        Image.fromarray(_halves()).save(root / "private" / "new.jpg")
        spy.clear()
        s = update_index(tmp_path / "idx", progress=False)
        assert s.exclude == ["private/**", "*.gif"] and s.embedded == 0 and s.errors == []
        assert [p for p in spy if "private" in p] == []
        # an update adds patterns (those photos leave the index); --clear-excludes forgets them
        s = update_index(tmp_path / "idx", progress=False, exclude=["mountains"])
        assert s.exclude == ["private/**", "*.gif", "mountains"] and s.removed == 3 and s.vectors == 15
        for fifo in ("a.jpg", "deeper/b.png"):
            (root / "private" / fifo).unlink()
        (root / "anim.gif").unlink()
        s = update_index(tmp_path / "idx", progress=False, clear_excludes=True)
        assert s.exclude == [] and s.embedded == 5 and s.vectors == 20 and s.errors == []
    finally:
        if (root / "private").exists():
            os.chmod(root / "private", 0o755)


def test_train_keeps_its_excludes_in_its_config(tmp_path, spy):
    from moco.config import resolve_config
    from moco.training.checkpoints import resume_config
    from moco.training.loop import train
    from tests.conftest import TINY

    root = _collection_with_a_private_folder(tmp_path / "photos")
    spy.clear()  # what making the collection touched
    try:
        cfg = resolve_config("v2", data_dir=str(root), out=str(tmp_path / "run"), **TINY, max_steps=1,
                             exclude=("private/**", "*.gif"))
        summary = train(cfg, progress=False)
        assert summary.images == 18 and summary.skipped == 0 and summary.excluded == 2
        assert [p for p in spy if "private" in p or p.endswith("anim.gif")] == []
        assert json.loads((tmp_path / "run" / "config.json").read_text())["exclude"] == ["private/**", "*.gif"]
        assert resume_config(tmp_path / "run").exclude == ("private/**", "*.gif")
    finally:
        os.chmod(root / "private", 0o755)


def test_the_commands_take_exclude(tmp_path, backbone, capsys):
    root = tmp_path / "photos"
    make_sample_collection(root, per_family=3, size=48, seed=4)
    assert main(["index", "build", str(root), "--backbone", str(backbone), "-o", str(tmp_path / "idx"), "--quiet",
                 "--exclude", "sunset/**", "--exclude", "*.png"]) == 0
    out = capsys.readouterr().out
    assert "excluded (--exclude 'sunset/**' --exclude '*.png')" in out
    paths = list(Catalog(tmp_path / "idx" / "catalog.sqlite").rows())
    assert paths and not [p for p in paths if p.startswith("sunset/") or p.endswith(".png")]
    assert main(["embed", str(root), "--backbone", str(backbone), "-o", str(tmp_path / "v.npy"), "--quiet",
                 "--exclude", "sunset"]) == 0
    listed = (tmp_path / "v.paths.txt").read_text().split()
    assert listed == [p for p in scan_images(root) if not p.startswith("sunset/")]
    assert main(["index", "build", str(root), "--backbone", str(backbone), "-o", str(tmp_path / "i2"),
                 "--exclude", "../up"]) == 2
    assert "--exclude '../up'" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ dates taken
DAYS = ["2019:07:01 10:00:00", "2020:02:29 23:59:59", "2021:12:31 12:00:00", "2022:01:01 00:00:00",
        "2023:06:15 08:30:00", "2024:03:04 05:06:07"]


def _dated_collection(root: Path) -> dict[str, str | None]:
    """The sample collection, its photos re-saved with EXIF dates (a few without: their mtime is their date)."""
    make_sample_collection(root, per_family=8, size=48, seed=5)
    dates: dict[str, str | None] = {}
    for i, path in enumerate(sorted(root.rglob("*.*"))):
        rel = path.relative_to(root).as_posix()
        if i % 7 == 3:
            os.utime(path, (1_600_000_000, 1_600_000_000))  # 2020-09-13 UTC, this machine's clock
            dates[rel] = None
            continue
        day = DAYS[i % len(DAYS)]
        Image.open(path).convert("RGB").save(path, format="JPEG" if path.suffix == ".jpg" else "PNG",
                                             exif=_exif(day, "Cam", f"Model {i % 3}"))
        dates[rel] = day
    return dates


@pytest.fixture(scope="module")
def dated(tmp_path_factory, backbone):
    tmp = tmp_path_factory.mktemp("dated")
    dates = _dated_collection(tmp / "photos")
    build_index(tmp / "photos", backbone, tmp / "idx", kind="flat", progress=False)
    return tmp, dates


def test_the_catalog_records_the_date_taken_camera_and_pixels(dated):
    tmp, dates = dated
    rows = Catalog(tmp / "idx" / "catalog.sqlite").rows()
    assert set(rows) == set(dates)
    for path, day in dates.items():
        row = rows[path]
        assert (row.width, row.height) == (48, 48)
        if day is None:
            local = datetime.datetime.fromtimestamp(1_600_000_000).strftime("%Y-%m-%dT%H:%M:%S")
            assert date_text(row.date) == local and row.camera is None  # the file's date, on this clock
            assert row.date_exif == 0
        else:
            assert date_text(row.date) == day.replace(":", "-", 2).replace(" ", "T")
            assert row.camera.startswith("Cam Model ") and row.date_exif == 1


def test_the_keeper_rule_reads_only_a_camera_date_as_a_date_taken(dated):
    from index.duplicates.keeper import photo_facts

    tmp, dates = dated
    rows = Catalog(tmp / "idx" / "catalog.sqlite").rows()
    facts = {path: photo_facts(tmp / "photos", rows[path]) for path in dates}
    assert {path for path, f in facts.items() if f.taken is not None} == {p for p, d in dates.items() if d}
    assert all(f.taken == rows[path].date for path, f in facts.items() if dates[path])


OLD_COLUMNS = "id, path, size, mtime_ns, hash, status, error, thumb, added, indexed, deleted"


def test_an_older_catalog_gets_the_columns_and_the_next_update_fills_them(dated, tmp_path):
    import shutil

    tmp, dates = dated
    shutil.copytree(tmp / "idx", tmp_path / "idx")
    db = sqlite3.connect(tmp_path / "idx" / "catalog.sqlite")  # the images table as version 0.1.0 made it
    db.executescript(f"""
        CREATE TABLE old (id INTEGER PRIMARY KEY, path TEXT NOT NULL UNIQUE, size INTEGER NOT NULL,
            mtime_ns INTEGER NOT NULL, hash TEXT, status TEXT NOT NULL CHECK (status IN ('ok', 'error')), error TEXT,
            thumb TEXT, added REAL NOT NULL, indexed INTEGER NOT NULL DEFAULT 0, deleted INTEGER NOT NULL DEFAULT 0);
        INSERT INTO old SELECT {OLD_COLUMNS} FROM images;
        DROP TABLE images;
        ALTER TABLE old RENAME TO images;
        CREATE INDEX images_hash ON images(hash);""")
    assert [r[1] for r in db.execute("PRAGMA table_info(images)")] == OLD_COLUMNS.split(", ")
    db.close()
    (tmp_path / "idx").chmod(0o555)  # read-only: opened as it is, the header columns read as empty
    try:
        if not os.access(tmp_path / "idx", os.W_OK):  # (root writes anyway)
            assert {r.date for r in Catalog(tmp_path / "idx" / "catalog.sqlite").rows().values()} == {None}
    finally:
        (tmp_path / "idx").chmod(0o755)
    cat = Catalog(tmp_path / "idx" / "catalog.sqlite")  # writable: the columns are added, empty
    assert {r.date for r in cat.rows().values()} == {None} and len(cat.without_header()) == len(dates)
    cat.close()
    s = update_index(tmp_path / "idx", progress=False)
    assert s.headers_read == len(dates) and s.embedded == 0 and s.reembedded == 0
    before = Catalog(tmp / "idx" / "catalog.sqlite").rows()
    after = Catalog(tmp_path / "idx" / "catalog.sqlite").rows()
    assert {p: (r.date, r.camera, r.width, r.height) for p, r in after.items()} == \
        {p: (r.date, r.camera, r.width, r.height) for p, r in before.items()}


def _reference(index: ImageIndex, q: np.ndarray, k: int, offset: int, keep) -> list[list[tuple[int, float]]]:
    """Brute force in numpy: every live row's centred vector scored against each query, filtered, ranked."""
    rows = {r.id: r for r in index.catalog.rows().values() if r.status == "ok"}
    ids = np.array(sorted(rows), np.int64)
    base = index.to_space(index.vectors(ids))  # N x D, as index.faiss holds them
    scores = index.to_space(q) @ base.T  # Q x N
    out = []
    for s in scores:
        ranked = [(int(ids[j]), float(s[j])) for j in np.argsort(-s, kind="stable") if keep(rows[int(ids[j])])]
        out.append(ranked[offset : offset + k])
    return out


@pytest.mark.parametrize(("k", "offset", "folder", "away", "span"), [
    (5, 0, None, (), ("2020-01-01", "2021-12-31")),
    (3, 2, None, ("stars",), ("2021-12-31", "")),
    (50, 0, None, ("mountains", "sunset"), ("", "2020-02-29")),
    (4, 1, "stars", (), ("2021-06-01", "2023-12-31")),
    (10, 0, None, (), ("2024-03-04T05:06", "2024-03-04T05:07")),
    (7, 3, None, (), ("", "")),
])
def test_search_by_date_and_folders_matches_a_brute_force_reference(dated, k, offset, folder, away, span):
    tmp, _ = dated
    index = ImageIndex.open(tmp / "idx")
    lo, hi = taken_bound(span[0], False), taken_bound(span[1], True)
    rng = np.random.default_rng(k)
    q = index.vectors(np.array(sorted(r.id for r in index.catalog.rows().values())[:: 9], np.int64))
    q = q + rng.normal(0, 0.05, q.shape).astype(np.float32)  # Q x D

    def keep(row) -> bool:
        ok = (folder is None or row.path.startswith(folder + "/")) and not row.path.startswith(
            tuple(f + "/" for f in away))
        return ok and (lo is None or row.date >= lo) and (hi is None or row.date < hi)

    hits = index.search(q, k=k, folder=folder, offset=offset, exclude_folders=away, taken=(lo, hi))
    want = _reference(index, q, k, offset, keep)
    for n, ref in enumerate(want):
        got = [(int(i), float(s)) for i, s in zip(hits.ids[n], hits.scores[n]) if i >= 0]
        assert [i for i, _ in got] == [i for i, _ in ref]
        assert np.allclose([s for _, s in got], [s for _, s in ref], atol=1e-4)
        assert all(keep(r) for r in hits.rows[n])
    assert any(len(ref) for ref in want)  # the filters leave something to find


def test_dates_at_every_door(dated, capsys):
    from app.page.handlers import SearchApp
    from app.search.scope import FOLDER_MODES, folder_filter

    tmp, dates = dated
    query = next(p for p, d in dates.items() if d and d.startswith("2021"))
    argv = ["index", "search", str(tmp / "idx"), str(tmp / "photos" / query), "-k", "4", "--json", "--include-queries",
            "--taken-from", "2021-12-31", "--taken-to", "2021-12-31", "--exclude-folder", "sunset"]
    assert main(argv) == 0
    hits = json.loads(capsys.readouterr().out)
    assert hits and all(h["taken"].startswith("2021-12-31T") for h in hits)
    assert hits[0]["path"] == query and not [h for h in hits if h["path"].startswith("sunset/")]
    assert main([*argv[:-4], "--taken-from", "2021-13-01"]) == 2
    assert "--taken-from '2021-13-01'" in capsys.readouterr().err
    assert main([*argv[:-4], "--taken-from", "2022-01-01", "--taken-to", "2021-01-01"]) == 2
    assert main([*argv[:-2], "--exclude-folder", "nosuch"]) == 2

    index = ImageIndex.open(tmp / "idx")
    app = SearchApp(index, index.load_embedder())
    only, away = folder_filter("stars", FOLDER_MODES[1])
    assert (only, away) == (None, ["stars"])
    gallery, info, state = app.search(str(tmp / "photos" / query), 6, only, away, "2019-01-01", "2021-12-31")
    assert "not in `stars/`" in info and "taken 2019-01-01" in info
    assert all(not p.startswith("stars/") for p in state.paths)
    assert all(taken_bound("2019-01-01", False) <= t < taken_bound("2021-12-31", True) for t in state.dates)
    assert all(caption.split(" · ")[-2][:4] in ("2019", "2020", "2021") for _, caption in gallery)
    more = app.more(state)[2]
    assert len(more.dates) == len(more.paths) and more.taken == state.taken
    with pytest.raises(UserError, match="taken_from"):
        app.search(str(tmp / "photos" / query), 6, None, (), "yesterday")
    app.close()


def test_skipped_notes_say_the_fix():
    assert skipped_notes({".heic": 412, ".dng": 1, ".jpg": 0}) == [
        "1 .dng file skipped: " + RAW,
        "412 .heic files skipped: " + HEIC]
    assert scan_photos(ROOT / "docs").files == ["screenshot-map.png", "screenshot-phone.png", "screenshot.png"]


def test_dedup_leaves_excluded_folders_out_and_shows_the_dates(dated, capsys):
    from index.duplicates.dedup import find_duplicates

    tmp, _ = dated
    index = ImageIndex.open(tmp / "idx")
    kinds = ("exact", "near", "similar")  # no copies here: alike photos, which near groups leave out
    every = find_duplicates(index, 0.3, save=False, kinds=kinds)
    assert any(m.path.startswith("stars/") for g in every for m in g.members)
    groups = find_duplicates(index, 0.3, save=False, kinds=kinds, exclude_folders=["stars"])
    assert groups and not any(m.path.startswith("stars/") for g in groups for m in g.members)
    rows = {m.path: index.catalog.row_by_path(m.path) for g in groups for m in g.members}
    # a member's date taken is its EXIF date; a date the catalog took from the file's mtime is none
    assert all(m.taken == (rows[m.path].date if rows[m.path].date_exif else None) for g in groups
               for m in g.members)
    assert any(m.taken is not None for g in groups for m in g.members)
    assert main(["index", "dedup", str(tmp / "idx"), "--threshold", "0.3", "--json", "--exclude-folder", "stars",
                 *(f"--kind={k}" for k in kinds)]) == 0
    assert json.loads(capsys.readouterr().out) == [g.to_json() for g in groups]


def test_moco_run_says_what_it_left_out_and_the_status_tab_shows_it(tmp_path, backbone, capsys, monkeypatch):
    """`moco run --exclude` with a given model (nothing trained): the excluded folder never read, a format whose
    package is missing here (pillow-heif, made unimportable in this process) counted in its output and its Status."""
    from app.run.pipeline import run_pipeline
    from app.run.status import RunStatus, status_markdown
    from moco.data import photos

    root = _collection_with_a_private_folder(tmp_path / "photos")
    os.chmod(root / "private", 0o755)
    (root / "phone").mkdir()
    for i in range(2):
        (root / "phone" / f"IMG_{i}.heic").write_bytes(b"never read")
    monkeypatch.setattr(photos, "enable_formats", lambda: False)  # as if pillow-heif were not installed
    checkpoint = next(backbone.parent.glob("tv*.pth"))  # the torchvision weights the test backbone came from
    status = RunStatus(tmp_path / "work")
    out = run_pipeline(root, tmp_path / "work", checkpoint=checkpoint, say=print, progress=False, status=status,
                       exclude=("private/**", "*.gif"))
    said = capsys.readouterr().out
    assert "photos: 2 .heic files skipped: " + HEIC in said
    assert "photos: 2 files and folders left out by --exclude, never read" in said
    assert out["summary"].unsupported == {".heic": 2} and out["summary"].vectors == 18
    text = status_markdown(status.snapshot())
    assert "**Not read:** 2 .heic files skipped: " + HEIC in text
    assert "**Excluded:** 2 files and folders" in text
    assert json.loads((out["index"] / "catalog.sqlite").with_name("index.json").read_text())
    assert Catalog(out["index"] / "catalog.sqlite").get_meta("exclude") == '["private/**", "*.gif"]'


@pytest.mark.parametrize("day", ["0001-01-01", "0999-06-30", "1969-12-31", "2024-02-29", "9999-12-31"])
def test_dates_of_every_year_go_both_ways_in_iso_8601(day):
    """The first and the last day a date can have are filters like any other (9999-12-31 included whole), and a
    date taken is written with four-digit years (``0001-01-01T00:00:00``, not ``1-01-01T...``)."""
    import datetime

    start, end = taken_bound(day, False), taken_bound(day, True)
    assert date_text(start) == f"{day}T00:00:00" and end - start == 86400
    assert datetime.datetime.fromisoformat(date_text(start)).date().isoformat() == day
    assert date_text(taken_bound(f"{day}T23:59:58", False)) == f"{day}T23:59:58"
    assert date_text(1e300) is None  # no camera's date: unknown rather than a crash


def test_a_bad_date_is_echoed_in_60_characters_at_most():
    with pytest.raises(UserError) as e:
        taken_bound("2024-13-01" + "z" * 1000, False, "--taken-to")
    assert "--taken-to '2024-13-01zzz" in str(e.value) and len(str(e.value)) < 220


def test_svg_drawings_are_counted_and_said_not_silently_left_out(tmp_path):
    root = tmp_path / "photos"
    (root / "icons").mkdir(parents=True)
    Image.new("RGB", (40, 30), "red").save(root / "a.jpg")
    svg = '<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"><rect width="10" height="10"/></svg>'
    for name in ("icons/logo.svg", "icons/arrow.SVG", "map.svgz"):
        (root / name).write_text(svg)
    (root / "notes.txt").write_text("not a picture at all")
    scan = scan_photos(root)
    assert scan.files == ["a.jpg"] and scan.unsupported == {}
    assert scan.unsupported_counts() == {".svg": 2, ".svgz": 1}
    assert scan.notes() == ["2 .svg files skipped: vector drawings, not photos (export them as PNG to include them)",
                            "1 .svgz file skipped: vector drawings, not photos (export them as PNG to include them)"]
    assert scan_photos(root, exclude=[f"{root}/icons/**"]).unsupported_counts() == {".svgz": 1}  # excluded: unsaid
