"""The `transformers` baselines of the engine benchmark: continuous batching and padded static generate()."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from bench.report import progress
from bench.workload import BenchRequest, SystemResult, check_lengths


def load_hf_model(model_dir: str, device: str, dtype: str = "float32"):
    """The `transformers` model in ``dtype``, eval mode, on ``device``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    return model.to(device).eval()


def run_generate_batch(model, workload: Sequence[BenchRequest]) -> SystemResult:
    """`transformers` continuous batching: the manager behind ``generate_batch``, fed request by request.

    ``generate_batch`` takes one ``max_new_tokens`` for all prompts, so each request is added to the same
    manager with its own ``max_new_tokens`` and ``eos_token_id=-1`` (EOS never ends it), greedy.
    """
    from transformers import GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    config = GenerationConfig(
        do_sample=False, eos_token_id=-1, max_new_tokens=max(r.output_len for r in workload)
    )
    hints = WorkloadHints(
        max_prompt_length=max(r.prompt_len for r in workload),
        max_generated_length=config.max_new_tokens,
        num_requests=len(workload),
    )
    generated: dict[str, int] = {}
    with model.continuous_batching_context_manager(
        generation_config=config, block=True, timeout=30, workload_hints=hints
    ) as manager:
        start = time.perf_counter()
        wanted = {}
        for i, request in enumerate(workload):
            rid = manager.add_request(
                list(request.prompt_ids),
                request_id=f"r{i}",
                max_new_tokens=request.output_len,
                eos_token_id=-1,
            )
            wanted[rid] = request.output_len
        while len(generated) < len(workload):
            result = manager.get_result(timeout=1)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError(
                        "transformers continuous batching stopped before finishing the workload"
                    )
                continue
            if not result.is_finished():
                continue
            if result.error is not None:
                raise RuntimeError(
                    f"transformers continuous batching failed {result.request_id}: {result.error}"
                )
            generated[result.request_id] = len(result.generated_tokens)
            progress(f"  generate_batch: {len(generated)}/{len(workload)} requests done")
        seconds = time.perf_counter() - start
    check_lengths("generate_batch", [generated[rid] for rid in wanted], list(wanted.values()))
    total = sum(generated.values())
    return SystemResult("transformers generate_batch", seconds, total, total)


def run_static_generate(model, workload: Sequence[BenchRequest], batch_size: int = 16) -> SystemResult:
    """Padded static batching: ``generate()`` on batches of ``batch_size`` in arrival order, left-padded.

    A batch runs until its longest request is done (EOS ignored through ``min_new_tokens``); only each
    request's own tokens count as output, the rest is reported as computed but wasted.
    """
    device = next(model.parameters()).device
    pad_id = model.generation_config.pad_token_id or 0  # masked out: its value never matters
    useful = computed = 0
    start = time.perf_counter()
    for first in range(0, len(workload), batch_size):
        batch = workload[first : first + batch_size]
        width = max(r.prompt_len for r in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, request in enumerate(batch):
            ids[row, width - request.prompt_len :] = torch.tensor(request.prompt_ids)
            mask[row, width - request.prompt_len :] = 1
        steps = max(r.output_len for r in batch)
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                do_sample=False,
                max_new_tokens=steps,
                min_new_tokens=steps,
                pad_token_id=pad_id,
            )
        check_lengths("static generate", [out.shape[1] - width] * len(batch), [steps] * len(batch))
        useful += sum(r.output_len for r in batch)
        computed += steps * len(batch)
        progress(f"  static generate: {first + len(batch)}/{len(workload)} requests done")
    seconds = time.perf_counter() - start
    notes = (
        f"batches of {batch_size} run to their longest request; {computed - useful} padded tokens not counted"
    )
    return SystemResult("transformers static generate()", seconds, useful, computed, notes)
