"""A stand-in OpenAI-compatible server on a real socket: it keeps every request body it receives and
answers each completion with one streamed word, its finish reason and its usage."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODEL = "fake-model"
REPLY = "Hello"
USAGE = {"prompt_tokens": 7, "completion_tokens": 1, "total_tokens": 8}


class FakeOpenAI(ThreadingHTTPServer):
    """The server; ``bodies`` holds the JSON bodies of the completions it was asked for, in order."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.bodies: list[dict] = []

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1"


class _Handler(BaseHTTPRequestHandler):
    server: FakeOpenAI

    def _send(self, content_type: str, payload: bytes) -> None:
        self.send_response(200)
        self.send_header("content-type", content_type)
        self.send_header("content-length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def do_GET(self) -> None:
        if self.path != "/v1/models":
            self.send_error(404)
            return
        self._send("application/json", json.dumps({"data": [{"id": MODEL, "object": "model"}]}).encode())

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        self.server.bodies.append(body)
        events = [
            {"choices": [{"index": 0, "delta": {"content": REPLY}, "text": REPLY, "finish_reason": None}]},
            {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
            {"choices": [], "usage": USAGE},
        ]
        stream = "".join(f"data: {json.dumps(event)}\n\n" for event in events) + "data: [DONE]\n\n"
        self._send("text/event-stream", stream.encode())

    def log_message(self, format: str, *args: object) -> None:
        """Quiet: the test asserts on ``bodies``."""


@contextmanager
def fake_openai() -> Iterator[FakeOpenAI]:
    """A :class:`FakeOpenAI` serving on a free loopback port until the block ends."""
    server = FakeOpenAI()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
