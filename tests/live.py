"""Live-server helpers: a free port, waiting for a server to answer, headless Debian chromium through
Playwright (never `playwright install`) and the UI's search gesture."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run"]


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_served(url: str, proc: subprocess.Popen, timeout: float = 300) -> Any:
    """The first HTTP response from ``url`` (any status) once ``proc``'s server listens."""
    import httpx

    t0 = time.time()
    while True:
        try:
            return httpx.get(url, timeout=2)
        except httpx.HTTPError:
            assert proc.poll() is None, "the server exited before answering"
            assert time.time() - t0 < timeout, f"{url} did not answer in {timeout} s"
            time.sleep(0.3)


@contextmanager
def chromium_page(url: str) -> Iterator[Any]:
    """A page of a fresh headless chromium at ``url``."""
    from playwright.sync_api import sync_playwright

    assert Path(CHROMIUM).exists(), "install Debian's chromium (`make test` does: apt-get install chromium)"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.goto(url)
            yield page
        finally:
            browser.close()


def search_in_page(page: Any, image: Path, k: int) -> None:
    """Upload ``image`` in the Search tab, set k, press Search and wait for ``k`` results in the gallery."""
    page.locator("#query input[type=file]").set_input_files(str(image))
    page.locator("#k input[type=number]").fill(str(k))
    page.locator("#k input[type=number]").press("Enter")
    page.wait_for_timeout(500)
    page.locator("#search-btn").click()
    page.wait_for_function(f"document.querySelectorAll('#results button.thumbnail-item').length == {k}",
                           timeout=60_000)
