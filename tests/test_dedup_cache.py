"""What a search for duplicates keeps between runs (index/duplicates/dedup_cache.py): frames read back equal to frames
made anew, pairs scored before reused only at their photos' versions and settings, files cut short by a kill or of other
settings handled, and a search after an update checking only the pairs of the new photos, with the groups of a
search that kept nothing. Real FAISS, SQLite and a real (randomly initialized) ResNet-18 on generated photos."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageEnhance

from app.cli.commands import main
from index.building.runner import build_index, update_index
from index.duplicates import check_workers, dedup, dedup_cache
from index.duplicates.dedup import load_duplicates, search_duplicates
from index.duplicates.dedup_cache import (
    CHECKED_FILE,
    FLATS_FILE,
    FRAMES_FILE,
    LINKS_FILE,
    NEIGHBOURS_FILE,
    WINDOWS_FILE,
    CheckedPairs,
    FrameFile,
    LinkFile,
    check_settings,
    kept_links,
    kept_neighbours,
)
from index.duplicates.verify import COLOUR_SIDE, COPY_SCORE, SIDE, copy_scores, frame_of
from index.search.image_index import ImageIndex
from moco.data.photos import ImageDecodeError, load_rgb
from moco.errors import UserError


def _pictures(n: int, seed: int = 0) -> dict[int, Image.Image]:
    rng = np.random.default_rng(seed)
    out = {}
    for i in range(n):
        w, h = int(rng.integers(40, 200)), int(rng.integers(40, 200))
        small = rng.integers(0, 256, (max(2, h // 8), max(2, w // 8), 3), dtype=np.uint8)
        out[i] = Image.fromarray(small).resize((w, h), Image.Resampling.BICUBIC)
    return out


def _same(a, b) -> bool:  # noqa: ANN001 - two Frames
    colours = [np.full((2, COLOUR_SIDE, COLOUR_SIDE), 128, np.uint8) if f.colour is None else f.colour for f in (a, b)]
    return (np.array_equal(a.grey, b.grey) and a.aspect == pytest.approx(b.aspect) and a.image.size == b.image.size
            and a.image.tobytes() == b.image.tobytes() and np.array_equal(*colours))


def test_frames_read_back_equal_frames_made_anew_and_only_changed_photos_are_made_again(tmp_path):
    pics = _pictures(12)
    for i, img in pics.items():
        img.save(tmp_path / f"{i}.png")
    photos = {i: (100 + i, tmp_path / f"{i}.png") for i in pics}
    first = FrameFile(tmp_path / FRAMES_FILE).update(photos, lambda i: None)
    assert first.made == 12 and len(first) == 12
    again = FrameFile(tmp_path / FRAMES_FILE).update(photos, lambda i: None)
    assert again.made == 0 and sorted(again) == sorted(pics)
    for i, img in pics.items():
        assert _same(again[i], frame_of(img)), i
    # photo 3 replaced in place (another version), photo 5 gone, photo 20 new
    ImageEnhance.Brightness(pics[3]).enhance(0.5).save(tmp_path / "3.png")
    pics[20] = _pictures(1, seed=9)[0]
    pics[20].save(tmp_path / "20.png")
    changed = {i: p for i, p in photos.items() if i != 5}
    changed |= {3: (999, tmp_path / "3.png"), 20: (120, tmp_path / "20.png")}
    third = FrameFile(tmp_path / FRAMES_FILE).update(changed, lambda i: None)
    assert third.made == 2 and 5 not in third and sorted(third) == sorted(changed)
    assert _same(third[3], frame_of(Image.open(tmp_path / "3.png")))
    assert _same(third[20], frame_of(pics[20]))
    assert third[20].colour is not None and third[20].colour.std() > 0  # the colours are kept with the grey


def test_crop_windows_are_kept_with_the_frames_and_made_once_for_each_version_of_a_photo(tmp_path):
    """FrameFile.windows: a photo's crop windows as crop_windows_of makes them from its frame's image (the same
    numbers), kept in WINDOWS_FILE so that the next search reads them: made again only for a photo replaced in place
    (another version) or new, for a record cut short by a kill, and for all where the file is of other settings.
    FrameFile.flats: the shrunk grey frames of both pixel searches, kept in FLATS_FILE the same way."""
    from index.duplicates.propose import CROP_SIDE, PIXEL_SIDE, crop_windows_of, flats_of

    pics = _pictures(12, seed=3)
    for i, img in pics.items():
        img.save(tmp_path / f"{i}.png")
    photos = {i: (100 + i, tmp_path / f"{i}.png") for i in pics}
    ids = [5, 0, 11, 3, 7]

    def want(frames_: FrameFile, which: list[int]) -> np.ndarray:
        return crop_windows_of([np.asarray(frames_[i].image, np.uint8) for i in which])

    def flats(frames_: FrameFile, which: list[int]) -> bool:  # read or made, as flats_of makes them
        return all(np.array_equal(frames_.flats(which, side), flats_of(frames_.greys(which), side))
                   for side in (PIXEL_SIDE, CROP_SIDE))

    first = FrameFile(tmp_path / FRAMES_FILE).update(photos, lambda i: None)
    assert np.array_equal(first.windows(ids), want(first, ids)) and first.windows_made == len(ids)
    assert np.array_equal(first.windows(ids + [1]), want(first, ids + [1])) and first.windows_made == len(ids) + 1
    assert flats(first, ids) and first.flats_made == len(ids)  # both sides made at once
    again = FrameFile(tmp_path / FRAMES_FILE).update(photos, lambda i: None)
    assert np.array_equal(again.windows(ids + [1]), want(again, ids + [1])) and again.windows_made == 0
    assert flats(again, ids + [1]) and again.flats_made == 1
    ImageEnhance.Brightness(pics[3]).enhance(0.5).save(tmp_path / "3.png")  # replaced in place: another version
    changed = photos | {3: (999, tmp_path / "3.png")}
    third = FrameFile(tmp_path / FRAMES_FILE).update(changed, lambda i: None)
    got = third.windows(ids)
    assert third.windows_made == 1 and np.array_equal(got, want(third, ids))
    assert flats(third, ids) and third.flats_made == 1
    assert not np.array_equal(got[3], want(first, [3])[0])
    path = tmp_path / WINDOWS_FILE
    with open(path, "r+b") as f:  # a kill in the middle of the last record's write (photo 3's)
        f.truncate(path.stat().st_size - 100)
    cut = FrameFile(tmp_path / FRAMES_FILE).update(changed, lambda i: None)
    assert np.array_equal(cut.windows(ids), want(cut, ids)) and cut.windows_made == 1
    path.write_bytes(b"MOCOWIN1" + b"\0" * 40)  # another format's header: started anew
    anew = FrameFile(tmp_path / FRAMES_FILE).update(changed, lambda i: None)
    assert np.array_equal(anew.windows(ids), want(anew, ids)) and anew.windows_made == len(ids)


def test_a_file_of_kept_windows_with_more_stale_records_than_live_ones_is_written_anew(tmp_path, monkeypatch):
    """Photos replaced in place leave their old windows behind: where the stale records outnumber the live ones (by
    more than STALE_SLACK), the windows file is written anew with the live ones, which are still read (not made
    again) and equal what crop_windows_of makes."""
    from index.duplicates.propose import crop_windows_of

    monkeypatch.setattr(dedup_cache, "STALE_SLACK", 0)
    pics = _pictures(12, seed=5)
    for i, img in pics.items():
        img.save(tmp_path / f"{i}.png")
    photos = {i: (100 + i, tmp_path / f"{i}.png") for i in pics}
    ids = list(pics)
    FrameFile(tmp_path / FRAMES_FILE).update(photos, lambda i: None).windows(ids)
    path = tmp_path / WINDOWS_FILE
    record = (path.stat().st_size - 24) // 12
    for i in range(8):  # 8 photos replaced in place: 8 stale records against 4 live ones
        ImageEnhance.Contrast(pics[i]).enhance(0.5).save(tmp_path / f"{i}.png")
    changed = photos | {i: (900 + i, tmp_path / f"{i}.png") for i in range(8)}
    later = FrameFile(tmp_path / FRAMES_FILE).update(changed, lambda i: None)
    got = later.windows([11, 9, 10, 8])  # the live ones: read from the file written anew
    assert later.windows_made == 0 and path.stat().st_size == 24 + 4 * record
    assert np.array_equal(got, crop_windows_of([np.asarray(later[i].image, np.uint8) for i in [11, 9, 10, 8]]))
    assert np.array_equal(later.windows(ids), crop_windows_of([np.asarray(later[i].image, np.uint8) for i in ids]))
    assert later.windows_made == 8 and path.stat().st_size == 24 + 12 * record


def test_frames_made_in_worker_processes_are_this_process_s_in_the_same_file(tmp_path, monkeypatch):
    """Frames made by two worker processes, a batch at a time, are the frames this process makes, appended in the
    same order: thumbnails where given, the photo's file where not (or where the thumbnail is unreadable), none for a
    photo that cannot be read; each photo counted once as the photos are done."""
    monkeypatch.setattr(dedup_cache, "FRAMES_IN_WORKERS", 1)
    pics = _pictures(30, seed=4)
    (tmp_path / "thumbs").mkdir()
    for i, img in pics.items():
        img.save(tmp_path / f"{i}.png")
        if i % 3 == 0:  # a thumbnail for some, as the index keeps them
            img.convert("RGB").save(tmp_path / "thumbs" / f"{i}.jpg", quality=90)
    (tmp_path / "thumbs" / "6.jpg").write_bytes(b"not a jpeg")  # unreadable: the photo is decoded instead
    (tmp_path / "7.png").write_bytes(b"not a png")  # no frame at all
    photos = {i: (i, tmp_path / "thumbs" / f"{i}.jpg" if i % 3 == 0 else None) for i in pics}

    def decode(i: int) -> Image.Image | None:  # this process's way to the photo's file (as the search's own)
        try:
            return load_rgb(tmp_path / f"{i}.png", min_short=2 * SIDE)
        except ImageDecodeError:
            return None

    made, steps = {}, {}
    for workers in (0, 2):
        counted: list[int] = []
        made[workers] = FrameFile(tmp_path / f"frames{workers}.bin").update(
            photos, decode, counted.append, batch=4,
            originals=lambda i: tmp_path / f"{i}.png", workers=workers)
        steps[workers] = sum(counted)
    assert steps[0] == steps[2] == len(pics)
    assert sorted(made[0]) == sorted(made[2]) == sorted(set(pics) - {7}) and made[2].made == len(pics) - 1
    for i in made[0]:
        assert _same(made[0][i], made[2][i]), i
    assert _same(made[2][6], frame_of(pics[6])) and _same(made[2][4], frame_of(pics[4]))
    assert (tmp_path / "frames0.bin").read_bytes() == (tmp_path / "frames2.bin").read_bytes()


def test_a_frame_file_cut_short_or_of_other_settings_is_read_as_far_as_it_is_whole(tmp_path):
    pics = _pictures(4)
    for i, img in pics.items():
        img.save(tmp_path / f"{i}.png")
    photos = {i: (7, tmp_path / f"{i}.png") for i in pics}
    FrameFile(tmp_path / FRAMES_FILE).update(photos, lambda i: None)
    path = tmp_path / FRAMES_FILE
    size = path.stat().st_size
    with open(path, "r+b") as f:  # a kill in the middle of the last record's write
        f.truncate(size - 1000)
    cut = FrameFile(path).update(photos, lambda i: None)
    assert cut.made == 1 and path.stat().st_size == size  # the torn record dropped, the photo made again
    assert all(_same(cut[i], frame_of(pics[i])) for i in pics)
    path.write_bytes(b"MOCOFRM1" + b"\0" * 40)  # another format's header: started anew
    assert FrameFile(path).update(photos, lambda i: None).made == 4
    path.write_bytes(b"not ours at all")
    assert FrameFile(path).update(photos, lambda i: None).made == 4


def test_a_read_only_folder_keeps_frames_in_memory(tmp_path):
    pics = _pictures(3)
    for i, img in pics.items():
        img.save(tmp_path / f"{i}.png")
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        got = FrameFile(folder / FRAMES_FILE).update({i: (1, tmp_path / f"{i}.png") for i in pics}, lambda i: None)
        assert sorted(got) == [0, 1, 2] and _same(got[1], frame_of(pics[1]))
    finally:
        folder.chmod(0o700)


def test_scored_pairs_are_reused_only_at_their_photos_versions(tmp_path, monkeypatch):
    versions = {1: 11, 2: 22, 3: 33, 4: 44}
    first = CheckedPairs(tmp_path / CHECKED_FILE, versions)
    assert len(first) == 0
    first.add({(1, 2): 0.5, (1, 3): 0.999, (2, 4): 0.25})
    pairs = np.array([[1, 2], [1, 3], [2, 3], [2, 4]])
    hit, score = CheckedPairs(tmp_path / CHECKED_FILE, versions).known(pairs)
    assert hit.tolist() == [True, True, False, True] and score[[0, 1, 3]].tolist() == [0.5, 0.999, 0.25]
    hit, _ = CheckedPairs(tmp_path / CHECKED_FILE, versions | {3: 34}).known(pairs)  # photo 3 replaced
    assert hit.tolist() == [True, False, False, True]
    hit, _ = CheckedPairs(tmp_path / CHECKED_FILE, {1: 11, 2: 22}).known(pairs)  # photos 3 and 4 gone
    assert hit.tolist() == [True, False, False, False]
    monkeypatch.setattr("index.duplicates.verify.COPY_SCORE", 0.99)  # the check's settings changed: nothing is reused
    assert check_settings() != 0 and not CheckedPairs(tmp_path / CHECKED_FILE, versions).known(pairs)[0].any()


def _collection(root: Path, n: int, seed: int) -> None:
    """``n`` smooth pictures, and for every fourth a brightened copy and a 90% crop."""
    root.mkdir(parents=True, exist_ok=True)
    for i, img in _pictures(n, seed).items():
        img.save(root / f"p{seed}_{i}.png")
        if i % 4 == 0:
            ImageEnhance.Brightness(img).enhance(1.2).save(root / f"p{seed}_{i}_bright.png")
            w, h = img.size
            img.crop((w // 20, h // 20, w - w // 20, h - h // 20)).save(root / f"p{seed}_{i}_crop.png")


def test_a_search_after_an_update_checks_only_the_pairs_of_the_new_photos(backbone, tmp_path, capsys):
    """The second search of an unchanged index checks no pair and looks up no photo's proposals or links again; after
    photos were added, it checks only pairs that hold a new photo (or the model's new links among the others), looks
    up only the new photos among all (the others among the new ones), searches only the new photos' links, and its
    links, proposals and groups are those of a search that kept nothing (the files deleted); after photos were
    deleted, only the photos that had one of them among their neighbours are looked up again, with the neighbours of a
    search anew."""
    photos = tmp_path / "photos"
    _collection(photos, 40, seed=1)
    build_index(photos, backbone, tmp_path / "idx", progress=False)
    idx = ImageIndex.open(tmp_path / "idx")
    first = search_duplicates(idx, save=False)
    d = first.decision
    assert d["reused"] == 0 and d["checked"] == d["proposed"] > 0 and d["frames_made"] == d["windows_made"] == len(idx)
    assert (tmp_path / "idx" / FRAMES_FILE).exists() and (tmp_path / "idx" / CHECKED_FILE).exists()
    kept_first = _neighbours(tmp_path / "idx")
    second = search_duplicates(ImageIndex.open(tmp_path / "idx"), save=False)
    assert second.decision["checked"] == second.decision["frames_made"] == second.decision["windows_made"] == 0
    assert [g.id for g in second.groups] == [g.id for g in first.groups]
    assert sum(g.kind == "near" for g in first.groups) >= 5  # the copies were found

    assert second.decision["looked_up"] == 0 and first.decision["looked_up"] == len(idx)
    assert second.decision["linked"] == 0 and first.decision["linked"] == len(idx)
    assert _neighbours(tmp_path / "idx") == kept_first
    links_first = kept_links(tmp_path / "idx" / LINKS_FILE)
    assert links_first and min(links_first.values()) >= first.decision["threshold"] - dedup.LINK_MARGIN - 1e-6

    before = {r.id for r in ImageIndex.open(tmp_path / "idx").catalog.rows_by_id(
        ImageIndex.open(tmp_path / "idx").catalog.vectors(dim=idx.dim)[0]).values()}
    _collection(photos, 8, seed=2)
    Image.open(photos / "p1_3.png").save(photos / "p1_3_again.jpg", quality=90)  # linked to a photo searched before
    update_index(tmp_path / "idx", progress=False)
    idx = ImageIndex.open(tmp_path / "idx")
    assert main(["index", "dedup", str(tmp_path / "idx")]) == 0  # as a user does it
    third = load_duplicates(tmp_path / "idx")
    d = third.decision
    assert (f"({len(idx) - len(before)} photos looked up among all, the others only among the photos new since "
            "the last search)") in capsys.readouterr().out
    assert 0 < d["checked"] < d["proposed"] // 2 and d["frames_made"] == d["windows_made"] == len(idx) - len(before)
    assert d["looked_up"] == len(idx) - len(before)  # the new photos; the others only among them
    assert d["linked"] == len(idx) - len(before)  # the new photos' links: the others' are kept
    incremental, links = _neighbours(tmp_path / "idx"), kept_links(tmp_path / "idx" / LINKS_FILE)
    assert set(links_first) < set(links)  # the new photos' links were added to the kept ones
    for name in (FRAMES_FILE, WINDOWS_FILE, FLATS_FILE, CHECKED_FILE, NEIGHBOURS_FILE, LINKS_FILE):
        (tmp_path / "idx" / name).unlink()
    fresh = search_duplicates(ImageIndex.open(tmp_path / "idx"), save=False)
    assert fresh.decision["reused"] == 0 and fresh.decision["looked_up"] == fresh.decision["linked"] == len(idx)
    assert incremental == _neighbours(tmp_path / "idx")  # each photo's, by each search: those of a search anew
    fresh_links = kept_links(tmp_path / "idx" / LINKS_FILE)  # the model's links: those of a search anew
    assert set(fresh_links) == set(links)
    assert np.allclose([fresh_links[q] for q in links], list(links.values()), atol=1e-5)
    assert fresh.decision["proposed"] == d["proposed"]
    assert [g.id for g in third.groups] == [g.id for g in fresh.groups]
    new_ids = {m.id for g in fresh.groups for m in g.members} - before
    assert new_ids  # the new photos' copies are grouped

    # photos deleted: the photos that had one of them among their neighbours are looked up among all again
    gone = sorted(photos.glob("p1_*.png"))[:6]
    for path in gone:
        path.unlink()
    update_index(tmp_path / "idx", progress=False)
    after = search_duplicates(ImageIndex.open(tmp_path / "idx"), save=False)
    assert 0 < after.decision["looked_up"] < len(ImageIndex.open(tmp_path / "idx"))
    incremental = _neighbours(tmp_path / "idx")
    (tmp_path / "idx" / NEIGHBOURS_FILE).unlink()
    search_duplicates(ImageIndex.open(tmp_path / "idx"), save=False)
    assert incremental == _neighbours(tmp_path / "idx")


def _neighbours(index_dir: Path) -> dict[tuple[int, int], list[int]]:
    """Each photo's neighbours by each search, as the neighbours file holds them: ``{(id, search): [ids]}``."""
    kept = kept_neighbours(index_dir / NEIGHBOURS_FILE)
    return {(i, s): [j for j in kept.near[n, s].tolist() if j >= 0]
            for n, i in enumerate(kept.ids.tolist()) for s in range(kept.near.shape[1])}


def test_the_kept_scores_are_the_check_s_own(tmp_path):
    """What a search reads back is what copy_scores gives the pair."""
    pics = _pictures(6, seed=3)
    frames_ = {i: frame_of(img) for i, img in pics.items()}
    scores = copy_scores([(0, 1), (2, 5), (3, 4)], frames_)
    CheckedPairs(tmp_path / CHECKED_FILE, {i: 1 for i in pics}).add(scores)
    hit, got = CheckedPairs(tmp_path / CHECKED_FILE, {i: 1 for i in pics}).known(np.array(list(scores)))
    assert hit.all() and got.tolist() == list(scores.values())


def test_kept_scores_reads_a_file_of_other_settings_and_leaves_it_as_it_was(tmp_path, monkeypatch):
    """A bench reading a search's scored pairs after the check's settings changed (kept_scores) gets them all and
    leaves the file as it was (it used to open it as a search does, which starts a file of other settings anew)."""
    import index.duplicates.verify as verify
    from index.duplicates.dedup_cache import kept_scores

    pics = _pictures(6, seed=3)
    frames_ = {i: frame_of(img) for i, img in pics.items()}
    scores = copy_scores([(0, 1), (2, 5), (3, 4)], frames_)
    CheckedPairs(tmp_path / CHECKED_FILE, {i: 1 for i in pics}).add(scores)
    before = (tmp_path / CHECKED_FILE).read_bytes()
    monkeypatch.setattr(verify, "COPY_SCORE", verify.COPY_SCORE - 0.001)  # other settings now
    pairs, got = kept_scores(tmp_path / CHECKED_FILE)
    assert [tuple(p) for p in pairs.tolist()] == list(scores) and got.tolist() == list(scores.values())
    assert (tmp_path / CHECKED_FILE).read_bytes() == before


def test_a_search_killed_in_the_pixel_check_goes_on_from_where_it_stopped(backbone, tmp_path):
    """SIGKILL after the pixel check's first block of pairs: the next search reuses that block's scores and checks
    only the rest, with the groups of an uninterrupted search."""
    from tests.live import killed_after_first

    photos = tmp_path / "photos"
    _collection(photos, 40, seed=4)
    build_index(photos, backbone, tmp_path / "idx", progress=False)
    killed_after_first("index.duplicates.dedup", "CheckedPairs.add", "m.PART = 16",
                       "from index.search.image_index import ImageIndex\n"
                       "m.search_duplicates(ImageIndex.open(sys.argv[1]))",
                       str(tmp_path / "idx"))
    again = search_duplicates(ImageIndex.open(tmp_path / "idx"), save=False)
    assert again.decision["reused"] == 16 and again.decision["checked"] == again.decision["proposed"] - 16
    shutil.move(tmp_path / "idx" / CHECKED_FILE, tmp_path / "kept")
    whole = search_duplicates(ImageIndex.open(tmp_path / "idx"), save=False)
    assert [g.id for g in again.groups] == [g.id for g in whole.groups]
    assert dedup.PART == check_workers.PART  # the subprocess's setting stayed there


def test_the_pixel_check_bench_scores_kept_pairs_again_and_agrees_with_itself(tmp_path, capsys):
    """bench/pixel_check_ab.py on a folder of kept work (frames and scored pairs written here), this tree as its
    own peer: every pair scored again, the kept scores found again, no pair changing side."""
    from bench.pixel_check_ab import main

    pics = _pictures(10, seed=4)
    pics[10] = ImageEnhance.Brightness(pics[0]).enhance(1.15)  # a copy: one pair a copy, the rest not
    for i, img in pics.items():
        img.save(tmp_path / f"{i}.png")
    versions = {i: 7 for i in pics}
    frames = FrameFile(tmp_path / FRAMES_FILE).update({i: (7, tmp_path / f"{i}.png") for i in pics}, lambda i: None)
    pairs = [(a, b) for a in range(11) for b in range(a + 1, 11) if (a + b) % 3 == 0 or (a, b) == (0, 10)]
    kept = copy_scores(pairs, frames)
    CheckedPairs(tmp_path / CHECKED_FILE, versions).add(kept)
    out = main(["--index", str(tmp_path), "--peer", str(Path(__file__).resolve().parents[1]), "--rounds", "1"])
    assert out["pairs"] == len(pairs) and out["changed_side"] == 0 and out["max_score_difference"] == 0.0
    assert out["copies"]["this"] == sum(s >= 0.995 for s in kept.values()) >= 1
    assert "changed side" in capsys.readouterr().out


def test_the_pixel_check_in_worker_processes_scores_as_this_process_does(tmp_path):
    """Pairs scored by two spawned workers that read the frames file themselves: the scores copy_scores gives in this
    process, in the pairs' order, NaN for a photo without a frame."""
    pics = _pictures(12, seed=5)
    pics[12] = ImageEnhance.Brightness(pics[3]).enhance(1.15)  # a copy
    pics[13] = pics[5].transpose(Image.Transpose.FLIP_LEFT_RIGHT)  # another
    for i, img in pics.items():
        img.save(tmp_path / f"{i}.png")
    frames_ = FrameFile(tmp_path / FRAMES_FILE).update({i: (7, tmp_path / f"{i}.png") for i in pics}, lambda i: None)
    pairs = np.array([(a, b) for a in range(14) for b in range(a + 1, 15)], np.int64)  # 14: no such photo
    parts = [pairs[s : s + 9] for s in range(0, len(pairs), 9)]
    got = list(check_workers.checked_parts(iter(parts), frames_, workers=2))
    assert [p.tolist() for p, _ in got] == [p.tolist() for p in parts]  # in order
    scores = np.concatenate([s for _, s in got])
    want = {}  # in this process, from the same frames, part by part (the same products: the same roundings)
    for part in parts:
        want.update(copy_scores([tuple(p) for p in part.tolist()], frames_))
    assert np.isnan(scores[pairs[:, 1] == 14]).all()
    assert scores[pairs[:, 1] != 14].tolist() == [want[a, b] for a, b in pairs.tolist() if b != 14]
    whole = copy_scores([tuple(p) for p in pairs.tolist()], frames_)  # all at once: other products, float32 sums
    assert scores[pairs[:, 1] != 14] == pytest.approx([whole[a, b] for a, b in pairs.tolist() if b != 14], abs=1e-5)
    assert sum(s >= COPY_SCORE for s in want.values()) >= 2  # the copies are among them


def test_a_search_with_pixel_check_workers_finds_what_one_process_finds(backbone, tmp_path):
    photos = tmp_path / "photos"
    _collection(photos, 40, seed=6)
    build_index(photos, backbone, tmp_path / "idx", progress=False)
    alone = search_duplicates(ImageIndex.open(tmp_path / "idx"), save=False, workers=0)
    for name in (FRAMES_FILE, CHECKED_FILE):
        (tmp_path / "idx" / name).unlink()
    two = search_duplicates(ImageIndex.open(tmp_path / "idx"), save=False, workers=2)
    assert two.decision["checked"] == alone.decision["checked"] > 0 and two.decision["reused"] == 0
    assert [(g.id, g.keep) for g in two.groups] == [(g.id, g.keep) for g in alone.groups]
    assert [g.id for g in alone.groups]
    with pytest.raises(UserError, match="--workers -1"):
        search_duplicates(ImageIndex.open(tmp_path / "idx"), save=False, workers=-1)


SEARCH_SCRIPT = """from index.duplicates.dedup import search_duplicates
from index.search.image_index import ImageIndex

{call}
"""


@pytest.mark.parametrize("guarded", [False, True])
def test_a_search_script_without_a_main_guard_gets_one_clear_error(backbone, tmp_path, guarded):
    """A library user's script that searches at its top level: each pixel-check worker (spawned) imports it again.
    Unguarded: one error naming the pitfall and the fix, not a broken pool's tracebacks; guarded: it searches."""
    photos = tmp_path / "photos"
    _collection(photos, 12, seed=7)
    build_index(photos, backbone, tmp_path / "idx", progress=False)
    search = f"print(len(search_duplicates(ImageIndex.open({str(tmp_path / 'idx')!r}), workers=2).groups), 'groups')"
    script = tmp_path / "find_mine.py"
    script.write_text(SEARCH_SCRIPT.format(call=f'if __name__ == "__main__":\n    {search}' if guarded else search))
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    if guarded:
        assert proc.returncode == 0 and " groups" in proc.stdout, proc.stderr[-3000:]
        return
    assert proc.returncode == 1 and proc.stderr.count("Traceback") == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("moco.errors.UserError: ") and str(script) in last and "workers=0" in last, last
    assert 'if __name__ == "__main__":' in last and "groups" not in proc.stdout


def test_kept_links_hold_the_photos_as_they_were_and_a_lower_threshold_or_other_space_searches_anew(tmp_path):
    """The model's kept links: a photo replaced since (another version) is left out with its links, a search at a
    threshold under the floor they were found at gets none (it would lack links), and a file of another space is
    started anew."""
    path = tmp_path / LINKS_FILE
    links = {1: {2: 0.9}, 2: {1: 0.9, 3: 0.85}, 3: {2: 0.85}}
    LinkFile(path, "space").save(0.8, [1, 2, 3, 4], {1: 10, 2: 20, 3: 30, 4: 40}, links)
    kept = LinkFile(path, "space").load({1: 10, 2: 20, 3: 30, 4: 40}, 0.82)
    assert kept.floor == pytest.approx(0.8) and kept.photos.tolist() == [1, 2, 3, 4]
    assert kept.pairs.tolist() == [[1, 2], [2, 3]] and np.allclose(kept.cosines, [0.9, 0.85])
    kept = LinkFile(path, "space").load({1: 10, 2: 21, 3: 30, 4: 40}, 0.82)  # 2 replaced in place
    assert kept.photos.tolist() == [1, 3, 4] and kept.pairs.tolist() == []
    assert LinkFile(path, "space").load({1: 10, 2: 20, 3: 30, 4: 40}, 0.79) is None
    assert LinkFile(path, "another space").load({1: 10, 2: 20, 3: 30, 4: 40}, 0.82) is None
    assert kept_links(path) == {}  # started anew


@pytest.mark.parametrize("deep", [None, 20])
def test_the_model_links_are_those_of_a_brute_force_range_search_crowded_photos_too(backbone, tmp_path, monkeypatch,
                                                                                    deep):
    """The model's links come from each photo's closest photos, a deeper search of the photos whose last closest is
    still a link, and a range search of those whose last is a link there too: at a threshold where half the photos
    have more links than that, the links are every pair at it or more, as numpy finds them over all pairs (``deep``:
    a depth that some photos' links outnumber, so that they are range-searched); a second search takes them from the
    index folder, searching none."""
    if deep is not None:
        monkeypatch.setattr(dedup, "WIDE_DEPTH", deep)
    _collection(tmp_path / "photos", 40, seed=4)
    build_index(tmp_path / "photos", backbone, tmp_path / "idx", progress=False)
    idx = ImageIndex.open(tmp_path / "idx")
    ids, raw = idx.catalog.vectors(dim=idx.dim)
    vecs = dedup._centred(idx, raw)
    versions = {i: dedup._version(r) for i, r in idx.catalog.rows_by_id(ids).items()}
    cos = vecs @ vecs.T  # N x N
    np.fill_diagonal(cos, -np.inf)
    threshold = float(np.median(np.sort(cos, axis=1)[:, -(dedup.MODEL_DEPTH + 4)]))  # half have more links
    links, searched, found = dedup._model_links(idx, ids, vecs, threshold, 16, versions, False)
    want = {(int(ids[a]), int(ids[b])) for a, b in zip(*np.nonzero(cos >= threshold)) if a < b}
    got = {(a, b) for a, nb in links.items() for b in nb if a < b}
    near_edge = {(int(ids[a]), int(ids[b])) for a, b in zip(*np.nonzero(np.abs(cos - threshold) < 1e-5)) if a < b}
    assert got - near_edge == want - near_edge and len(want) > dedup.MODEL_DEPTH * len(ids) // 2
    most = int((cos >= threshold).sum(axis=1).max())
    assert most >= dedup.WIDE_DEPTH if deep else most < dedup.WIDE_DEPTH  # range-searched photos, or none
    assert searched == len(ids) and found.ids.tolist() == ids.tolist()
    sims, near = idx.store.search(vecs, dedup.MODEL_DEPTH)  # the proposals' own search
    assert np.array_equal(found.near, near) and np.allclose(found.sims, sims)
    again, searched, _ = dedup._model_links(idx, ids, vecs, threshold + 0.01, 16, versions, False)
    assert searched == 0
    assert {(a, b) for a, nb in again.items() for b in nb if a < b} == {
        q for q in got if cos[list(ids).index(q[0]), list(ids).index(q[1])] >= threshold + 0.01}


def test_the_check_s_processes_are_chosen_for_the_pairs_it_will_check(backbone, tmp_path, monkeypatch):
    """After photos were deleted and as many added, the kept scores hold about as many pairs as the search proposes,
    yet the pairs of the new photos are still to check: the number the search weighs its worker processes by is
    the number of pairs it checks (not the proposals less the kept file's length, which said none and left a
    search of 115,000 new pairs on one core)."""
    photos = tmp_path / "photos"
    _collection(photos, 40, seed=4)
    build_index(photos, backbone, tmp_path / "idx", progress=False)
    search_duplicates(ImageIndex.open(tmp_path / "idx"), save=False)
    for path in sorted(photos.glob("p4_*"))[:12]:
        path.unlink()
    _collection(photos, 10, seed=5)
    update_index(tmp_path / "idx", progress=False)
    weighed: list[int] = []
    monkeypatch.setattr(dedup, "check_workers", lambda pairs: weighed.append(pairs) or 0)
    again = search_duplicates(ImageIndex.open(tmp_path / "idx"), save=False)
    assert weighed == [again.decision["checked"]] and again.decision["checked"] > 0
    assert again.decision["reused"] > 0
