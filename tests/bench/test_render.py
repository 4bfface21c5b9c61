"""The engine benchmark's table: every system, Weir's ratios against their targets, the roofline."""

from __future__ import annotations

import pytest

from api.cli import build_parser
from bench.engine_throughput import TARGETS, median_run, render
from bench.workload import SystemResult


def _system(label: str, tok_s: float) -> dict:
    return {"label": label, "output_tokens_per_s": tok_s, "seconds": 100 / tok_s, "output_tokens": 100}


def test_engine_table_shows_ratios_and_roofline():
    weir, batch, static = 90.0, 10.0, 30.0
    result = {
        "workload": {"requests": 4, "prompt_len": [32, 512], "output_len": [32, 128], "prompt_tokens": 900,
                     "output_tokens": 100, "flops": 5e10},
        "machine": {"device": "cpu", "dtype": "bfloat16"},
        "matmul_gflops": 250.0,
        "bandwidth_gb_s": 20.0,
        "roofline_tokens_per_s": 120.0,
        "weir_fraction_of_roofline": weir / 120.0,
        "weir_ratio": {
            "transformers_generate_batch": weir / batch,
            "transformers_static_generate": weir / static,
        },
        "systems": {
            "weir": _system("weir engine", weir),
            "transformers_generate_batch": _system("transformers generate_batch", batch),
            "transformers_static_generate": _system("transformers static generate()", static),
        },
    }  # fmt: skip
    lines = render(result).splitlines()
    row = {
        name: next(line for line in lines if line.startswith(s["label"]))
        for name, s in result["systems"].items()
    }
    assert f"{weir / batch:.2f}x" in row["transformers_generate_batch"]
    assert row["transformers_generate_batch"].endswith("met") == (
        weir / batch >= TARGETS["transformers_generate_batch"]
    )
    assert row["transformers_static_generate"].endswith("MISSED") == (
        weir / static < TARGETS["transformers_static_generate"]
    )
    roofline = next(line for line in lines if line.startswith("roofline"))
    assert f"{weir / 120:.0%}" in roofline and roofline.endswith("met")


def test_repeats_report_each_systems_median_run_and_every_run():
    results = [SystemResult("weir engine", seconds, 100, 100) for seconds in (1.0, 4.0, 2.0, 0.5)]
    assert median_run(results).seconds == 2.0  # tokens/s 25, 50, 100, 200: the lower middle one
    assert median_run(results[:3]).seconds == 2.0
    result = {
        "workload": {"requests": 4, "prompt_len": [32, 512], "output_len": [32, 128], "prompt_tokens": 900,
                     "output_tokens": 100, "flops": 5e10},
        "machine": {"device": "cpu", "dtype": "bfloat16"},
        "matmul_gflops": 250.0, "bandwidth_gb_s": 20.0, "roofline_tokens_per_s": 120.0,
        "weir_fraction_of_roofline": 0.5, "weir_ratio": {},
        "systems": {"weir": _system("weir engine", 60.0) | {"runs_tokens_per_s": [55.0, 60.0, 71.25]}},
    }  # fmt: skip
    assert "weir engine 55.0, 60.0, 71.2" in render(result)
    del result["systems"]["weir"]["runs_tokens_per_s"]
    assert "median run" not in render(result)


def test_repeats_must_be_positive():
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "engine", "--repeats", "0"])
