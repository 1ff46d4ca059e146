"""Which web pages may call the JSON API from a browser (app/guard/origins.py), on a real server over real HTTP: the
server's own and the ``--api-cors-origin`` ones; any other origin gets 403, whichever name the server is reached by
(Gradio's own CORS middleware, which the server's Starlette one turns off, would let it read the answers with the
visitor's login when that name is not localhost)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from app.guard.access import ApiSettings
from app.guard.origins import check_cors_origins
from app.server.launch import serve
from index.building.runner import build_index
from moco.errors import UserError

from .live import ARGS, CHROMIUM, free_port, wait_served

TOKEN = "cors-token-0123456789abcdef"
ALLOWED = "https://app.example"
EVIL = "https://evil.example"
BEARER = {"Authorization": f"Bearer {TOKEN}"}


SITE_PORT = free_port()  # the port of the web apps in the browser test: the named one, then another site
SITE = f"http://app.example:{SITE_PORT}"


@pytest.fixture(scope="module")
def server(sample_photos, backbone, tmp_path_factory):
    """A live server whose API names two other origins: (base url, port)."""
    idx = tmp_path_factory.mktemp("cors") / "idx"
    build_index(sample_photos, backbone, idx, progress=False)
    port = free_port()
    demo = serve(idx, port=port, device="cpu", block=False,
                 api=ApiSettings(token=TOKEN, cors_origins=check_cors_origins([f"{ALLOWED}/,{SITE}"]),
                                 allowed_hosts=("photos.example",)))
    try:
        yield f"http://127.0.0.1:{port}", port
    finally:
        demo.close()
        demo.api_service.close()


# The server reached as localhost, and under another name (a LAN address, a domain behind a reverse proxy).
HOSTS = ["localhost", "photos.example"]


@pytest.mark.parametrize("host", HOSTS)
def test_another_sites_page_is_refused_with_403_and_no_answer(server, host):
    url, port = server
    with httpx.Client(base_url=url, timeout=60, headers={"Host": f"{host}:{port}"}) as c:
        r = c.get("/api/v1/stats", headers={**BEARER, "Origin": EVIL})
        assert r.status_code == 403, r.text
        assert r.json() == {"detail": f"a web page from {EVIL} may not call this API: start the server with "
                                      f"--api-cors-origin {EVIL} to allow that page"}
        pre = c.options("/api/v1/search", headers={"Origin": EVIL, "Access-Control-Request-Method": "POST",
                                                   "Access-Control-Request-Headers": "authorization"})
        assert pre.status_code == 403 and "access-control-allow-origin" not in pre.headers
        r = c.get("/api/v1/stats", headers={**BEARER, "Origin": "null"})  # a sandboxed frame, a file:// page
        assert r.status_code == 403 and "Origin 'null' may not call this API" in r.json()["detail"]


@pytest.mark.parametrize("host", HOSTS)
def test_a_named_origin_gets_the_preflight_and_the_answer(server, sample_photos: Path, host):
    url, port = server
    photo = sorted(sample_photos.rglob("*.jpg"))[0]
    with httpx.Client(base_url=url, timeout=60, headers={"Host": f"{host}:{port}"}) as c:
        pre = c.options("/api/v1/search", headers={"Origin": ALLOWED, "Access-Control-Request-Method": "POST",
                                                   "Access-Control-Request-Headers": "authorization"})
        assert pre.status_code == 200  # Starlette's CORSMiddleware's answer
        assert pre.headers["access-control-allow-origin"] == ALLOWED
        assert "POST" in pre.headers["access-control-allow-methods"]
        assert "authorization" in pre.headers["access-control-allow-headers"].lower()
        r = c.post("/api/v1/search", headers={**BEARER, "Origin": ALLOWED},
                   files={"image": (photo.name, photo.read_bytes())}, data={"k": "3"})
        assert r.status_code == 200 and len(r.json()["results"]) == 3
        assert r.headers["access-control-allow-origin"] == ALLOWED
        assert "retry-after" in r.headers["access-control-expose-headers"].lower()
        assert c.get("/api/v1/stats", headers={"Origin": ALLOWED}).status_code == 401  # still needs the login


def test_the_servers_own_pages_and_programs_pass(server):
    url, port = server
    for host, origin in [(f"127.0.0.1:{port}", f"http://127.0.0.1:{port}"),
                         ("photos.example", "https://photos.example"), ("photos.example:443", "https://photos.example"),
                         (f"photos.example:{port}", None)]:
        headers = {**BEARER, "Host": host, **({"Origin": origin} if origin else {})}
        r = httpx.get(url + "/api/v1/stats", headers=headers, timeout=60)
        assert r.status_code == 200 and r.json()["images"] > 0, (host, origin, r.text)
        assert "access-control-allow-origin" not in r.headers or r.headers["access-control-allow-origin"] == origin
    # the same name on another port or scheme is another origin
    r = httpx.get(url + "/api/v1/stats", headers={**BEARER, "Host": "photos.example", "Origin": "http://photos.example:8080"},
                  timeout=60)
    assert r.status_code == 403


def test_the_pages_routes_answer_another_site_without_cors_headers(server, sample_photos: Path):
    """Gradio's middleware would reflect any origin, with credentials, for a server reached as photos.example: a
    foreign origin gets no CORS header at all (the page's own script needs none); a named origin gets its own."""
    url, port = server
    for path in ["/config", "/gradio_api/info"]:
        for host in HOSTS:
            r = httpx.get(url + path, headers={**BEARER, "Origin": EVIL, "Host": f"{host}:{port}"}, timeout=60)
            assert r.status_code == 200 and "access-control-allow-origin" not in r.headers, (path, host, r.headers)
            assert "access-control-allow-credentials" not in r.headers
        pre = httpx.options(url + path, headers={"Origin": EVIL, "Host": f"photos.example:{port}",
                                                 "Access-Control-Request-Method": "POST"}, timeout=60)
        assert "access-control-allow-origin" not in pre.headers
        r = httpx.get(url + path, headers={**BEARER, "Origin": ALLOWED, "Host": f"photos.example:{port}"}, timeout=60)
        assert r.headers["access-control-allow-origin"] == ALLOWED
    photo = sorted(sample_photos.rglob("*.jpg"))[0]  # the page's upload, from its own origin: works as before
    r = httpx.post(url + "/gradio_api/upload", files={"files": (photo.name, photo.read_bytes())},
                   headers={**BEARER, "Origin": "https://photos.example", "Host": "photos.example"},
                   timeout=60)
    assert r.status_code == 200 and r.json()[0].endswith(photo.name)


def test_origins_are_checked_and_written_as_browsers_send_them():
    assert check_cors_origins(["HTTPS://App.Example:443/", "http://localhost:3000,http://[::1]:80"]) == (
        "https://app.example", "http://localhost:3000", "http://[::1]")
    assert check_cors_origins([]) == ()
    for bad, words in [("*", "name each web page's origin"), ("https://app.example/path", "no path"),
                       ("app.example", "scheme://host[:port]"), ("ftp://app.example", "scheme://host[:port]"),
                       ("https://app.example:99999", "port")]:
        with pytest.raises(UserError, match=words.replace("[", r"\[").replace("]", r"\]")):
            check_cors_origins([bad])


def test_the_flag_is_checked_before_serving(capsys):
    from app.cli.commands import main

    assert main(["serve", "no-such-idx", "--api-cors-origin", "*"]) == 2
    assert "--api-cors-origin '*'" in capsys.readouterr().err


FETCH = """async ([api, token]) => {
  try {
    const stats = await fetch(api + "/api/v1/stats", {headers: {Authorization: "Bearer " + token}});
    const page = await fetch(api + "/config", {credentials: "include", headers: {Authorization: "Bearer " + token}});
    return "read " + stats.status + " " + (await stats.json()).images + " " + (await page.json()).version.length;
  } catch (e) {
    return "blocked: " + e;
  }
}"""


@pytest.mark.slow
def test_a_browser_reads_the_api_only_from_a_named_origin(server, tmp_path):
    """Real chromium, the server reached as photos.example (where Gradio alone would let any origin read it), and
    two web apps on the same port under two names: app.example (named) reads the API; evil.example reads neither
    the API nor the page's routes."""
    from playwright.sync_api import sync_playwright

    _, port = server
    (tmp_path / "index.html").write_text("<!doctype html><title>a web app</title>")
    site = subprocess.Popen([sys.executable, "-m", "http.server", str(SITE_PORT), "--bind", "127.0.0.1", "--directory",
                             str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_served(f"http://127.0.0.1:{SITE_PORT}/", site, timeout=30)
        rules = "MAP photos.example 127.0.0.1, MAP app.example 127.0.0.1, MAP evil.example 127.0.0.1"
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=[*ARGS, f"--host-resolver-rules={rules}"])
            try:
                answers = {}
                for name in ["app.example", "evil.example"]:
                    page = browser.new_page()
                    page.goto(f"http://{name}:{SITE_PORT}/")
                    answers[name] = page.evaluate(FETCH, [f"http://photos.example:{port}", TOKEN])
            finally:
                browser.close()
    finally:
        site.terminate()
        site.wait(30)
    assert answers["app.example"].startswith("read 200 48 "), answers
    assert answers["evil.example"].startswith("blocked: TypeError: Failed to fetch"), answers
