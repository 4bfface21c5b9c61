"""Packed Q4_1 / Q8_0 weights against the dense fp32 products: each of the model's matrices, and the engine's
single-stream decode.

    .venv/bin/python bench/packed_weights.py [--model DIR] [--rows 1 8 32] [--repeats 20] [--tokens 128]

Part one times ``y = x @ W.T`` for SmolLM2's matrices (layer 0's four projections and the logits
projection, the real weights) at each row count with every dense kernel the engine has here (``aten``:
``F.linear``; ``onednn`` where available) and with the packed kernel; each figure is the fastest of
``--repeats`` runs, with the packed kernel's effective read bandwidth at 1 row and the time to decode the
whole matrix to fp32 (what holding only the packed form would add to every larger step). Part two runs one
request through the engine (fp32, a 128-token prompt of ordinary tokens, ``--tokens`` output tokens, EOS
ignored) with ``$WEIR_PACKED_WEIGHTS`` off and then auto, after a warm-up request each: TTFT and TPOT (mean
time between output tokens).
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.model import bench_model_dir, load_tokenizer  # noqa: E402
from bench.report import format_table, progress, write_json  # noqa: E402
from bench.workload import ordinary_token_ids  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.core import EngineCore, generate_offline  # noqa: E402
from engine.models.config import ModelConfig  # noqa: E402
from engine.models.dense import KERNELS, available_kernels  # noqa: E402
from engine.models.dtype_choice import fastest_seconds  # noqa: E402
from engine.models.loader import load_weights  # noqa: E402
from engine.models.packed import pack_lossless, packed_kernel_available  # noqa: E402
from engine.models.packed_weights import PACKED_ENV  # noqa: E402
from engine.types import SamplingParams  # noqa: E402

PROMPT_TOKENS = 128


def _best(run: Callable[[], object], repeats: int) -> float:
    run()  # warm-up
    return fastest_seconds(run, repeats)


def kernel_rows(model_dir: Path, row_counts: list[int], repeats: int) -> tuple[tuple[str, ...], list[tuple]]:
    """(headers, rows): per matrix and row count, ms per product for each dense kernel and the packed one."""
    config = ModelConfig.from_dir(model_dir)
    weights = load_weights(model_dir, config, "cpu", torch.float32)
    first = weights.layers[0]
    matrices = {
        "qkv": first.qkv,
        "out": first.out,
        "gate_up": first.gate_up,
        "down": first.down,
        "lm_head": weights.lm_head,
    }
    dense_kernels = available_kernels(torch.device("cpu"), torch.float32)
    rows = []
    with torch.inference_mode():
        for name, weight in matrices.items():
            packed = pack_lossless(weight)
            forms = {kernel: KERNELS[kernel][0](weight) for kernel in dense_kernels}
            decode = _best(packed.dequantize, repeats) * 1e3 if packed else None
            for count in row_counts:
                progress(f"{name} {tuple(weight.shape)} x {count} rows")
                x = torch.randn(count, weight.shape[1])
                dense = [
                    _best(lambda k=k, x=x, forms=forms: KERNELS[k][1](x, forms[k], None), repeats)
                    for k in dense_kernels
                ]
                fast = _best(lambda x=x, p=packed: p.linear(x), repeats) if packed else math.nan
                read = packed.nbytes / fast / 1e9 if packed and count == 1 else None
                fmt = packed.format if packed else "dense"
                speedup = min(dense) / fast
                rows.append((name, fmt, count, *(s * 1e3 for s in dense), fast * 1e3, speedup, read, decode))
    headers = ("matrix", "format", "rows", *(f"{k} ms" for k in dense_kernels), "packed ms", "speed-up")
    return (*headers, "packed GB/s", "decode ms"), rows


def single_stream(model_dir: Path, setting: str, tokens: int, prompt: list[int]) -> tuple[float, float]:
    """(TTFT s, TPOT s) of one request through an fp32 engine with ``$WEIR_PACKED_WEIGHTS`` = ``setting``."""
    os.environ[PACKED_ENV] = setting
    core = EngineCore.from_config(EngineConfig(model=str(model_dir), device="cpu", dtype="float32"))
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    generate_offline(core, [(prompt[:16], SamplingParams(max_tokens=8, ignore_eos=True))])  # warm-up
    (out,) = generate_offline(core, [(prompt, params)])
    times = out.token_times
    return out.first_token_time - out.arrival_time, (times[-1] - times[0]) / (len(times) - 1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a Llama-family directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=128, help="output tokens of the single stream")
    parser.add_argument("--out", help="also write the results as JSON here")
    args = parser.parse_args()
    if not packed_kernel_available():
        raise SystemExit("the packed kernel is not available on this machine (see the log)")
    model_dir = bench_model_dir(args.model, "packed")
    threads = torch.get_num_threads()
    headers, rows = kernel_rows(model_dir, args.rows, args.repeats)
    ids = ordinary_token_ids(load_tokenizer(model_dir))
    prompt = random.Random(0).choices(ids, k=PROMPT_TOKENS)
    stream = {setting: single_stream(model_dir, setting, args.tokens, prompt) for setting in ("off", "auto")}
    print(f"{model_dir.name}, fp32, {threads} threads, best of {args.repeats} products")
    print(format_table(headers, rows))
    print(f"\nsingle stream: {PROMPT_TOKENS}-token prompt, {args.tokens} output tokens")
    base = stream["off"][1]
    stream_rows = [
        (f"packed weights {s}", ttft * 1e3, tpot * 1e3, base / tpot) for s, (ttft, tpot) in stream.items()
    ]
    stream_headers = ("engine", "TTFT ms", "TPOT ms", "TPOT speed-up")
    print(format_table(stream_headers, stream_rows))
    if args.out:
        write_json(
            args.out,
            {
                "benchmark": "packed_weights",
                "products": [dict(zip(headers, r, strict=True)) for r in rows],
                "single_stream": [dict(zip(stream_headers, r, strict=True)) for r in stream_rows],
            },
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
