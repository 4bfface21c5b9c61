"""Transport limits of a real ``weir serve``, driven with raw sockets: read deadlines, the connection caps
(in all, per client address, and the slots kept for authenticated connections), and refusals that h11
detects before the application runs, all in OpenAI's error envelope.

Client addresses other than 127.0.0.1 are other loopback addresses (all of 127.0.0.0/8 is local on Linux).

Deadlines are set to one second on the command line; a socket timeout far above that is the failure bound.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest

from tests.api.server import ApiServer, run_db, serving, wait_until

SOCKET_TIMEOUT_S = 30.0
LEFT_EARLY = "client left before sending the whole body"
PARTIAL_BODY = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: weir\r\nAuthorization: Bearer %s\r\n"
    b'Content-Type: application/json\r\nContent-Length: 200\r\n\r\n{"model": '
)


@pytest.fixture(scope="module")
def start_server(
    tiny_model_dir: Path, api_database_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[..., ApiServer]]:
    """``start_server(*options)``: ``weir serve`` with the tiny model, logging at INFO, until the end."""
    with ExitStack() as servers:

        def start(*options: str) -> ApiServer:
            state = tmp_path_factory.mktemp("transport-state")
            options = (*options, "--kv-cache-memory", "8")
            return servers.enter_context(serving(tiny_model_dir, api_database_url, state, *options))

        yield start


@pytest.fixture(scope="module")
def quick_server(start_server: Callable[..., ApiServer]) -> ApiServer:
    """A server whose header, body and keep-alive deadlines are one second."""
    return start_server("--header-timeout", "1", "--body-timeout", "1", "--keep-alive-timeout", "1")


PATIENT = ("--header-timeout", "600", "--keep-alive-timeout", "600")  # idle connections stay for the test
SLOTS, PER_ADDRESS = 8, 4
OPEN_SLOTS = SLOTS - SLOTS // 4  # what connections that never authenticated may hold: 6 of the 8


@pytest.fixture(scope="module")
def capped_server(start_server: Callable[..., ApiServer]) -> ApiServer:
    """A server that serves two connections at once and lets idle ones stay open for the whole test."""
    return start_server("--max-connections", "2", *PATIENT)


@pytest.fixture(scope="module")
def slotted_server(start_server: Callable[..., ApiServer]) -> ApiServer:
    """A server that serves 8 connections at once, 4 from one address, 2 of them kept for authenticated
    connections."""
    return start_server(
        "--max-connections", str(SLOTS), "--max-connections-per-address", str(PER_ADDRESS), *PATIENT
    )


def _connect(server: ApiServer, source: str = "127.0.0.1") -> socket.socket:
    """A connection to ``server`` from the loopback address ``source``."""
    host, port = server.base_url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=SOCKET_TIMEOUT_S, source_address=(source, 0))


def _read_to_eof(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a socket timeout fails the test)."""
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def _read_response(sock: socket.socket) -> tuple[int, bytes]:
    """One response with a Content-Length body: its status and body; the connection stays usable."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536) or pytest.fail(f"connection closed mid-response: {data!r}")
    head, body = data.split(b"\r\n\r\n", 1)
    fields = dict(line.lower().split(b": ", 1) for line in head.split(b"\r\n")[1:])
    length = int(fields[b"content-length"])
    while len(body) < length:
        body += sock.recv(65536) or pytest.fail(f"connection closed mid-body: {body!r}")
    return int(head.split(b" ", 2)[1]), body


def _envelope(raw: bytes, status: int) -> dict:
    """The error of a complete raw response that must be ``status`` in OpenAI's envelope."""
    head, body = raw.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 %d " % status), raw
    assert b"content-type: application/json" in head.lower() and b"connection: close" in head.lower()
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def _log_lines(server: ApiServer) -> list[str]:
    return server.log_path.read_text().splitlines()


def _count(server: ApiServer, text: str) -> int:
    return sum(text in line for line in _log_lines(server))


def _assert_no_errors_logged(server: ApiServer) -> None:
    errors = [line for line in _log_lines(server) if line.startswith("ERROR")]
    assert errors == []


HEALTHZ = b"GET /healthz HTTP/1.1\r\nHost: weir\r\n\r\n"


def test_idle_connections_are_closed(quick_server: ApiServer) -> None:
    with _connect(quick_server) as never_asked:
        assert _read_to_eof(never_asked) == b""
    with _connect(quick_server) as asked_once:
        asked_once.sendall(HEALTHZ)
        assert _read_response(asked_once)[0] == 200
        assert _read_to_eof(asked_once) == b""  # keep-alive timeout


@pytest.mark.parametrize("after_a_request", [False, True])
def test_partial_headers_are_closed_without_an_answer(quick_server: ApiServer, after_a_request: bool) -> None:
    before = _count(quick_server, "request headers incomplete")
    with _connect(quick_server) as sock:
        if after_a_request:
            sock.sendall(HEALTHZ)
            assert _read_response(sock)[0] == 200
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: weir\r\nAuthorization: Bear")
        assert _read_to_eof(sock) == b""
    wait_until(lambda: _count(quick_server, "request headers incomplete") > before, what="the log line")


def test_stalled_body_gets_408_and_is_logged_as_info(quick_server: ApiServer) -> None:
    _, key = run_db(quick_server.database_url, quick_server.create_tenant)
    before = _count(quick_server, LEFT_EARLY)
    with _connect(quick_server) as sock:
        sock.sendall(PARTIAL_BODY % key.encode())
        error = _envelope(_read_to_eof(sock), 408)
    assert error["code"] == "request_timeout" and error["type"] == "invalid_request_error"
    wait_until(lambda: _count(quick_server, LEFT_EARLY) > before, what="the application's INFO line")
    _assert_no_errors_logged(quick_server)


def test_client_leaving_mid_body_is_logged_as_info(quick_server: ApiServer) -> None:
    _, key = run_db(quick_server.database_url, quick_server.create_tenant)
    before = _count(quick_server, LEFT_EARLY)
    with _connect(quick_server) as sock:
        sock.sendall(PARTIAL_BODY % key.encode())
    wait_until(lambda: _count(quick_server, LEFT_EARLY) > before, what="the application's INFO line")
    _assert_no_errors_logged(quick_server)


def test_oversized_headers_get_431_in_the_envelope(quick_server: ApiServer) -> None:
    huge = {"Authorization": "Bearer wk-" + "x" * 200_000}
    response = httpx.get(f"{quick_server.v1}/models", headers=huge, timeout=SOCKET_TIMEOUT_S)
    assert response.status_code == 431, response.text
    error = response.json()["error"]
    assert error["code"] == "request_headers_too_large" and error["type"] == "invalid_request_error"


def test_malformed_request_gets_400_in_the_envelope(quick_server: ApiServer) -> None:
    with _connect(quick_server) as sock:
        sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        assert _envelope(_read_to_eof(sock), 400)["code"] == "invalid_http"


def _models(key: str) -> bytes:
    """An authenticated request."""
    return b"GET /v1/models HTTP/1.1\r\nHost: weir\r\nAuthorization: Bearer %s\r\n\r\n" % key.encode()


def _assert_over_capacity(sock: socket.socket) -> None:
    """The connection's first request is answered 503 with Retry-After, and the connection closed."""
    sock.sendall(HEALTHZ)
    refusal = _read_to_eof(sock)
    error = _envelope(refusal, 503)
    assert error["code"] == "server_overloaded" and error["type"] == "server_error"
    assert b"\r\nretry-after: 1\r\n" in refusal.lower()


def _answers(sock: socket.socket, request: bytes = HEALTHZ) -> bool:
    """Whether the connection still answers ``request`` with a 200 (False: the server had closed it)."""
    try:
        sock.sendall(request)
        if not sock.recv(1, socket.MSG_PEEK):
            return False
    except (ConnectionResetError, BrokenPipeError):
        return False
    return _read_response(sock)[0] == 200


def _admitted(server: ApiServer, request: bytes, source: str = "127.0.0.1") -> socket.socket | None:
    """A new connection that the server serves (the readiness probe's may not be released yet)."""
    sock = _connect(server, source)
    if _answers(sock, request):
        return sock
    sock.close()
    return None


def test_connections_beyond_the_cap_get_503(capped_server: ApiServer) -> None:
    """Once authenticated connections hold every slot, a new one is refused."""
    _, key = run_db(capped_server.database_url, capped_server.create_tenant)
    admitted = lambda: _admitted(capped_server, _models(key))  # noqa: E731
    first = wait_until(admitted, what="a first admitted connection")
    second = wait_until(admitted, what="a second admitted connection")
    with first, second, _connect(capped_server) as third:
        _assert_over_capacity(third)
        assert _answers(second, _models(key))  # admitted connections keep being served
    with wait_until(admitted, what="a connection admitted once others closed"):
        pass


def test_one_address_gets_at_most_its_share_of_connections(slotted_server: ApiServer) -> None:
    with ExitStack() as stack:
        for _ in range(PER_ADDRESS):
            admitted = wait_until(lambda: _admitted(slotted_server, HEALTHZ), what="a connection admitted")
            stack.enter_context(admitted)
        _assert_over_capacity(stack.enter_context(_connect(slotted_server)))
        assert _answers(stack.enter_context(_connect(slotted_server, "127.0.0.2")))  # another address


def test_idle_unauthenticated_connections_do_not_keep_an_authenticated_one_out(
    slotted_server: ApiServer,
) -> None:
    """More idle connections than there are slots, then an authenticated request on a new connection: it is
    served, and the idle connections that waited longest were closed for the newcomers."""
    _, key = run_db(slotted_server.database_url, slotted_server.create_tenant)
    with ExitStack() as stack:
        idle = [
            stack.enter_context(_connect(slotted_server, f"127.0.0.{3 + i // PER_ADDRESS}"))
            for i in range(SLOTS)
        ]
        authenticated = stack.enter_context(_connect(slotted_server, "127.0.0.5"))
        assert _answers(authenticated, _models(key))
        answered = [_answers(sock) for sock in idle]
        closed = answered.count(False)
        assert answered == [False] * closed + [True] * (SLOTS - closed)  # the oldest were closed
        assert SLOTS - closed <= OPEN_SLOTS
        for i in range(SLOTS):  # another flood: the authenticated connection keeps its slot
            stack.enter_context(_connect(slotted_server, f"127.0.0.{6 + i // PER_ADDRESS}"))
        assert _answers(authenticated, _models(key))
