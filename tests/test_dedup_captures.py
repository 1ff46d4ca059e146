"""Two captures by their files (index/duplicates/captures.py): pairs whose EXIF dates taken or cameras say they are two
shots are never copies, against a rule written out by hand, and in a real search of a real index: a photo and its
brightened copy are grouped while their files agree or say nothing, and kept apart once they disagree."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image, ImageEnhance

from app.cli.commands import main
from index.building.runner import build_index
from index.catalog import Row
from index.duplicates.captures import APART_S, ZONE_STEP_S, Captures, taken_apart
from index.duplicates.dedup import search_duplicates
from index.search.image_index import ImageIndex
from moco.data.sample import make_sample_collection

EXIF_IFD, DATE_TAKEN, MAKE, MODEL = 0x8769, 0x9003, 0x010F, 0x0110


def _row(i: int, taken: float | None, exif: int | None, camera: str | None) -> Row:
    return Row(id=i, path=f"{i}.jpg", size=1, mtime_ns=0, hash=str(i), status="ok", date=taken, date_exif=exif,
               camera=camera)


def _by_hand(a: Row, b: Row) -> bool:
    if a.date_exif and b.date_exif and a.date is not None and b.date is not None:
        gap = abs(a.date - b.date)
        shifted = any(abs(gap - q * ZONE_STEP_S) < APART_S for q in range(0, 200))
        if gap >= APART_S and not shifted:
            return True
    return bool(a.camera and b.camera and a.camera != b.camera)


def test_pairs_taken_apart_are_those_the_rule_names():
    """Every kind of pair: dates a second or more apart (not whole quarter hours), the same second, a date from the
    file's mtime only, no date, two cameras, one camera missing; and random ones against the rule by hand."""
    t0 = 1_700_000_000.0
    rows = {1: _row(1, t0, 1, "Canon EOS R5"), 2: _row(2, t0, 1, "Canon EOS R5"),  # a copy: the same
            3: _row(3, t0 + 1, 1, "Canon EOS R5"), 4: _row(4, t0 + 3600, 1, "Canon EOS R5"),  # 1 s; a zone's shift
            5: _row(5, t0 + 3601, 1, None), 6: _row(6, t0 + 5, 0, None),  # 1 h 1 s; a file's mtime
            7: _row(7, None, None, None), 8: _row(8, t0, 1, "Pixel 8"), 9: _row(9, t0 + 0.4, 1, None)}
    pairs = np.array([(1, 2), (1, 3), (1, 4), (1, 5), (1, 6), (1, 7), (1, 8), (1, 9), (2, 99)], np.int64)
    got = taken_apart(pairs, rows)
    assert got.tolist() == [False, True, False, True, False, False, True, False, False]
    rng = np.random.default_rng(0)
    cameras = [None, "A", "B"]
    many = {i: _row(i, float(t0 + rng.choice([0, 0.5, 1, 7, 900, 1800.5, 3600, 5400, 86400])), int(rng.integers(0, 2)),
                    cameras[int(rng.integers(0, 3))]) for i in range(1, 60)}
    pairs = np.array([(a, b) for a in range(1, 60) for b in range(a + 1, 60)], np.int64)
    assert taken_apart(pairs, many).tolist() == [_by_hand(many[a], many[b]) for a, b in pairs.tolist()]
    assert taken_apart(np.zeros((0, 2), np.int64), many).shape == (0,)
    table = Captures.of(many)  # the table a search builds once: every pair of two id lists, an unknown id says nothing
    a, b = np.array([3, 1, 59, 999]), np.array([2, 59, 1000, 7, 3])
    want = [[a_ in many and b_ in many and _by_hand(many[a_], many[b_]) for b_ in b.tolist()] for a_ in a.tolist()]
    assert table.apart(a, b).tolist() == want
    assert Captures.of({}).apart(a, b).sum() == 0


def _exif(taken: str | None, camera: tuple[str, str] | None) -> bytes:
    exif = Image.Exif()
    if camera:
        exif[MAKE], exif[MODEL] = camera
    if taken:
        exif.get_ifd(EXIF_IFD)[DATE_TAKEN] = taken
    return exif.tobytes()


@pytest.mark.parametrize("copy_taken, copy_camera, grouped", [
    ("2024:05:06 07:08:09", ("Canon", "EOS R5"), True),  # what an editor keeps
    (None, None, True),  # what a messenger drops: the pixels alone judge
    ("2024:05:06 09:08:09", ("Canon", "EOS R5"), True),  # moved two time zones
    ("2024:05:06 07:08:14", ("Canon", "EOS R5"), False),  # another shot, 5 s later
    ("2024:05:06 07:08:09", ("Apple", "iPhone 15"), False),  # another camera
])
def test_a_copy_is_grouped_unless_its_file_says_it_is_another_shot(backbone, tmp_path, capsys, copy_taken,
                                                                   copy_camera, grouped):
    root = tmp_path / "photos"
    make_sample_collection(root, per_family=2, size=96, seed=3)
    photo = sorted(root.rglob("*.jpg"))[0]
    img = Image.open(photo).convert("RGB")
    img.save(photo, quality=95, exif=_exif("2024:05:06 07:08:09", ("Canon", "EOS R5")))
    ImageEnhance.Brightness(img).enhance(1.2).save(root / "brighter.jpg", quality=95,
                                                   exif=_exif(copy_taken, copy_camera))
    build_index(root, backbone, tmp_path / "idx", progress=False, device="cpu")
    found = search_duplicates(ImageIndex.open(tmp_path / "idx"), save=True)
    together = [g for g in found.groups if {m.path for m in g.members} >= {photo.relative_to(root).as_posix(),
                                                                         "brighter.jpg"}]
    assert bool(together) == grouped, [[m.path for m in g.members] for g in found.groups]
    apart = found.decision["taken_apart"]
    assert (apart >= 1) == (not grouped)
    assert main(["index", "dedup", str(tmp_path / "idx")]) == 0
    out = capsys.readouterr().out
    assert (f"taken apart: {apart} pair" in out) == (not grouped)



def test_after_an_update_new_photos_taken_apart_from_the_old_ones_change_no_group(backbone, tmp_path):
    """Every photo with its own date taken: after an update, the photos from before do not score the new photos their
    files keep apart (the proposals' products skip them); an editor's copy that kept its photo's date and a re-encode
    that dropped it are grouped with their photos, and the groups are those of a search that kept nothing."""
    from index.building.runner import update_index

    root = tmp_path / "photos"
    make_sample_collection(root, per_family=3, size=96, seed=5)
    photos = sorted(root.rglob("*.jpg"))
    for n, p in enumerate(photos):  # a camera's files: a date taken each, a minute apart
        Image.open(p).convert("RGB").save(p, quality=95, exif=_exif(f"2024:05:06 07:{n:02d}:09", ("Canon", "EOS R5")))
    build_index(root, backbone, tmp_path / "idx", progress=False, device="cpu")
    search_duplicates(ImageIndex.open(tmp_path / "idx"), save=True)
    first, second = photos[0], photos[4]
    ImageEnhance.Brightness(Image.open(first).convert("RGB")).enhance(1.15).save(
        root / "edited.jpg", quality=95, exif=Image.open(first).getexif().tobytes())  # an editor keeps the date
    Image.open(second).convert("RGB").save(root / "sent.jpg", quality=60)  # a messenger's re-encode: no metadata
    make_sample_collection(tmp_path / "more", per_family=1, size=96, seed=9)
    for n, p in enumerate(sorted((tmp_path / "more").rglob("*.jpg"))):  # new shots, later
        Image.open(p).convert("RGB").save(root / f"new{n}.jpg", quality=95,
                                          exif=_exif(f"2024:05:07 08:{n:02d}:09", ("Canon", "EOS R5")))
    update_index(tmp_path / "idx", progress=False, device="cpu")
    found = search_duplicates(ImageIndex.open(tmp_path / "idx"), save=False)
    assert found.decision["looked_up"] < found.images  # the photos from before: only against the new ones
    for name in ("dedup-neighbours.bin", "dedup-checked.bin", "dedup-links.bin", "dedup-frames.bin",
                 "dedup-windows.bin", "dedup-flats.bin"):
        (tmp_path / "idx" / name).unlink()
    cold = search_duplicates(ImageIndex.open(tmp_path / "idx"), save=False)
    groups = lambda f: sorted(sorted(m.path for m in g.members) for g in f.groups)  # noqa: E731
    assert groups(found) == groups(cold)
    rel = lambda p: p.relative_to(root).as_posix()  # noqa: E731
    assert any({rel(first), "edited.jpg"} <= set(g) for g in groups(found))
    assert any({rel(second), "sent.jpg"} <= set(g) for g in groups(found))
