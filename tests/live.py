"""Live-server helpers: a free port, waiting for a server to answer, headless Debian chromium through
Playwright (never `playwright install`) and the UI's search gesture."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run"]


def run_tree(cmd: list[str], *, timeout: float, **kwargs: Any) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True, timeout=...)`` for a command that starts processes of
    its own (torchrun's ranks, pytest's workers), in a process group of its own: past ``timeout`` the whole group is
    killed and the test fails with what it printed. (``subprocess.run`` kills only the first process, then waits
    for the end of an output that a rank blocked in a collective keeps open: forever.)"""
    import signal

    import pytest

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            **kwargs)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(cmd[:6])} ... ran past {timeout} s: killed with its processes\n"
                    f"{out[-2000:]}\n{err[-3000:]}")
    finally:
        if proc.poll() is None:  # the test stopped some other way (its own timeout, Ctrl+C): nothing left behind
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def killed_after_first(module: str, name: str, setup: str, call: str, *args: str) -> None:
    """Run ``call`` (Python, with ``args`` as ``sys.argv[1:]``) in a process of its own in which ``module``'s
    ``name`` (a function, or ``Class.method``) kills the process with SIGKILL right after its first call returns,
    as a power cut would; ``setup`` runs first (e.g. a smaller block size). Fails the test unless it died so."""
    import signal

    import pytest

    owner, _, attr = name.rpartition(".")
    target = f"m.{owner}" if owner else "m"
    code = (f"import os, signal, sys\nimport {module} as m\n{setup}\nreal = {target}.{attr}\n"
            f"def once(*a, **k):\n    out = real(*a, **k)\n    os.kill(os.getpid(), signal.SIGKILL)\n"
            f"{target}.{attr} = once\n{call}\n")
    done = run_tree([sys.executable, "-c", code, *args], timeout=600, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    if done.returncode != -signal.SIGKILL:
        pytest.fail(f"{module}.{name} did not end the process with SIGKILL: {done.returncode}\n{done.stderr[-2000:]}")


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
def moco_serve(index_dir: Path, log: Path, *flags: str) -> Iterator[str]:
    """`moco serve INDEX_DIR FLAGS` in a process of its own on a free port (CPU, one thread), its output in ``log``:
    the page's URL once it answers; the server is stopped at the end."""
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "app.cli", "serve", str(index_dir), "--port", str(port),
                                 "--device", "cpu", *flags], env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/"
    try:
        wait_served(url, proc, timeout=180)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@contextmanager
def chromium() -> Iterator[Any]:
    """A fresh headless Debian chromium (a Playwright ``Browser``)."""
    from playwright.sync_api import sync_playwright

    assert Path(CHROMIUM).exists(), "install Debian's chromium (`make test` does: apt-get install chromium)"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            yield browser
        finally:
            browser.close()


@contextmanager
def chromium_page(url: str) -> Iterator[Any]:
    """A page of a fresh headless chromium at ``url``."""
    with chromium() as browser:
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        page.goto(url)
        yield page


def search_in_page(page: Any, image: Path, k: int) -> None:
    """Upload ``image`` in the Search tab, set k, press Search and wait for ``k`` results in the gallery. The page's
    first render waits for the server's config and load events: on a machine busy with other work that takes more
    than Playwright's default 30 s, so the upload waits up to 120 s (a bound on waiting, not a speed asserted)."""
    page.locator("#query input[type=file]").set_input_files(str(image), timeout=120_000)
    page.locator("#k input[type=number]").fill(str(k))
    page.locator("#k input[type=number]").press("Enter")
    page.wait_for_timeout(500)
    page.locator("#search-btn").click()
    page.wait_for_function(f"document.querySelectorAll('#results button.thumbnail-item').length == {k}",
                           timeout=60_000)
