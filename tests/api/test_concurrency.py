"""Many concurrent streams from several tenants: all complete, and the ledger bills each tenant what its
clients received."""

from __future__ import annotations

import asyncio
from collections import Counter

import httpx
import openai

from tests.api.server import ApiServer, wait_until

STREAMS = 50
TENANTS = 3


async def test_fifty_concurrent_streams_billed_as_counted(api_server: ApiServer, make_tenant) -> None:
    tenants = [make_tenant(ttft_target_s=120) for _ in range(TENANTS)]  # this test is not about shedding
    clients = [openai.AsyncOpenAI(base_url=api_server.v1, api_key=key, max_retries=0) for _, key in tenants]
    model = httpx.get(f"{api_server.base_url}/readyz").json()["model"]

    async def one(i: int) -> tuple[int, str, int, int]:
        max_tokens = 4 + i % 9
        stream = await clients[i % TENANTS].chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": f"Request number {i}"}],
            max_tokens=max_tokens,
            temperature=0.8,
            seed=i,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        usage = chunks[-1].usage
        assert finish in (["length"], ["stop"])
        if finish == ["length"]:
            assert usage.completion_tokens == max_tokens
        assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) <= usage.completion_tokens
        return tenants[i % TENANTS][0], chunks[-1].id, usage.prompt_tokens, usage.completion_tokens

    results = await asyncio.gather(*(one(i) for i in range(STREAMS)))
    counted: dict[int, Counter] = {tenant_id: Counter() for tenant_id, _ in tenants}
    for tenant_id, _, prompt_tokens, completion_tokens in results:
        counted[tenant_id].update(requests=1, prompt_tokens=prompt_tokens, output_tokens=completion_tokens)
    for tenant_id, expected in counted.items():
        rows = api_server.wait_usage(tenant_id, expected["requests"])
        assert {r["request_id"] for r in rows} == {rid for tid, rid, _, _ in results if tid == tenant_id}
        assert all(r["status"] == "ok" for r in rows)
        billed = Counter(
            requests=len(rows),
            prompt_tokens=sum(r["prompt_tokens"] for r in rows),
            output_tokens=sum(r["output_tokens"] for r in rows),
        )
        assert billed == expected
    wait_until(api_server.engine_idle, what="all KV blocks free after the streams")
