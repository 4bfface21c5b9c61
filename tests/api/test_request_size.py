"""Large bodies are bounded before work and never stall the event loop: /healthz answers meanwhile."""

from __future__ import annotations

import json
import threading
import time

import httpx

from tests.api.server import ApiServer

HEALTHZ_BOUND_S = 0.05  # nine polls in ten answer within this while the bodies are handled
STALL_S = 0.5  # and none waits this long (a stalled event loop held /healthz for 0.7-2 s)


def _model(server: ApiServer) -> str:
    return httpx.get(f"{server.base_url}/readyz").json()["model"]


def _healthz_while(server: ApiServer, send: list[tuple[str, dict]], key: str) -> tuple[list[float], list]:
    """Send the bodies one after another on a thread while /healthz is polled; the poll latencies and the
    responses' statuses and error envelopes."""
    results: list = []
    # serialized first: the poller shares this process, and json.dumps of a large body holds the GIL
    payloads = [(path, json.dumps(body, separators=(",", ":")).encode()) for path, body in send]
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}

    def sender() -> None:
        with httpx.Client(timeout=60) as client:
            for path, payload in payloads:
                response = client.post(f"{server.v1}/{path}", content=payload, headers=headers)
                results.append((response.status_code, response.json()["error"]))

    thread = threading.Thread(target=sender)
    latencies = []
    with httpx.Client(timeout=10) as client:
        thread.start()
        while thread.is_alive():
            started = time.perf_counter()
            assert client.get(f"{server.base_url}/healthz").status_code == 200
            latencies.append(time.perf_counter() - started)
    thread.join()
    return latencies, results


def test_large_bodies_are_refused_without_stalling_the_server(api_server: ApiServer, make_tenant) -> None:
    _, key = make_tenant()
    model = _model(api_server)
    many_messages = {"model": model, "messages": [{"role": "user"}] * 60_000}
    long_chat = {"model": model, "messages": [{"role": "user", "content": "word " * 26_000}] * 5}
    long_prompt = {"model": model, "prompt": "ab " * 43_000}  # just within the character cap: tokenized
    beyond_cap = {"model": model, "prompt": "ab " * 150_000}
    latencies, results = _healthz_while(
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
    assert len(latencies) >= 4
    ordered = sorted(latencies)
    assert ordered[int(0.9 * (len(ordered) - 1))] < HEALTHZ_BOUND_S, ordered[-5:]
    assert ordered[-1] < STALL_S, ordered[-5:]
