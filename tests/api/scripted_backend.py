"""A backend on a real socket that answers as the test scripts it: a ``weir engine`` (``/health``, ``/stats``,
NDJSON deltas) and an OpenAI-compatible server under ``/v1`` (``/v1/models``, SSE chunks) at once. Each
path answers the next of its queued answers, or its default once the queue is empty."""

from __future__ import annotations

import contextlib
import json
import threading
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from engine.types import EngineStats
from tests.api.server import ApiServer, serving
from tests.fixtures.database import copy_of_template

MODEL = "scripted-model"
COMPLETIONS = "/v1/completions"
GENERATE = "/v1/engine/generate"


@dataclass(frozen=True)
class Answer:
    """One HTTP answer: its status, content type and body (sent without a length, then the socket closes)."""

    body: bytes
    status: int = 200
    content_type: str = "application/json"


def json_answer(value: object, status: int = 200) -> Answer:
    return Answer(json.dumps(value).encode(), status)


def sse(*events: dict) -> Answer:
    """An OpenAI stream of ``events``, then ``[DONE]``."""
    body = "".join(f"data: {json.dumps(event)}\n\n" for event in events) + "data: [DONE]\n\n"
    return Answer(body.encode(), content_type="text/event-stream")


def text_chunk(text: str) -> dict:
    return {"choices": [{"index": 0, "text": text, "finish_reason": None}]}


def last_chunk(finish_reason: str, usage: dict) -> dict:
    return {"choices": [{"index": 0, "text": "", "finish_reason": finish_reason}], "usage": usage}


def ndjson(*deltas: dict) -> Answer:
    """A ``weir engine`` stream of ``deltas`` (each completed with the wire format's defaults)."""
    empty = {"text": "", "token_ids": [], "finished": False, "finish_reason": None, "prompt_tokens": 0}
    empty |= {"cached_tokens": 0, "output_tokens": 0, "queue_s": 0.0, "error": None}
    return Answer(b"".join(json.dumps(empty | delta).encode() + b"\n" for delta in deltas))


HEALTH = {"status": "ok", "model": MODEL, "max_model_len": 2048, "vocab_size": 49152, "block_size": 16}
STATS = asdict(EngineStats(0, 0, 64, 64, 16, 0.0, 0.0, 0, 0))


class ScriptedBackend(ThreadingHTTPServer):
    """The server, serving on a free loopback port inside a ``with`` block; ``script(path, *answers)``
    queues answers, ``hits[path]`` counts the requests."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self._thread = threading.Thread(target=self.serve_forever, daemon=True)
        self.defaults = {
            "/health": json_answer(HEALTH),
            "/stats": json_answer(STATS),
            "/v1/models": json_answer({"object": "list", "data": [{"id": MODEL, "object": "model"}]}),
        }
        self.hits: Counter[str] = Counter()
        self._queues: dict[str, deque[Answer]] = {}
        self._lock = threading.Lock()

    def __enter__(self) -> ScriptedBackend:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
        self._thread.join()
        self.server_close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def script(self, path: str, *answers: Answer) -> None:
        with self._lock:
            self._queues.setdefault(path, deque()).extend(answers)

    def left(self, path: str) -> int:
        """Answers still queued for ``path``."""
        with self._lock:
            return len(self._queues.get(path, ()))

    def answer(self, path: str) -> Answer | None:
        with self._lock:
            self.hits[path] += 1
            queue = self._queues.get(path)
            return queue.popleft() if queue else self.defaults.get(path)


class _Handler(BaseHTTPRequestHandler):
    server: ScriptedBackend

    def _reply(self) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        answer = self.server.answer(self.path)
        if answer is None:
            self.send_error(404)
            return
        self.send_response(answer.status)
        self.send_header("content-type", answer.content_type)
        self.send_header("connection", "close")
        self.end_headers()
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # the gateway stopped reading
            self.wfile.write(answer.body)

    do_GET = do_POST = _reply

    def log_message(self, format: str, *args: object) -> None:
        """Quiet: the tests read ``hits``."""


@contextlib.contextmanager
def gateway_before(
    backend: str, model_dir: Path, server_url: str, template: str, state: Path, log_level: str
) -> Iterator[ApiServer]:
    """``weir serve`` on a fresh copy of the database in front of one backend (a ``[[backends]]`` entry's
    lines), probing it every 0.2 s."""
    config = state / "backends.toml"
    config.write_text(f"[pool]\nprobe_interval_s = 0.2\n\n[[backends]]\n{backend}\n")
    with (
        copy_of_template(server_url, template, prefix="weir_scripted") as url,
        serving(model_dir, url, state, "--backends", str(config), "--log-level", log_level) as server,
    ):
        yield server
