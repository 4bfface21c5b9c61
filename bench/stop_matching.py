"""`weir bench stops`: the stop-string matcher's time per token as the output grows.

The workload is adversarial: the output repeats ``ab`` and the four stop strings are 256 characters long
(the API's cap) and each almost matches it, so the matcher always holds back a long tail that could still
become a stop string. The matcher's cost per token must stay flat from hundreds to thousands of tokens. The
comparison row is the straightforward matcher it replaced: every push searches the held-back text for every
stop and tries every overlap length.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence

from bench.report import format_table, write_json
from engine.sampler import StopStringMatcher

STOP_CHARS = 256
STOPS = (
    "ab" * (STOP_CHARS // 2 - 1) + "ac",
    "ab" * (STOP_CHARS // 2 - 1) + "bb",
    "b" + "ab" * (STOP_CHARS // 2 - 1) + "c",
    "a" * (STOP_CHARS - 1) + "b",
)
TOKEN = "ab"


class SearchingMatcher:
    """The matcher Weir used before: a whole-buffer search and an overlap scan on every push."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self._held = ""

    def push(self, text: str) -> tuple[str, bool]:
        buffer = self._held + text
        cut = min((i for i in (buffer.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self._held = ""
            return buffer[:cut], True
        keep = max((self._overlap(buffer, s) for s in self.stops), default=0)
        self._held = buffer[len(buffer) - keep :] if keep else ""
        return buffer[: len(buffer) - keep], False

    @staticmethod
    def _overlap(text: str, stop: str) -> int:
        for n in range(min(len(text), len(stop) - 1), 0, -1):
            if text.endswith(stop[:n]):
                return n
        return 0


REPEATS = 5  # each figure is the fastest of this many runs (the machine's other work only adds time)


def time_per_token(make: Callable[[Sequence[str]], object], tokens: int) -> float:
    """Microseconds per pushed token over an output of ``tokens`` tokens (fastest of ``REPEATS`` runs)."""
    best = float("inf")
    for _ in range(REPEATS):
        matcher = make(STOPS)
        started = time.perf_counter()
        for _ in range(tokens):
            _, hit = matcher.push(TOKEN)
            if hit:
                raise AssertionError("the benchmark's stop strings must never match")
        best = min(best, time.perf_counter() - started)
    return best / tokens * 1e6


def main(args: argparse.Namespace) -> int:
    rows, results = [], []
    for n in args.tokens:
        print(f"timing {n} tokens ...", flush=True)
        weir, searching = time_per_token(StopStringMatcher, n), time_per_token(SearchingMatcher, n)
        rows.append((n, weir, searching, searching / weir))
        results.append({"tokens": n, "weir_us_per_token": weir, "searching_us_per_token": searching})
    print(format_table(("output tokens", "weir µs/token", "per-push search µs/token", "search / weir"), rows))
    if args.out:
        write_json(args.out, {"benchmark": "stops", "results": results})
    return 0
