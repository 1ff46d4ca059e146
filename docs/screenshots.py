"""Take the README's screenshots from a running search page (the one `make run` serves).

    python docs/screenshots.py http://127.0.0.1:7860 runs/default/sample/photos/mountains/mountains_003.jpg

Writes docs/screenshot.png (desktop, 1280x800) and docs/screenshot-phone.png (390x844): a search, then a
click on the third result (details panel). Uses Debian's chromium through Playwright (never `playwright install`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.live import ARGS, CHROMIUM  # noqa: E402

VIEWS = {"screenshot.png": {"width": 1280, "height": 800}, "screenshot-phone.png": {"width": 390, "height": 844}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("url")
    p.add_argument("photo", type=Path)
    p.add_argument("--k", type=int, default=12)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    args = p.parse_args()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        for name, viewport in VIEWS.items():
            page = browser.new_page(viewport=viewport)
            page.goto(args.url)
            page.get_by_role("tab", name="Search").click()
            page.locator("#query input[type=file]").set_input_files(str(args.photo))
            page.locator("#k input[type=number]").fill(str(args.k))
            page.locator("#k input[type=number]").press("Enter")
            page.wait_for_timeout(500)
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
            print(f"wrote {args.out / name}")
            page.close()
        browser.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
