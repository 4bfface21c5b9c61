"""A request whose client leaves while it is still queued in the engine is billed nothing: one ledger row,
with no prompt, cached or output tokens and cost 0 (the engine never ran it)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.api.server import ApiServer, run_db, serving, wait_until
from tests.api.test_disconnect import _long_request, _model, _send

PATIENT_S = 600.0  # a TTFT target no request here misses: none is refused for its start deadline


@pytest.fixture(scope="module")
def one_seat_server(
    tiny_model_dir: Path, api_database_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ApiServer]:
    """One running sequence at most: a second request waits in the engine while the first runs."""
    options = ("--max-num-seqs", "1", "--kv-cache-memory", "8", "--log-level", "warning")
    with serving(tiny_model_dir, api_database_url, tmp_path_factory.mktemp("one-seat"), *options) as server:
        yield server


def test_a_request_that_left_while_queued_is_billed_nothing(one_seat_server: ApiServer) -> None:
    server = one_seat_server
    _, running_key = run_db(server.database_url, server.create_tenant, ttft_target_s=PATIENT_S)
    queued_tenant, queued_key = run_db(server.database_url, server.create_tenant, ttft_target_s=PATIENT_S)
    short = {"model": _model(server), "prompt": "Once upon a time", "max_tokens": 4}
    with _send(server, running_key, _long_request(server, stream=True)):
        wait_until(lambda: server.admin("engine")["running"] == 1, what="the long request running")
        with _send(server, queued_key, short):
            wait_until(lambda: server.admin("engine")["waiting"] == 1, what="the second request queued")
        [row] = server.wait_usage(queued_tenant, 1)
        assert server.admin("engine")["running"] == 1  # the long request still holds the only seat
    assert (row["status"], row["finish_reason"], row["queue_s"]) == ("cancelled", "abort", None)
    assert (row["prompt_tokens"], row["cached_tokens"], row["output_tokens"]) == (0, 0, 0)
    assert float(row["cost"]) == 0.0
    wait_until(server.engine_idle, what="all KV blocks free")
    assert server.usage_rows(queued_tenant) == [row]  # exactly one row
