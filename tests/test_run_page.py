"""`moco run` (what `make run` starts) serves its page from the first seconds: Status while training runs (no index
yet), then search turns on by itself in the same page, and the page's flows walked as a person walks them (search,
tick, search again; the Collection tab's counts after a reload; a keeper chosen and the other card read; a result
tapped on a phone); Ctrl+C/SIGTERM during training stops the run without exporting."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .live import ARGS, CHROMIUM, free_port, wait_served

pytestmark = pytest.mark.slow
STEPS = 150  # a few seconds of training at least: the page watches it go
ROOT = Path(__file__).resolve().parents[1]


def _moco_run(work: Path, port: int, steps: int, log: Path, verbose: bool = False,
              photos: Path | None = None) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="2")
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-m", "app.cli", *(["--verbose"] if verbose else []), "run",
                                 *([str(photos)] if photos else []), "--work", str(work), "--max-steps",
                                 str(steps), "--port", str(port), "--device", "cpu", "--quiet"], env=env,
                                stdout=out, stderr=subprocess.STDOUT)


def _status(page) -> str:
    return page.locator("#status-info").inner_text()


def _photos(root: Path) -> int:
    """4 families of 12 photos of 64 px (not the stars nor the tiles: a random network cannot tell them apart, and
    tiles of one texture are copies of each other by their pixels), an exact copy of one photo and a 75% JPEG q80
    copy of another in ``inbox/``: how many photos."""
    import io
    import shutil

    from PIL import Image

    from moco.data.sample import make_sample_collection

    make_sample_collection(root, per_family=12, size=64, seed=1)
    for family in ("stars", "tiles"):
        shutil.rmtree(root / family)
    photos = sorted(root.rglob("*.jpg"))
    (root / "inbox").mkdir()
    shutil.copyfile(photos[0], root / "inbox" / "exact.jpg")
    buf = io.BytesIO()
    Image.open(photos[13]).convert("RGB").resize((48, 48), Image.Resampling.BICUBIC).save(buf, "JPEG", quality=80)
    Image.open(io.BytesIO(buf.getvalue())).save(root / "inbox" / "small.png")
    return sum(1 for p in root.rglob("*") if p.is_file())


def test_status_while_training_then_search_turns_on(tmp_path):
    from playwright.sync_api import sync_playwright

    from app.run.pipeline import collection_dir

    work, port, log, photos = tmp_path / "work", free_port(), tmp_path / "run.log", tmp_path / "photos"
    n = _photos(photos)
    proc = _moco_run(work, port, STEPS, log, verbose=True, photos=photos)
    work = collection_dir(work, photos)  # this folder's own directory in WORK
    try:
        wait_served(f"http://127.0.0.1:{port}/", proc, timeout=120)
        assert not (work / "index").exists()  # the page answers before any index exists
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
            page = browser.new_page(viewport={"width": 1280, "height": 800})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(f"http://127.0.0.1:{port}/")
            page.wait_for_function("document.querySelector('#status-info') && "
                                   "document.querySelector('#status-info').innerText.includes('Training step')",
                                   timeout=240_000)
            training = _status(page)
            assert not (work / "index").exists(), "training must still run while Status shows it"
            assert f"/ {STEPS}" in training and "loss" in training and "ETA" in training
            assert "preparing the index" in page.locator("#title").inner_text()
            page.wait_for_function("document.querySelector('#loss-plot') && "
                                   "document.querySelector('#loss-plot').offsetParent !== null",
                                   timeout=60_000)  # the live loss curve
            page.wait_for_function("document.querySelector('#status-info').innerText.includes('Ready')",
                                   timeout=600_000)
            assert (work / "index" / "index.faiss").is_file()
            page.wait_for_function(f"document.querySelector('#title').innerText.includes('{n} images')",
                                   timeout=30_000)
            page.get_by_role("tab", name="Search").click()  # the same page, never reloaded
            photo = sorted(photos.rglob("*.jpg"))[0]
            page.locator("#query input[type=file]").set_input_files(str(photo))
            _enabled(page, "#search-btn")
            page.locator("#search-btn").click()
            page.wait_for_function("document.querySelectorAll('#results button.thumbnail-item').length == 12",
                                   timeout=60_000)
            assert "12 results" in page.locator("#search-info").inner_text()
            _walk(page, work, photos)
            _phone(browser, f"http://127.0.0.1:{port}/", photo)
            browser.close()
        assert not errors, errors
        deadline = time.monotonic() + 60  # serving only from "search is on": the heap left then is frozen (app/heap.py)
        while ("app.server.heap: heap frozen" not in log.read_text() and time.monotonic() < deadline
               and proc.poll() is None):
            time.sleep(0.2)
        text = log.read_text()
        assert ("search is on" in text
                and "app.server.heap: heap frozen: " in text.split("search is on", 1)[1]), text[-2000:]
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def _enabled(page, selector: str, enabled: bool = True) -> None:
    from playwright.sync_api import expect

    locator = page.locator(selector)
    (expect(locator).to_be_enabled if enabled else expect(locator).to_be_disabled)(timeout=30_000)


def _walk(page, work: Path, photos: Path) -> None:
    """Search again with a ticked result; find the duplicates, reload, the same counts; choose the other photo of
    the near group as its keeper and read the card of the one that was: its cosine to the new keeper, measured."""
    from index.image_index import ImageIndex

    _enabled(page, "#again-btn", False)  # nothing ticked yet
    page.locator("#more-like label").nth(1).click()
    _enabled(page, "#again-btn")
    page.locator("#again-btn").click()
    page.wait_for_function("document.querySelector('#search-info').innerText.includes('2 photos')", timeout=60_000)
    page.get_by_role("tab", name="Collection").click()
    page.locator("#dedup-btn").click()
    page.wait_for_function("document.querySelectorAll('#dup-groups .dup-group').length == 2", timeout=180_000)
    counts = _dup_counts(page)
    assert counts[0].startswith("2 groups of duplicates (1 exact, 1 near") and "Groups 1–2 of 2" in counts[1]
    page.reload()
    page.get_by_role("tab", name="Collection").click()
    page.wait_for_function("document.querySelectorAll('#dup-groups .dup-group').length == 2", timeout=60_000)
    assert _dup_counts(page) == counts  # the same search, the same words
    _choose(page, "Group 2 · near · 2 photos", "inbox/small.png")
    _enabled(page, "#dup-keep-btn", False)  # its keeper is chosen already
    page.locator("#dup-keeper label").filter(has=page.locator("input:not(:checked)")).first.click()
    _enabled(page, "#dup-keep-btn")
    page.locator("#dup-keep-btn").click()
    page.wait_for_function("document.querySelector('#dup-message').innerText.includes('keeping')", timeout=60_000)
    page.wait_for_function("document.querySelectorAll('#dup-groups .dup-group')[1].innerText.includes('chosen by "
                           "you')", timeout=30_000)
    card = page.locator("#dup-groups .dup-group").nth(1).locator("figure:not(.dup-keep) figcaption").inner_text()
    ids = [int(x) for x in page.evaluate("[...document.querySelectorAll('#dup-groups .dup-group')[1]"
                                         ".querySelectorAll('figure')].map(f => f.dataset.id)")]
    keep = int(page.evaluate("document.querySelector('#dup-groups .dup-group:nth-child(2) figure.dup-keep')"
                             ".dataset.id"))
    index = ImageIndex.open(work / "index")
    v = index.center(index.vectors(__import__("numpy").array([keep, *[i for i in ids if i != keep]])))
    assert f"cos {float(v[1] @ v[0]):.3f} to the keeper" in card, card


def _choose(page, group: str, member: str, tries: int = 5) -> None:
    """Choose ``group`` in the Collection tab's group list until its photos (``member`` among them) are offered as
    keepers; again when the list was drawn anew under the pointer (a page still loading its events)."""
    from playwright.sync_api import Error

    for _ in range(tries):
        try:
            page.locator("#dup-group input").click()
            page.get_by_role("option", name=group).click(timeout=10_000)
            page.wait_for_function(f"document.querySelector('#dup-keeper').innerText.includes({member!r})",
                                   timeout=10_000)
            return
        except Error:
            page.keyboard.press("Escape")
    raise AssertionError(f"{group} could not be chosen in {tries} tries")


def _dup_counts(page) -> tuple[str, str]:
    stats = page.locator("#collection-stats").inner_text()
    line = next(x for x in stats.splitlines() if "of duplicates" in x)
    return line.strip(), page.locator("#dup-where").inner_text().strip()


def _phone(browser, url: str, photo: Path) -> None:
    """On a phone, a tapped result's details come into view (they are below every result)."""
    page = browser.new_page(viewport={"width": 390, "height": 844}, is_mobile=True, has_touch=True)
    page.goto(url)
    page.wait_for_selector("#query input[type=file]", state="attached", timeout=60_000)
    page.locator("#query input[type=file]").set_input_files(str(photo))
    _enabled(page, "#search-btn")
    page.locator("#search-btn").click()
    page.wait_for_function("document.querySelectorAll('#results button.thumbnail-item').length == 12",
                           timeout=60_000)
    page.locator("#results button.thumbnail-item").nth(4).tap()
    page.wait_for_function("""() => { const d = document.querySelector('#details');
        if (!d || d.offsetParent === null) return false;
        const r = d.getBoundingClientRect(); return r.top >= -1 && r.top < window.innerHeight; }""", timeout=30_000)
    page.close()


def test_sigterm_during_training_stops_the_run_before_export(tmp_path):
    work, port, log = tmp_path / "work", free_port(), tmp_path / "run.log"
    proc = _moco_run(work, port, 10_000, log)
    work = work / "sample"
    try:
        wait_served(f"http://127.0.0.1:{port}/", proc, timeout=120)
        metrics = work / "run" / "metrics.jsonl"
        while not (metrics.is_file() and metrics.read_text().count("\n") >= 1):
            assert proc.poll() is None, log.read_text()[-2000:]
            time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert "stopped by SIGTERM" in text and "run the same command to resume" in text
    assert (work / "run" / "checkpoint.pt").is_file()
    assert not (work / "backbone.safetensors").exists() and not (work / "index").exists()
