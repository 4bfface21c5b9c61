"""How the serve benchmark plans its loads, picks its comparison rate and reads its servers and keys."""

from __future__ import annotations

import argparse

import pytest

from bench.http_load import ChatSession, chat_messages, poisson_arrivals
from bench.model import load_tokenizer
from bench.serve import build_chat_load, build_load, comparison_point
from bench.targets import DUMMY_KEY, comparison_targets, parse_peer, read_keys
from bench.workload import ChatSpec, WorkloadSpec
from engine.config import EngineConfig

BLOCK = EngineConfig().block_size
RATES = [0.5, 1.0, 2.0]


def _first_blocks(tokenizer, texts: list[str]) -> set[tuple[int, ...]]:
    """The first block-sized run of tokens of each text (none for a text shorter than a block)."""
    encoded = [tokenizer.encode(text, add_special_tokens=False) for text in texts]
    return {tuple(ids[:BLOCK]) for ids in encoded if len(ids) >= BLOCK}


def test_each_rate_draws_fresh_prompts_of_the_same_shape(tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    spec = WorkloadSpec(num_requests=6, prompt_len=(BLOCK, 3 * BLOCK), output_len=(4, 9), seed=4)
    loads = [build_load(tokenizer, spec, rate, [None], index) for index, rate in enumerate(RATES)]
    assert loads[1] == build_load(tokenizer, spec, RATES[1], [None], 1)
    blocks = [_first_blocks(tokenizer, [r.prompt for r in load]) for load in loads]
    assert all(len(b) == len(spec_load) for b, spec_load in zip(blocks, loads, strict=True))
    for i, mine in enumerate(blocks):
        for theirs in blocks[i + 1 :]:
            assert not mine & theirs
    assert {tuple(r.max_tokens for r in load) for load in loads} == {tuple(r.max_tokens for r in loads[0])}
    for load, rate in zip(loads, RATES, strict=True):
        assert [r.at * rate for r in load] == pytest.approx([r.at * RATES[0] for r in loads[0]])


def test_shared_prefix_conversations_open_with_one_system_prompt_per_rate(tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    spec = ChatSpec(WorkloadSpec(4, (8, 16), (4, 8), seed=1), system_len=6 * BLOCK, turns=3)
    loads = [build_chat_load(tokenizer, spec, rate, ["k1", "k2"], index) for index, rate in enumerate(RATES)]
    for load in loads:
        assert len({session.system for session in load}) == 1
        assert [session.api_key for session in load] == ["k1", "k2", "k1", "k2"]
        assert all(len(s.user_turns) == len(s.max_tokens) == 3 for s in load)
        system_tokens = tokenizer.encode(load[0].system, add_special_tokens=False)
        assert 5 * BLOCK <= len(system_tokens) <= 6 * BLOCK
    systems = [_first_blocks(tokenizer, [load[0].system]) for load in loads]
    assert not systems[0] & systems[1] and not systems[1] & systems[2] and not systems[0] & systems[2]


def test_a_turn_carries_the_conversation_and_its_answers():
    session = ChatSession(0.0, "be brief", ("one?", "two?", "three?"), (4, 4, 4), None)
    assert chat_messages(session, []) == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "one?"},
    ]
    assert chat_messages(session, ["1", "2"]) == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "one?"},
        {"role": "assistant", "content": "1"},
        {"role": "user", "content": "two?"},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "three?"},
    ]


def _args(*peers: str, peer_keys: tuple[str, ...] = ()) -> argparse.Namespace:
    return argparse.Namespace(
        base_url="http://127.0.0.1:8000/v1",
        name="weir",
        keys=None,
        model_name=None,
        peer=list(peers),
        peer_keys=list(peer_keys),
    )


def test_peers_get_a_dummy_bearer_or_their_keys_and_a_model_when_named(tmp_path):
    assert parse_peer("vllm=http://10.0.0.2:8001/v1@org/Model-1") == (
        "vllm", "http://10.0.0.2:8001/v1", "org/Model-1"
    )  # fmt: skip
    assert parse_peer("tgi=http://user@host/v1") == ("tgi", "http://user@host/v1", None)
    keys = tmp_path / "keys.txt"
    keys.write_text("wk-a\nwk-b\n")
    args = _args("vllm=http://h:1/v1@m", "twin=http://h:2/v1", peer_keys=(f"twin={keys}",))
    weir, vllm, twin = comparison_targets(args, "serve", None)
    assert (weir.name, weir.keys, weir.model) == ("weir", (None,), None)
    assert (vllm.base_url, vllm.keys, vllm.model) == ("http://h:1/v1", (DUMMY_KEY,), "m")
    assert (twin.keys, twin.model) == (("wk-a", "wk-b"), None)
    load = [ChatSession(float(i), "s", ("u",), (4,), None) for i in range(5)]
    assert [r.api_key for r in twin.deal(load)] == ["wk-a", "wk-b", "wk-a", "wk-b", "wk-a"]
    for bad, message in [
        (_args("vllm:http://h/v1"), "NAME=http"),
        (_args("weir=http://h/v1"), "named alike"),
        (_args("a=http://h/v1@"), "no model"),
        (_args("a=http://h/v1", peer_keys=(f"b={keys}",)), "names no --peer"),
    ]:
        with pytest.raises(SystemExit, match=message):
            comparison_targets(bad, "serve", None)


def _sweep(attainments: list[float]) -> list[dict]:
    return [
        {"rate_rps": rate, "systems": {"peer": {"slo_attainment": a}}}
        for rate, a in zip([0.5, 1.0, 2.0], attainments, strict=False)
    ]


def test_comparison_rate_is_where_the_reference_starts_missing():
    point, note = comparison_point(_sweep([1.0, 0.95, 0.4]), "peer", 0.9)
    assert point["rate_rps"] == 2.0 and "starts missing" in note
    point, note = comparison_point(_sweep([1.0, 1.0, 1.0]), "peer", 0.9)
    assert point["rate_rps"] == 2.0 and "higher rates" in note
    point, note = comparison_point(_sweep([0.2, 0.1, 0.0]), "peer", 0.9)
    assert point["rate_rps"] == 0.5 and "lower rates" in note


def test_keys_file_gives_one_key_per_tenant(tmp_path):
    path = tmp_path / "keys.txt"
    path.write_text("# demo keys\nwk-a\n\nwk-b\nwk-c\n")
    assert read_keys(str(path), 2) == ["wk-a", "wk-b"]
    assert read_keys(str(path), None) == ["wk-a", "wk-b", "wk-c"]
    assert read_keys(None, 1) == [None]
    with pytest.raises(SystemExit, match="holds 3 key"):
        read_keys(str(path), 4)
    with pytest.raises(SystemExit, match="needs --keys"):
        read_keys(None, 2)
    (tmp_path / "empty.txt").write_text("# none yet\n")
    with pytest.raises(SystemExit, match="holds no key"):
        read_keys(str(tmp_path / "empty.txt"), None)
    with pytest.raises(SystemExit, match="cannot read"):
        read_keys(str(tmp_path / "missing.txt"), 1)


def test_poisson_arrivals_are_seeded_and_match_the_rate():
    arrivals = poisson_arrivals(2000, rate=4.0, seed=3)
    assert arrivals == poisson_arrivals(2000, rate=4.0, seed=3)
    assert arrivals == sorted(arrivals)
    assert 2000 / arrivals[-1] == pytest.approx(4.0, rel=0.1)
