"""The search page in Debian's Chromium at a desktop's 1280x800 and a phone's 390x844, against `moco serve`.

Each test drives the real server (a subprocess whose log is read back) through Playwright: results readable
and reachable, clicking a result, k and folder re-running the search, exports, our messages for bad
uploads, and the Negatives tab opened from a result. The page `moco run` serves before its index exists
(``serve_pending``, in this process) is checked for what it says before and after search turns on.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from .conftest import trained_index
from .live import chromium, free_port, moco_serve

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
VIEWPORTS = {"desktop": {"width": 1280, "height": 800}, "phone": {"width": 390, "height": 844}}
RESULTS = "#results button.thumbnail-item"


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[dict[str, Any]]:
    """`moco serve` over a tiny trained run's index (queue negatives), its log in a file."""
    tmp = tmp_path_factory.mktemp("browser")
    photos = trained_index(tmp, photo_size=64)["photos"]
    log = tmp / "server.log"
    with moco_serve(tmp / "idx", log, "--checkpoint", str(tmp / "run" / "checkpoint.pt")) as url:
        yield {"url": url, "photos": photos, "idx": tmp / "idx", "log": log, "tmp": tmp}


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with chromium() as b:
        yield b


# a line of the Status tab's log as `moco run` writes them, long enough to need two lines on a desktop
LONG_MESSAGE = ("generating a sample collection (240 photos in 4 families, 60 each) in /home/someone/Pictures/"
                "a-folder-with-a-long-name/and-another-level-below-it/yet-another-one/sample_photos ...")


@pytest.fixture(scope="module")
def pending(served) -> Iterator[dict[str, Any]]:
    """The page `moco run` serves before its index exists (``serve_pending``, in this process), over the served
    index's folders; ``app.attach`` turns its search on (once, for the rest of the module)."""
    from app.run.status import RunStatus
    from app.server.launch import serve_pending

    status = RunStatus(served["tmp"] / "pending")
    status.stage("indexing", "the sample photos")
    status.say(LONG_MESSAGE)
    port = free_port()
    demo, app = serve_pending(served["idx"], served["photos"], status, port=port)
    try:
        yield {"url": f"http://127.0.0.1:{port}/", "app": app, "idx": served["idx"], "photos": served["photos"]}
    finally:
        demo.close()
        app.close()


def _new_page(browser: Any, url: str, viewport: str, shown: str = "#query") -> Any:
    """A page of its own context at ``viewport`` once ``shown`` is, collecting uncaught page and console errors."""
    context = browser.new_context(viewport=VIEWPORTS[viewport], accept_downloads=True)
    p = context.new_page()
    p.errors = []
    p.on("pageerror", lambda e: p.errors.append(f"page error: {e}"))
    p.on("console", lambda m: p.errors.append(f"console {m.text}") if m.type == "error" else None)
    p.viewport_name = viewport
    p.loads = []  # the page's loads: more than one where Gradio reloaded it (it does, a connection given up for lost)
    p.on("load", lambda page: p.loads.append(page.url))
    p.goto(url)
    p.wait_for_selector(shown)
    return p


def _close(p: Any) -> None:
    """Close the page's context; fails on the errors it collected (unless the test expected some)."""
    errors = [e for e in p.errors if not getattr(p, "expect_errors", False)]
    p.context.close()
    assert not errors, errors


@pytest.fixture(params=list(VIEWPORTS))
def page(request, browser, served) -> Iterator[Any]:
    """A fresh page of `moco serve` at one viewport; fails the test on uncaught page errors or console errors."""
    p = _new_page(browser, served["url"], request.param)
    yield p
    _close(p)


def _query(served) -> Path:
    return sorted(served["photos"].rglob("*.jpg"))[3]


def _search(page: Any, image: Path, k: int | None = None) -> None:
    page.locator("#query input[type=file]").set_input_files(str(image))
    _turns_enabled(page.locator("#search-btn"))  # on once the photo is there
    if k is not None:
        _set_k(page, k, wait=False)
    page.locator("#search-btn").click()
    _wait_results(page, k or 12, "uploaded image")


def _set_k(page: Any, k: int, wait: bool = True) -> None:
    box = page.locator("#k input[type=number]")
    box.fill(str(k))
    box.press("Enter")
    box.blur()
    if wait:
        _wait_results(page, k)


def _wait_results(page: Any, n: int, info: str = "") -> None:
    page.wait_for_function(f"""() => document.querySelectorAll('{RESULTS}').length == {n} &&
        document.querySelector('#search-info').innerText.startsWith('{n} results') &&
        document.querySelector('#search-info').innerText.includes({json.dumps(info)}) &&
        [...document.querySelectorAll('{RESULTS} img')].every(i => i.src.includes('/gradio_api/file=') &&
          (i.getBoundingClientRect().top > innerHeight || (i.complete && i.naturalWidth > 0)))""",
                           timeout=60_000)


def _in_viewport(page: Any, selector: str) -> bool:
    """The element is on screen after scrolling it into view, and its width fits the viewport."""
    el = page.locator(selector).first
    el.scroll_into_view_if_needed()
    box = el.bounding_box()
    width = page.viewport_size["width"]
    return box is not None and box["x"] >= 0 and box["x"] + box["width"] <= width + 1 and box["width"] > 0


def _overflowing(page: Any, selector: str) -> list[str]:
    """Shown elements in ``selector`` (itself included) whose content is wider than their box: an inner scroll
    box, or something cut off."""
    return page.evaluate("""(sel) => { const root = document.querySelector(sel);
        return [root, ...root.querySelectorAll('*')].filter(e => e.getClientRects().length > 0 &&
            e.clientWidth > 0 && e.scrollWidth > e.clientWidth + 1)
            .map(e => `${e.tagName}.${e.className} ${e.scrollWidth} > ${e.clientWidth}`);
    }""", selector)


def _label_clear_of_first_item(page: Any, gallery: str) -> None:
    """The gallery's label ends above its first item (it does not cover the first row)."""
    label, first = page.evaluate(f"""[document.querySelector('{gallery} label[data-testid=block-label]'),
        document.querySelector('{gallery} button.thumbnail-item')].map(e => e.getBoundingClientRect())
        .map(r => [r.top, r.bottom])""")
    assert label[1] <= first[0] + 0.5, (gallery, label, first)


def _breaks_only_after_a_slash(page: Any, box: str, path: str) -> None:
    """Made just wide enough for the longest name in it (and a "/"), the ``box`` breaks the ``path`` in it (a
    monospace path) only after a "/", never inside a name, and nothing sticks out."""
    out = page.evaluate("""([boxSel, pathSel]) => {
        const box = document.querySelector(boxSel), el = box.querySelector(pathSel), text = el.textContent;
        const longest = Math.max(...text.split('/').map(n => n.length)) + 1;
        const whole = [...el.getClientRects()].reduce((w, r) => w + r.width, 0);
        box.style.width = `${Math.ceil(whole * longest / text.length) + 8}px`;
        const chars = [], walker = document.createTreeWalker(el, NodeFilter.SHOW_TEXT);
        for (let n = walker.nextNode(); n; n = walker.nextNode()) for (let i = 0; i < n.length; i++) {
            const r = document.createRange(); r.setStart(n, i); r.setEnd(n, i + 1);
            const b = r.getBoundingClientRect(); if (b.width > 0) chars.push([n.data[i], b.top, b.right]); }
        const right = box.getBoundingClientRect().right;
        box.style.width = '';
        const before = [];  // the character before each line break
        chars.forEach((c, i) => { if (i > 0 && c[1] > chars[i - 1][1] + 2) before.push(chars[i - 1][0]); });
        return {text, before, out: chars.filter(c => c[2] > right + 1).map(c => c[0])}; }""", [box, path])
    assert out["before"], out  # the test means something: the path did not fit on one line
    assert set(out["before"]) == {"/"} and not out["out"], out


def _turns_enabled(locator: Any, enabled: bool = True) -> None:
    """The element is enabled (or not) now or within 30 s (a guard, not a measurement)."""
    from playwright.sync_api import expect

    (expect(locator).to_be_enabled if enabled else expect(locator).to_be_disabled)(timeout=30_000)


def _captions(page: Any) -> list[dict[str, Any]]:
    return page.evaluate(f"""[...document.querySelectorAll('{RESULTS} .caption-label')].map(c => {{
        const r = c.getBoundingClientRect();
        return {{text: c.innerText, clipped: c.scrollWidth > c.clientWidth + 1 || c.scrollHeight > c.clientHeight + 1,
                 x: r.x, right: r.right, y: r.y}}; }})""")


def test_results_are_readable_on_desktop_and_phone(page, served):
    title = page.locator("#title").inner_text()
    assert f" · {served['photos'].name} · " in title and served["idx"].name not in title  # the photos, not the index
    _search(page, _query(served), k=12)
    _label_clear_of_first_item(page, "#results")
    caps = _captions(page)
    assert len(caps) == 12
    ranked = [c["text"].split(" · ")[-1] for c in caps]
    paths = {p.relative_to(served["photos"]).as_posix() for p in served["photos"].rglob("*.*")}
    assert all(r in paths for r in ranked), ranked  # the whole path, not "mou..."
    assert not any(c["clipped"] for c in caps), caps  # nothing cut off
    width = page.viewport_size["width"]
    assert all(0 <= c["x"] and c["right"] <= width + 1 for c in caps)  # no column off-screen
    columns = len({round(c["x"]) for c in caps})
    assert (2 <= columns <= 3) if page.viewport_name == "phone" else columns >= 4
    inner_scroll = page.evaluate("""[...document.querySelectorAll('#results .grid-wrap, #results .grid-container')]
        .some(e => e.scrollHeight > e.clientHeight + 1 && getComputedStyle(e).overflowY != 'visible')""")
    assert not inner_scroll  # the page extends, no hidden inner scroll box
    _set_k(page, 20)  # a larger k (re-runs by itself) extends the page too
    assert _in_viewport(page, f"{RESULTS} >> nth=19")
    page.wait_for_function(f"document.querySelectorAll('{RESULTS}')[19].querySelector('img').naturalWidth > 0")
    page.locator("#more-btn").click()
    page.wait_for_function(f"document.querySelectorAll('{RESULTS}').length > 20", timeout=60_000)
    assert _in_viewport(page, "#more-btn")
    assert page.locator("#folder input").first.input_value() == "All folders" and _in_viewport(page, "#folder")


def test_click_replaces_query_details_copy_open_and_search_uses_it(page, served):
    _search(page, _query(served), k=8)
    before = page.locator("#query img").first.get_attribute("src")
    third = _captions(page)[2]["text"].split(" · ")[-1]
    page.locator(RESULTS).nth(2).click()
    page.wait_for_function(f"document.querySelector('#search-info').innerText.includes({json.dumps(third)})",
                           timeout=60_000)
    assert page.evaluate(f"document.querySelectorAll('{RESULTS}.selected').length") == 0  # selection cleared
    page.wait_for_function(f"document.querySelector('#query img') && "
                           f"document.querySelector('#query img').src != {json.dumps(before)}")
    assert _in_viewport(page, "#details")
    full = str(served["photos"] / third)
    field = page.locator("#detail-path textarea, #detail-path input").first
    assert field.input_value() == full
    assert field.evaluate("e => e.tagName") == "INPUT"  # one line: the full path never wraps inside a name
    detail = page.locator("#detail-info").inner_text()
    assert third in detail and "modified" in detail
    _breaks_only_after_a_slash(page, "#detail-info", "code")
    with page.expect_download() as dl:  # the export names the query as the path it is, no Markdown
        page.locator("#export-json").click()
    assert json.loads(Path(dl.value.path()).read_text())["query"] == third
    preview = page.locator("#detail-preview img").first
    assert preview.bounding_box()["width"] >= 160
    assert page.locator("#detail-path button[aria-label*='opy'], #detail-path button[title*='opy']").count() >= 1
    with page.context.expect_page() as popup:  # "Open original": the original's bytes, in a new tab
        page.locator("#open-original").click()
    tab = popup.value
    tab.wait_for_load_state()
    body = page.request.get(tab.url).body()
    assert body == (served["photos"] / third).read_bytes()
    tab.close()
    page.locator("#search-btn").click()  # Search now uses the result's image, not the first upload
    _wait_results(page, 8, "uploaded image")
    assert _captions(page)[0]["text"].split(" · ")[-1] == third


def test_tick_results_and_search_again_with_them(page, served):
    if page.viewport_name == "phone":
        pytest.skip("the same components at both sizes: one run is enough for the events")
    q = _query(served)
    _search(page, q, k=8)
    names = [c["text"].split(" · ")[-1] for c in _captions(page)]
    itself = q.relative_to(served["photos"]).as_posix()
    assert itself not in names  # the upload is indexed: the photo itself is left out of its results
    assert "the photo itself is left out" in page.locator("#search-info").inner_text()
    more = page.locator("#more-like input[type=checkbox]")
    more.first.wait_for()
    assert more.count() == 8
    more.nth(1).check()
    more.nth(2).check()
    page.locator("#less-like input[type=checkbox]").nth(7).check()
    page.locator("#again-btn").click()
    _wait_results(page, 8, "3 photos, less like 1")
    again = [c["text"].split(" · ")[-1] for c in _captions(page)]
    assert not {itself, names[1], names[2], names[7]} & set(again), again  # the query's photos are left out
    page.wait_for_function("document.querySelectorAll('#more-like input[type=checkbox]').length == 8 && "
                           "[...document.querySelectorAll('#more-like input[type=checkbox]')].every(c => !c.checked)")


def test_k_and_folder_rerun_and_export(page, served, tmp_path):
    exports = page.locator("#export-csv, #export-json")
    page.locator("#export-json").wait_for(state="attached")  # the page renders in parts: #query may come first
    assert exports.count() == 2 and all(exports.nth(i).is_disabled() for i in range(2))  # nothing to export yet
    _search(page, _query(served), k=10)
    for i in range(2):
        _turns_enabled(exports.nth(i))  # with the results (the same update, maybe a frame later)
    _set_k(page, 4)
    family = _query(served).parent.name
    page.locator("#folder input").click()
    page.get_by_role("option", name=family, exact=True).click()
    page.wait_for_function(f"document.querySelector('#search-info').innerText.includes('{family}/')",
                           timeout=60_000)
    _wait_results(page, 4)
    shown = [c["text"].split(" · ")[-1] for c in _captions(page)]
    assert all(s.startswith(family + "/") for s in shown)
    scores = [c["text"].split(" · ")[1] for c in _captions(page)]
    with page.expect_download() as dl:
        page.locator("#export-csv").click()
    rows = list(csv.DictReader(io.StringIO(Path(dl.value.path()).read_text())))
    assert [r["path"] for r in rows] == shown and [int(r["rank"]) for r in rows] == [1, 2, 3, 4]
    assert [r["score"] for r in rows] == scores  # the page's text, to the digit
    weak = ["weak match" in c["text"] for c in _captions(page)]
    assert [r["weak_match"] for r in rows] == [str(w).lower() for w in weak]  # true/false, not Python's True
    with page.expect_download() as dl:
        page.locator("#export-json").click()
    data = json.loads(Path(dl.value.path()).read_text())
    assert [r["path"] for r in data["results"]] == shown and data["folder"] == family


BAD = {
    "notes.jpg": (lambda p: p.write_text("this is a text file, not a photo"), "notes.jpg: not an image"),
    "empty.jpg": (lambda p: p.write_bytes(b""), "empty.jpg: empty file"),
    "cut.jpg": (None, "cut.jpg: truncated or corrupt"),
    "tiny.png": (lambda p: Image.new("RGB", (1, 1)).save(p), "tiny.png is 1 x 1 pixels: too small to search with"),
}


# The results' heading as said, without the event timer Gradio draws over a pending output ("0.1s"): on a loaded
# machine the timer of the last event can still show, with another count, when the heading is read.
HEADING_JS = r"document.querySelector('#search-info').innerText.replace(/^\s*\d+(\.\d+)?s\s*/, '')"


def _heading(page: Any) -> str:
    return page.evaluate(HEADING_JS)


def test_bad_uploads_get_our_message_and_one_log_line(page, served, tmp_path):
    _search(page, _query(served), k=6)  # results on screen: a bad upload must not leave them under its message
    heading = _heading(page)
    good = _query(served).read_bytes()
    start = served["log"].stat().st_size  # this test's part of the server log
    for name, (make, words) in BAD.items():
        path = tmp_path / name
        make(path) if make else path.write_bytes(good[: len(good) // 2])
        page.locator("#query input[type=file]").set_input_files(str(path))
        page.wait_for_timeout(300)
        page.locator("#search-btn").click()
        page.wait_for_function(f"document.querySelector('#search-error').innerText.includes({json.dumps(words)})",
                               timeout=30_000)
        assert _in_viewport(page, "#search-error")
        assert "upload a" in page.locator("#search-error").inner_text()
        with contextlib.suppress(Exception):  # the event's timer ("0.1s") may leave the heading a frame after
            page.wait_for_function(f"{HEADING_JS} === {json.dumps(heading)}", timeout=5_000)
        assert _heading(page) == heading  # the results shown, still said as they are
        assert page.locator(RESULTS).count() == 6
    big = tmp_path / "huge.jpg"
    big.write_bytes(good + b"\0" * (26 * 1024 * 1024))
    page.expect_errors = True  # Gradio itself logs the refused upload in the console
    page.locator("#query input[type=file]").set_input_files(str(big))
    page.wait_for_function("document.querySelector('#search-error').innerText.includes('over the 25 MB upload limit')",
                           timeout=30_000)
    assert "huge.jpg is 27" in page.locator("#search-error").inner_text()
    with contextlib.suppress(Exception):  # as above: the event's timer may leave the heading a frame after
        page.wait_for_function(f"{HEADING_JS} === {json.dumps(heading)}", timeout=5_000)
    assert _heading(page) == heading
    log = served["log"].read_bytes()[start:].decode()
    assert "Traceback" not in log
    for name, (_, words) in BAD.items():
        lines = [line for line in log.splitlines() if name in line]
        assert len(lines) == 1 and words in lines[0], (name, log[-2000:])  # one line per bad upload


def test_inspect_negatives_from_a_result(page, served):
    _search(page, _query(served), k=6)
    page.locator(RESULTS).nth(1).click()
    page.wait_for_selector("#inspect-btn", state="visible")
    page.wait_for_function("document.querySelector('#detail-info').innerText.includes('modified')", timeout=60_000)
    page.locator("#inspect-btn").click()
    page.wait_for_function("document.querySelector('#neg-summary') && "
                           "document.querySelector('#neg-summary').innerText.includes('InfoNCE loss')",
                           timeout=60_000)
    summary = page.locator("#neg-summary").inner_text()
    assert "negatives score at or above the positive" in summary and "%" in summary
    assert "0 key" not in summary and "key(s)" not in summary
    assert _in_viewport(page, "#neg-summary")
    sizes = page.evaluate("[...document.querySelectorAll('#views img')].map(i => i.getBoundingClientRect().width)")
    assert len(sizes) == 2 and min(sizes) >= 160, sizes  # the augmentation is visible
    _label_clear_of_first_item(page, "#negatives")
    table = page.locator("#negatives-table").inner_text()
    assert "%" in table and "softmax share" in table and _in_viewport(page, "#negatives-table")
    assert not _overflowing(page, "#negatives-table")  # no inner scroll box, no column cut off
    heads = page.evaluate("""[...document.querySelectorAll('#negatives-table th')].map(h => {
        const r = h.getBoundingClientRect(); return [h.innerText.trim(), r.left, r.right]; })""")
    width = page.viewport_size["width"]
    assert [h[0] for h in heads] == ["rank", "photo", "cosine", "logit (cos/T)", "softmax share",
                                     "likely false negative (evidence)"]
    assert all(0 <= left and right <= width + 1 for _, left, right in heads), heads  # every column on screen


@pytest.mark.parametrize("viewport", list(VIEWPORTS))
def test_the_status_log_wraps_its_lines(browser, pending, viewport):
    page = _new_page(browser, pending["url"], viewport, "#title")
    page.get_by_role("tab", name="Status").click()
    page.wait_for_function("document.querySelector('#status-info .status-log') && "
                           "document.querySelector('#status-info .status-log').innerText.includes('sample_photos')",
                           timeout=30_000)
    assert _in_viewport(page, "#status-info .status-log")
    assert not _overflowing(page, "#status-info")  # every line whole on screen, no inner scroll box
    log = page.locator("#status-info .status-log").inner_text()
    assert " ".join(log.split()) == LONG_MESSAGE  # wrapped, nothing cut
    _close(page)


HINT = "#search-info"
HINT_TEXT = f"document.querySelector('{HINT}') && document.querySelector('{HINT}').innerText"


def test_the_search_hint_and_buttons_follow_the_index(browser, pending):
    """Before the index: search and exports off, the hint says search turns on by itself; once it is on, the
    open page and any page opened later say so."""
    before = _new_page(browser, pending["url"], "desktop", "#title")
    before.get_by_role("tab", name="Search").click()
    assert "turns on by itself when the index is ready" in before.locator(HINT).inner_text()
    for button in ("#search-btn", "#export-csv", "#export-json"):
        assert before.locator(button).is_disabled(), button
    before.locator("#query input[type=file]").set_input_files(str(_query(pending)))  # a photo while it waits
    before.wait_for_timeout(1000)
    assert before.locator("#search-btn").is_disabled()  # no index yet: nothing to search
    pending["app"].attach(pending["idx"], device="cpu")
    before.wait_for_function(f"{HINT_TEXT}.includes('Upload a photo and press Search')", timeout=30_000)
    _turns_enabled(before.locator("#search-btn"))  # the photo given before: on with the index
    after = _new_page(browser, pending["url"], "desktop", "#title")  # a page opened once search is on
    after.wait_for_selector("#search-btn", timeout=30_000)  # it opens on the Search tab
    after.wait_for_function(f"{HINT_TEXT}.includes('Upload a photo and press Search')", timeout=30_000)
    for page in (before, after):
        assert "turns on by itself" not in page.locator(HINT).inner_text()
        assert page.locator("#export-csv").is_disabled() and page.locator("#export-json").is_disabled()  # no results
        assert page.locator("#more-btn").is_disabled() and page.locator("#again-btn").is_disabled()  # no search
    assert after.locator("#search-btn").is_disabled()  # no photo given: nothing to search with
    _search(after, _query(pending), k=4)
    _turns_enabled(after.locator("#export-csv"))
    _turns_enabled(after.locator("#more-btn"))  # a full page of 4: more may follow
    assert after.locator("#again-btn").is_disabled()  # nothing ticked yet
    after.locator("#more-like label").first.click()
    _turns_enabled(after.locator("#again-btn"))
    _close(before)
    _close(after)


# ------------------------------------------------------------------------------------ duplicates, reviewed
@pytest.fixture(scope="module")
def dup_served(backbone, tmp_path_factory) -> Iterator[dict[str, Any]]:
    """`moco serve` over a collection with an exact and a near copy, its duplicates found by `moco index dedup`."""
    from index.building.runner import build_index

    from .test_dedup_actions import _bytes, _collection

    tmp = tmp_path_factory.mktemp("dups")
    photos = tmp / "photos"
    expected = _collection(photos)
    build_index(photos, backbone, tmp / "idx", progress=False, device="cpu")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, "-m", "app.cli", "index", "dedup", str(tmp / "idx")], env=env, check=True,
                   capture_output=True)
    with moco_serve(tmp / "idx", tmp / "server.log") as url:
        yield {"url": url, "photos": photos, "idx": tmp / "idx", "expected": expected, "before": _bytes(photos),
               "log": tmp / "server.log"}


def _dup_message(page: Any, words: str, log: Path) -> str:
    """The Collection tab's message once it says ``words``; else a failure that shows what the page and the server
    said instead (the message, the buttons, Gradio's toasts, the page's errors and loads, the server log's end)."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    try:
        page.wait_for_function(f"document.querySelector('#dup-message').innerText.includes({json.dumps(words)})",
                               timeout=180_000)
    except PlaywrightTimeout:
        buttons = {b: page.locator(b).is_enabled() for b in ("#dup-keep-btn", "#dup-move-btn", "#dup-undo-btn")}
        toasts = page.evaluate("[...document.querySelectorAll('[class*=toast]')].map(t => t.innerText.trim())"
                               ".filter(Boolean)")  # Gradio's: an error, or its connection given up for lost
        tail = log.read_text(errors="replace").splitlines()[-40:]
        said = page.locator("#dup-message").inner_text()
        raise AssertionError(f"no {words!r} in the message: {said!r}; buttons enabled: {buttons}; toasts: {toasts}; "
                             f"page errors: {page.errors}; loads: {len(page.loads)}; the server's log ends:\n"
                             + "\n".join(tail)) from None
    return page.locator("#dup-message").inner_text()


def test_review_a_page_of_groups_change_a_keeper_move_and_undo(browser, dup_served):
    from index.duplicates.resolve.actions import DUPLICATES_DIR

    from .test_dedup_actions import _where

    photos, dups = dup_served["photos"], dup_served["photos"] / DUPLICATES_DIR
    exact, near = dup_served["expected"]["exact"], dup_served["expected"]["near"]
    page = _new_page(browser, dup_served["url"], "desktop", "#title")
    page.get_by_role("tab", name="Collection").click()
    page.wait_for_function("document.querySelectorAll('#dup-groups .dup-group').length == 2", timeout=60_000)
    assert "Groups 1–2 of 2" in page.locator("#dup-where").inner_text()
    panels = page.locator("#dup-groups .dup-group")
    assert "exact · 2 photos" in panels.nth(0).inner_text() and "near · 2 photos" in panels.nth(1).inner_text()
    first = panels.nth(0).inner_text()
    assert "✓ keep" in first and "identical to the keeper" in first and "oldest file" in first and "64×64" in first
    page.wait_for_function("[...document.querySelectorAll('#dup-groups img')].every(i => i.complete && "
                           "i.naturalWidth > 0)", timeout=60_000)  # the thumbnails, drawn (a broken one never is)
    assert f"keep {near[0]}: most pixels (64 x 64)" in panels.nth(1).inner_text().replace("\n", " ")
    # the near group: keep its small copy instead, then move the other (its original) out
    page.locator("#dup-group input").click()
    page.get_by_role("option", name="Group 2 · near · 2 photos").click()
    page.wait_for_function(f"document.querySelector('#dup-keeper').innerText.includes({json.dumps(near[1])})",
                           timeout=30_000)
    page.locator("#dup-keeper label", has_text=near[1]).click()
    _turns_enabled(page.locator("#dup-keep-btn"))  # another photo than the keeper chosen
    page.locator("#dup-keep-btn").click()
    _dup_message(page, f"keeping {near[1]}", dup_served["log"])  # the path as code
    page.wait_for_function("document.querySelectorAll('#dup-groups .dup-group')[1].innerText.includes('chosen by "
                           "you')", timeout=30_000)
    _turns_enabled(page.locator("#dup-move-btn"))
    page.locator("#dup-move-btn").click()
    text = _dup_message(page, "photo moved", dup_served["log"])
    assert "1 photo moved" in text and "index updated" in text
    where = _where(dup_served["before"], photos, dups)
    assert [p for p, w in where.items() if w == "dest"] == [near[0]]  # the original moved, the chosen copy kept
    page.wait_for_function("document.querySelectorAll('#dup-groups .dup-group').length == 1", timeout=30_000)
    # every exact group at once into a folder of the user's, first as a dry run, then for real; then undo both moves
    elsewhere = photos.parent / "elsewhere"
    page.locator("#dup-move-to textarea, #dup-move-to input").first.fill(str(elsewhere))
    page.locator("#dup-dry-run input").check()
    page.locator("#dup-bulk-btn").click()
    text = _dup_message(page, "would move", dup_served["log"])
    assert f"Dry run: 1 photo would move to {elsewhere}" in text and exact[1] in text
    assert not elsewhere.exists() and _where(dup_served["before"], photos, dups)[exact[1]] == "root"  # nothing moved
    page.locator("#dup-dry-run input").uncheck()
    page.locator("#dup-bulk-btn").click()
    # the message of the move before says "1 photo moved" too: the groups gone say this move is done
    page.wait_for_function("document.querySelector('#dup-where').innerText.includes('No exact or near groups')",
                           timeout=60_000)
    assert f"1 photo moved to {elsewhere}" in _dup_message(page, "1 photo moved", dup_served["log"])
    assert (elsewhere / exact[1]).is_file() and not (photos / exact[1]).exists()
    assert (dups / near[0]).is_file() and not (photos / near[0]).exists()  # the move before, where it went
    _turns_enabled(page.locator("#dup-undo-btn"))
    page.locator("#dup-undo-btn").click()
    _dup_message(page, "2 photos put back", dup_served["log"])
    assert set(_where(dup_served["before"], photos, dups).values()) == {"root"}
    assert [p.name for p in elsewhere.rglob("*")] == [".moco-destination.json"]  # emptied folders gone
    page.wait_for_function("document.querySelectorAll('#dup-groups .dup-group').length == 2", timeout=30_000)
    _close(page)
