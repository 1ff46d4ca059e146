"""Login throttling (app.guard.access): the policy against a synthetic clock, then real servers on loopback where a
rotating ``X-Forwarded-For`` must not buy more guesses, and a named trusted proxy does name the client."""

from __future__ import annotations

import pytest

from app.guard.access import LoginThrottle, parse_trusted_proxies

from .live import free_port


class _Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_an_address_is_locked_out_after_failures_with_doubling_waits():
    clock = _Clock()
    th = LoginThrottle(free=3, account_free=100, base_s=2.0, max_s=16.0, forget_s=100.0, clock=clock)
    for _ in range(2):
        assert th.wait("a", "alice") == 0
        th.record("a", "alice", ok=False)
    assert th.wait("a", "alice") == 0
    th.record("a", "alice", ok=False)  # third failure: locked for 2 s
    assert th.wait("a", "alice") == 2.0 and th.wait("b", "alice") == 0  # another address is not
    clock.t += 2.0
    th.record("a", "alice", ok=False)
    assert th.wait("a", "alice") == 4.0
    for expected in (8.0, 16.0, 16.0):  # doubles, up to the cap
        clock.t += 100.0 - 1  # within forget_s of the last failure
        th.record("a", "alice", ok=False)
        assert th.wait("a", "alice") == expected
    clock.t += 16.0
    th.record("a", "alice", ok=True)  # a success clears the record
    th.record("a", "alice", ok=False)
    assert th.wait("a", "alice") == 0
    clock.t += 101.0  # quiet longer than forget_s: starts from zero
    th.record("a", "alice", ok=False)
    th.record("a", "alice", ok=False)
    assert th.wait("a", "alice") == 0


def _tries(th: LoginThrottle, account: str, addresses: list[str]) -> int:
    """Wrong passwords for ``account`` that get checked, one attempt from each address in turn."""
    tried = 0
    for address in addresses:
        if th.wait(address, account) == 0:
            th.record(address, account, ok=False)
            tried += 1
    return tried


def test_rotating_addresses_get_a_bounded_number_of_guesses_per_account():
    clock = _Clock()
    th = LoginThrottle(free=3, account_free=10, base_s=1.0, max_s=300.0, forget_s=900.0, clock=clock)
    assert _tries(th, "alice", [f"10.0.{i // 256}.{i % 256}" for i in range(5000)]) == 10
    assert th.wait("192.0.2.7", "alice") == 1.0  # a fresh address waits too
    clock.t += 1.0
    assert _tries(th, "alice", [f"10.1.0.{i}" for i in range(200)]) == 1  # one more, then 2 s
    assert th.wait("10.2.0.1", "alice") == 2.0
    assert th.wait("10.2.0.1", "bob") == 0  # the lock is alice's, not the addresses'


def test_an_address_locked_on_one_account_can_still_try_another():
    th = LoginThrottle(free=3, account_free=10, clock=_Clock())
    assert _tries(th, "mallory", ["a"] * 10) == 3
    assert th.wait("a", "mallory") > 0
    assert th.wait("a", "alice") == 0 and th.wait("b", "mallory") == 0  # other account; other address


def test_an_account_lockout_spares_the_addresses_it_logged_in_from():
    clock = _Clock()
    th = LoginThrottle(free=3, account_free=5, clock=clock)
    th.record("home", "alice", ok=True)  # the owner logged in from here once
    assert _tries(th, "alice", [f"10.0.0.{i}" for i in range(50)]) == 5  # someone else locks the account
    assert th.wait("10.9.9.9", "alice") > 0
    assert th.wait("home", "alice") == 0  # the owner still gets in from home ...
    assert _tries(th, "alice", ["home"] * 10) == 3  # ... where wrong passwords are throttled as anywhere


def test_records_stay_bounded_under_a_flood_of_names():
    clock = _Clock()
    th = LoginThrottle(free=3, account_free=10, max_records=1000, clock=clock)
    for i in range(20_000):
        clock.t += 0.001
        th.record(f"10.0.{i // 256 % 256}.{i % 256}", f"user{i}", ok=False)
    assert len(th) <= 1000
    assert th.wait("10.0.0.0", "alice") == 0
    for i in range(20_000):  # successes (any name, when the server has no --auth) are remembered boundedly too
        th.record(f"10.1.{i // 256 % 256}.{i % 256}", f"user{i}", ok=True)
    assert len(th._known) <= 1000


def test_trusted_proxies_are_addresses_or_networks(capsys):
    from app.cli.commands import main

    assert parse_trusted_proxies(["127.0.0.1", "10.0.0.0/8, ::1", ""]) == ["127.0.0.1", "10.0.0.0/8", "::1"]
    assert main(["serve", "no-such-idx", "--trusted-proxy", "127.0.0.1,proxy.local"]) == 2
    err = capsys.readouterr().err
    assert "--trusted-proxy 'proxy.local': not an IP address" in err and "e.g. --trusted-proxy 127.0.0.1" in err


# ------------------------------------------------------------------------------------- live servers
def _pending_server(tmp_path, auth, trusted_proxies=()):
    from app.run.status import RunStatus
    from app.server.launch import serve_pending

    port = free_port()
    demo, _ = serve_pending(tmp_path / "idx", tmp_path / "photos", RunStatus(tmp_path / "work"), "127.0.0.1", port,
                            auth, trusted_proxies=trusted_proxies)
    return demo, f"http://127.0.0.1:{port}"


def _login(http, url: str, user: str, password: str, client: str) -> int:
    return http.post(url + "/login", data={"username": user, "password": password},
                     headers={"X-Forwarded-For": client}).status_code


@pytest.mark.slow
def test_a_rotating_forwarded_for_does_not_bypass_the_lockout(tmp_path):
    import httpx

    demo, url = _pending_server(tmp_path, ("alice", "right-pass"))
    try:
        with httpx.Client(timeout=30) as http:
            codes = [_login(http, url, "alice", f"wrong{i}", f"203.0.113.{i}") for i in range(30)]
            assert codes == [400] * 5 + [429] * 25, codes  # the peer is loopback, whatever the header says
            locked = http.post(url + "/login", data={"username": "alice", "password": "right-pass"},
                               headers={"X-Forwarded-For": "198.51.100.1"})
            assert locked.status_code == 429 and int(locked.headers["retry-after"]) >= 1
            assert "try again" in locked.json()["detail"]
            assert http.get(url + "/config").status_code in (401, 403)  # still not logged in
    finally:
        demo.close()


@pytest.mark.slow
def test_a_trusted_proxy_names_the_client_and_the_account_is_throttled_too(tmp_path):
    import httpx

    from app.guard.access import ACCOUNT_FREE

    demo, url = _pending_server(tmp_path, ("alice", "right-pass"), trusted_proxies=["127.0.0.1"])
    try:
        with httpx.Client(timeout=30) as http:
            assert _login(http, url, "alice", "right-pass", "198.51.100.1") == 200  # the owner, once
            codes = [_login(http, url, "alice", f"wrong{i}", f"203.0.113.{i}") for i in range(ACCOUNT_FREE + 10)]
            assert codes == [400] * ACCOUNT_FREE + [429] * 10, codes  # each address is new: the account locks
            assert _login(http, url, "bob", "guess", "192.0.2.1") == 400  # another account is not locked
            assert _login(http, url, "alice", "right-pass", "198.51.100.1") == 200  # nor the owner's address
            for i in range(5):  # and one address is still locked out by itself, behind the proxy
                _login(http, url, "carol", f"wrong{i}", "192.0.2.99")
            assert _login(http, url, "carol", "x", "192.0.2.99") == 429
            assert _login(http, url, "carol", "x", "192.0.2.100") == 400
    finally:
        demo.close()
