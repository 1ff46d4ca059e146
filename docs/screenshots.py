"""Take the README's screenshots from a running search page (the one `make run` serves).

    python docs/screenshots.py http://127.0.0.1:7860 runs/default/sample/photos/mountains/mountains_003.jpg

Writes docs/screenshot.png (desktop, 1280x800) and docs/screenshot-phone.png (390x844): a search, then a
click on the third result (details panel); and docs/screenshot-map.png: the Map tab (1280x800), a box drawn over
some points and the pointer over another (``--map-only``: that one alone). Beside them, docs/screenshots.json: for
each picture, its sha256 and the tabs it shows (read from the page when it was taken), which
tests/test_readme.py holds against the page's tabs. Uses Debian's chromium through Playwright (never `playwright
install`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.live import ARGS, CHROMIUM  # noqa: E402

MAP_SHOT = "screenshot-map.png"
RECORD = "screenshots.json"  # each picture's sha256 and the tabs it shows
TABS = """[...document.querySelectorAll('button[role=tab]')].map(b => [b.innerText.trim(), b.offsetParent !== null])"""
VIEWS = {"screenshot.png": {"width": 1280, "height": 800}, "screenshot-phone.png": {"width": 390, "height": 844}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("url")
    p.add_argument("photo", type=Path)
    p.add_argument("--k", type=int, default=12)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    p.add_argument("--map-only", action="store_true", help=f"write {MAP_SHOT} alone")
    args = p.parse_args()
    from playwright.sync_api import sync_playwright

    record_path = args.out / RECORD
    record = json.loads(record_path.read_text()) if record_path.is_file() else {}
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        record[MAP_SHOT] = map_shot(browser, args.url, args.out / MAP_SHOT)
        for name, viewport in {} if args.map_only else VIEWS.items():
            page = browser.new_page(viewport=viewport)
            page.goto(args.url)
            page.get_by_role("tab", name="Search").click()
            page.locator("#query input[type=file]").set_input_files(str(args.photo))
            page.locator("#k input[type=number]").fill(str(args.k))
            page.locator("#k input[type=number]").press("Enter")
            page.wait_for_function("!document.querySelector('#search-btn').disabled", timeout=60_000)
            page.locator("#search-btn").click()
            images = "document.querySelectorAll('#results button.thumbnail-item img')"
            page.wait_for_function(f"{images}.length == {args.k} && [...{images}].every(i => i.complete)",
                                   timeout=60_000)
            page.locator("#results button.thumbnail-item").nth(2).click()
            page.wait_for_function("document.querySelector('#detail-info') && "
                                   "document.querySelector('#detail-info').innerText.includes('modified')",
                                   timeout=60_000)
            page.wait_for_timeout(1500)
            page.evaluate("window.scrollTo(0, 0)")
            page.screenshot(path=str(args.out / name), full_page=True)
            record[name] = _shown(page, args.out / name)
            page.close()
        browser.close()
    record_path.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    print(f"wrote {record_path}")
    return 0


def _shown(page: Any, path: Path) -> dict[str, Any]:
    """What the picture at ``path`` shows: its sha256, the page's tabs and those of them on screen (a phone puts the
    others in a menu) when it was taken."""
    print(f"wrote {path}")
    tabs = page.evaluate(TABS)
    visible = [t for t, on in tabs if on]
    menu = page.locator(".overflow-menu button").first  # a phone: the tabs that do not fit are in this menu
    if menu.count() and menu.is_visible():
        menu.click()
        page.wait_for_timeout(300)
        tabs += page.evaluate("[...document.querySelectorAll('.overflow-dropdown button')].map(b => "
                              "[b.innerText.trim(), false])")
    names = [t for t, _ in tabs]
    return {"sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "tabs": list(dict.fromkeys(names)),
            "visible": visible}


def map_shot(browser: Any, url: str, out: Path) -> dict[str, Any]:
    """The Map tab at 1280x800: a box over the points of the upper left, the pointer over the point nearest the
    middle (its thumbnail shown)."""
    page = browser.new_page(viewport=VIEWS["screenshot.png"])
    page.goto(url)
    page.get_by_role("tab", name="Map").click()
    points = "document.querySelector('#collection-map canvas.cmap-points')"
    page.wait_for_function(f"{points} && {points}.dataset.points > 0", timeout=60_000)
    box = page.locator("#collection-map canvas.cmap-over").bounding_box()
    page.mouse.move(box["x"] + box["width"] * 0.2, box["y"] + box["height"] * 0.05)
    page.mouse.down()
    page.mouse.move(box["x"] + box["width"] * 0.38, box["y"] + box["height"] * 0.4, steps=8)
    page.mouse.up()
    page.wait_for_function("document.querySelector('#map-selection-info').innerText.includes('selected')",
                           timeout=60_000)
    api = "[...document.querySelectorAll('#collection-map *')].find(e => e.cmap).cmap"
    middle = page.evaluate(f"""([w, h]) => {{ const ids = {api}.ids(); let best = null, bd = Infinity;
        for (const id of ids) {{ const [x, y] = {api}.place(id), d = (x - w / 2) ** 2 + (y - h / 2) ** 2;
          if (d < bd) {{ bd = d; best = [x, y]; }} }} return best; }}""", [box["width"], box["height"]])
    page.mouse.move(box["x"] + middle[0], box["y"] + middle[1])
    page.wait_for_function("(() => { const i = document.querySelector('#collection-map .cmap-tip img'); "
                           "return i && i.complete && i.naturalWidth > 0; })()", timeout=30_000)
    page.evaluate("window.scrollTo(0, 0)")
    page.screenshot(path=str(out))
    shown = _shown(page, out)
    page.close()
    return shown


if __name__ == "__main__":
    raise SystemExit(main())
