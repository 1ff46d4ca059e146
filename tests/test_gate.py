"""The gate of the expensive routes: deterministic with events (no timing), and on a live server, a full gate answers
the collection's views with 503 and Retry-After while searches go on."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

from app.api.gate import Gate
from app.guard.access import ApiSettings
from app.search.batcher import Overloaded
from app.server.launch import serve

from .live import free_port


def _occupy(gate: Gate, n: int) -> tuple[threading.Event, list[threading.Thread], list[object]]:
    """``n`` calls admitted by ``gate`` that block until the event is set (each awaited in a thread of its own)."""
    release, started, out = threading.Event(), threading.Semaphore(0), []

    def blocked() -> str:
        started.release()
        release.wait()
        return "done"

    def call() -> None:
        try:
            out.append(asyncio.run(gate.run(blocked)))
        except Overloaded as e:
            out.append(e)

    threads = [threading.Thread(target=call) for _ in range(n)]
    for t in threads:
        t.start()
    for _ in range(min(n, gate.running)):
        started.acquire(timeout=60)  # the running ones have started (the others wait in line)
    return release, threads, out


def _until(done, guard_s: float = 120) -> None:
    """Wait until ``done()`` (a guard against a hang, not a measurement)."""
    import time

    deadline = time.monotonic() + guard_s
    while not done():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_the_gate_runs_some_lines_up_some_and_sheds_the_rest():
    now = [0.0]
    gate = Gate(running=1, waiting=2, clock=lambda: now[0])
    release, threads, out = _occupy(gate, 3)
    _until(lambda: gate.pending == 3)  # all three admitted (one running, two in line)
    with pytest.raises(Overloaded, match=r"busy \(3 views of the collection in flight, its limit\): try again in"):
        asyncio.run(gate.run(lambda: "never"))
    assert gate.retry_after() >= 1
    release.set()
    for t in threads:
        t.join(60)
    assert out == ["done"] * 3 and gate.pending == 0
    assert asyncio.run(gate.run(lambda x: x + 1, 41)) == 42  # a place again
    gate.close()


def test_a_full_gate_sheds_the_views_not_the_searches(backbone, sample_photos, tmp_path):
    from index.building.runner import build_index

    build_index(sample_photos, backbone, tmp_path / "idx", progress=False)
    port = free_port()
    demo = serve(tmp_path / "idx", port=port, device="cpu", block=False, api=ApiSettings())
    gate = demo.api_service.views
    photo = sorted(sample_photos.rglob("*.jpg"))[0]
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}/api/v1", timeout=120) as http:
            release, threads, _ = _occupy(gate, gate.limit)
            try:
                _until(lambda: gate.pending == gate.limit)
                for path in ("/themes?k=7", "/map", "/unusual", "/photos", "/themes/0"):
                    r = http.get(path)
                    assert r.status_code == 503, (path, r.status_code, r.text[:200])
                    assert int(r.headers["Retry-After"]) >= 1 and "views of the collection" in r.json()["detail"]
                r = http.post("/search", files={"image": (photo.name, photo.read_bytes())}, data={"k": "3"})
                assert r.status_code == 200 and len(r.json()["results"]) == 3  # searches go on
                assert http.get("/stats").status_code == 200
            finally:
                release.set()
                for t in threads:
                    t.join(60)
            assert http.get("/themes?k=7").json()["k"] == 7
    finally:
        demo.close()
        demo.api_service.close()
