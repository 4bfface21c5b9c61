"""The engine benchmark's table: every system, Weir's ratios against their targets, the roofline."""

from __future__ import annotations

from bench.engine_throughput import TARGETS, render


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
