"""``weir serve`` in front of an OpenAI-compatible backend that sends what it likes: negative counts, no
output after text, several tokens per chunk, a stream or an error body past its cap. Every request gets a
clear answer and exactly one ledger row, billed at least the tokens streamed and at most ``max_tokens``, and
its reservation and concurrency slot come back."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from api.backend_clients import BODY_BYTES, stream_bytes
from tests.api.scripted_backend import (
    COMPLETIONS,
    Answer,
    ScriptedBackend,
    gateway_before,
    last_chunk,
    sse,
    text_chunk,
)
from tests.api.server import ApiServer
from tests.api.test_fair_share import _model, _prompt, _tenant

PATIENT_S = 600.0
PROMPT = _prompt(1, 8)  # eight prompt tokens, as the gateway counts them
WORD = " the"  # one token of the served model's tokenizer


@pytest.fixture(scope="module")
def backend() -> Iterator[ScriptedBackend]:
    with ScriptedBackend() as server:
        yield server


@pytest.fixture(scope="module")
def gateway(
    backend: ScriptedBackend,
    tiny_model_dir: Path,
    pg_server_url: str,
    migrated_template: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[ApiServer]:
    entry = f'kind = "openai"\nurl = "{backend.url}/v1"'
    state = tmp_path_factory.mktemp("scripted-openai-pool")
    with gateway_before(entry, tiny_model_dir, pg_server_url, migrated_template, state, "warning") as server:
        yield server


def _rows(gateway: ApiServer, tenant_id: int, request_ids: list[str]) -> list[dict]:
    """The tenant's ledger rows in the order of ``request_ids``: exactly one each, and no other."""
    rows = gateway.wait_usage(tenant_id, len(request_ids))
    assert sorted(r["request_id"] for r in rows) == sorted(request_ids)
    by_id = {r["request_id"]: r for r in rows}
    return [by_id[request_id] for request_id in request_ids]


async def test_negative_counts_are_billed_as_streamed_and_free_the_slot(
    gateway: ApiServer, backend: ScriptedBackend
) -> None:
    """Two answers with negative usage to a tenant allowed two requests at once, settled (their rows are
    in): a third still runs."""
    tenant_id, client = _tenant(gateway, max_concurrency=2, ttft_target_s=PATIENT_S)
    negative = {"prompt_tokens": -5, "completion_tokens": -7, "total_tokens": -12}
    bad = sse(text_chunk(WORD), text_chunk(WORD), last_chunk("stop", negative))
    good = sse(text_chunk(WORD), last_chunk("stop", {"prompt_tokens": 8, "completion_tokens": 1}))
    backend.script(COMPLETIONS, bad, bad, good)
    model = _model(gateway)
    answers = [await client.completions.create(model=model, prompt=PROMPT, max_tokens=8) for _ in range(2)]
    _rows(gateway, tenant_id, [a.id for a in answers])
    answers.append(await client.completions.create(model=model, prompt=PROMPT, max_tokens=8))
    assert [a.choices[0].text for a in answers] == [WORD * 2, WORD * 2, WORD]
    assert [(a.usage.prompt_tokens, a.usage.completion_tokens) for a in answers] == [(8, 2), (8, 2), (8, 1)]
    rows = _rows(gateway, tenant_id, [a.id for a in answers])
    assert [(r["status"], r["prompt_tokens"], r["output_tokens"]) for r in rows] == [
        ("ok", 8, 2),
        ("ok", 8, 2),
        ("ok", 8, 1),
    ]
    assert [float(r["cost"]) for r in rows] == [8 + 2 * 2, 8 + 2 * 2, 8 + 2 * 1]


async def test_no_output_after_streamed_text_is_billed_as_streamed(
    gateway: ApiServer, backend: ScriptedBackend
) -> None:
    tenant_id, client = _tenant(gateway, ttft_target_s=PATIENT_S)
    backend.script(
        COMPLETIONS,
        sse(
            *(text_chunk(WORD) for _ in range(3)),
            last_chunk("stop", {"prompt_tokens": 8, "completion_tokens": 0}),
        ),
    )
    stream = await client.completions.create(
        model=_model(gateway),
        prompt=PROMPT,
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == WORD * 3
    assert chunks[-1].usage.completion_tokens == 3
    (row,) = _rows(gateway, tenant_id, [chunks[0].id])
    assert (row["status"], row["output_tokens"], float(row["cost"])) == ("ok", 3, 8 + 2 * 3)


async def test_several_tokens_per_chunk_are_held_to_max_tokens(
    gateway: ApiServer, backend: ScriptedBackend
) -> None:
    """A backend that ignores ``max_tokens`` and sends three tokens a chunk: the client gets four tokens
    (the second chunk cut after its first), billed four."""
    tenant_id, client = _tenant(gateway, ttft_target_s=PATIENT_S)
    usage = {"prompt_tokens": 8, "completion_tokens": 9}
    backend.script(COMPLETIONS, sse(*(text_chunk(WORD * 3) for _ in range(3)), last_chunk("length", usage)))
    answer = await client.completions.create(model=_model(gateway), prompt=PROMPT, max_tokens=4)
    assert (answer.choices[0].text, answer.choices[0].finish_reason) == (WORD * 4, "length")
    assert answer.usage.completion_tokens == 4
    (row,) = _rows(gateway, tenant_id, [answer.id])
    assert (row["status"], row["output_tokens"]) == ("ok", 4)


def _stream_of(size: int) -> Answer:
    """A stream of exactly ``size`` bytes: one token, an SSE comment as filler, the end and its usage."""
    head = f"data: {json.dumps(text_chunk(WORD))}\n\n".encode()
    tail = sse(last_chunk("stop", {"prompt_tokens": 8, "completion_tokens": 1})).body
    filler = b": " + b"x" * (size - len(head) - len(tail) - 3) + b"\n"
    return Answer(head + filler + tail, content_type="text/event-stream")


async def test_a_stream_is_read_up_to_its_byte_bound(gateway: ApiServer, backend: ScriptedBackend) -> None:
    """A stream for 4 output tokens may have 64 KiB + 4 x 2 KiB = 73,728 bytes; one byte more ends the
    answer with an error event after the token that came, billed."""
    cap = stream_bytes(4)
    assert cap == 73_728
    tenant_id, client = _tenant(gateway, ttft_target_s=PATIENT_S)
    backend.script(COMPLETIONS, _stream_of(cap), _stream_of(cap + 1))
    results = []
    for _ in range(2):
        stream = await client.completions.create(
            model=_model(gateway), prompt=PROMPT, max_tokens=4, stream=True
        )
        text, error = "", None
        try:
            async for chunk in stream:
                text += chunk.choices[0].text if chunk.choices else ""
        except openai.APIError as exc:
            error = str(exc)
        results.append((stream.response.headers["x-request-id"], text, error))
    (within_id, within, no_error), (over_id, over, error) = results
    assert (within, no_error) == (WORD, None)
    assert over == WORD and error is not None and f"passed {cap} bytes" in error
    rows = _rows(gateway, tenant_id, [within_id, over_id])
    assert [(r["status"], r["output_tokens"]) for r in rows] == [("ok", 1), ("error", 1)]


async def test_an_error_body_is_read_up_to_its_byte_bound(
    gateway: ApiServer, backend: ScriptedBackend
) -> None:
    """A 400 from the backend is the request's own failure; its body is read up to 1 MiB, no further."""
    assert BODY_BYTES == 1 << 20
    tenant_id, client = _tenant(gateway, ttft_target_s=PATIENT_S)
    backend.script(COMPLETIONS, Answer(b"x" * BODY_BYTES, 400), Answer(b"x" * (BODY_BYTES + 1), 400))
    errors, request_ids = [], []
    for _ in range(2):
        with pytest.raises(openai.InternalServerError) as raised:
            await client.completions.create(model=_model(gateway), prompt=PROMPT, max_tokens=4)
        errors.append(raised.value.message)
        request_ids.append(raised.value.response.headers["x-request-id"])
    assert "400: xxxx" in errors[0]
    assert f"400: the error body passed {BODY_BYTES} bytes" in errors[1]
    rows = _rows(gateway, tenant_id, request_ids)
    assert [(r["status"], r["output_tokens"]) for r in rows] == [("error", 0)] * 2
