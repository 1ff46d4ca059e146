"""The page's views of the whole collection without a browser (app.page.overview): the Map tab's payload covers every
indexed photo once, as the index's map lays it out; a box or lasso drawn on it selects what a direct geometric
reference selects; a point searches like the photo's own vector; the Themes, Unusual and Browse pages say what the
index's views hold, a page at a time. A real index (FAISS, SQLite, a random ResNet-18) of generated photos."""

from __future__ import annotations

import base64
import html
import re

import numpy as np
import pytest

from app.page.handlers import SearchApp
from app.page.overview import MAX_SELECTED, NO_THEME, map_payload, quantise, region_mask
from index.building.runner import build_index
from index.overview.documents import browse_photos
from index.overview.layout import collection_map
from index.overview.themes import collection_themes
from index.overview.unusual import unusual_photos
from index.search.image_index import ImageIndex
from moco.data.sample import make_sample_collection
from moco.errors import UserError


@pytest.fixture(scope="module")
def app(backbone, tmp_path_factory) -> SearchApp:
    tmp = tmp_path_factory.mktemp("page_overview")
    make_sample_collection(tmp / "photos", per_family=8, size=48, seed=5)
    build_index(tmp / "photos", backbone, tmp / "idx", progress=False, device="cpu")
    index = ImageIndex.open(tmp / "idx")
    return SearchApp(index, index.load_embedder(device="cpu"))


def _array(payload: dict, key: str, dtype: type) -> np.ndarray:
    return np.frombuffer(base64.b64decode(payload[key]), np.dtype(dtype).newbyteorder("<"))


def test_the_map_payload_holds_every_indexed_photo_once_as_the_index_lays_it_out(app):
    payload = app.overview.map("thumbs/")
    index = app.index
    ok = sorted(r.id for r in index.catalog.rows().values() if r.status == "ok")
    ids = _array(payload, "ids", np.uint32)
    assert payload["n"] == len(ids) == len(ok) and sorted(ids.tolist()) == ok and len(set(ids.tolist())) == len(ok)
    cmap = collection_map(index)
    xy = _array(payload, "xy", np.uint16).reshape(-1, 2)  # N x 2
    np.testing.assert_array_equal(ids, cmap.ids)
    assert np.abs(xy / 65535 - cmap.xy).max() <= 0.5 / 65535 + 1e-7  # quantised to the nearest step
    themes = collection_themes(index)
    codes = _array(payload, "theme", np.uint16)
    assert [t["id"] for t in payload["themes"]] == [t.id for t in themes.themes]
    assert [payload["themes"][c]["id"] for c in codes] == cmap.theme.tolist()  # each point's own theme
    rows = index.catalog.rows_by_id(ok)
    folders = _array(payload, "folder", np.uint16)
    assert [payload["folders"][c] for c in folders] == [rows[int(i)].path.split("/")[0] for i in ids]
    assert payload["thumbs"] == "thumbs/" and all((index.dir / "thumbs" / f"{i}.jpg").is_file() for i in ids)
    assert app.overview.map("thumbs/") is payload  # kept for the index's version
    assert f"**{len(ok)} photos**" in app.overview.map_text()


def test_many_folders_share_one_colour_past_the_largest_and_big_ids_stay_exact():
    ids = np.array([3, 2**40 + 1], np.int64)
    p = map_payload(ids, np.array([[0, 0], [1, 1]], np.float32), np.array([0, NO_THEME]), np.array([0, NO_THEME]),
                    [{"id": 0, "size": 1, "label": "theme 0 (1)"}], ["a"], "t/", other_folders=30)
    assert p["ids_type"] == "f64" and _array(p, "ids", np.float64).tolist() == [3.0, 2.0**40 + 1]
    assert _array(p, "xy", np.uint16).tolist() == [0, 0, 65535, 65535] and p["other_folders"] == 30


def _in_triangle(p: np.ndarray, tri: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(inside, on an edge within 1e-6 of its length) for points ``p`` (N x 2) and a triangle (3 x 2), by the signs
    of the three cross products (a reference independent of the even-odd rule)."""
    signs, near = [], np.zeros(len(p), bool)
    for a, b in zip(tri, np.roll(tri, -1, axis=0)):
        cross = (b[0] - a[0]) * (p[:, 1] - a[1]) - (b[1] - a[1]) * (p[:, 0] - a[0])  # N
        near |= np.abs(cross) <= 1e-6 * np.hypot(*(b - a)) * 65535
        signs.append(np.sign(cross))
    s = np.stack(signs)  # 3 x N
    return (s > 0).all(0) | (s < 0).all(0), near


@pytest.mark.parametrize("seed", range(4))
def test_a_box_and_a_lasso_select_what_geometry_says(seed):
    rng = np.random.default_rng(seed)
    q = quantise(rng.random((3000, 2)))  # 3000 x 2
    corners = np.sort(rng.integers(0, 65536, (2, 2)), axis=0)  # [x0 y0], [x1 y1]
    box = region_mask(q, "box", corners[::-1].tolist())  # corners in any order
    x, y = q[:, 0].astype(int), q[:, 1].astype(int)
    ref = (x >= corners[0, 0]) & (x <= corners[1, 0]) & (y >= corners[0, 1]) & (y <= corners[1, 1])
    np.testing.assert_array_equal(box, ref)
    tri = rng.integers(0, 65536, (3, 2)).astype(np.float64)
    lasso = region_mask(q, "lasso", tri.tolist())
    inside, near = _in_triangle(q.astype(np.float64), tri)
    assert (inside | near).sum() > 0 or lasso.sum() == 0
    np.testing.assert_array_equal(lasso[~near], inside[~near])


def test_a_concave_lasso_leaves_its_notch_out():
    q = quantise(np.array([[0.2, 0.5], [0.5, 0.5], [0.8, 0.5], [0.5, 0.2]]))
    notch = (np.array([[0.1, 0.1], [0.9, 0.1], [0.9, 0.9], [0.5, 0.3], [0.1, 0.9]]) * 65535).tolist()  # a "V" top
    assert region_mask(q, "lasso", notch).tolist() == [True, False, True, True]


@pytest.mark.parametrize("shape, points, words", [
    ("box", [[0, 0]], "2 corners"), ("lasso", [[0, 0], [1, 1]], "3 to"), ("circle", [[0, 0], [1, 1]], "box or lasso"),
    ("box", "nonsense", "list of [x, y]"), ("box", [[0, float("nan")], [1, 1]], "list of [x, y]"),
])
def test_a_bad_selection_is_said_plainly(app, shape, points, words):
    with pytest.raises(UserError, match=re.escape(words)):
        app.overview.region(shape, points)


def test_the_region_handler_selects_on_the_index_map_and_caps_what_it_shows(app):
    cmap = collection_map(app.index)
    everything = [[0, 0], [65535, 65535]]
    ids, total = app.overview.region("box", everything)
    assert total == len(cmap.ids) and ids == cmap.ids[:MAX_SELECTED].tolist()
    ids, total = app.overview.region("box", everything, limit=5)
    assert total == len(cmap.ids) and ids == cmap.ids[:5].tolist()
    left = quantise(cmap.xy)[:, 0] <= 30000
    ids, total = app.overview.region("box", [[0, 0], [30000, 65535]])
    assert total == int(left.sum()) and ids == cmap.ids[left].tolist()
    payload = app.overview.map("thumbs/")
    assert app.overview.region("box", everything, version=payload["version"])[1] == len(cmap.ids)
    with pytest.raises(UserError, match="the collection changed since this map was drawn"):
        app.overview.region("box", everything, version="an older map")
    gallery = app.overview.gallery(ids)
    paths = app.index.catalog.rows_by_id(ids)
    assert [c.split(" · ")[-1] for _, c in gallery] == [paths[i].path for i in ids]


def test_a_point_searches_with_the_photo_s_stored_vector(app):
    photo = sorted(app.index.catalog.rows().values(), key=lambda r: r.id)[5]
    gallery, info, state = app.search_id(photo.id, k=6)
    ref = app.index.search(app.index.vectors(np.array([photo.id])), k=7)  # the ranking with the photo itself
    assert ref.ids[0][0] == photo.id and state.ids == ref.ids[0][1:].tolist()  # ... which the page leaves out
    assert state.source == {"id": photo.id, "path": photo.path} and photo.path in info and len(gallery) == 6
    assert "the photo itself is left out" in info
    with pytest.raises(UserError, match="no longer in the index"):
        app.search_id(10**9)


def test_themes_are_cards_of_their_central_photos_sizes_and_folders(app):
    cards, choices = app.overview.themes()
    themes = collection_themes(app.index)
    assert [v for _, v in choices] == [t.id for t in themes.themes]
    for t in themes.themes:
        card = re.search(rf'<div class="theme-card" data-theme="{t.id}".*?</div></div>'.replace("</div></div>",
                                                                                               "</p></div>"), cards)
        assert card, t.id
        text = html.unescape(card.group(0))
        assert f"Theme {t.id} · {t.size} photos" in text
        assert [int(m) for m in re.findall(r"thumbs/(\d+)\.jpg", text)] == t.central
        assert all(f"{f}/</code> {c}" in text for f, c in t.folders if f)


def test_unusual_pages_rank_as_the_index_and_the_last_page_is_kept(app):
    gallery, ids, where, offset = app.overview.unusual(0, limit=5)
    ranked, total = unusual_photos(app.index, 0, 10**6)
    assert ids == [i for i, _ in ranked[:5]] and offset == 0 and f"of **{total}**" in where
    assert gallery[0][1].startswith(f"#1 · closest other {ranked[0][1]:.3f} · ")
    _, ids, where, offset = app.overview.unusual(10**6, limit=5)  # past the end: the last page
    assert offset == (total - 1) // 5 * 5 and ids == [i for i, _ in ranked[offset:]]


def test_browse_pages_by_folder_theme_and_date(app):
    folder = app.folders()[0]
    gallery, ids, where, offset = app.overview.browse(app.folder_on_disk(folder), None, "name", 0, limit=3)
    rows, total = app.index.browse(folder=folder, sort="name", offset=0, limit=3)
    assert ids == [r.id for r in rows] and f"Photos 1–3 of **{total}** in `{folder}/`, by name" in where
    assert all(c.endswith(r.path) for (_, c), r in zip(gallery, rows))
    _, ids, where, offset = app.overview.browse(None, 0, "-date", 10**6, limit=4)
    rows, total = browse_photos(app.index, theme=0, sort="-date", offset=offset, limit=4)
    assert offset == (total - 1) // 4 * 4 and ids == [r.id for r in rows] and "of theme 0" in where
    with pytest.raises(UserError, match="no sub-folder"):
        app.folder_on_disk("no-such-folder")
