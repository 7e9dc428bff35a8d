"""Start-up work kept out of a first request: small prefill batches' kernels, graph uploads.

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
and a few decode steps of dummy requests (vLLM's warm-up releases them). Then it uploads the
runner's full CUDA graphs to the device (``spec_decode/graph_upload.py``), so that no graph's
first replay falls in a request. Other engines keep vLLM's warm-up as it is. vLLM versions:
0.26 - 0.33 (the function and its three arguments, and its request count read from
``scheduler_config.max_num_seqs``, are the same in all of them).
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
from gemma4_spec.spec_decode import graph_upload
from gemma4_spec.switches import turned_off

WORKER_MODULE = "vllm.v1.worker.gpu_worker"
PREFILL_WARMUP_ENV = "GEMMA4_SPEC_PREFILL_WARMUP"
# One representative of each class Triton specialises an integer argument on (1, not a multiple
# of 16, a multiple of 16).
WARM_REQUEST_COUNTS = (1, 2, 16)


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
        graph_upload.upload_runner_graphs(model_runner)

    worker_module.warmup_kernels = ours(warmup_kernels)


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
