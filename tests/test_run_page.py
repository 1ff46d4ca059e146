"""`moco run` (what `make run` starts) serves its page from the first seconds: Status while training runs (no index
yet), then search turns on by itself in the same page, and the page's flows walked as a person walks them (search,
tick, search again; the Collection tab's counts after a reload; a keeper chosen and the other card read; a result
tapped on a phone); Ctrl+C/SIGTERM during training stops the run without exporting."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from .live import ARGS, CHROMIUM, free_port, wait_served

pytestmark = pytest.mark.slow
STEPS = 60  # several seconds of training on one thread (more under load): the page watches it go
ROOT = Path(__file__).resolve().parents[1]


def _moco_run(work: Path, port: int, steps: int, log: Path, verbose: bool = False,
              photos: Path | None = None) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")  # two threads on a loaded suite: twice the CPU
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
            _opened_at(browser, f"http://127.0.0.1:{port}/")
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
    from index.search.image_index import ImageIndex

    _enabled(page, "#again-btn", False)  # nothing ticked yet
    page.locator("#more-like label").nth(1).click()
    _enabled(page, "#again-btn")
    page.locator("#again-btn").click()
    page.wait_for_function("document.querySelector('#search-info').innerText.includes('2 photos')", timeout=60_000)
    page.get_by_role("tab", name="Collection").click()
    page.locator("#dedup-btn").click()
    panels = "document.querySelectorAll('#dup-groups .dup-group')"
    page.wait_for_function(f"{panels}.length >= 2", timeout=180_000)  # the exact copy's group and a near one
    counts, n = _dup_counts(page), page.evaluate(f"{panels}.length")
    assert re.match(rf"{n} groups of duplicates \(1 exact, {n - 1} near", counts[0]), counts
    assert f"Groups 1–{n} of {n}" in counts[1], counts
    page.reload()
    page.get_by_role("tab", name="Collection").click()
    page.wait_for_function(f"{panels}.length == {n}", timeout=60_000)
    assert _dup_counts(page) == counts  # the same search, the same words
    at = page.evaluate(f"[...{panels}].findIndex(g => g.innerText.includes('· near ·'))")
    ids = page.evaluate(f"[...{panels}[{at}].querySelectorAll('figure')].map(f => f.dataset.id)")
    _choose(page, at, ids)
    _enabled(page, "#dup-keep-btn", False)  # its keeper is chosen already
    page.locator("#dup-keeper label").filter(has=page.locator("input:not(:checked)")).first.click()
    _enabled(page, "#dup-keep-btn")
    page.locator("#dup-keep-btn").click()
    page.wait_for_function("document.querySelector('#dup-message').innerText.includes('keeping')", timeout=60_000)
    page.wait_for_function(f"{panels}[{at}].innerText.includes('chosen by you')", timeout=30_000)
    keep = int(page.evaluate(f"{panels}[{at}].querySelector('figure.dup-keep').dataset.id"))
    index = ImageIndex.open(work / "index")
    for other in (int(i) for i in ids if int(i) != keep):  # each other card: its cosine to the new keeper
        card = page.locator("#dup-groups .dup-group").nth(at).locator(f"figure[data-id='{other}'] figcaption")
        v = index.to_space(index.vectors(np.array([keep, other])))  # 2 x D, unit
        assert f"cos {float(v[1] @ v[0]):.3f} to the keeper" in card.inner_text(), card.inner_text()


def _choose(page, at: int, ids: list[str], tries: int = 5) -> None:
    """Choose the group at position ``at`` in the Collection tab's list until its photos (``ids``) are offered as
    keepers; again when the list was drawn anew under the pointer (a page still loading its events). The server's
    answer may take long on a loaded machine: it is awaited while the choice stands."""
    from playwright.sync_api import Error

    offered = "[...document.querySelectorAll('#dup-keeper input')].map(i => i.value).sort().join()"
    value = "document.querySelector('#dup-group input').value"
    seen: list[str] = []
    for _ in range(tries):
        try:
            page.locator("#dup-group input").click()
            option = page.get_by_role("option").nth(at)
            want = option.inner_text(timeout=10_000).strip()
            option.click(timeout=10_000)
            page.wait_for_function(f"{value} == {want!r}", timeout=10_000)  # the choice took, on the page
            # the keepers offered (the server's answer), or the choice undone by a list drawn anew
            page.wait_for_function(f"{offered} == {','.join(sorted(ids))!r} || {value} != {want!r}",
                                   timeout=120_000)
            if page.evaluate(f"{offered} == {','.join(sorted(ids))!r}"):
                return
            seen.append(f"chose {want!r}, then the list read {page.evaluate(value)!r}")
        except Error as e:
            if not seen:
                page.screenshot(path="/work/choose.png", full_page=True)
                Path("/work/choose.txt").write_text(str(e))
            seen.append(f"{str(e).splitlines()[0]} | offered {page.evaluate(offered)!r} | options "
                        f"{page.get_by_role('option').all_inner_texts()} | value {page.evaluate(value)!r}")
            page.keyboard.press("Escape")
    raise AssertionError(f"group {at + 1} (ids {sorted(ids)}) could not be chosen in {tries} tries: {seen}")


def _holder(held: list):
    """A route handler that keeps the page's POSTs (its events) in ``held``, unanswered, while ``held`` is a list
    whose last item is not None (None: let them go), and lets the rest go."""
    def hold(route) -> None:
        held.append(route) if route.request.method == "POST" and held[-1:] != [None] else route.continue_()
    return hold


def _opened_at(browser, url: str) -> None:
    """A page opened once search is on (its tabs built before: at Status) goes to the Search tab; a tab the person
    picked before the load's answers came stays picked. The answers are held here until the pick is made: a slow
    machine, made certain."""
    import time

    from playwright.sync_api import expect

    for pick in (None, "Collection"):
        page = browser.new_page(viewport={"width": 1280, "height": 800})
        held: list = []
        page.route("**/gradio_api/**", _holder(held))
        page.goto(url)
        deadline = time.monotonic() + 60  # a guard against a hang, not a measurement
        while not held:
            assert time.monotonic() < deadline, "the page sent no event at its load"
            page.wait_for_timeout(50)
        if pick:
            page.get_by_role("tab", name=pick).click()
        waiting = list(held)
        held.append(None)  # the later ones go at once
        for route in waiting:
            route.continue_()
        page.wait_for_function("window.mocoTabChecked === true", timeout=60_000)  # the page's script has looked
        expect(page.get_by_role("tab", name=pick or "Search")).to_have_attribute("aria-selected", "true")
        page.close()


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
