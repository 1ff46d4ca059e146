"""Issue 12: nothing a user's disk can hold stops or poisons the index (lost index.json, failed writes, mixed files)."""

from __future__ import annotations

import errno
import json
import shutil
import sqlite3
from pathlib import Path

import faiss
import numpy as np
import pytest
from PIL import Image

from app.cli.commands import main
from index.search.image_index import ImageIndex
from index.search.store import VectorStore
from moco.data.sample import make_sample_collection
from moco.errors import UserError


def _photos(root: Path, seed: int) -> Path:
    make_sample_collection(root, per_family=3, size=48, seed=seed)  # 18 photos
    return root


@pytest.fixture()
def photos(tmp_path) -> Path:
    return _photos(tmp_path / "photos", seed=3)


def _build(photos: Path, backbone: Path, out: Path) -> int:
    return main(["index", "build", str(photos), "--backbone", str(backbone), "-o", str(out), "--quiet"])


def _update(out: Path) -> int:
    return main(["index", "update", str(out), "--quiet"])


def _rows(out: Path) -> dict[str, tuple[int, str, str | None, str | None, bytes | None]]:
    """path -> (id, status, error, thumb, vector bytes), straight from the SQLite file."""
    db = sqlite3.connect(out / "catalog.sqlite")
    rows = db.execute("SELECT i.path, i.id, i.status, i.error, i.thumb, v.vector FROM images i "
                      "LEFT JOIN vectors v ON v.id = i.id WHERE i.deleted = 0").fetchall()
    db.close()
    return {p: (i, s, e, t, v) for p, i, s, e, t, v in rows}


def _faiss_ids(out: Path) -> set[int]:
    index = faiss.read_index(str(out / "index.faiss"))  # owns the memory the downcast view reads
    return set(faiss.vector_to_array(faiss.downcast_index(index).id_map).tolist())


def _finds_itself(out: Path) -> None:
    """Every photo's stored vector finds that photo at rank 1, with score 1."""
    idx = ImageIndex.open(out)
    ids, vecs = idx.catalog.vectors()
    hits = idx.search(vecs, k=1)
    np.testing.assert_array_equal(hits.ids[:, 0], ids)
    np.testing.assert_allclose(hits.scores[:, 0], 1.0, atol=1e-4)
    assert _faiss_ids(out) == set(ids.tolist())


def _add_photos(photos: Path, tmp_path: Path, seed: int = 7) -> set[str]:
    """Six new photos under ``photos/new``; their catalog paths."""
    make_sample_collection(tmp_path / f"extra{seed}", per_family=1, size=48, seed=seed)
    shutil.move(tmp_path / f"extra{seed}", photos / "new")
    return {p.relative_to(photos).as_posix() for p in (photos / "new").rglob("*") if p.is_file()}


# ------------------------------------------------------------------------- point 2: index.json lost
@pytest.mark.parametrize("command", ["build", "update"])
def test_lost_index_json_is_recovered_from_the_catalog(photos, backbone, tmp_path, capsys, command):
    out = tmp_path / "idx"
    assert _build(photos, backbone, out) == 0
    before = _rows(out)
    (out / "index.json").unlink()  # a first build killed between the two writes, or the file lost
    with pytest.raises(UserError, match=r"index.json is missing: `moco index update .*` rewrites it"):
        ImageIndex.open(out)
    capsys.readouterr()
    assert (_build(photos, backbone, out) if command == "build" else _update(out)) == 0
    assert "index.json is missing" in capsys.readouterr().err  # said what happened
    assert _rows(out) == before  # same ids and vectors: nothing re-embedded
    _finds_itself(out)


def test_build_without_catalog_replaces_a_stale_index_faiss(photos, backbone, tmp_path, capsys):
    out = tmp_path / "idx"
    assert _build(photos, backbone, out) == 0
    (out / "catalog.sqlite").unlink()
    (out / "index.json").unlink()
    capsys.readouterr()
    assert _build(photos, backbone, out) == 0
    assert "no catalog.sqlite" in capsys.readouterr().err
    _finds_itself(out)


# ------------------------------------------------------------------- point 3: failed writes of ours
def test_update_recreates_a_missing_thumbs_folder(photos, backbone, tmp_path):
    out = tmp_path / "idx"
    assert _build(photos, backbone, out) == 0
    shutil.rmtree(out / "thumbs")
    new = _add_photos(photos, tmp_path)
    assert _update(out) == 0
    rows = _rows(out)
    assert all(rows[p][1] == "ok" for p in new) and all(r[1] == "ok" for r in rows.values())
    for _, _, _, thumb, _ in rows.values():  # old thumbnails are made again too
        with Image.open(out / thumb) as im:
            assert max(im.size) <= 256
    _finds_itself(out)


def test_a_failed_thumbnail_write_stops_the_run_and_marks_no_photo_bad(photos, backbone, tmp_path, capsys):
    out = tmp_path / "idx"
    assert _build(photos, backbone, out) == 0
    before = _rows(out)
    shutil.rmtree(out / "thumbs")
    (out / "thumbs").write_text("a file where the thumbnails folder belongs")  # every thumbnail write fails
    new = _add_photos(photos, tmp_path)
    capsys.readouterr()
    assert _update(out) != 0
    err = capsys.readouterr().err
    assert str(out / "thumbs") in err and "run the same command" in err and "nothing saved before" in err
    rows = _rows(out)
    assert all(r[1] == "ok" for r in rows.values())  # no photo marked bad for a failure of ours
    assert rows == before  # the failed round was not committed: those photos are still to do
    (out / "thumbs").unlink()
    assert _update(out) == 0
    rows = _rows(out)
    assert new <= set(rows) and all(r[1] == "ok" and (out / r[3]).is_file() for r in rows.values())
    _finds_itself(out)


def test_update_remakes_a_deleted_thumbnail_without_re_embedding(photos, backbone, tmp_path):
    out = tmp_path / "idx"
    assert _build(photos, backbone, out) == 0
    before = _rows(out)
    path, (_, _, _, thumb, _) = sorted(before.items())[4]
    original = np.asarray(Image.open(out / thumb))
    (out / thumb).unlink()
    assert _update(out) == 0
    assert _rows(out) == before
    np.testing.assert_array_equal(np.asarray(Image.open(out / thumb)), original)


def test_old_error_rows_of_our_own_failures_are_retried(photos, backbone, tmp_path, capsys):
    out = tmp_path / "idx"
    (photos / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    assert _build(photos, backbone, out) == 0
    before = _rows(out)
    victim = sorted(p for p in before if p != "broken.jpg")[2]
    db = sqlite3.connect(out / "catalog.sqlite")  # what an older version wrote when thumbs/ was missing
    old_reason = f"FileNotFoundError: [Errno 2] No such file or directory: '{out}/thumbs/.3.jpg.77.tmp'"
    db.execute("UPDATE images SET status='error', thumb=NULL, indexed=0, error=? WHERE path=?", (old_reason, victim))
    db.execute("DELETE FROM vectors WHERE id=?", (before[victim][0],))
    db.commit()
    db.close()
    assert main(["index", "update", str(out), "--quiet", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["reembedded"] == 1 and [e["path"] for e in summary["errors"]] == ["broken.jpg"]
    rows = _rows(out)
    assert rows[victim][:2] == before[victim][:2] and rows[victim][1] == "ok"
    np.testing.assert_allclose(np.frombuffer(rows[victim][4], np.float32),
                               np.frombuffer(before[victim][4], np.float32), atol=1e-5)
    assert rows["broken.jpg"] == before["broken.jpg"]  # a photo that does not decode stays an error
    _finds_itself(out)


@pytest.mark.parametrize(("reason", "ours"), [
    ("FileNotFoundError: [Errno 2] No such file or directory: 'idx/thumbs/.3.jpg.1.tmp'", True),
    ("OSError: [Errno 28] No space left on device", True),
    ("[Errno 28] No space left on device", True),
    ("PermissionError: [Errno 13] Permission denied: 'idx/thumbs/4.jpg'", True),
    ("truncated or corrupt: image file is truncated", False),
    ("not an image (cannot identify format)", False),
    ("empty file (0 bytes)", False),
    ("unreadable: Permission denied", False),
    ("decompression bomb: 12000 x 8000 pixels exceeds limit 89478485", False),
    (None, False),
])
def test_which_error_reasons_are_ours(reason, ours):
    from index.building.prepare import is_our_failure

    assert is_our_failure(reason) is ours


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.ENOTDIR])
def test_write_failure_messages_name_the_path_and_the_fix(tmp_path, code):
    from index.building.prepare import write_failed

    err = write_failed(OSError(code, "boom"), tmp_path / "thumbs" / "3.jpg")
    assert isinstance(err, UserError) and str(tmp_path / "thumbs" / "3.jpg") in str(err)
    assert "run the same command" in str(err) and "nothing saved before this point is lost" in str(err)
    if code == errno.ENOSPC:
        assert str(err).startswith(f"no space left on device while writing {tmp_path / 'thumbs' / '3.jpg'}: free")


# ------------------------------------------------------------------ point 6: files of another index
@pytest.mark.parametrize("kind", ["flat", "ivf", "hnsw", "ivfpq"])
def test_index_id_trailer_is_ignored_by_faiss(tmp_path, kind):
    from index.search.trailer import read_index_id

    rng = np.random.default_rng(0)
    vecs = rng.standard_normal((2000, 16)).astype(np.float32)
    vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
    store = VectorStore.create(kind, 16, len(vecs), use_gpu="no")
    store.train(vecs)
    store.add(np.arange(len(vecs)) * 3, vecs)
    store.save(tmp_path / "plain.faiss")
    store.save(tmp_path / "tagged.faiss", index_id="0123456789abcdef0123456789abcdef")
    plain, tagged = (tmp_path / "plain.faiss").read_bytes(), (tmp_path / "tagged.faiss").read_bytes()
    assert tagged[: len(plain)] == plain and len(tagged) > len(plain)
    assert read_index_id(tmp_path / "tagged.faiss") == "0123456789abcdef0123456789abcdef"
    assert read_index_id(tmp_path / "plain.faiss") is None
    a, b = faiss.read_index(str(tmp_path / "plain.faiss")), faiss.read_index(str(tmp_path / "tagged.faiss"))
    assert a.ntotal == b.ntotal == len(vecs)
    for index in (a, b):
        if kind != "flat":
            faiss.ParameterSpace().set_index_parameter(index, "nprobe" if kind != "hnsw" else "efSearch", 8)
    sa, ia = a.search(vecs[:50], 10)
    sb, ib = b.search(vecs[:50], 10)
    np.testing.assert_array_equal(ia, ib)
    np.testing.assert_array_equal(sa, sb)


@pytest.fixture()
def two_indexes(backbone, tmp_path) -> tuple[Path, Path]:
    a, b = tmp_path / "idx_a", tmp_path / "idx_b"
    assert _build(_photos(tmp_path / "photos_a", seed=1), backbone, a) == 0
    assert _build(_photos(tmp_path / "photos_b", seed=2), backbone, b) == 0
    return a, b


def _ids(out: Path) -> tuple[str | None, str | None, str | None]:
    """The index id in catalog.sqlite, index.json and index.faiss."""
    from index.search.trailer import read_index_id

    db = sqlite3.connect(out / "catalog.sqlite")
    got = db.execute("SELECT value FROM meta WHERE key='index_id'").fetchone()
    db.close()
    return got and got[0], json.loads((out / "index.json").read_text()).get("index_id"), read_index_id(
        out / "index.faiss")


def test_each_index_has_one_id_in_its_three_files(two_indexes):
    a, b = two_indexes
    ida, idb = _ids(a), _ids(b)
    assert len(set(ida)) == len(set(idb)) == 1 and ida != idb and len(ida[0]) == 32
    assert _update(a) == 0 and _ids(a) == ida  # kept for the life of the index


def test_a_catalog_of_another_index_is_refused(two_indexes, capsys):
    a, b = two_indexes
    shutil.copyfile(a / "catalog.sqlite", b / "catalog.sqlite")
    with pytest.raises(UserError, match="catalog.sqlite belongs to another index"):
        ImageIndex.open(b)
    capsys.readouterr()
    assert main(["index", "search", str(b), str(next((b.parent / "photos_b").rglob("*.jpg"))), "--json"]) == 2
    assert f"{b / 'catalog.sqlite'} belongs to another index" in capsys.readouterr().err


def test_an_index_faiss_of_another_index_is_refused_then_repaired_by_update(two_indexes, capsys):
    a, b = two_indexes
    shutil.copyfile(a / "index.faiss", b / "index.faiss")
    with pytest.raises(UserError, match=r"index.faiss belongs? to another index.*moco index update"):
        ImageIndex.open(b)
    capsys.readouterr()
    assert _update(b) == 0
    assert "index.faiss" in capsys.readouterr().err  # the warning says it was rebuilt
    assert len(set(_ids(b))) == 1
    _finds_itself(b)
    photo = sorted((b.parent / "photos_b").rglob("*.jpg"))[0]
    assert main(["index", "search", str(b), str(photo), "--json", "-k", "1", "--include-queries"]) == 0
    hit = json.loads(capsys.readouterr().out.strip().splitlines()[-1])[0]
    assert Path(hit["path"]).name == photo.name and hit["score"] == pytest.approx(1.0, abs=1e-3)


def test_an_index_from_before_index_ids_opens_and_gets_an_id(photos, backbone, tmp_path, capsys):
    out = tmp_path / "idx"
    assert _build(photos, backbone, out) == 0
    db = sqlite3.connect(out / "catalog.sqlite")  # take every id away, as an older version wrote it
    db.execute("DELETE FROM meta WHERE key='index_id'")
    db.commit()
    db.close()
    meta = json.loads((out / "index.json").read_text())
    del meta["index_id"]
    (out / "index.json").write_text(json.dumps(meta))
    ids, raw = ImageIndex.open(out).catalog.vectors()  # an older version's index.faiss: raw vectors, no trailer
    old = VectorStore.create("flat", raw.shape[1], len(ids), "no")
    old.add(ids, raw)
    old.save(out / "index.faiss")
    assert _ids(out) == (None, None, None)
    _finds_itself(out)
    capsys.readouterr()
    assert _update(out) == 0
    assert "rebuilding" not in capsys.readouterr().err  # nothing foreign: the id is simply added
    assert len(set(_ids(out))) == 1 and _ids(out)[0]
    _finds_itself(out)


def test_update_rebuilds_an_index_faiss_of_another_dim(photos, backbone, tmp_path, capsys):
    from index.search.trailer import read_index_id

    out = tmp_path / "idx"
    assert _build(photos, backbone, out) == 0
    VectorStore.create("flat", 256, 1, "no").save(out / "index.faiss", read_index_id(out / "index.faiss"),
                                                  np.zeros(256, np.float32))
    capsys.readouterr()
    assert _update(out) == 0
    assert "holds 256-d vectors, the catalog 512-d: rebuilding index.faiss" in capsys.readouterr().err
    _finds_itself(out)
