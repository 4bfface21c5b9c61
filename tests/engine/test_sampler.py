"""Token sampling (greedy, temperature, top-k, top-p, seeds) and stop strings."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.sampler import StopStringMatcher, make_generator, sample
from engine.types import SamplingParams

VOCAB = 50


def draw(logits: torch.Tensor, params: list[SamplingParams], steps: int) -> list[list[int]]:
    generators = [make_generator(p, logits.device) for p in params]
    return [sample(logits, params, generators) for _ in range(steps)]


def test_greedy_rows_take_the_argmax() -> None:
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0), SamplingParams(top_k=1), SamplingParams(temperature=0)]
    assert sample(logits, params, [None, None, None]) == logits.argmax(dim=-1).tolist()


def test_seeded_request_draws_the_same_tokens_whatever_shares_its_batch() -> None:
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(1))
    seeded = SamplingParams(temperature=1.0, seed=42)
    alone = [row[0] for row in draw(logits[:1], [seeded], 20)]
    others = [SamplingParams(temperature=0.7), SamplingParams(temperature=0), SamplingParams(top_p=0.5)]
    mixed = [row[2] for row in draw(logits[[1, 2, 0, 3]], [others[0], others[1], seeded, others[2]], 20)]
    assert alone == mixed
    assert len(set(alone)) > 1  # really sampled, not argmax
    unseeded = [row[0] for row in draw(logits[:1], [SamplingParams(temperature=1.0, seed=7)], 20)]
    assert unseeded != alone


def test_top_k_and_top_p_only_draw_from_the_kept_tokens() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05] + [0.0] * (VOCAB - 4)) + 1e-9
    logits = probs.log().expand(2, VOCAB).clone()
    params = [SamplingParams(top_k=2, seed=1), SamplingParams(top_p=0.7, seed=2)]
    rows = draw(logits, params, 200)
    assert {r[0] for r in rows} == {0, 1}
    assert {r[1] for r in rows} == {0, 1}  # 0.5 < 0.7, 0.5 + 0.3 >= 0.7: two tokens kept
    params = [SamplingParams(top_p=0.9, seed=3), SamplingParams(temperature=0.05, seed=4)]
    rows = draw(logits, params, 200)
    assert {r[0] for r in rows} == {0, 1, 2}
    assert {r[1] for r in rows} == {0}  # a low temperature sharpens towards the mode


def test_bad_sampling_params_are_refused_with_a_clear_message() -> None:
    for kwargs, message in [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"stop": ("",)}, "stop strings"),
    ]:
        with pytest.raises(ValueError, match=message):
            SamplingParams(**kwargs)
    assert SamplingParams(stop="END").stop == ("END",)


def test_stop_string_straddling_pieces_is_cut_and_never_emitted() -> None:
    matcher = StopStringMatcher(["STOP", "\n\n"])
    emitted = []
    for piece in ["Hello S", "T", "ill ST", "O", "P and more"]:
        text, hit = matcher.push(piece)
        emitted.append(text)
        if hit:
            break
    assert emitted == ["Hello ", "", "STill ", "", ""] and hit
    assert "".join(emitted) == "Hello STill "


def test_held_back_text_is_released_when_the_output_ends_otherwise() -> None:
    matcher = StopStringMatcher(["</end>"])
    assert matcher.push("a </e") == ("a ", False)
    assert matcher.push("n") == ("", False)
    assert matcher.flush() == "</en"
    assert StopStringMatcher([]).push("x</") == ("x</", False)


@pytest.mark.parametrize("temperature", [1e-30, 1e-39, 1e-45, 5e-324])
def test_tiny_temperatures_are_greedy_not_nan(temperature: float) -> None:
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(5)) * 30
    params = [SamplingParams(temperature=temperature, seed=s) for s in (1, 2)]
    for row in draw(logits, params, 5):
        assert row == logits.argmax(dim=-1).tolist()


def _first_stop(text: str, stops: list[str]) -> int | None:
    """Where the output is cut: before the stop string that completes first (the longest if several)."""
    ends = [(text.find(s) + len(s), -len(s)) for s in stops if s in text]
    if not ends:
        return None
    end, neg_len = min(ends)
    return end + neg_len


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="ab\n", max_size=40),
    stops=st.lists(st.text(alphabet="ab\n", min_size=1, max_size=5), min_size=1, max_size=4),
    cuts=st.lists(st.integers(min_value=0, max_value=40), max_size=10),
)
def test_streamed_stop_matching_equals_a_whole_text_search(
    text: str, stops: list[str], cuts: list[int]
) -> None:
    matcher = StopStringMatcher(stops)
    bounds = [0, *sorted(c for c in cuts if c <= len(text)), len(text)]
    emitted, hit = "", False
    for start, end in zip(bounds, bounds[1:], strict=False):
        out, hit = matcher.push(text[start:end])
        emitted += out
        if hit:
            break
        assert len(matcher._held) < max(map(len, stops))  # held back: less than a stop
    if not hit:
        emitted += matcher.flush()
    cut = _first_stop(text, stops)
    assert hit == (cut is not None)
    assert emitted == (text if cut is None else text[:cut])
