"""The page's handlers without a browser: uploads, exports, originals, details, re-runs and the pending page."""

from __future__ import annotations

import csv
import gc
import json
import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import app.collection.library as library
import app.page.handlers as handlers
from app.page.handlers import SearchApp, score_text
from app.search.scope import ALL_FOLDERS
from app.search.uploads import MAX_UPLOAD_MB, read_upload
from index.building.plan import file_hash
from index.building.runner import build_index
from index.search.image_index import ImageIndex
from index.search.query import MIN_SIDE_PX
from moco.data.sample import make_sample_collection
from moco.errors import UserError

from .conftest import random_backbone


@pytest.fixture(scope="module")
def app(tmp_path_factory) -> SearchApp:
    tmp = tmp_path_factory.mktemp("handlers")
    make_sample_collection(tmp / "photos", per_family=4, size=48, seed=4)
    build_index(tmp / "photos", random_backbone(tmp), tmp / "idx", progress=False)
    index = ImageIndex.open(tmp / "idx")
    return SearchApp(index, index.load_embedder(device="cpu"))


def _photo(app: SearchApp, i: int = 2) -> Path:
    return sorted(app.index.root.rglob("*.jpg"))[i]


@pytest.mark.parametrize("content, words", [
    (b"plain text, not a photo", "not an image"), (b"", "empty file"), (None, "truncated or corrupt"),
])
def test_bad_uploads_are_one_line_naming_the_file(app, tmp_path, content, words):
    path = tmp_path / "upload.jpg"
    path.write_bytes(content if content is not None else _photo(app).read_bytes()[:300])
    with pytest.raises(UserError) as e:
        read_upload(str(path))
    msg = str(e.value)
    assert msg.startswith("upload.jpg: ") and words in msg and "upload a photo" in msg and "\n" not in msg
    assert str(tmp_path) not in msg  # the server's temp path means nothing to the person uploading


def test_upload_over_the_cap_is_refused_from_its_size(tmp_path):
    big = tmp_path / "big.jpg"
    with open(big, "wb") as f:
        f.truncate(MAX_UPLOAD_MB * 1024 * 1024 + 1)  # sparse: never decoded, refused from its size
    with pytest.raises(UserError, match=f"big.jpg is .* over the {MAX_UPLOAD_MB} MB upload limit"):
        read_upload(str(big))
    with pytest.raises(UserError, match="no image"):
        read_upload(None)


def test_an_image_with_too_many_pixels_is_refused_in_plain_words(tmp_path):
    huge = tmp_path / "huge.png"
    Image.new("1", (12000, 12000)).save(huge)  # 144 megapixels in a small file
    with pytest.raises(UserError) as e:
        read_upload(str(huge))
    msg = str(e.value)
    assert msg.startswith("huge.png: too many pixels (144 megapixels, the limit is 89): downscale it"), msg
    assert "bomb" not in msg and "89478485" not in msg and "upload a photo" not in msg
    huger = tmp_path / "huger.png"
    Image.new("1", (20000, 10000)).save(huger)  # over twice the limit: PIL will not even open it
    with pytest.raises(UserError, match=r"huger.png: too many pixels \(over 178 megapixels, the limit is 89\)"):
        read_upload(str(huger))


@pytest.mark.parametrize("size", [(1, 1), (MIN_SIDE_PX - 1, 300), (300, MIN_SIDE_PX - 1)])
def test_an_image_too_small_to_search_with_is_refused_naming_its_size(app, tmp_path, size):
    tiny = tmp_path / "tiny.png"
    Image.new("RGB", size, (200, 40, 40)).save(tiny)
    words = f"tiny.png is {size[0]} x {size[1]} pixels: too small to search with (at least {MIN_SIDE_PX} px"
    with pytest.raises(UserError, match=words.replace("(", r"\(")):
        read_upload(str(tiny))
    with pytest.raises(UserError, match=f"{size[0]} x {size[1]} pixels"):
        app.search(str(tiny), k=3)  # no meaningless results
    with pytest.raises(UserError, match="too small"):
        read_upload(Image.new("RGB", size))
    Image.new("RGB", (MIN_SIDE_PX, MIN_SIDE_PX)).save(tiny)
    assert read_upload(str(tiny)).size == (MIN_SIDE_PX, MIN_SIDE_PX)  # the minimum itself is searchable


def test_scores_read_as_on_the_page_and_never_minus_zero(app):
    for score, text in [(-0.0004, "0.000"), (-0.0, "0.000"), (0.0004, "0.000"), (-0.0006, "-0.001"), (0.9996, "1.000"),
                        (0.25, "0.250")]:
        assert score_text(score) == text
        assert app.caption(1, score, "a/b.jpg").startswith(f"#1 · {text} · ")


def test_the_title_names_the_photo_folder(app):
    assert f"`{app.index.root.name}` · {len(app.index)} images" in app.title()
    assert f"`{app.index.dir.name}`" not in app.title()


def test_rerun_folder_and_export_match_the_index(app, tmp_path):
    _, info, state = app.search(str(_photo(app)), k=6, folder="")
    itself = app.index.ids_of_files([file_hash(_photo(app))])  # an indexed photo: left out of its results
    ref = app.index.search(app.embedder.embed(_photo(app)), k=6, exclude_ids=itself)
    assert itself and state.ids == list(ref.ids[0]) and "the photo itself is left out" in info
    _, _, again = app.rerun(state, 3, ALL_FOLDERS)
    assert again.ids == state.ids[:3] and again.label == state.label
    family = _photo(app).parent.name
    _, info, only = app.rerun(state, 3, family)  # the family's photos but the photo itself
    assert only.paths and all(p.startswith(family + "/") for p in only.paths) and f"`{family}/`" in info
    csv_path, json_path = app.export(only)
    rows = list(csv.DictReader(open(csv_path, encoding="utf-8")))
    assert [r["path"] for r in rows] == only.paths and [int(r["rank"]) for r in rows] == list(range(1, 4))
    assert [r["score"] for r in rows] == [score_text(s) for s in only.scores]  # as the page shows them
    weak = app.index.weak_below
    assert [r["weak_match"] for r in rows] == [str(s < weak).lower() for s in only.scores]  # true/false
    data = json.loads(Path(json_path).read_text())
    assert [r["id"] for r in data["results"]] == only.ids and data["score"] == "centred cosine"
    assert [r["score"] for r in data["results"]] == [float(score_text(s)) for s in only.scores]
    assert [r["weak_match"] for r in data["results"]] == [s < weak for s in only.scores]
    assert '"weak_match": true' in Path(json_path).read_text() or '"weak_match": false' in Path(json_path).read_text()
    assert data["query"] == "the uploaded image"
    _, _, picked = app.select(only, 1)  # a search with a result: the query is its path, as text
    data = json.loads(Path(app.export(picked)[1]).read_text())
    assert data["query"] == only.paths[1] and "`" not in data["query"]
    with pytest.raises(UserError, match="search first"):
        app.export(None)
    with pytest.raises(UserError, match="Search first"):
        app.rerun(None, 5, "")


def test_details_and_original_only_for_indexed_files_inside_the_root(app, tmp_path, monkeypatch):
    photo = _photo(app, 5)
    row = app.index.catalog.row_by_path(photo.relative_to(app.index.root).as_posix())
    d = app.details(row.id)
    assert d["full_path"] == str(photo) and "modified" in d["markdown"] and d["preview"].size[0] >= 48
    copy = app.original(row.id)
    assert Path(copy).read_bytes() == photo.read_bytes() and Path(copy).parent.parent == app._files
    with pytest.raises(UserError, match="not an indexed photo"):
        app.original(10_000)
    # a photo replaced by a link to a file outside the collection is not served
    outside = tmp_path / "secret.jpg"
    outside.write_bytes(photo.read_bytes())
    moved = photo.with_suffix(".bak")
    os.replace(photo, moved)
    try:
        os.symlink(outside, photo)
        with pytest.raises(UserError, match="links outside the collection"):
            app.original(row.id)
    finally:
        photo.unlink()
        os.replace(moved, photo)
    monkeypatch.setattr(library, "MAX_ORIGINAL_BYTES", 10)
    with pytest.raises(UserError, match="over the"):
        app.original(row.id)


def test_select_uses_the_stored_vector_and_names_the_photo(app):
    _, _, state = app.search(str(_photo(app)), k=5)
    _, info, picked = app.select(state, 3)
    vec = app.index.vectors(np.array([state.ids[3]]))[0]
    ref = app.index.search(vec[None], k=5, exclude_ids=[state.ids[3]])  # the photo itself left out
    assert picked.ids == list(ref.ids[0]) and picked.source == {"id": state.ids[3], "path": state.paths[3]}
    assert state.paths[3] in info and "the photo itself is left out" in info


def test_a_pending_page_says_the_index_is_not_ready(tmp_path):
    from app.run.status import RunStatus

    status = RunStatus(tmp_path)
    status.stage("training", "run")
    pending = SearchApp(status=status)
    assert not pending.ready and "preparing" in pending.title() and pending.folder_choices() == [(ALL_FOLDERS, "")]
    for call in (lambda: pending.search(None), lambda: pending.negatives(None), lambda: pending.collection()):
        with pytest.raises(UserError, match=r"not ready yet \(training\).*Status"):
            call()


# ------------------------------------------------------------------------------------ files we write
FORMULA_STARTS = ["=", "+", "-", "@", "\t", "\r", "\n"]


@pytest.fixture(scope="module")
def hostile_export(tmp_path_factory) -> tuple[list[dict[str, str]], dict]:
    """An index of photos named like spreadsheet formulas, searched and exported: (CSV rows, JSON)."""
    tmp = tmp_path_factory.mktemp("hostile")
    make_sample_collection(tmp / "sample", per_family=1, size=48, seed=5)
    photos = sorted((tmp / "sample").rglob("*.jpg"))
    (tmp / "photos").mkdir()
    for start, photo in zip(FORMULA_STARTS, photos * 2):
        (tmp / "photos" / f"{start}cmd|' -C calc'!A0.jpg").write_bytes(photo.read_bytes())
    (tmp / "photos" / "plain.jpg").write_bytes(photos[0].read_bytes())
    build_index(tmp / "photos", random_backbone(tmp), tmp / "idx", progress=False)
    index = ImageIndex.open(tmp / "idx")
    app = SearchApp(index, index.load_embedder(device="cpu"))
    query = tmp / "query.png"  # other bytes than every indexed photo: none of them is left out as the photo itself
    with Image.open(photos[0]) as im:
        im.save(query)
    _, _, state = app.search(str(query), k=len(FORMULA_STARTS) + 1)
    csv_path, json_path = app.export(state)
    rows = list(csv.DictReader(open(csv_path, newline="", encoding="utf-8")))
    return rows, json.loads(Path(json_path).read_text())


@pytest.mark.parametrize("start", FORMULA_STARTS, ids=repr)
def test_export_csv_cells_never_start_a_formula(hostile_export, start):
    rows, data = hostile_export
    name = f"{start}cmd|' -C calc'!A0.jpg"
    assert name in [r["path"] for r in data["results"]]  # the JSON stays exact
    assert "'" + name in [r["path"] for r in rows] and name not in [r["path"] for r in rows]
    assert "plain.jpg" in [r["path"] for r in rows]  # other names untouched
    assert all(float(r["score"]) == pytest.approx(j["score"]) for r, j in zip(rows, data["results"]))


def test_result_files_expire_by_age_and_are_named_unguessably(app, monkeypatch):
    now = [0.0]
    monkeypatch.setattr(handlers, "_clock", lambda: now[0])
    mine = SearchApp(app.index, app.embedder)
    _, _, state = mine.search(str(_photo(app, 5)), k=4)
    first, _ = mine.export(state)
    now[0] += handlers._KEEP_S / 2
    second, _ = mine.export(state)
    assert Path(first).is_file() and Path(second).is_file()  # both younger than _KEEP_S
    now[0] += handlers._KEEP_S / 2 + 1
    third, _ = mine.export(state)
    assert not Path(first).exists() and Path(second).is_file() and Path(third).is_file()  # only the first too old
    names = [Path(f).parent.name for f in (second, third)]
    assert all(len(n) == 16 and int(n, 16) >= 0 for n in names) and names[0] != names[1]  # 64 random bits each
    mine.close()


def test_result_files_stay_under_the_cap_and_go_with_the_app(app, monkeypatch):
    photo = _photo(app, 5)
    row = app.index.catalog.row_by_path(photo.relative_to(app.index.root).as_posix())
    monkeypatch.setattr(handlers, "_KEEP_BYTES", 3 * photo.stat().st_size + 1)
    monkeypatch.setattr(handlers, "_KEEP_EXPORTS", 32)  # the count cap, at a size a test can reach
    mine = SearchApp(app.index, app.embedder)
    files = mine._files
    assert files.is_dir() and files.name.startswith("moco-results-") and os.stat(files).st_mode & 0o777 == 0o700
    _, _, state = mine.search(str(photo), k=4)
    for _ in range(10):
        last = mine.original(row.id)
        sizes = [f.stat().st_size for f in files.rglob("*") if f.is_file()]
        assert sum(sizes) <= handlers._KEEP_BYTES and Path(last).is_file()
    for _ in range(handlers._KEEP_EXPORTS + 5):
        last_csv, _ = mine.export(state)
        assert len(list(files.iterdir())) <= handlers._KEEP_EXPORTS and Path(last_csv).is_file()
    mine.close()
    assert not files.exists()
    again = SearchApp(app.index, app.embedder)
    files = again._files
    again.export(state)
    del again  # an app that is let go takes its files along (and at exit, every app does)
    gc.collect()
    assert not files.exists()


def test_result_folders_never_exceed_the_cap_even_while_exports_run_at_once(app, monkeypatch):
    import threading
    import time

    cap = 6
    monkeypatch.setattr(handlers, "_KEEP_EXPORTS", cap)
    mine = SearchApp(app.index, app.embedder)
    _, _, state = mine.search(str(_photo(app, 5)), k=4)
    for _ in range(cap):
        mine.export(state)
    assert len(list(mine.files_dir.iterdir())) == cap  # full
    seen: list[int] = []

    class Watched(str):
        """A folder filter of "" that counts the result folders each time an export reads it (while it writes)."""

        def __bool__(self) -> bool:
            seen.append(len(list(mine.files_dir.iterdir())))
            time.sleep(0.05)  # the others go on meanwhile
            return False

    start = threading.Barrier(cap - 1)
    done: list[str] = []

    def one() -> None:
        start.wait()
        for _ in range(3):
            done.append(mine.export(replace(state, folder=Watched()))[0])

    def watch() -> None:  # and between those reads, as often as it can
        while any(t.is_alive() for t in threads):
            seen.append(len(list(mine.files_dir.iterdir())))

    threads = [threading.Thread(target=one) for _ in range(cap - 1)]
    for t in threads:
        t.start()
    watcher = threading.Thread(target=watch)
    watcher.start()
    for t in [*threads, watcher]:
        t.join()
    assert len(done) == 3 * (cap - 1) and len(seen) > len(done)
    assert max(seen) <= cap, seen  # never more folders than the cap, not even for a moment
    assert len(list(mine.files_dir.iterdir())) == cap and all(Path(f).is_file() for f in done[-1:])
    with pytest.raises(TypeError):  # an export that fails midway leaves no folder behind
        mine.export(replace(state, label=object()))
    assert len(list(mine.files_dir.iterdir())) == cap
    mine.close()
