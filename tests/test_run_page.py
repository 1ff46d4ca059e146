"""`moco run` serves its page from the first seconds: Status while training runs (no index yet), then search
turns on by itself in the same page; Ctrl+C/SIGTERM during training stops the run without exporting."""

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
ROOT = Path(__file__).resolve().parents[1]


def _moco_run(work: Path, port: int, steps: int, log: Path, verbose: bool = False) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="2")
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-m", "app.cli", *(["--verbose"] if verbose else []), "run",
                                 "--work", str(work), "--max-steps",
                                 str(steps), "--port", str(port), "--device", "cpu", "--quiet"], env=env,
                                stdout=out, stderr=subprocess.STDOUT)


def _status(page) -> str:
    return page.locator("#status-info").inner_text()


def test_status_while_training_then_search_turns_on(tmp_path):
    from playwright.sync_api import sync_playwright

    work, port, log = tmp_path / "work", free_port(), tmp_path / "run.log"
    proc = _moco_run(work, port, 12, log, verbose=True)
    work = work / "sample"  # the sample's own directory in WORK
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
            assert "/ 12" in training and "loss" in training and "ETA" in training
            assert "preparing the index" in page.locator("#title").inner_text()
            page.wait_for_function("document.querySelector('#loss-plot') && "
                                   "document.querySelector('#loss-plot').offsetParent !== null",
                                   timeout=60_000)  # the live loss curve
            page.wait_for_function("document.querySelector('#status-info').innerText.includes('Ready')",
                                   timeout=600_000)
            assert (work / "index" / "index.faiss").is_file()
            page.wait_for_function("document.querySelector('#title').innerText.includes('240 images')",
                                   timeout=30_000)
            page.get_by_role("tab", name="Search").click()  # the same page, never reloaded
            photo = sorted((work / "photos").rglob("*.jpg"))[0]
            page.locator("#query input[type=file]").set_input_files(str(photo))
            page.wait_for_timeout(300)
            page.locator("#search-btn").click()
            page.wait_for_function("document.querySelectorAll('#results button.thumbnail-item').length == 12",
                                   timeout=60_000)
            assert "12 results" in page.locator("#search-info").inner_text()
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
