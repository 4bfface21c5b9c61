"""`weir bench serve` and `weir bench latency` end to end on the tiny model: the API suite's ``weir serve``
and a second one without prefix caching, on the same database (so one key works on both), as a peer."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from api.cli import main
from bench.http_load import chat_messages, run_load, served_model
from bench.model import load_tokenizer
from bench.serve import build_chat_load
from bench.workload import ChatSpec, WorkloadSpec
from engine.config import EngineConfig
from engine.tokenizer import Tokenizer
from tests.api.server import ApiServer, serving

BLOCK = EngineConfig().block_size


@pytest.fixture(scope="module")
def nocache(tiny_model_dir: Path, api_server: ApiServer, tmp_path_factory) -> Iterator[ApiServer]:
    """``weir serve --no-prefix-caching`` over the API suite's database."""
    options = ["--no-prefix-caching", "--kv-cache-memory", "8", "--log-level", "warning"]
    state = tmp_path_factory.mktemp("nocache-state")
    with serving(tiny_model_dir, api_server.database_url, state, *options) as server:
        yield server


@pytest.fixture
def keys_file(make_tenant, tmp_path: Path) -> Path:
    """A file holding the key of a fresh tenant."""
    _, key = make_tenant()
    path = tmp_path / "keys.txt"
    path.write_text(f"{key}\n")
    return path


def _bench(
    kind: str, server: ApiServer, peer: str, keys: Path, model_dir: Path, out: Path, *options: str
) -> int:
    return main(
        ["bench", kind, "--base-url", server.v1, "--keys", str(keys), "--model", str(model_dir)]
        + ["--peer", peer, "--peer-keys", f"nocache={keys}", "--out", str(out), *options]
    )


def _row(lines: list[str], *starts: str) -> list[str]:
    """The cells of the table row whose first cells are ``starts``."""
    return next(line.split() for line in lines if line.split()[: len(starts)] == list(starts))


def test_serve_runs_each_rate_against_the_peer_with_fresh_prompts(
    api_server, nocache, keys_file, tiny_model_dir, tmp_path, capsys
):
    out = tmp_path / "serve.json"
    loose = ["--slo-ttft-ms", "60000", "--slo-tpot-ms", "60000"]
    options = ["--quick", "--requests", "3", "--rate", "4", "8", *loose]
    assert _bench("serve", api_server, f"nocache={nocache.v1}", keys_file, tiny_model_dir, out, *options) == 0
    result = json.loads(out.read_text())
    lines = capsys.readouterr().out.splitlines()

    assert [point["rate_rps"] for point in result["sweep"]] == [4.0, 8.0]
    for point in result["sweep"]:
        weir, peer = point["systems"]["weir"], point["systems"]["nocache"]
        assert weir["completed"] == peer["completed"] == 3
        assert weir["output_tokens"] == peer["output_tokens"]  # the same prompts to the same greedy model
        assert weir["cached_pct"] == 0  # nothing of the previous rate's prompts is reused
        ratios = point["ratios"]["nocache"]
        assert ratios["goodput"] == pytest.approx(peer["goodput_rps"] / weir["goodput_rps"], abs=1e-3)
        assert ratios["ttft_p50"] == pytest.approx(peer["ttft_ms"]["p50"] / weir["ttft_ms"]["p50"], abs=1e-3)
        rate = f"{point['rate_rps']:.2f}"
        weir_row, peer_row = _row(lines, rate, "weir"), _row(lines, rate, "nocache")
        assert weir_row[-3:] == ["-", "-", "-"]
        assert peer_row[-3:] == [f"{ratios[k]:.2f}x" for k in ("goodput", "ttft_p50", "tpot_p50")]
    assert "nocache starts missing" in result["comparison_note"] or "met its SLO" in result["comparison_note"]


def test_shared_prefix_chats_build_on_the_answers_and_hit_weirs_prefix_cache(
    api_server, nocache, keys_file, tiny_model_dir, tmp_path, capsys
):
    out = tmp_path / "chat.json"
    options = ["--workload", "shared-prefix", "--system-prompt-tokens", str(8 * BLOCK), "--turns", "3"]
    options += [
        "--quick",
        "--requests",
        "2",
        "--rate",
        "2",
        "--slo-ttft-ms",
        "60000",
        "--slo-tpot-ms",
        "60000",
    ]
    assert _bench("serve", api_server, f"nocache={nocache.v1}", keys_file, tiny_model_dir, out, *options) == 0
    systems = json.loads(out.read_text())["systems"]
    assert systems["weir"]["completed"] == systems["nocache"]["completed"] == 6
    assert systems["weir"]["cached_pct"] > 40  # later turns reuse the system prompt and the turns before
    assert systems["nocache"]["cached_pct"] == 0
    capsys.readouterr()


async def test_each_turn_sends_the_earlier_answers_after_the_common_system_prompt(
    api_server, make_tenant, tiny_model_dir
):
    _, key = make_tenant()
    spec = ChatSpec(WorkloadSpec(2, (8, 16), (4, 8), seed=3), system_len=4 * BLOCK, turns=3)
    sessions = build_chat_load(load_tokenizer(tiny_model_dir), spec, rate=50.0, keys=[key])
    records = await run_load(api_server.v1, await served_model(api_server.v1, key), sessions)

    tokenizer = Tokenizer(tiny_model_dir)
    assert [r.ok for r in records] == [True] * 6
    for index, session in enumerate(sessions):
        turns = records[3 * index : 3 * index + 3]
        for turn, record in enumerate(turns):
            assert record.text  # an answer that the next turn carries
            messages = chat_messages(session, [r.text for r in turns[:turn]])
            assert record.prompt_tokens == len(tokenizer.apply_chat_template(messages))
        first_prompt = turns[0].prompt_tokens
        assert turns[1].prompt_tokens > first_prompt + turns[0].output_tokens
        assert all(r.cached_tokens >= BLOCK * (first_prompt // BLOCK - 1) for r in turns[1:])


def test_latency_table_sets_each_figure_of_the_peer_against_weir(
    api_server, nocache, keys_file, tiny_model_dir, tmp_path, capsys
):
    model = tiny_model_dir.name
    out = tmp_path / "latency.json"
    sizes = ["--prompt-tokens", "16", "48", "--repeats", "2", "--streams", "1", "3"]
    sizes += ["--output-tokens", "6", "--stream-prompt-tokens", "16"]
    assert (
        _bench("latency", api_server, f"nocache={nocache.v1}@{model}", keys_file, tiny_model_dir, out, *sizes)
        == 0
    )
    result = json.loads(out.read_text())
    lines = capsys.readouterr().out.splitlines()

    assert [f["key"] for f in result["figures"]] == ["ttft_16", "ttft_48", "tpot_1", "tpot_3"]
    assert result["systems"]["nocache"]["model"] == model
    header = next(line for line in lines if line.startswith("figure"))
    assert header.split() == ["figure", "weir", "ms", "nocache", "ms", "nocache/weir"]
    for figure in result["figures"]:
        key = figure["key"]
        weir, peer = (result["systems"][name]["figures"][key] for name in ("weir", "nocache"))
        count = int(key.split("_")[1])
        assert weir["failed"] == peer["failed"] == 0
        assert len(weir["samples_ms"]) == len(peer["samples_ms"]) == (2 if key.startswith("ttft") else count)
        assert result["ratios"]["nocache"][key] == pytest.approx(
            peer["median_ms"] / weir["median_ms"], abs=1e-3
        )
        row = next(line for line in lines if line.startswith(figure["label"]))
        assert row.endswith(f"{result['ratios']['nocache'][key]:.2f}x")
        if key.startswith("ttft"):
            assert count - 2 <= weir["prompt_tokens"] <= count
        else:
            assert 2 <= weir["output_tokens"] <= 6
