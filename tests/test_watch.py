"""Keeping an index up with its folder (index.building.watch, `moco serve --watch`, `moco index update --watch`):
when an update is due, against a synthetic clock; a real index updated by a polling watcher driven by that clock
(a photo still being copied waits, a failed update is tried again later); and a real `moco serve --watch` process
while photos are copied in (some slowly), renamed and deleted: every change searchable or gone once the folder
settles, and no search failing meanwhile."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from index.building.runner import build_index, update_index
from index.building.watch import Settle, Watcher, snapshot
from index.search.image_index import ImageIndex

from .live import moco_serve


class Clock:
    """A synthetic monotonic clock: time moves only when the test says."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _photo(path: Path, seed: int, size: int = 40) -> Path:
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (5, 5, 3), dtype=np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(small).resize((size, size), Image.Resampling.BICUBIC).save(path, quality=92)
    return path


def _indexed(idx: Path) -> set[str]:
    return set(ImageIndex.open(idx).catalog.rows())


def test_a_batch_is_due_once_it_settles_or_after_the_longest_wait():
    s = Settle(settle_s=3.0, max_wait_s=60.0)
    assert not s.due(0.0)  # nothing noted
    for t in (0.0, 1.0, 2.0):  # a burst
        s.note(t)
    assert not s.due(4.9) and s.due(5.0)  # 3 s after the last change
    s.take()
    assert not s.due(100.0)  # taken: nothing waits
    for t in np.arange(200.0, 262.0, 1.0):  # a copy that never pauses for 3 s
        s.note(float(t))
        assert s.due(float(t)) == (t - 200.0 >= 60.0), t
    s.take()
    s.note(300.0)
    s.hold_until = 360.0  # after a failed update
    assert not s.due(359.0) and s.due(360.0)


def test_a_polling_watcher_updates_a_real_index_when_the_folder_settles(tmp_path, backbone):
    root, idx = tmp_path / "photos", tmp_path / "idx"
    for i in range(4):
        _photo(root / "a" / f"p{i}.jpg", i)
    build_index(root, backbone, idx, progress=False, device="cpu")
    clock = Clock()
    calls = []

    def update():
        calls.append(clock.now)
        return update_index(idx, progress=False, device="cpu")

    w = Watcher(root, update, settle_s=3.0, max_wait_s=60.0, poll_s=5.0, clock=clock)
    assert not w.step()  # no scan due yet, nothing changed
    _photo(root / "b" / "new.jpg", 10)
    big = root / "b" / "copying.jpg"
    data = _photo(tmp_path / "whole.jpg", 11, size=200).read_bytes()
    big.write_bytes(data[: len(data) // 2])  # a file still being copied
    clock.now += 5.0
    assert not w.step()  # the scan saw the changes: they wait to settle (a scan's interval at least)
    assert w.state.pending_since == clock.now and "waiting to settle" in w.state.describe()
    clock.now += 4.0
    assert not w.step()
    clock.now += 1.0  # the next scan: the copy has grown since
    big.write_bytes(data)
    assert not w.step() and calls == []
    clock.now += 5.0  # the next scan: nothing changed for 5 s
    assert w.step() and calls == [clock.now]
    assert _indexed(idx) == {"a/p0.jpg", "a/p1.jpg", "a/p2.jpg", "a/p3.jpg", "b/new.jpg", "b/copying.jpg"}
    assert ImageIndex.open(idx).catalog.rows()["b/copying.jpg"].status == "ok"  # whole, not the half
    assert w.state.updates == 1 and w.state.last["new"] == 2 and w.state.pending_since is None
    # a folder renamed and a photo deleted
    (root / "a").rename(root / "album")
    (root / "b" / "new.jpg").unlink()
    clock.now += 5.0
    assert not w.step()
    clock.now += 5.0
    assert w.step()
    assert _indexed(idx) == {f"album/p{i}.jpg" for i in range(4)} | {"b/copying.jpg"}
    assert w.state.last["moved"] == 4 and w.state.last["removed"] == 1
    # an update that fails (the backbone moved away) is tried again after the longest wait, then succeeds
    meta_backbone = Path(ImageIndex.open(idx).meta["backbone_path"])
    moved = meta_backbone.with_suffix(".away")
    meta_backbone.rename(moved)
    try:
        _photo(root / "c" / "later.jpg", 12)
        clock.now += 5.0
        w.step()
        clock.now += 5.0
        assert w.step() and w.state.error and w.state.updates == 2  # it tried, and failed
        assert "failed" in w.state.describe() and "c/later.jpg" not in _indexed(idx)
        clock.now += 30.0
        assert not w.step()  # held back: not hammering a failing update
    finally:
        moved.rename(meta_backbone)
    clock.now += 30.0
    assert w.step() and w.state.error is None and w.state.updates == 3
    assert "c/later.jpg" in _indexed(idx)
    assert len(snapshot(root)) == 6
    from app.page.handlers import SearchApp
    from app.page.views import status_outputs

    served = ImageIndex.open(idx)
    app = SearchApp(served, served.load_embedder(device="cpu"))
    try:
        assert status_outputs(app, True)[0] == "Serving a finished index."
        app.watcher = w  # as `moco serve --watch` sets it: the Status tab says what the watch did
        text = status_outputs(app, True)[0]
        assert f"Watching {root} (scanning every 5 s): 3 updates" in text and "1 new" in text
    finally:
        app.close()


def test_update_watch_flags_are_checked(tmp_path):
    from app.cli import main

    assert main(["index", "update", str(tmp_path), "--poll", "5"]) == 2  # --poll without --watch
    assert main(["index", "update", str(tmp_path), "--watch", "--poll", "0"]) == 2


@pytest.mark.slow
def test_a_served_index_follows_its_folder_while_it_is_searched(tmp_path, backbone):
    root, idx = tmp_path / "photos", tmp_path / "idx"
    for i in range(20):
        _photo(root / "first" / f"p{i:03d}.jpg", i)
    build_index(root, backbone, idx, progress=False, device="cpu")
    source = tmp_path / "incoming"
    for i in range(200):
        _photo(source / f"n{i:03d}.jpg", 1000 + i)
    failures: list[str] = []
    stop = threading.Event()
    with moco_serve(idx, tmp_path / "server.log", "--watch") as url:
        api = url + "api/v1"

        def search_all_along() -> None:  # a search every 0.2 s while the folder changes
            query = (root / "first" / "p000.jpg").read_bytes()
            with httpx.Client(timeout=60) as http:
                while not stop.is_set():
                    r = http.post(f"{api}/search", files={"image": ("q.jpg", query)}, data={"k": "5"})
                    if r.status_code != 200:
                        failures.append(f"{r.status_code} {r.text[:200]}")
                    time.sleep(0.2)

        searcher = threading.Thread(target=search_all_along)
        searcher.start()
        try:
            (root / "new").mkdir()
            for i in range(150):  # a burst, at once
                shutil.copyfile(source / f"n{i:03d}.jpg", root / "new" / f"n{i:03d}.jpg")
            for i in range(150, 200):  # some slowly, and the slow ones in pieces
                data = (source / f"n{i:03d}.jpg").read_bytes()
                with open(root / "new" / f"n{i:03d}.jpg", "wb") as f:
                    f.write(data[: len(data) // 2])
                    f.flush()
                    time.sleep(0.02)
                    f.write(data[len(data) // 2 :])
            (root / "new").rename(root / "renamed")  # a folder renamed
            for i in range(5):  # some deleted
                (root / "first" / f"p{i:03d}.jpg").unlink()
            want = ({f"renamed/n{i:03d}.jpg" for i in range(200)}
                    | {f"first/p{i:03d}.jpg" for i in range(5, 20)})
            probes = [f"renamed/n{i:03d}.jpg" for i in (0, 77, 149, 150, 199)] + ["first/p000.jpg"]  # + a deleted one
            queries = {p: (root / p).read_bytes() for p in probes[:-1]}
            queries["first/p000.jpg"] = _photo(tmp_path / "gone.jpg", 0).read_bytes()  # its very bytes, made again

            def first_hits(http: httpx.Client) -> dict[str, str]:
                return {p: http.post(f"{api}/search", files={"image": ("q.jpg", q)},
                                     data={"k": "1", "include_queries": "true"}).json()["results"][0]["path"]
                        for p, q in queries.items()}

            deadline = time.monotonic() + 300  # a bound on waiting, not a speed asserted
            with httpx.Client(timeout=60) as http:
                while True:
                    got = {h["path"] for h in http.get(f"{api}/photos", params={"limit": 500}).json()["photos"]}
                    hits = first_hits(http)
                    if (got == want and all(hits[p] == p for p in probes[:-1])) or time.monotonic() > deadline:
                        break
                    time.sleep(1.0)
            assert got == want, (sorted(got - want)[:5], sorted(want - got)[:5])
            assert all(hits[p] == p for p in probes[:-1]), hits  # each searchable by its own photo
            assert hits["first/p000.jpg"] != "first/p000.jpg"  # the deleted photo is gone from the results
        finally:
            stop.set()
            searcher.join(60)
    assert failures == []
    assert "watching" in (tmp_path / "server.log").read_text()


def test_update_watch_keeps_the_index_up_until_ctrl_c(tmp_path, backbone):
    import os
    import signal
    import subprocess
    import sys

    root, idx = tmp_path / "photos", tmp_path / "idx"
    _photo(root / "p0.jpg", 0)
    build_index(root, backbone, idx, progress=False, device="cpu")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]), OMP_NUM_THREADS="1",
               PYTHONFAULTHANDLER="1")  # SIGABRT prints every thread's stack: where a stop would hang
    proc = subprocess.Popen([sys.executable, "-m", "app.cli", "index", "update", str(idx), "--watch", "--poll", "1",
                             "--device", "cpu", "--quiet"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    # (Ctrl+C as a terminal gives it: a pytest-xdist worker ignores SIGINT, and a child that inherits an ignored
    # SIGINT never gets Python's KeyboardInterrupt for it)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)  # the output as it comes
    reader.start()

    def wait_for(words: str) -> None:
        deadline = time.monotonic() + 240  # a bound on waiting, not a speed asserted
        while not any(words in line for line in lines):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.2)

    try:
        wait_for("(Ctrl+C to stop)")  # the first update done, the watch on
        assert sum("1 images searchable" in line for line in lines) == 1
        _photo(root / "p1.jpg", 1)
        wait_for("2 images searchable")  # the watch's update, printed once it is written
        assert _indexed(idx) == {"p0.jpg", "p1.jpg"} and len(ImageIndex.open(idx)) == 2
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=300)  # a bound on waiting, not a speed asserted
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)  # its threads' stacks into the output, then it is gone
            proc.wait(timeout=60)
        reader.join(30)
    out = "".join(lines)
    assert proc.returncode == 0, out
    assert "scanning every 1 s" in out and "stopped watching" in out


def test_a_folder_events_cannot_watch_is_scanned_instead(tmp_path, caplog):
    """Where the file system's events cannot be had (here: the folder is not there yet, as a drive not mounted;
    elsewhere: inotify's watches used up), the watch scans instead of failing the server's start."""
    pytest.importorskip("watchdog")
    clock = Clock()
    calls = []
    w = Watcher(tmp_path / "not-mounted", lambda: calls.append(clock.now) or {"new": 0}, settle_s=1.0, clock=clock)
    assert w.state.mode == "events"
    w.start()
    w.stop()  # its thread stopped: the test takes the steps, on its clock
    assert w.state.mode == "scanning every 10 s" and "scanning it every 10 s instead" in caplog.text
    _photo(tmp_path / "not-mounted" / "p.jpg", 0)  # the drive comes back with a photo
    clock.now += 10.0
    assert not w.step()  # seen, settling
    clock.now += 10.0
    assert w.step() and calls == [clock.now]
