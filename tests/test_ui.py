"""The search UI: handlers against ImageIndex and a hand-made InfoNCE, gradio_client, the file route, a browser."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import urllib.parse
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from app.page.handlers import SearchApp
from app.page.views import groups_html, negatives_outputs
from app.server.launch import make_demo, serve
from index.building.plan import file_hash
from index.building.runner import build_index
from index.search.image_index import ImageIndex
from moco.config import from_plain
from moco.data.augment import two_views
from moco.data.cache import cache_size_for
from moco.data.photos import square_u8
from moco.training.setup import build_model
from moco.weights.layouts import load_checkpoint

from .conftest import random_backbone, trained_index
from .live import free_port, wait_served

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict[str, Path]:
    """A tiny trained run (real queue with image ids), its exported backbone and an index of its photos."""
    return trained_index(tmp_path_factory.mktemp("ui"))


@pytest.fixture(scope="module")
def app(setup) -> SearchApp:
    index = ImageIndex.open(setup["idx"])
    return SearchApp(index, index.load_embedder(device="cpu"), setup["ckpt"])


def _query(setup) -> Path:
    return sorted(setup["photos"].rglob("*.jpg"))[3]


def test_search_handlers_equal_image_index(app, setup):
    q = _query(setup)
    gallery, info, state = app.search(str(q), k=5, folder="")
    itself = app.index.ids_of_files([file_hash(q)])  # an indexed photo: left out of its own results
    ref = app.index.search(app.embedder.embed(q), k=10, exclude_ids=itself)
    assert itself and state.ids == list(ref.ids[0, :5]) and len(gallery) == 5
    np.testing.assert_allclose(state.scores, ref.scores[0, :5], atol=1e-6)
    assert gallery[0][1].startswith("#1 · ") and "embed" in info and "search" in info
    assert "the photo itself is left out" in info
    assert all(Path(t).parent == setup["idx"] / "thumbs" for t, _ in gallery)
    gallery2, _, state2 = app.more(state)  # "more" continues the ranking
    assert state2.ids == list(ref.ids[0, :10]) and len(gallery2) == 10
    _, _, state3 = app.select(state2, 7)  # clicking a result searches with it, itself left out
    clicked = int(ref.ids[0, 7])
    assert state3.ids == app.index.search(app.index.vectors(np.array([clicked])), k=5,
                                          exclude_ids=[clicked]).ids[0].tolist() and clicked not in state3.ids
    family = state.paths[0].split("/")[0]
    _, _, only = app.search(str(q), k=50, folder=family)
    assert only.paths and all(p.startswith(family + "/") for p in only.paths)


def test_errors_are_messages_not_tracebacks(app, setup, tmp_path):
    from app.page.blocks import _safe

    search = _safe(3, 1)(app.search)
    bad = tmp_path / "upload.jpg"
    bad.write_bytes(b"\xff\xd8\xff not an image")
    for args, words in [((None, 5, ""), "no image"), ((str(bad), 5, ""), "upload.jpg"),
                        ((str(_query(setup)), 5, "../etc"), "no sub-folder")]:
        gallery, info, state = search(*args)
        assert info.startswith("**Error:**") and words in info and "Traceback" not in info
        assert isinstance(gallery, dict) and gallery.get("__type__") == "update"  # the results shown stay
    assert _safe(4, 1)(app.negatives)(None, 5, 0)[1].startswith("**Error:**")
    assert _safe(3, 1)(app.more)(None)[1].startswith("**Error:**")


def _hand_info_nce(pos: float, negs: np.ndarray, t: float) -> tuple[np.ndarray, float, int]:
    logits = np.concatenate([[pos], negs]).astype(np.float64) / t
    z = np.exp(logits - logits.max())
    shares = z / z.sum()
    return shares, float(-np.log(shares[0])), int(1 + (negs >= pos).sum())


def test_negatives_from_the_saved_queue_match_a_hand_computation(app, setup):
    img = Image.open(_query(setup)).convert("RGB")
    view = app.negatives_source.compute(img, n=8, seed=3)
    assert view.source == "queue" and "queue" in view.space
    # independently: the checkpoint's model, the same seeded views, q . queue by hand
    ckpt = load_checkpoint(setup["ckpt"])
    cfg = from_plain(ckpt["config"])
    model = build_model(cfg)
    model.load_state_dict(ckpt["model"])
    model.eval()
    square = square_u8(img, cache_size_for(cfg.image_size, cfg.cache_size))
    xq, xk = two_views(torch.tensor(square)[None], cfg.augment, cfg.image_size, cfg.mean, cfg.std,
                       torch.Generator().manual_seed(3))
    with torch.no_grad():
        q = F.normalize(model.projector(model.backbone(xq)), dim=1)[0]
        k = F.normalize(model.projector_momentum(model.backbone_momentum(xk)), dim=1)[0]
    filled = ckpt["model"]["queue_ids"][0] >= 0
    negs = (q @ ckpt["model"]["queue"][0][:, filled]).numpy()
    shares, loss, rank = _hand_info_nce(float(q @ k), negs, cfg.temperature)
    assert view.positive == pytest.approx(float(q @ k), abs=1e-5)
    assert view.count == int(filled.sum()) and view.loss == pytest.approx(loss, rel=1e-4)
    assert view.positive_rank == rank and view.positive_share == pytest.approx(shares[0], rel=1e-4)
    top = np.argsort(-negs)[:8]
    assert [n.similarity for n in view.negatives] == pytest.approx(list(negs[top]), abs=1e-5)
    assert [n.share for n in view.negatives] == pytest.approx(list(shares[1 + top]), rel=1e-4)
    assert [n.logit for n in view.negatives] == pytest.approx(list(negs[top] / cfg.temperature), abs=1e-4)
    assert view.above_positive == int((negs >= float(q @ k)).sum())  # flags need evidence: test_negatives_evidence
    ids = ckpt["model"]["queue_ids"][0][filled].numpy()[top]
    assert [n.path for n in view.negatives] == [ckpt["files"][i] for i in ids]
    views, text, gallery, table = negatives_outputs(view)
    assert len(views) == 2 and f"{loss:.3f}" in text and len(table) == 8  # 3 decimals, shares in percent
    assert all(row[4].endswith("%") and len(row[2].split(".")[1]) == 3 for row in table)


def test_the_queue_note_counts_the_photos_own_keys_and_says_nothing_of_none(app, setup):
    ckpt = load_checkpoint(setup["ckpt"])
    ids, files = ckpt["model"]["queue_ids"][0].tolist(), ckpt["files"]
    keys = {i: ids.count(i) for i in range(len(files))}
    assert 0 in keys.values()  # more photos than queue slots: some have no key in the queue
    for count in sorted(set(keys.values())):  # one photo of each count
        train_id = min(i for i, c in keys.items() if c == count)
        row = app.index.catalog.row_by_path(files[train_id])
        note = next(n for n in app.negatives_for(row.id, n=2).notes if n.startswith("the query is training image"))
        end = {0: f"({files[train_id]})", 1: ": its key in the queue is the same photo"}.get(
            count, f": its {count} keys in the queue are the same photo")
        assert note.endswith(end) and "key(s)" not in note, note


def test_negatives_from_the_index_match_a_hand_computation(setup):
    index = ImageIndex.open(setup["idx"])
    emb = index.load_embedder(device="cpu")
    app = SearchApp(index, emb, None)
    img = Image.open(_query(setup)).convert("RGB")
    view = app.negatives_source.compute(img, n=5, seed=1)
    assert view.source == "index" and "the index's space (" in view.space
    assert any("query image itself" in n for n in view.notes)  # the query is in the index: left out
    ids, vecs = index.catalog.vectors()
    clean = emb.embed(img)[0]
    keep = vecs @ clean < 0.9999
    square = square_u8(img, emb.resize)
    xq, xk = two_views(torch.tensor(square)[None], "v2", emb.image_size, emb.pixel_mean, emb.pixel_std,
                       torch.Generator().manual_seed(1))
    q, k = index.to_space(emb.embed_views(torch.cat([xq, xk])))  # centred, as search scores
    negs = index.to_space(vecs[keep]) @ q
    shares, loss, rank = _hand_info_nce(float(q @ k), negs, view.temperature)
    assert view.count == int(keep.sum()) == len(ids) - 1
    assert view.loss == pytest.approx(loss, rel=1e-4) and view.positive_rank == rank
    top = np.argsort(-negs)[:5]
    assert [n.share for n in view.negatives] == pytest.approx(list(shares[1 + top]), rel=1e-4)
    assert all(n.thumb is not None and Path(n.thumb).parent.name == "thumbs" for n in view.negatives)


def test_collection_tab_and_dedup(app, setup):
    text, groups = app.collection()
    assert "36 images" in text and "recall@10" in text and "resnet18" in text
    shutil.copyfile(_query(setup), setup["photos"] / "copy.jpg")
    try:
        from index.building.runner import update_index

        update_index(setup["idx"], progress=False)
        text, groups = app.collection(threshold=0.95)
        assert (" group of duplicates" in text or " groups of duplicates" in text) and "exact" in text
        mine = [g for g in groups if "copy.jpg" in [m.path for m in g.members]]
        assert len(mine) == 1 and _query(setup).relative_to(setup["photos"]).as_posix() in [
            m.path for m in mine[0].members]
        assert mine[0].kind == "exact" and mine[0].keep != "copy.jpg"  # the original: the older file
        kinds = [g.kind for g in groups]
        assert kinds == sorted(kinds, key=["exact", "near"].index)  # exact first, then near, each largest first
        assert all(a.size >= b.size for a, b in zip(groups, groups[1:]) if a.kind == b.kind)
        panels = groups_html(groups, app.index)
        assert panels.count('class="dup-group"') == len(groups)
        assert f"Group 1 of {len(groups)} · {groups[0].kind} · {groups[0].size} photos" in panels
        assert "copy.jpg" in panels and "✓ keep" in panels and mine[0].reason in panels
    finally:
        (setup["photos"] / "copy.jpg").unlink()
        update_index(setup["idx"], progress=False)


@pytest.fixture(scope="module")
def server(setup):
    """The page as `moco serve` runs it (its guard layers, uvicorn), and the page's app."""
    port = free_port()
    running = serve(setup["idx"], setup["ckpt"], port=port, device="cpu", block=False)
    try:
        yield f"http://127.0.0.1:{port}", running.api_service.library
    finally:
        running.close()
        running.api_service.close()


@pytest.mark.slow
def test_gradio_client_search_and_negatives(server, setup):
    from gradio_client import Client, handle_file

    url, app = server
    client = Client(url, verbose=False)
    gallery, info, = client.predict(handle_file(str(_query(setup))), 6, "", api_name="/search")[:2]
    ref = app.index.search(app.embedder.embed(_query(setup)), k=6,
                           exclude_ids=app.index.ids_of_files([file_hash(_query(setup))]))  # itself left out
    assert [item["caption"].split(" · ")[-1] for item in gallery] == ref.paths[0]
    assert "6 results" in info and "the photo itself is left out" in info
    views, summary, negs, table = client.predict(handle_file(str(_query(setup))), 4, 0, api_name="/negatives")
    assert "InfoNCE loss" in summary and "saved MoCo queue" in summary and len(table["data"]) == 4


@pytest.mark.slow
def test_file_route_refuses_everything_but_thumbs(server, setup):
    import httpx

    url, app = server
    thumb = next((setup["idx"] / "thumbs").iterdir())
    secret_files = [setup["idx"] / "catalog.sqlite", setup["idx"] / "index.json", _query(setup), Path("/etc/passwd"),
                    ROOT / "pyproject.toml"]
    attempts = []
    for f in secret_files:
        attempts += [str(f), urllib.parse.quote(str(f)), urllib.parse.quote(str(f), safe="")]
    rel = "../" * 12 + "etc/passwd"
    thumbs = setup["idx"] / "thumbs"
    attempts += [f"{thumbs}/../catalog.sqlite", f"{thumbs}/..%2fcatalog.sqlite", f"{thumbs}/%2e%2e/index.json",
                 rel, urllib.parse.quote(rel, safe=""), "..%2f..%2f..%2fetc%2fpasswd", f"{thumbs}/../../photos"]
    with httpx.Client(timeout=10) as http:
        for a in attempts:
            for route in ("/gradio_api/file=", "/file="):
                r = http.get(url + route + a)
                assert r.status_code in (400, 403, 404, 405), (a, r.status_code)
                assert b"root:" not in r.content and b"SQLite format" not in r.content
        ok = http.get(url + "/gradio_api/file=" + str(thumb))
        assert ok.status_code == 200 and ok.content[:2] == b"\xff\xd8"  # the thumbnails are served


def test_empty_index_and_rebuilt_with_another_backbone_are_messages(setup, tmp_path):
    from app.page.blocks import _safe

    empty_photos = tmp_path / "empty"
    empty_photos.mkdir()
    (empty_photos / "broken.jpg").write_bytes(b"not a photo")
    build_index(empty_photos, setup["tmp"] / "backbone.safetensors", tmp_path / "empty_idx", progress=False)
    index = ImageIndex.open(tmp_path / "empty_idx")
    app = SearchApp(index, index.load_embedder(device="cpu"))
    _, info, _ = _safe(3, 1)(app.search)(str(_query(setup)), 5, "")
    assert "the index is empty" in info
    # the index directory is rebuilt with another model while the server runs
    shutil.copytree(setup["idx"], tmp_path / "live_idx")
    live = ImageIndex.open(tmp_path / "live_idx")
    app = SearchApp(live, live.load_embedder(device="cpu"))
    assert app.search(str(_query(setup)), 3, "")[2].ids
    other = random_backbone(tmp_path, seed=5)
    shutil.rmtree(tmp_path / "live_idx")
    build_index(setup["photos"], other, tmp_path / "live_idx", progress=False)
    gallery, info, _ = _safe(3, 1)(app.search)(str(_query(setup)), 3, "")
    assert "rebuild" in info and "Traceback" not in info and info.startswith("**Error:**")


@pytest.mark.slow
def test_serve_cli_warns_on_open_host_and_enforces_auth(setup):
    import os
    import subprocess
    import sys

    import httpx

    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "app.cli", "serve", str(setup["idx"]), "--host", "0.0.0.0",
                             "--port", str(port), "--device", "cpu"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert "without --auth" in proc.stderr.readline()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "app.cli", "serve", str(setup["idx"]), "--port", str(port),
                             "--auth", "alice:s3cret-pass", "--device", "cpu"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        r = wait_served(url + "/config", proc, timeout=120)
        assert r.status_code in (401, 403)  # nothing without the login
        with httpx.Client() as http:
            ok = http.post(url + "/login", data={"username": "alice", "password": "s3cret-pass"})
            assert ok.status_code == 200 and http.get(url + "/config").status_code == 200
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    from app.cli.commands import main

    assert main(["serve", str(setup["idx"]), "--auth", "no-colon"]) == 2


@pytest.mark.slow
def test_upload_size_is_capped(server):
    import httpx

    url, _ = server
    big = b"\xff\xd8" + b"\0" * (26 * 1024 * 1024)
    r = httpx.post(url + "/gradio_api/upload", files={"files": ("big.jpg", big, "image/jpeg")}, timeout=60)
    assert r.status_code == 413, r.status_code


def test_the_page_served_beside_training_has_pyplot_imported_before_its_first_event(tmp_path):
    """`moco run`'s page imports pyplot (Agg) before serving: Gradio switching the backend in an event's thread
    while the run's curves import pyplot in another failed the event and stopped the Status timer."""
    code = ("import sys\nfrom app.run.status import RunStatus\nfrom app.server.launch import serve_pending\n"
            f"demo, _ = serve_pending({str(tmp_path / 'idx')!r}, {str(tmp_path / 'photos')!r}, "
            f"RunStatus({str(tmp_path / 'work')!r}), port={free_port()})\n"
            "import matplotlib\nprint('matplotlib.pyplot' in sys.modules, matplotlib.get_backend().lower())\n"
            "demo.close()\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=str(ROOT), MPLBACKEND="tkagg"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "True agg" in out.stdout.splitlines(), out.stdout


def test_every_event_answers_an_error_with_as_many_outputs_as_it_has(setup):
    """An event whose handler fails answers our message in one output and leaves the others: as many values as the
    event has outputs, or Gradio refuses the answer (a click on a result did, with one output missing)."""
    demo, _ = make_demo(setup["idx"], setup["ckpt"], device="cpu")
    wrapped = [(fn.fn.__name__, fn.fn.n_outputs, len(fn.outputs)) for fn in demo.fns.values()
               if hasattr(fn.fn, "n_outputs")]
    assert len(wrapped) >= 8, wrapped  # the page's events, each behind _safe
    assert [w for w in wrapped if w[1] != w[2]] == []


def test_a_page_of_a_finished_index_served_alone_stops_refreshing_after_it_loads(setup):
    """The page's load sets its refresh timer: off for a finished index served alone (nothing on the Status tab can
    change), on with a watched folder, a run's status or an index still to come; its other outputs stay the Status
    tab's."""
    import gradio as gr

    from app.page.blocks import ticking
    from app.run.status import RunStatus
    from index.building.watch import Watcher

    demo, app = make_demo(setup["idx"], setup["ckpt"], device="cpu")
    load = next(fn for fn in demo.fns.values() if fn.api_name == "status")
    assert isinstance(load.outputs[-1], gr.Timer)
    out = load.fn(True)
    assert len(out) == len(load.outputs) and out[-1].active is False and "Serving a finished index" in out[0]
    app.watcher = Watcher(app.index.root, lambda: None, poll_s=60)  # `moco serve --watch` (not started)
    watched = load.fn(True)
    assert watched[-1].active is True and "Serving the index" in watched[0]
    app.watcher = None
    assert ticking(app) is False
    assert ticking(SearchApp()) is True  # no index yet: search turns on by a tick
    assert ticking(SearchApp(status=RunStatus(setup["idx"].parent / "work"))) is True


def test_a_tick_of_a_result_no_longer_shown_is_dropped_not_refused():
    """The page's tick lists: a value sent after a search changed the results (an event still on its way under load)
    names a result that is gone: it is dropped, and the ticks still shown are kept; nothing not shown is let in, and
    a value of another kind is still Gradio's to refuse."""
    import gradio as gr

    from app.page import inputs

    ticks = inputs.CheckboxGroup([("1. a.jpg", 11), ("2. b.jpg", 12)], label="More like these")
    assert ticks.preprocess([12, 99, 11]) == [12, 11]
    assert ticks.preprocess([99]) == [] and ticks.preprocess([]) == []
    assert ticks.preprocess([{"x": 1}, 11]) == [11]
    with pytest.raises(gr.Error):
        ticks.preprocess("11")
