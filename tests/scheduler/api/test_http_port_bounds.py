"""The scheduler's HTTP port holds against hostile clients, against a real in-process scheduler with
auth on: a bad ``Content-Length`` is a 400 and the body is never read, an oversized one a 413
before reading; 100 half-sent requests leave ``/health`` answering, and a client that trickles its
request head is cut off at the head deadline; the login's ``next`` redirects only to local paths,
and state-changing forms without their CSRF token are refused."""

from __future__ import annotations

import http.client
import re
import socket
import urllib.parse

import pytest

from opentinker_client import RLClient
from tests.support.http import assert_slow_clients_are_bounded, http_get, read_until_closed
from tests.support.security import LoopbackScheduler


@pytest.fixture(scope="module")
def sched(tmp_path_factory):
    config = "auth: {enabled: true}\nheartbeat_interval: 0.5\n"
    with LoopbackScheduler(tmp_path_factory.mktemp("bounds") / "state", config, http_port=0) as s:
        yield s


def _connect(sched) -> socket.socket:
    return socket.create_connection(("127.0.0.1", sched.running.http.port), timeout=30)


@pytest.mark.parametrize("length", ["-1", "-5", "12abc"])
def test_a_bad_content_length_is_a_400_and_the_body_is_never_read(sched, length) -> None:
    with _connect(sched) as conn:
        conn.sendall(f"POST /ui/login HTTP/1.1\r\nHost: x\r\nContent-Length: {length}\r\n\r\n".encode())
        conn.sendall(b"a" * 65536)  # the start of a body the client means to send for ever
        answer = read_until_closed(conn)  # the server answers and closes while the client still sends
    assert answer.startswith(b"HTTP/1.1 400 "), answer[:200]
    assert http_get(f"http://127.0.0.1:{sched.running.http.port}/health")[0] == 200


def test_a_body_over_the_limit_is_refused_before_it_is_read(sched) -> None:
    with _connect(sched) as conn:
        conn.sendall(b"POST /ui/login HTTP/1.1\r\nHost: x\r\nContent-Length: 209715200\r\n\r\n")
        answer = read_until_closed(conn)  # no body byte was sent: the answer cannot have waited for one
    assert answer.startswith(b"HTTP/1.1 413 ") and b"body too large: at most 65536 bytes" in answer, answer[:300]


def test_a_chunked_form_over_the_limit_is_refused_as_it_streams(sched) -> None:
    with _connect(sched) as conn:
        conn.sendall(b"POST /ui/login HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        chunk = b"a" * 4096
        for _ in range(3):
            conn.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        answer = read_until_closed(conn)
    assert answer.startswith(b"HTTP/1.1 413 ") and b"form too large" in answer, answer[:300]


def test_a_head_over_the_limit_sent_in_one_piece_is_a_431(sched) -> None:
    with _connect(sched) as conn:
        conn.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n")
        answer = read_until_closed(conn)
    assert answer.startswith(b"HTTP/1.1 431 ") and b"at most 16384 bytes" in answer, answer[:300]


def test_a_request_framed_both_ways_is_refused_and_nothing_after_it_is_read_as_a_request(sched) -> None:
    """Content-Length and Transfer-Encoding together: a proxy in front may frame the body
    otherwise, so a request smuggled after it must not be answered (RFC 9112 6.1)."""
    with _connect(sched) as conn:
        conn.sendall(
            b"POST /ui/login HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"0\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n"
        )
        answer = read_until_closed(conn)
    assert answer.startswith(b"HTTP/1.1 400 ") and answer.count(b"HTTP/1.1 ") == 1, answer[:500]


def test_health_answers_with_100_half_sent_requests_open_and_a_trickling_client_is_cut_off(sched) -> None:
    assert_slow_clients_are_bounded(sched.running.http.port, lambda s: setattr(sched.running.http, "head_timeout_s", s))


def _login_form(conn: http.client.HTTPConnection) -> tuple[str, str]:
    """(csrf token, Cookie header) of a fresh login form; ("", "") when the page has neither."""
    conn.request("GET", "/ui/login")
    page = conn.getresponse()
    match = re.search(r'name="csrf" value="([0-9a-f]+)"', page.read().decode())
    cookie = (page.getheader("Set-Cookie") or "").split(";")[0]
    return (match.group(1) if match else ""), cookie


def _post(conn: http.client.HTTPConnection, path: str, form: dict, headers: dict | None = None):
    body = urllib.parse.urlencode(form)
    conn.request("POST", path, body, {"Content-Type": "application/x-www-form-urlencoded", **(headers or {})})
    resp = conn.getresponse()
    return resp, resp.read().decode()


@pytest.mark.parametrize(
    "next_path",
    [
        "/ui/queue\r\nSet-Cookie: injected=1",
        "/ui/queue\r\n\r\n<script>alert(1)</script>",
        "//evil.example/ui/",
        "https://evil.example/",
        "/\\evil.example",
        "ui/queue",
    ],
)
def test_login_redirects_only_to_a_local_path(sched, next_path) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", sched.running.http.port, timeout=30)
    try:
        csrf, cookie = _login_form(conn)
        resp, _ = _post(
            conn, "/ui/login", {"api_key": sched.admin_key, "next": next_path, "csrf": csrf}, {"Cookie": cookie}
        )
    finally:
        conn.close()
    assert resp.status == 303 and resp.getheader("Location") == "/"
    cookies = resp.msg.get_all("Set-Cookie") or []
    assert len(cookies) == 1 and cookies[0].startswith("otk_key=") and "injected" not in str(resp.msg)


def test_state_changing_forms_need_their_csrf_token(sched) -> None:
    port = sched.running.http.port
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        # Another site's form: no otk_login cookie (SameSite=Strict), no token. No login happens.
        resp, page = _post(conn, "/ui/login", {"api_key": sched.admin_key, "next": "/ui/queue"})
        assert resp.status == 403 and "came from another site" in page and resp.getheader("Location") is None
        assert not any(c.startswith("otk_key=") for c in resp.msg.get_all("Set-Cookie") or [])
        # The form's token with another visitor's cookie is refused as well.
        csrf, _ = _login_form(conn)
        _, other_cookie = _login_form(conn)
        resp, _ = _post(conn, "/ui/login", {"api_key": sched.admin_key, "csrf": csrf}, {"Cookie": other_cookie})
        assert resp.status == 403
        # The page's own form works, and its cookies are HttpOnly and SameSite=Strict.
        conn.request("GET", "/ui/login")
        page = conn.getresponse()
        set_cookie = page.getheader("Set-Cookie")
        assert {"HttpOnly", "SameSite=Strict"} <= {a.strip() for a in set_cookie.split(";")}
        csrf = re.search(r'name="csrf" value="([0-9a-f]+)"', page.read().decode()).group(1)
        resp, _ = _post(
            conn,
            "/ui/login",
            {"api_key": sched.admin_key, "next": "/ui/queue", "csrf": csrf},
            {"Cookie": set_cookie.split(";")[0]},
        )
        assert resp.status == 303 and resp.getheader("Location") == "/ui/queue"
        session = resp.getheader("Set-Cookie").split(";")[0]

        # Cancel: logged in by cookie, a cross-site post has no token and cancels nothing.
        with RLClient(sched.target, api_key=sched.admin_key) as client:
            task = client.submit_task(workload_type="full_rl", model="mlp", env_config={"env_id": "CartPole-v1"})
            resp, page = _post(conn, f"/ui/task/{task}/cancel", {"reason": "x"}, {"Cookie": session})
            assert resp.status == 403 and "came from another site" in page
            assert client.get_task(task).state == "pending"
    finally:
        conn.close()
