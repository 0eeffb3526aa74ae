"""Connection limits of the real server (issue 40): a deadline for request heads, and
the connections over the bound refused at once. The model never loads (a path that does
not exist), which leaves the HTTP layer to test."""

from __future__ import annotations

import select
import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest

from api.local_server import running_server

HEAD = b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n"  # no blank line: never complete


@pytest.fixture
def server(tmp_path, request):
    from ragsnap.api.app import create_app
    from ragsnap.api.settings import Settings

    limits = getattr(request, "param", {})
    settings = Settings(model=str(tmp_path / "no-model"), cache_url="none", **limits)
    with running_server(create_app(settings)) as url:
        yield url


def _connect(url: str) -> socket.socket:
    parts = urlsplit(url)
    return socket.create_connection((parts.hostname, parts.port), timeout=5)


def _closed_by_server(sock: socket.socket) -> bytes | None:
    """What the server sent before closing, or None while the connection is open."""
    if not select.select([sock], [], [], 0)[0]:
        return None
    received = b""
    while chunk := sock.recv(4096):
        received += chunk
    return received


@pytest.mark.parametrize("server", [{"header_timeout_s": 1.0}], indirect=True)
def test_slow_heads_are_closed_by_the_deadline_and_health_answers_throughout(server):
    slow = []
    for i in range(200):
        sock = _connect(server)
        sock.sendall(HEAD if i % 2 else b"")  # half send part of a head, half nothing
        slow.append(sock)
    trickle = _connect(server)  # a byte every 0.2 s: the deadline runs from the first
    started = time.monotonic()
    closed: dict[int, bytes] = {}
    with httpx.Client(base_url=server, headers={"Host": "localhost"}, timeout=5) as client:
        while len(closed) < len(slow) and time.monotonic() - started < 6:
            assert client.get("/healthz").status_code == 200
            for i, sock in enumerate(slow):
                if i not in closed and (sent := _closed_by_server(sock)) is not None:
                    closed[i] = sent
            try:
                trickle.sendall(HEAD[int((time.monotonic() - started) * 5) % len(HEAD) :][:1])
            except OSError:
                pass  # closed by the server
            time.sleep(0.2)
    elapsed = time.monotonic() - started
    assert len(closed) == len(slow), f"{len(slow) - len(closed)} slow connections still open"
    assert elapsed < 4  # 1 s deadline; 200 sockets polled every 0.2 s on a busy machine
    assert all(sent.startswith(b"HTTP/1.1 408") for sent in closed.values())
    trickle.settimeout(3)
    assert b"408" in trickle.recv(4096)
    for sock in (*slow, trickle):
        sock.close()


@pytest.mark.parametrize("server", [{"max_connections": 8}], indirect=True)
def test_connections_over_the_bound_are_refused_at_once(server):
    held = [_connect(server) for _ in range(8)]
    time.sleep(0.2)
    extra = _connect(server)
    extra.settimeout(2)
    started = time.monotonic()
    assert extra.recv(4096).startswith(b"HTTP/1.1 503")
    assert time.monotonic() - started < 1.5
    for sock in held:  # once they leave, new connections are served again
        sock.close()
    deadline = time.monotonic() + 5
    while True:
        try:
            status = httpx.get(f"{server}/healthz", headers={"Host": "localhost"}).status_code
        except httpx.HTTPError:
            status = 0
        if status == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert status == 200
    extra.close()


@pytest.mark.parametrize("server", [{"header_timeout_s": 0.5}], indirect=True)
def test_a_kept_alive_connection_sends_requests_slower_than_the_deadline(server):
    with httpx.Client(base_url=server, headers={"Host": "localhost"}) as client:
        for _ in range(3):  # one connection, idle longer than the head deadline between
            assert client.get("/healthz").status_code == 200
            time.sleep(0.8)
