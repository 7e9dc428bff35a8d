"""Compile the attention kernels of small prefill batches at start-up, not in a first request.

Wraps: ``vllm.v1.worker.gpu_worker.warmup_kernels``, the name the GPU worker calls (from
``vllm.v1.worker.gpu.warmup``) to compile Model Runner V2's Triton kernels before serving. vLLM's
warm-up prefills one batch of as many requests as the scheduler allows (``max_num_seqs``, or
fewer where the batch's tokens or the KV blocks run out). Triton compiles a kernel once for each
class of every integer argument (equal to 1, a multiple of 16, any other value), and the Triton
attention kernel takes the batch's sequence count: a prefill of one request, or of a count in
another class than the warm-up's, compiles the target's attention in the user's request, several
times slower than the next one (measured on the H200: ``benchmarks/results/h200``). vLLM's
in-tree gemma4_mtp has them compiled at start-up as a side effect: it captures its draft-prefill
graphs with batches of ``1 + k`` tokens a request, which the attention kernel runs as prefills;
with our verification rewrite (``patch_triton_attn``) those batches run on the decode kernel.

When the engine drafts with gemma4_mtp, the wrapper runs vLLM's own warm-up again with the
request count capped at each of ``WARM_REQUEST_COUNTS`` below ``max_num_seqs`` (one sequence,
another count, a multiple of 16), so every class a real batch can have is compiled before the
first request; ``GEMMA4_SPEC_PREFILL_WARMUP=0`` turns it off. Each extra round is one prefill
and a few decode steps of dummy requests (vLLM's warm-up releases them). Other engines keep
vLLM's warm-up as it is. vLLM versions: 0.26 - 0.33 (the function and its three arguments, and
its request count read from ``scheduler_config.max_num_seqs``, are the same in all of them).

Opt-in, not yet measured (``GEMMA4_SPEC_SHAPE_WARMUP=1``): the GEMM shapes of a first request
as well. CUDA loads a kernel's module at its first launch (torch's default, lazy loading), and
the GEMMs that run outside CUDA graphs pick their kernels by row count: the target's logits
(one row per token a step samples, up to ``max_num_seqs`` times ``1 + k``) and the prefill
steps above the largest captured size. The first-pass profile of the trained pair put the
growth of a first pass at B = 16 / 32 in those GEMMs' own host time, with nothing compiled,
captured or allocated (``benchmarks/results/h200``). The warm-up computes the logits of every
row count once, and runs vLLM's own dummy forward (the call its worker makes for compile
sizes) at each power of two from the largest captured size to ``max_num_batched_tokens``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from types import ModuleType
from typing import Any

from gemma4_spec.patch import patch_v2_sample
from gemma4_spec.patch.hooks import is_ours, ours
from gemma4_spec.patch.patch_vllm_config import drafts_with_gemma4_mtp
from gemma4_spec.switches import turned_off, turned_on

WORKER_MODULE = "vllm.v1.worker.gpu_worker"
PREFILL_WARMUP_ENV = "GEMMA4_SPEC_PREFILL_WARMUP"
# One representative of each class Triton specialises an integer argument on (1, not a multiple
# of 16, a multiple of 16).
WARM_REQUEST_COUNTS = (1, 2, 16)
SHAPE_WARMUP_ENV = "GEMMA4_SPEC_SHAPE_WARMUP"


def apply(worker_module: ModuleType) -> None:
    original = getattr(worker_module, "warmup_kernels", None)
    if original is None or is_ours(original):
        return  # not a vLLM with V2's warm-up (the contract test names the version)

    @functools.wraps(original)
    def warmup_kernels(
        model_runner: Any, worker_execute_model: Any, worker_sample_tokens: Any
    ) -> None:
        original(model_runner, worker_execute_model, worker_sample_tokens)
        config = getattr(model_runner, "vllm_config", None)
        if not drafts_with_gemma4_mtp(config):
            return
        patch_v2_sample.prepare(model_runner)
        if not turned_off(PREFILL_WARMUP_ENV):
            scheduler = model_runner.scheduler_config
            for count in extra_request_counts(scheduler.max_num_seqs):
                with requests_capped_at(scheduler, count):
                    original(model_runner, worker_execute_model, worker_sample_tokens)
        if turned_on(SHAPE_WARMUP_ENV):
            warm_gemm_shapes(model_runner)

    worker_module.warmup_kernels = ours(warmup_kernels)


def warm_gemm_shapes(model_runner: Any) -> None:
    """Launch, once each, the GEMMs a first request runs outside CUDA graphs (see the module's
    docstring): the target's logits at every row count a step can sample, and a dummy forward
    at each prefill size of ``prefill_sizes``."""
    import torch

    rows = model_runner.max_num_reqs * model_runner.decode_query_len
    hidden = model_runner.model_config.get_hidden_size()
    with torch.inference_mode():
        states = torch.zeros(rows, hidden, dtype=model_runner.dtype, device=model_runner.device)
        for count in range(1, rows + 1):
            model_runner.model.compute_logits(states[:count])
        largest = model_runner.vllm_config.compilation_config.max_cudagraph_capture_size or 0
        for size in prefill_sizes(largest, model_runner.max_num_tokens):
            # As vLLM's worker warms its compile sizes (its metrics and LoRA state untouched).
            model_runner._dummy_run(size, skip_eplb=True, remove_lora=False)
    if torch.accelerator.is_available():
        torch.accelerator.synchronize()


def prefill_sizes(largest_captured: int, max_num_tokens: int) -> list[int]:
    """The powers of two above ``largest_captured`` up to ``max_num_tokens``, and that last."""
    sizes, size = [], 1
    while size <= largest_captured:
        size *= 2
    while size < max_num_tokens:
        sizes.append(size)
        size *= 2
    if max_num_tokens > largest_captured:
        sizes.append(max_num_tokens)
    return sizes


def extra_request_counts(max_num_seqs: int) -> list[int]:
    """The batch sizes warmed besides vLLM's own (which is at most ``max_num_seqs``)."""
    return [count for count in WARM_REQUEST_COUNTS if count < max_num_seqs]


@contextlib.contextmanager
def requests_capped_at(scheduler_config: Any, count: int) -> Iterator[None]:
    """vLLM's warm-up sizes its batch by ``max_num_seqs``; every runner buffer was sized from it
    at start-up already, so lowering it for the warm-up's duration changes nothing else."""
    saved = scheduler_config.max_num_seqs
    scheduler_config.max_num_seqs = count
    try:
        yield
    finally:
        scheduler_config.max_num_seqs = saved
