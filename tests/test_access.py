"""One access rule for every route of the server (issue 39), on real servers over real HTTP: whatever a server is
given (``--auth``, ``--api-token`` or both), every route of its app (walked from the app itself: the JSON API,
Gradio's page, API, queue, file and upload routes) refuses an anonymous request, and takes the right credential;
the ``Host`` header is checked on every route (DNS rebinding); one failed-login count for the page and the API."""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.guard.access import ApiSettings, LoginThrottle
from app.server.launch import serve
from index.building.runner import build_index
from moco.errors import UserError

from .live import free_port

TOKEN = "access-token-0123456789abcdef"
AUTH = ("alice", "right-pass-123")
BEARER = {"Authorization": f"Bearer {TOKEN}"}
MODES = ["token", "login", "both"]
# What an anonymous request may reach: the login form (POST /login, throttled; GET / answers 200 with a form that
# posts to it), Gradio's packaged frontend files, the same for every Gradio app, and the route Gradio's own launch
# calls (it answers true or false). Nothing else.
PUBLIC = {("POST", "/login"), ("POST", "/login/"), ("GET", "/"), ("HEAD", "/")}
PUBLIC_PREFIXES = ("/assets/", "/static/", "/svelte/", "/favicon.ico", "/manifest.json", "/robots.txt",
                   "/gradio_api/startup-events")


class _Clock:
    """A synthetic clock for the servers' login throttles: a lockout lasts until the test moves it on."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture(scope="module")
def idx(sample_photos, backbone, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("access") / "idx"
    build_index(sample_photos, backbone, out, progress=False)
    return out


@pytest.fixture(scope="module", params=MODES)
def server(request, idx) -> Any:
    """A live server given the token, the login or both: a namespace with url, port, mode, clock, demo."""
    mode, port, clock = request.param, free_port(), _Clock()
    settings = ApiSettings(token=TOKEN if mode != "login" else None, throttle=LoginThrottle(clock=clock))
    if mode == "token":  # the rebinding checks hold with a named origin too
        settings.cors_origins = (f"http://evil.example:{port}",)
    demo = serve(idx, port=port, auth=AUTH if mode != "token" else None, device="cpu", block=False, api=settings)
    try:
        yield type("Server", (), dict(url=f"http://127.0.0.1:{port}", port=port, mode=mode, clock=clock, demo=demo))
    finally:
        demo.close()
        demo.api_service.close()


def _routes(app: Any) -> list[tuple[str, str]]:
    """Every (method, path) the app answers, walked from its routes: mounts and included routers too."""
    out: list[tuple[str, str]] = []

    def walk(routes: list[Any], prefix: str) -> None:
        for r in routes:
            if hasattr(r, "original_router"):  # FastAPI's included router (Gradio's /gradio_api)
                walk(r.original_router.routes, prefix + r.include_context.prefix)
            elif hasattr(r, "routes"):  # a mount
                walk(r.routes, prefix + r.path)
            else:
                out.extend((m, prefix + r.path) for m in sorted(getattr(r, "methods", None) or ["WEBSOCKET"]))

    walk(app.routes, "")
    return out


def _concrete(path: str) -> str:
    return re.sub(r"\{[^}]*\}", "1", path)


def _collection_names(idx: Path, sample_photos: Path) -> list[str]:
    return [p.name for p in sample_photos.iterdir()] + [str(idx), "thumbs"]


def _status(http: httpx.Client, method: str, path: str, body: bool = False) -> tuple[int, str]:
    """The status and, for a refusal or with ``body``, the first 64 kB of the answer (a stream is not read)."""
    try:
        with http.stream(method, _concrete(path), timeout=5) as r:
            if not body and r.status_code not in (401, 403):
                return r.status_code, ""
            body = b""
            for chunk in r.iter_bytes():
                body += chunk
                if len(body) > 65536:
                    break
            return r.status_code, body.decode("utf-8", "replace")
    except httpx.ReadTimeout:
        return -1, "(a stream left open)"
    except httpx.RemoteProtocolError:  # Gradio's own stream routes, for an unknown event id
        return -2, "(the connection closed mid-answer)"


@contextmanager
def _logged_in(server: Any) -> Iterator[httpx.Client]:
    """A client logged in with the page's login form (a token-only server: user name ``token``, the token)."""
    user, password = ("token", TOKEN) if server.mode == "token" else AUTH
    with httpx.Client(base_url=server.url, timeout=30) as http:
        r = http.post("/login", data={"username": user, "password": password})
        assert r.status_code == 200, r.text
        yield http


def test_every_route_refuses_an_anonymous_request(server, idx, sample_photos):
    routes = _routes(server.demo.server_app)
    assert len(routes) > 60 and ("POST", "/api/v1/search") in routes and ("POST", "/gradio_api/queue/join") in routes
    names = _collection_names(idx, sample_photos)
    answered = []
    with httpx.Client(base_url=server.url) as http:
        for method, path in routes:
            if method == "WEBSOCKET":
                continue
            public = (method, path) in PUBLIC or (method in ("GET", "HEAD") and path.startswith(PUBLIC_PREFIXES))
            code, body = _status(http, method, path, body=public)
            if public:
                assert not [n for n in names if n in body], (method, path, body[:300])
            elif code not in (401, 403):
                answered.append((method, path, code, body[:80]))
    assert not answered, f"{server.mode}: answered without a login: {answered}"


def test_the_page_answers_an_anonymous_browser_with_a_login_form_and_nothing_else(server, idx, sample_photos):
    r = httpx.get(server.url + "/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "www-authenticate" not in r.headers  # no browser prompt: the form below
    assert '<form' in r.text and 'name="password"' in r.text
    assert not [n for n in _collection_names(idx, sample_photos) if n in r.text]  # Gradio's page names the folders
    assert ("--api-token" in r.text) == (server.mode != "login") and ("--auth" in r.text) == (server.mode != "token")


def test_every_route_takes_the_right_credential(server):
    """Logged in on the page (the login form; with a token-only server: user name ``token``, the token as the
    password), no route refuses; the JSON API also takes Bearer or Basic, and so do the page's routes."""
    routes = [r for r in _routes(server.demo.server_app) if r[0] != "WEBSOCKET" and r[1] != "/logout"]
    with _logged_in(server) as http:
        refused = [(m, p) for m, p in routes if _refused(*_status(http, m, p))]
        assert not refused, f"{server.mode}: refused with the login: {refused}"
        assert http.get("/config").status_code == 200 and "Search" in http.get("/").text
    others = [BEARER] if server.mode != "login" else []
    if server.mode != "token":
        others.append({"Authorization": "Basic " + base64.b64encode(":".join(AUTH).encode()).decode()})
    for headers in others:
        with httpx.Client(base_url=server.url, headers=headers, timeout=30) as http:
            for path in ["/api/v1/stats", "/config", "/gradio_api/info", "/"]:
                assert http.get(path).status_code == 200, (path, headers)


def _refused(code: int, body: str) -> bool:
    """Refused by the access rule (Gradio's run-history routes answer 401 for a missing Hugging Face login)."""
    return code in (401, 403) and ("login" in body.lower() or "not authenticated" in body.lower()) and (
        "run history" not in body)


def _gradio_search(http: httpx.Client, photo: Path) -> dict:
    """A search through Gradio's own API (upload, call, the event's stream): the gallery of its result."""
    up = http.post("/gradio_api/upload", files={"files": (photo.name, photo.read_bytes())})
    assert up.status_code == 200, up.text
    image = {"path": up.json()[0], "orig_name": photo.name, "meta": {"_type": "gradio.FileData"}}
    # the Search button's inputs: image, k, folder, the folder filter's mode, the dates taken from and to
    call = http.post("/gradio_api/call/search", json={"data": [image, 4, "", "only this folder", "", ""]})
    assert call.status_code == 200, call.text
    with http.stream("GET", f"/gradio_api/call/search/{call.json()['event_id']}") as r:
        lines = [line for line in r.iter_lines() if line.startswith("data:")]
    return json.loads(lines[-1][5:])[0]


def test_a_search_through_gradios_api_needs_the_credential_and_so_do_its_thumbnails(server, sample_photos):
    """The issue's case: with the token only, Gradio's API listed its endpoints and searched without it."""
    photo = sorted(sample_photos.rglob("*.jpg"))[3]
    with httpx.Client(base_url=server.url, timeout=60) as anonymous:
        assert anonymous.get("/gradio_api/info").status_code == 401
        assert anonymous.post("/gradio_api/upload", files={"files": (photo.name, photo.read_bytes())}
                              ).status_code == 401
        assert anonymous.post("/gradio_api/call/search", json={"data": [None, 4, "", "only this folder", "", ""]}
                              ).status_code == 401
        with _logged_in(server) as http:
            gallery = _gradio_search(http, photo)
            assert len(gallery) == 4
            url = gallery[0]["image"]["url"]
            assert http.get(url).status_code == 200
            assert anonymous.get(url).status_code == 401
            first = http.get("/api/v1/stats")  # the page's login cookie opens the JSON API too
            assert first.status_code == 200 and first.json()["images"] > 0
    if server.mode == "token":  # Gradio's own client logs in with the token as docs/api.md says
        from gradio_client import Client, handle_file

        client = Client(server.url, auth=("token", TOKEN), verbose=False, download_files=False)
        gallery, info, *_ = client.predict(handle_file(str(photo)), 4, "", api_name="/search")
        assert "4 results" in info and len(gallery) == 4


def test_another_sites_page_cannot_upload_or_queue_with_the_visitors_login(server, sample_photos):
    """Cross-site request forgery: a page on another site makes the visitor's browser POST to Gradio's upload and
    queue routes, the login cookie attached (Origin: that site). Refused with 403 as the JSON API refuses it, nothing
    stored; the page's own origin (and a program, which sends no Origin) still uploads."""
    photo = sorted(sample_photos.rglob("*.jpg"))[2]
    files = {"files": (photo.name, photo.read_bytes())}
    from gradio.utils import get_upload_folder

    cache = Path(get_upload_folder())
    before = sorted(cache.rglob("*")) if cache.is_dir() else []
    with _logged_in(server) as http:
        for origin in ("https://attacker.example", "null"):
            for method, path, kw in (("POST", "/gradio_api/upload", {"files": files}),
                                     ("POST", "/gradio_api/queue/join", {"json": {"data": [], "fn_index": 0}}),
                                     ("POST", "/api/v1/search", {"files": {"image": files["files"]}})):
                r = http.request(method, path, headers={"Origin": origin}, **kw)
                assert r.status_code == 403, (origin, path, r.status_code, r.text[:200])
                assert "may not" in r.json()["detail"] and "access-control-allow-origin" not in r.headers
        assert (sorted(cache.rglob("*")) if cache.is_dir() else []) == before  # nothing stored
        own = http.post("/gradio_api/upload", files=files, headers={"Origin": server.url})
        assert own.status_code == 200 and own.json()[0].endswith(photo.name)
        assert http.post("/gradio_api/upload", files=files).status_code == 200
        assert http.get("/gradio_api/info", headers={"Origin": "https://attacker.example"}).status_code == 200


# ------------------------------------------------------------------------------------------ DNS rebinding
def test_a_rebinding_pages_host_is_refused_on_every_door(server):
    """What a page on evil.example sends once its name resolves to 127.0.0.1: Host and Origin are its own. With
    a named --api-cors-origin for it (the token server) too."""
    evil = f"evil.example:{server.port}"
    headers = {"Host": evil, "Origin": f"http://{evil}"}
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for path, extra in [("/api/v1/stats", BEARER), ("/", {}), ("/config", {}), ("/gradio_api/info", {})]:
            r = http.get(path, headers={**headers, **extra})
            assert r.status_code == 403, (path, r.status_code, r.text[:200])
            assert "evil.example" in r.json()["detail"] and "--allowed-host" in r.json()["detail"]
            assert "access-control-allow-origin" not in r.headers
        r = http.post("/login", headers=headers, data={"username": "token", "password": TOKEN})
        assert r.status_code == 403
        for host in ["localhost", f"localhost:{server.port}", f"127.0.0.1:{server.port}", f"[::1]:{server.port}"]:
            assert http.get("/api/v1/openapi.json", headers={"Host": host}).status_code != 403, host


# --------------------------------------------------------------------------- one failed-login count
def _page_login(url: str, user: str, password: str) -> int:
    return httpx.post(url + "/login", data={"username": user, "password": password}, timeout=30).status_code


def _api_login(url: str, headers: dict[str, str]) -> int:
    return httpx.get(url + "/api/v1/stats", headers=headers, timeout=30).status_code


def _basic(user: str, password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


def test_wrong_api_logins_lock_the_pages_login_and_the_reverse(server):
    if server.mode == "token":
        api_wrong, page_account, right = {"Authorization": "Bearer wrong-0123456789abcdef"}, "token", TOKEN
        api_right = BEARER
    else:
        api_wrong, page_account, right = _basic(AUTH[0], "wrong"), AUTH[0], AUTH[1]
        api_right = _basic(*AUTH)
    try:
        assert [_api_login(server.url, api_wrong) for _ in range(5)] == [401] * 5
        assert _page_login(server.url, page_account, right) == 429  # the page's login waits too, even when right
        server.clock.t += 3600  # the lockout is over
        assert [_page_login(server.url, page_account, f"wrong{i}") for i in range(5)] == [400] * 5
        assert _api_login(server.url, api_right) == 429  # and the reverse
    finally:
        server.clock.t += 3600
    assert _api_login(server.url, api_right) == 200 and _page_login(server.url, page_account, right) == 200


def test_the_names_a_server_answers_to():
    from app.guard.origins import check_allowed_hosts, host_allowed

    for host in ["", "localhost", "LOCALHOST:7860", "app.localhost:80", "127.0.0.1:7860", "[::1]:7860", "10.0.0.7",
                 "192.168.1.5:7860", "[fe80::1]"]:
        assert host_allowed(host), host
    for host in ["evil.example", "evil.example:7860", "localhost.evil.example", "127.0.0.1.nip.io", "evil.example:x"]:
        assert not host_allowed(host), host
    assert host_allowed("photos.example.:443", names=("photos.example",))
    assert host_allowed("myhost.lan:7860", bind="myhost.lan") and not host_allowed("myhost.lan", bind="0.0.0.0")
    assert host_allowed("anything.example", names=("*",))
    assert check_allowed_hosts(["Photos.Example.,nas.local", "", "nas.local"]) == ("photos.example", "nas.local")
    for bad in ["http://photos.example", "photos.example:443", "photos.example/x", "a b"]:
        with pytest.raises(UserError, match="--allowed-host"):
            check_allowed_hosts([bad])


def test_the_allowed_host_flag_is_checked_before_serving(capsys):
    from app.cli.commands import main

    assert main(["serve", "no-such-idx", "--allowed-host", "https://photos.example/"]) == 2
    assert "--allowed-host 'https://photos.example/': expected a host name" in capsys.readouterr().err


@pytest.mark.slow
def test_a_browser_logs_into_a_token_only_server_with_the_token(idx, sample_photos):
    """The page of a token-only server in chromium: the login form, a wrong token refused, the right one opens
    the page (user name ``token``), which then searches as usual, its thumbnails loaded with the login."""
    from .live import chromium_page, search_in_page

    port = free_port()
    demo = serve(idx, port=port, device="cpu", block=False, api=ApiSettings(token=TOKEN))
    try:
        with chromium_page(f"http://127.0.0.1:{port}/") as page:
            assert page.locator("input[name=username]").input_value() == "token"
            page.fill("input[name=password]", "wrong-token-0123456789")
            page.click("button[type=submit]")
            page.wait_for_function("document.getElementById('error').textContent.length > 0")
            assert "Wrong user name or password" in page.inner_text("#error")
            page.fill("input[name=password]", TOKEN)
            page.click("button[type=submit]")
            page.wait_for_selector("#search-btn", timeout=60_000)  # Gradio's page, logged in
            cookies = {c["name"]: c for c in page.context.cookies()}
            assert any(name.startswith("access-token-") and c["httpOnly"] for name, c in cookies.items())
            search_in_page(page, sorted(sample_photos.rglob("*.jpg"))[3], 4)
            page.wait_for_function("[...document.querySelectorAll('#results img')].every(i => i.naturalWidth > 0)")
    finally:
        demo.close()
        demo.api_service.close()
