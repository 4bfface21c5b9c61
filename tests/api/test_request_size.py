"""Large bodies are bounded before work and never stall the event loop: /healthz answers meanwhile."""

from __future__ import annotations

import json
import threading
import time

import httpx

from tests.api.server import ApiServer

Span = tuple[float, float]  # (sent, answered), from time.perf_counter()


def _model(server: ApiServer) -> str:
    return httpx.get(f"{server.base_url}/readyz").json()["model"]


def _healthz_while(
    server: ApiServer, send: list[tuple[str, dict]], key: str
) -> tuple[list[Span], list[Span], list]:
    """Send the bodies one after another on a thread while /healthz is polled; the polls' and the bodies'
    spans, and the responses' statuses and error envelopes."""
    results: list = []
    bodies: list[Span] = []
    # serialized first: the poller shares this process, and json.dumps of a large body holds the GIL
    payloads = [(path, json.dumps(body, separators=(",", ":")).encode()) for path, body in send]
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}

    def sender() -> None:
        with httpx.Client(timeout=60) as client:
            for path, payload in payloads:
                started = time.perf_counter()
                response = client.post(f"{server.v1}/{path}", content=payload, headers=headers)
                bodies.append((started, time.perf_counter()))
                results.append((response.status_code, response.json()["error"]))

    thread = threading.Thread(target=sender)
    polls: list[Span] = []
    with httpx.Client(timeout=10) as client:
        thread.start()
        while thread.is_alive():
            started = time.perf_counter()
            assert client.get(f"{server.base_url}/healthz").status_code == 200
            polls.append((started, time.perf_counter()))
    thread.join()
    return polls, bodies, results


def test_large_bodies_are_refused_without_stalling_the_server(api_server: ApiServer, make_tenant) -> None:
    _, key = make_tenant()
    model = _model(api_server)
    many_messages = {"model": model, "messages": [{"role": "user"}] * 60_000}
    long_chat = {"model": model, "messages": [{"role": "user", "content": "word " * 26_000}] * 5}
    long_prompt = {"model": model, "prompt": "ab " * 43_000}  # just within the character cap: tokenized
    beyond_cap = {"model": model, "prompt": "ab " * 150_000}
    polls, bodies, results = _healthz_while(
        api_server,
        [
            ("chat/completions", many_messages),
            ("chat/completions", long_chat),
            ("completions", long_prompt),
            ("completions", beyond_cap),
        ],
        key,
    )
    (s1, e1), (s2, e2), (s3, e3), (s4, e4) = results
    assert s1 == 400 and e1["param"] == "messages" and "1024" in e1["message"]
    assert s2 == 400 and e2["code"] == "context_length_exceeded" and "characters" in e2["message"]
    assert s3 == 400 and e3["code"] == "context_length_exceeded" and "prompt" in e3["message"]
    assert s4 == 400 and e4["code"] == "context_length_exceeded" and "characters" in e4["message"]
    # The tokenized prompt takes the server longest; /healthz was answered all along while it was handled
    # (polls sent and answered within its span), and no poll waited for as much as half of it, as one
    # would wait for a loop held by the tokenizer. Both sides scale with the machine's speed.
    sent, answered = bodies[2]
    inside = [(a, b) for a, b in polls if sent <= a and b <= answered]
    assert len(inside) >= 2, (len(inside), answered - sent)
    longest_poll = max(b - a for a, b in polls)
    assert longest_poll < (answered - sent) / 2, (longest_poll, answered - sent)
