"""Prefix caching: full blocks shared by hash within a tenant, evicted least recently used, billed cached."""

from __future__ import annotations

from pathlib import Path

from engine.core import generate_offline
from engine.kv_cache import KVCacheManager
from engine.types import SamplingParams
from tests.engine.engine_helpers import assert_block_references_match, make_core, random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=6)


def computed(kv: KVCacheManager, request_id: str, tokens: list[int], salt: str = "t") -> None:
    """Give a sequence blocks for all its tokens and register them as computed."""
    assert kv.grow(request_id, len(tokens))
    kv.cache_full_blocks(request_id, tokens, len(tokens), salt)


def test_full_blocks_are_shared_by_hash_and_the_last_tokens_block_never() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    tokens = list(range(100, 110))  # two full blocks and a partial one
    computed(kv, "a", tokens)
    assert kv.share_prefix("b", tokens[:9] + [7, 7], "t") == 8  # both full blocks
    assert kv.table("b") == kv.table("a")[:2]
    assert kv.share_prefix("c", tokens[:8], "t") == 4  # its last token's block is computed, not shared
    assert kv.share_prefix("d", tokens, "other tenant") == 0
    assert kv.share_prefix("e", [1, *tokens[1:]], "t") == 0  # a different first token: a different chain
    assert_block_references_match(kv, "abcde")
    for request_id in ("a", "b", "c"):
        kv.free(request_id)
    assert kv.num_free_blocks == kv.num_blocks  # cached blocks no one holds count as free
    assert kv.share_prefix("f", tokens, "t") == 8  # and are still found
    kv.free("f")


def test_the_cache_probe_counts_what_sharing_would_give_and_takes_nothing() -> None:
    """Admission asks how much of a prompt is cached before the request reaches the engine: the same count
    as ``share_prefix``, per tenant, with no reference taken; 0 with caching off."""
    kv = KVCacheManager(num_blocks=16, block_size=4)
    tokens = list(range(100, 110))
    computed(kv, "a", tokens)
    refs = [kv.allocator.ref_count(b) for b in kv.table("a")]
    assert kv.cached_prefix_tokens(tokens[:8], "t") == 4  # its last token's block is never shared
    assert kv.cached_prefix_tokens(tokens[:9] + [7, 7], "t") == 8
    assert kv.cached_prefix_tokens(tokens, "other tenant") == 0
    assert [kv.allocator.ref_count(b) for b in kv.table("a")] == refs
    assert kv.cached_prefix_tokens(tokens[:9] + [7, 7], "t") == kv.share_prefix("b", tokens[:9] + [7, 7], "t")
    assert KVCacheManager(16, 4, prefix_caching=False).cached_prefix_tokens(tokens, "t") == 0


def test_cached_blocks_are_evicted_least_recently_used_when_memory_runs_out() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    old, recent = list(range(10, 18)), list(range(20, 28))
    computed(kv, "old", old)
    computed(kv, "recent", recent)
    kv.free("old")
    kv.free("recent")
    assert kv.allocator.num_cached == 4
    assert kv.grow("new", 8)  # takes the two blocks of the least recently freed prompt
    assert kv.share_prefix("again-old", old + [1], "t") == 0
    assert kv.share_prefix("again-recent", recent + [1], "t") == 8
    assert_block_references_match(kv, ["old", "recent", "new", "again-old", "again-recent"])


def test_a_shared_system_prompt_is_computed_once_and_billed_as_cached(tiny_model_dir: Path) -> None:
    system = random_prompts((40,), seed=3)[0]
    questions = random_prompts((5, 9, 13), seed=4)
    prompts = [system + q for q in questions]
    cold = make_core(tiny_model_dir, block_size=4, prefix_caching=False)
    expected = [o.token_ids for o in generate_offline(cold, [(p, GREEDY) for p in prompts])]

    core = make_core(tiny_model_dir, block_size=4)
    first = generate_offline(core, [(prompts[0], GREEDY)])[0]
    rest = generate_offline(core, [(p, GREEDY) for p in prompts[1:]])
    assert first.cached_tokens == 0 and [o.cached_tokens for o in rest] == [40, 40]
    assert [first.token_ids] + [o.token_ids for o in rest] == expected  # same tokens as computing it all
    assert core.stats().kv_blocks_free == core.stats().kv_blocks_total
    assert core.stats().kv_blocks_cached >= 10  # the system prompt's blocks stay findable

    other_tenant = "someone-else"
    core.add_request("x", prompts[1], GREEDY, tenant_id=other_tenant)
    while core.has_unfinished():
        outputs = core.step()
    assert outputs[-1].cached_tokens == 0  # caches are not shared across tenants


def test_queued_prompts_count_what_the_cache_will_not_serve(tiny_model_dir: Path) -> None:
    """The prefill a new request waits behind counts the queued prompts less what the prefix cache held when
    they arrived (as admission counts the new request's own): a queue of turns after a cached system prompt
    does not make the TTFT estimate, nor the engine's own prediction, count the system prompt again."""
    system = random_prompts((40,), seed=5)[0]
    questions = random_prompts((6, 10), seed=6)
    core = make_core(tiny_model_dir, block_size=4)
    generate_offline(core, [(system + [7], GREEDY)])  # the system prompt's 10 blocks are cached now
    cold = core.estimate_ttft(len(system) + len(questions[0])).seconds
    for i, question in enumerate(questions):
        core.add_request(f"q{i}", system + question, GREEDY)
    assert core.estimate_ttft(8).queued_tokens == sum(len(q) for q in questions)
    first = core.scheduler.waiting[0]
    assert first.expected_cached_tokens == len(system) and first.predicted_ttft < cold
    while core.has_unfinished():
        core.step()
    assert core.estimate_ttft(8).queued_tokens == 0
