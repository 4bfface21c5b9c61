"""The compute ceiling's FLOP count, checked against torch's own FLOP counter on a real Llama."""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoModelForCausalLM

from bench.ceiling import ModelShape, request_flops, workload_flops


def test_shape_flops_match_torch_flop_counter(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, dtype=torch.float32, attn_implementation="eager"
    )
    shape = ModelShape.from_model_dir(tiny_model_dir)
    n = 24
    ids = torch.randint(3, 1000, (1, n))
    with torch.inference_mode(), FlopCounterMode(display=False) as counter:
        model(input_ids=ids, logits_to_keep=1)
    # Eager attention multiplies the full n x n scores and values (the causal mask saves nothing there).
    expected = n * shape.dense_flops_per_token() + shape.attention_flops(n * n) + shape.logits_flops()
    assert counter.get_total_flops() == expected


def test_request_flops_sums_every_fed_token():
    shape = ModelShape(hidden=32, layers=3, heads=4, kv_heads=2, head_dim=8, intermediate=48, vocab=100)
    prompt, output = 7, 5
    by_token = 0
    for position in range(prompt + output - 1):  # the last output token is never fed back
        by_token += shape.dense_flops_per_token() + shape.attention_flops(position + 1)
        if position >= prompt - 1:
            by_token += shape.logits_flops()
    assert request_flops(shape, prompt, output) == by_token
    both = workload_flops(shape, [(prompt, output), (3, 2)])
    assert both == by_token + request_flops(shape, 3, 2)
