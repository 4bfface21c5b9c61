"""``weir serve --backend openai:URL`` in front of a real OpenAI-compatible server that is not Weir:
`transformers serve` (its continuous batching) on the tiny model. The gateway tokenizes and meters; the
prompt goes to the backend as chat messages, and the ledger holds the backend's own usage counts."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from bench.peer_server import free_port, transformers_server
from tests.api.server import ApiServer, run_db, serving
from tests.fixtures.database import copy_of_template

PEER_KV_BYTES = 16 << 20


@pytest.fixture(scope="module")
def peer(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log_path = tmp_path_factory.mktemp("transformers-serve") / "server.log"
    with transformers_server(tiny_model_dir, free_port(), "cpu", PEER_KV_BYTES, log_path) as base_url:
        yield base_url


@pytest.fixture(scope="module")
def gateway(
    peer: str,
    tiny_model_dir: Path,
    pg_server_url: str,
    migrated_template: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[ApiServer]:
    state = tmp_path_factory.mktemp("openai-pool-state")
    options = ["--backend", f"openai:{peer}", "--log-level", "warning"]
    with (
        copy_of_template(pg_server_url, migrated_template, prefix="weir_openai_pool") as url,
        serving(tiny_model_dir, url, state, *options) as server,
    ):
        yield server


async def test_a_streamed_chat_through_an_openai_compatible_backend_is_metered(gateway: ApiServer) -> None:
    tenant_id, key = run_db(gateway.database_url, gateway.create_tenant, ttft_target_s=600.0)
    client = openai.AsyncOpenAI(base_url=gateway.v1, api_key=key, max_retries=0, timeout=300)
    model = (await client.models.list()).data[0].id
    stream = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Name three rivers."}],
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, usage, finish = "", None, None
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage
    assert text and finish == "length"
    assert usage is not None and usage.completion_tokens == 8 and usage.prompt_tokens > 0
    (row,) = gateway.wait_usage(tenant_id, 1)
    assert (row["status"], row["finish_reason"]) == ("ok", "length")
    assert (row["prompt_tokens"], row["output_tokens"]) == (usage.prompt_tokens, usage.completion_tokens)
    assert float(row["cost"]) == usage.prompt_tokens + 2 * usage.completion_tokens
    assert gateway.admin("engine")["running"] == 0
