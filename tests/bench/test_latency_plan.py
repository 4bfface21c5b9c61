"""What `weir bench latency` sends: its figures' prompts and request counts, and the sizes it refuses."""

from __future__ import annotations

import argparse

import pytest

from bench.cli import add_latency_arguments
from bench.latency_bench import TTFT_OUTPUT_TOKENS, check_arguments, make_probes
from bench.model import load_tokenizer
from engine.config import EngineConfig

BLOCK = EngineConfig().block_size


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_latency_arguments(parser)
    return parser.parse_args(["--base-url", "http://127.0.0.1:8000/v1", *argv])


def test_figures_send_fresh_prompts_of_their_size(tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    options = ["--prompt-tokens", "32", "64", "--repeats", "3", "--streams", "1", "4"]
    args = _args(*options, "--output-tokens", "20", "--stream-prompt-tokens", "24")
    probes = make_probes(tokenizer, args)

    assert [(p.key, p.measure, p.concurrent, len(p.prompts), p.max_tokens) for p in probes] == [
        ("ttft_32", "ttft", False, 3, TTFT_OUTPUT_TOKENS),
        ("ttft_64", "ttft", False, 3, TTFT_OUTPUT_TOKENS),
        ("tpot_1", "tpot", True, 1, 20),
        ("tpot_4", "tpot", True, 4, 20),
    ]
    sizes = {"ttft_32": 32, "ttft_64": 64, "tpot_1": 24, "tpot_4": 24}
    encoded = [
        (probe.key, tokenizer.encode(prompt, add_special_tokens=False))
        for probe in probes
        for prompt in probe.prompts
    ]
    assert all(sizes[key] - 2 <= len(ids) <= sizes[key] for key, ids in encoded)
    first_blocks = {tuple(ids[:BLOCK]) for _, ids in encoded}
    assert len(first_blocks) == len(encoded)  # no prompt starts like another: no prefix cache hit
    assert make_probes(tokenizer, args) == probes


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--prompt-tokens", "16", "16"], "repeats a value"),
        (["--streams", "0"], "at least 1"),
        (["--repeats", "0"], "at least 1"),
        (["--output-tokens", "1"], "at least 2"),
    ],
)
def test_sizes_that_cannot_give_a_figure_are_refused(argv, message):
    with pytest.raises(SystemExit, match=message):
        check_arguments(_args(*argv))
    check_arguments(_args())
