"""Views of the whole collection (index.overview) and browsing: checked against numpy references on a real index.

Real FAISS, SQLite and a real (randomly initialized) ResNet-18 on generated photos: the map covers every indexed
photo exactly once and follows an update; the themes partition the collection and are spherical k-means (each photo
in the theme whose centre it scores highest); the unusual photos' scores are the brute-force closest-other cosines;
browsing pages, sorts and filters as a direct transcription of its rule.
"""

from __future__ import annotations

import os
import re
import shutil

import numpy as np
import pytest
from PIL import Image

from index.building.runner import build_index, update_index
from index.overview.cache import cache_file, centred_vectors, forget_views, index_version, space_vectors
from index.overview.documents import (
    ThemesDoc,
    browse_document,
    browse_photos,
    map_document,
    map_rows,
    theme_document,
    themes_document,
    unusual_document,
)
from index.overview.layout import collection_map, map_faces, pca_layout, save_map_png, scale_unit
from index.overview.themes import SMOOTH, auto_themes, collection_themes, smoothed_vectors, theme_members
from index.overview.unusual import unusual_photos
from index.search.image_index import ImageIndex
from moco.data.sample import make_sample_collection
from moco.errors import UserError
from moco.extras import install_hint
from tests.mounts import remount_ro, tmpfs


@pytest.fixture(scope="module")
def built(backbone, tmp_path_factory) -> dict:
    """An index of 6 families x 5 photos in family folders, two photos with an exact copy at the top."""
    tmp = tmp_path_factory.mktemp("overview")
    photos = tmp / "photos"
    make_sample_collection(photos, per_family=5, size=48, seed=3)
    firsts = sorted(photos.rglob("*.jpg"))[:2]
    for n, f in enumerate(firsts):
        shutil.copy(f, photos / f"copy{n}.jpg")
    build_index(photos, backbone, tmp / "idx", progress=False, device="cpu")
    return {"photos": photos, "idx": tmp / "idx", "tmp": tmp, "copied": firsts}


def _live(idx: ImageIndex) -> tuple[np.ndarray, np.ndarray]:
    """The search space's vectors: what the unusual photos are scored in."""
    ids, raw = idx.catalog.vectors(dim=idx.dim)
    return ids, idx.to_space(raw)  # N, N x D


def _centred(idx: ImageIndex) -> tuple[np.ndarray, np.ndarray]:
    """The features centred on the index's mean, unit length, not whitened: what the map and the themes read."""
    ids, raw = idx.catalog.vectors(dim=idx.dim)
    c = raw - idx.mean
    return ids, c / np.linalg.norm(c, axis=1, keepdims=True)  # N, N x D


def _smoothed(idx: ImageIndex) -> tuple[np.ndarray, np.ndarray]:
    """What the themes cut, by brute force: each photo's centred features plus those of its SMOOTH closest other
    photos by search score (the index's space), unit length."""
    ids, c = _centred(idx)
    _, s = space_vectors(idx)
    sim = s @ s.T  # N x N
    np.fill_diagonal(sim, -np.inf)
    near = np.argsort(-sim, axis=1, kind="stable")[:, :SMOOTH]  # N x SMOOTH
    out = c + c[near].sum(1)
    return ids, out / np.linalg.norm(out, axis=1, keepdims=True)


def test_the_map_covers_every_photo_once_in_the_unit_square(built):
    idx = ImageIndex.open(built["idx"])
    ids, x = _centred(idx)
    m = collection_map(idx)
    assert m.method == "pca" and m.version == index_version(idx)
    assert np.array_equal(np.sort(m.ids), ids) and len(set(m.ids.tolist())) == len(ids) == len(idx)
    assert m.xy.shape == (len(ids), 2) and m.xy.dtype == np.float32
    assert m.xy.min() >= 0 and m.xy.max() <= 1 and np.isclose(np.ptp(m.xy, 0).max(), 1.0)
    themes = collection_themes(idx)
    assert np.array_equal(m.theme, themes.labels[np.searchsorted(themes.ids, m.ids)])
    # the PCA reference: the top two principal directions of the index's vectors, up to sign
    c = x - x.mean(0)
    _, _, vt = np.linalg.svd(c.astype(np.float64), full_matrices=False)
    ref = scale_unit(c @ vt[:2].T)
    for axis in range(2):  # each axis the same up to its sign
        a, r = m.xy[:, axis] - m.xy[:, axis].mean(), ref[:, axis] - ref[:, axis].mean()
        assert np.allclose(a, r, atol=1e-4) or np.allclose(a, -r, atol=1e-4), axis
    assert cache_file(idx, "map-pca").is_file()


def test_the_map_is_read_back_and_computed_again_after_an_update(built, tmp_path):
    idx_dir = tmp_path / "idx"
    shutil.copytree(built["idx"], idx_dir)
    idx = ImageIndex.open(idx_dir)
    first = collection_map(idx)
    saved = os.stat(cache_file(idx, "map-pca")).st_mtime_ns
    forget_views()  # as another process: from the file
    again = collection_map(ImageIndex.open(idx_dir))
    assert again.version == first.version and np.array_equal(again.xy, first.xy)
    assert os.stat(cache_file(idx, "map-pca")).st_mtime_ns == saved
    Image.new("RGB", (48, 48), (250, 10, 10)).save(built["photos"].parent / "red.png")
    photos = tmp_path / "photos"
    shutil.copytree(built["photos"], photos)
    shutil.copy(built["photos"].parent / "red.png", photos / "red.png")
    os.remove(sorted(photos.rglob("*.jpg"))[-1])
    update_index(idx_dir, root=photos, progress=False, device="cpu")
    after = collection_map(idx)
    ids, _ = _live(idx)
    assert after.version != first.version
    assert np.array_equal(np.sort(after.ids), ids) and len(ids) == len(first.ids)  # one in, one out
    assert set(after.ids.tolist()) != set(first.ids.tolist())
    assert os.stat(cache_file(idx, "map-pca")).st_mtime_ns != saved


def test_a_read_only_index_computes_its_views_without_writing(built, tmp_path):
    with tmpfs(tmp_path / "mnt", "32m") as mnt:
        idx_dir = mnt / "idx"
        shutil.copytree(built["idx"], idx_dir)
        for f in idx_dir.glob("*.npz"):
            f.unlink()
        remount_ro(mnt)
        idx = ImageIndex.open(idx_dir)
        assert idx.catalog.read_only
        m = collection_map(idx)
        t = collection_themes(idx)
        page, total = unusual_photos(idx)
        assert len(m.ids) == len(t.ids) == total == len(idx)
        assert not list(idx_dir.glob("*.npz"))


def test_themes_partition_the_collection_as_spherical_k_means(built):
    idx = ImageIndex.open(built["idx"])
    ids, x = _smoothed(idx)
    c_ids, c = _centred(idx)
    assert np.allclose(smoothed_vectors(idx, c_ids, c), x, atol=1e-5)  # the index's k-NN: exact here (flat)
    assert not np.allclose(x, c, atol=1e-2)  # the neighbours moved every photo
    themes = collection_themes(idx)
    assert themes.k == auto_themes(len(ids)) == len(themes.themes) and np.array_equal(themes.ids, ids)
    assert [t.id for t in themes.themes] == list(range(themes.k))
    sizes = [t.size for t in themes.themes]
    assert sizes == sorted(sizes, reverse=True) and sum(sizes) == len(ids)
    members = [set(theme_members(idx, t.id, 0, 10**6)[0]) for t in themes.themes]
    assert set().union(*members) == set(ids.tolist()) and sum(map(len, members)) == len(ids)  # a partition
    # each photo is in the theme whose centre (the normalized mean of its members, at convergence) it scores highest
    centres = np.stack([x[themes.labels == t].mean(0) for t in range(themes.k)])
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    s = x @ centres.T  # N x k
    assert (s[np.arange(len(x)), themes.labels] >= s.max(1) - 0.05).mean() >= 0.9
    for t in themes.themes:
        got, total = theme_members(idx, t.id, 0, 100)
        assert total == t.size and got[: len(t.central)] == t.central
        cos = themes.centrality[np.searchsorted(ids, got)]
        assert np.all(np.diff(cos) <= 1e-6)  # most central first
        assert sum(n for _, n in t.folders) <= t.size and t.folders == sorted(t.folders, key=lambda f: (-f[1], f[0]))
    page, total = theme_members(idx, 0, offset=1, limit=2)
    assert total == themes.themes[0].size and page == theme_members(idx, 0, 0, 3)[0][1:3]
    with pytest.raises(UserError, match="themes 0 to"):
        theme_members(idx, themes.k)
    with pytest.raises(UserError, match="--themes"):
        collection_themes(idx, k=0)
    three = collection_themes(idx, k=3)
    assert three.k == 3 and sorted(np.unique(three.labels).tolist()) == [0, 1, 2]
    assert collection_themes(idx).k == themes.k  # the automatic themes kept


def test_unusual_photos_are_the_farthest_from_any_other_by_brute_force(built):
    idx = ImageIndex.open(built["idx"])
    ids, x = _live(idx)
    s = x @ x.T
    np.fill_diagonal(s, -np.inf)
    ref = s.max(1)  # each photo's closest other
    page, total = unusual_photos(idx, 0, len(ids))
    assert total == len(ids)
    got = dict(page)
    assert np.allclose([got[int(i)] for i in ids], ref, atol=1e-5)
    scores = [c for _, c in page]
    assert scores == sorted(scores)
    rows = idx.catalog.rows_by_id(ids)
    copied = {r.id for r in rows.values() if r.path.startswith("copy")}
    originals = {r.id for r in rows.values() if r.hash in {rows[c].hash for c in copied}} - copied
    for i in copied | originals:  # a photo with an exact copy is not unusual: its copy scores 1
        assert got[i] == pytest.approx(1.0, abs=1e-5)
    assert unusual_photos(idx, 2, 3) == (page[2:5], total)


def test_browse_pages_sorts_and_filters_by_folder_and_theme(built):
    idx = ImageIndex.open(built["idx"])
    ids, paths, taken = idx.catalog.entries()
    rows, total = idx.browse(limit=1000)
    assert total == len(ids) and [r.path for r in rows] == sorted(paths)
    folder = sorted({p.split("/")[0] for p in paths if "/" in p})[1]
    rows, total = idx.browse(folder=folder + "/", sort="name", offset=1, limit=2)
    under = sorted(p for p in paths if p.startswith(folder + "/"))
    assert total == len(under) and [r.path for r in rows] == under[1:3]
    newest, _ = idx.browse(sort="-date", limit=1000)
    oldest, _ = idx.browse(sort="date", limit=1000)
    assert [r.date for r in oldest] == sorted(r.date for r in oldest)
    assert [r.date for r in newest] == sorted((r.date for r in newest), reverse=True)
    for t in collection_themes(idx).themes[:3]:
        rows, total = browse_photos(idx, theme=t.id, limit=1000)
        assert total == t.size and {r.id for r in rows} == set(theme_members(idx, t.id, 0, 1000)[0])
        assert [r.path for r in rows] == sorted(r.path for r in rows)
    with pytest.raises(UserError, match="sort"):
        idx.browse(sort="size")
    with pytest.raises(UserError, match="theme"):
        browse_photos(idx, theme=999)


def test_the_views_read_the_search_space_and_the_centred_features(built, tmp_path):
    idx = ImageIndex.open(built["idx"])
    ids, x = space_vectors(idx)
    scores, found = idx.store.search(x[:3], 1)
    assert np.allclose(scores[:, 0], 1.0, atol=1e-5)
    assert np.allclose(np.linalg.norm(x, axis=1), 1.0, atol=1e-5)
    same, c = centred_vectors(idx)
    assert np.array_equal(same, ids) and np.allclose(c, _centred(idx)[1], atol=1e-6)
    assert not idx.whitened and np.allclose(c, x, atol=1e-5)  # an index that only centres: one space for both


def test_pca_layout_is_deterministic_and_scale_unit_keeps_proportions():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 16)).astype(np.float32) * np.linspace(3, 0.1, 16, dtype=np.float32)
    a, b = pca_layout(x), pca_layout(x.copy())
    assert np.array_equal(a, b)
    xy = scale_unit(np.array([[0, 0], [2, 1], [1, 0.5]], np.float32))
    assert np.allclose(xy, [[0, 0.25], [1, 0.75], [0.5, 0.5]])
    assert scale_unit(np.zeros((3, 2))).tolist() == [[0.5, 0.5]] * 3
    assert auto_themes(0) == 0 and auto_themes(1) == 1 and auto_themes(100) == 7 and auto_themes(10**6) == 64


# ------------------------------------------------------------------------------------------ the command line
def _json(capsys) -> object:
    import json

    return json.loads(capsys.readouterr().out)


def test_the_commands_print_the_views(built, tmp_path, capsys):
    from app.cli.commands import main

    idx = ImageIndex.open(built["idx"])
    m, themes = collection_map(idx), collection_themes(idx)
    capsys.readouterr()
    assert main(["index", "map", str(built["idx"]), "--json", "-o", str(tmp_path / "map.png")]) == 0
    rows = _json(capsys)
    paths = {r.id: r.path for r in idx.catalog.rows_by_id(m.ids).values()}
    assert [r["id"] for r in rows] == m.ids.tolist() and [r["path"] for r in rows] == [paths[i] for i in m.ids]
    assert np.allclose([[r["x"], r["y"]] for r in rows], m.xy, atol=1e-5)
    assert [r["theme"] for r in rows] == m.theme.tolist()
    with Image.open(tmp_path / "map.png") as png:
        assert png.format == "PNG" and png.size == (1200, 1200)
        drawn = np.asarray(png.convert("RGB"), np.float32)
    save_map_png(m, tmp_path / "dots.png", idx.root.name)  # the same map without thumbnails
    with Image.open(tmp_path / "dots.png") as png:
        dots = np.asarray(png.convert("RGB"), np.float32)
    faces = map_faces(m.xy)
    assert faces and np.abs(drawn - dots).mean(axis=2).__gt__(30).sum() > len(faces) * 400  # thumbnails drawn
    assert main(["index", "themes", str(built["idx"]), "--json"]) == 0
    doc = _json(capsys)
    assert doc["k"] == themes.k and doc["count"] == len(themes.ids)
    assert [(t["id"], t["size"], [c["id"] for c in t["central"]]) for t in doc["themes"]] == [
        (t.id, t.size, t.central) for t in themes.themes]
    assert main(["index", "themes", str(built["idx"]), "--themes", "2", "--json"]) == 0
    assert _json(capsys)["k"] == 2
    assert main(["index", "unusual", str(built["idx"]), "-n", "5", "--json"]) == 0
    doc = _json(capsys)
    assert [(p["id"], round(p["closest"], 4)) for p in doc["photos"]] == [
        (i, round(c, 4)) for i, c in unusual_photos(idx, 0, 5)[0]]
    assert doc["total"] == len(idx) and doc["next_offset"] == 5
    assert main(["index", "browse", str(built["idx"]), "--theme", "1", "--sort=-date", "--json"]) == 0
    doc = _json(capsys)
    rows, total = browse_photos(idx, theme=1, sort="-date")
    assert doc["total"] == total and [p["id"] for p in doc["photos"]] == [r.id for r in rows]
    assert main(["index", "themes", str(built["idx"])]) == 0
    assert "theme 0: " in capsys.readouterr().out


def test_the_documents_are_what_the_api_validates_and_the_commands_print(built, capsys):
    """Each document's ``to_json()`` passes unchanged through the API's model (same keys, same order, same values)
    and is what ``moco index map|themes|unusual|browse --json`` print."""
    from dataclasses import FrozenInstanceError

    from app.api.models import CollectionMap, PhotosPage, ThemePage, ThemesResponse, UnusualPage
    from app.cli.commands import main

    idx = ImageIndex.open(built["idx"])
    where = str(built["idx"])
    m = map_document(idx)
    docs = [(m, CollectionMap, None), (themes_document(idx), ThemesResponse, ["themes", where]),
            (theme_document(idx, 1, 2, 3), ThemePage, None),
            (unusual_document(idx, 0, 4), UnusualPage, ["unusual", where, "-n", "4"]),
            (browse_document(idx, None, 1, "-date", 1, 5), PhotosPage,
             ["browse", where, "--theme", "1", "--sort=-date", "--offset", "1", "-n", "5"])]
    for doc, model, argv in docs:
        js = doc.to_json()
        assert list(js) == list(model.model_fields), model
        assert model.model_validate(js).model_dump(mode="json") == js, model
        if argv:
            capsys.readouterr()
            assert main(["index", *argv, "--json"]) == 0
            assert _json(capsys) == js, argv
    page, browsed = docs[2][0], docs[4][0]
    assert len(page.photos) == min(3, page.size - 2) and page.next_offset == (5 if page.size > 5 else None)
    assert len(docs[3][0].photos) == 4 and len(browsed.photos) == min(5, browsed.total - 1)
    themes = docs[1][0]
    assert isinstance(themes, ThemesDoc) and sum(t.size for t in themes.themes) == m.count == len(idx)
    assert all(c.path for t in themes.themes for c in t.central) and themes.themes[0].folders[0].count > 0
    with pytest.raises(FrozenInstanceError):
        m.count = 0  # type: ignore[misc]
    capsys.readouterr()
    assert main(["index", "map", where, "--json"]) == 0
    points = map_rows(idx, m)
    assert _json(capsys) == [p.to_json() for p in points]
    assert [(p.id, p.x, p.y, p.theme) for p in points] == list(zip(m.ids, m.x, m.y, m.theme))


def test_the_commands_refuse_bad_input_clearly(built, tmp_path, capsys):
    from app.cli.commands import main

    for argv, words in [(["map", "-o", str(tmp_path / "map.jpg")], "give a name ending in .png"),
                        (["themes", "--themes", "0"], "--themes 0"),
                        (["unusual", "-n", "0"], "-n 0"),
                        (["browse", "--folder", "nowhere"], "no sub-folder 'nowhere'"),
                        (["browse", "--theme", "99"], "theme 99: this collection has themes 0 to")]:
        capsys.readouterr()
        assert main(["index", argv[0], str(built["idx"]), *argv[1:]]) == 2, argv
        assert words in capsys.readouterr().err, argv


def test_umap_without_its_extra_names_the_extra(built):
    try:
        import umap  # noqa: F401
    except ImportError:
        with pytest.raises(UserError, match=re.escape(install_hint("map"))):
            collection_map(ImageIndex.open(built["idx"]), "umap")
    else:
        m = collection_map(ImageIndex.open(built["idx"]), "umap")
        assert m.method == "umap" and m.xy.min() >= 0 and m.xy.max() <= 1 and len(m.ids) == len(set(m.ids.tolist()))


@pytest.mark.parametrize("grid", [1, 3, 10])
def test_the_maps_faces_are_each_cells_point_closest_to_its_centre(grid):
    rng = np.random.default_rng(grid)
    xy = np.concatenate([rng.random((200, 2)), [[0.0, 0.0], [1.0, 1.0]]]).astype(np.float32)
    want = {}
    for i, (x, y) in enumerate(xy.tolist()):  # brute force: every point against its cell's best so far
        c = (min(int(x * grid), grid - 1), min(int(y * grid), grid - 1))
        d = (x - (c[0] + 0.5) / grid) ** 2 + (y - (c[1] + 0.5) / grid) ** 2
        if c not in want or d < want[c][0]:
            want[c] = (d, i)
    got = map_faces(xy, grid)
    assert {(c, r): i for c, r, i in got} == {c: i for c, (_, i) in want.items()} and len(got) == len(want)
