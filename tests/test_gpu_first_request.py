"""The first requests after start-up compile no Triton kernel and capture no CUDA graph (Model
Runner V2, CUDA graphs), a batch of ragged requests at a new size included.

vLLM's warm-up prefills one batch of ``max_num_seqs`` requests, and Triton compiles its attention
kernel once per class of the batch's sequence count (1, a multiple of 16, any other): a first
request of one prompt, or a first batch of a few, compiled the target's attention inside the
request (``patch/patch_v2_warmup.py``). Our warm-up covers every class. The control is the same
engine with that warm-up turned off (``GEMMA4_SPEC_PREFILL_WARMUP=0``), whose first requests must
compile something, or the test could not tell. Each engine runs in its own process: Triton keeps
compiled kernels in memory per process, so a second engine there would find the first's.

Skipped without CUDA (CI and the CPU machines); run on the GPU machine (benchmarks/results/h200).
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from gemma4_spec.patch.patch_v2_warmup import PREFILL_WARMUP_ENV
from gemma4_spec.testing.engine_run import (
    PLUGIN_V2_SPECULATOR,
    RunConfig,
    generate_in_subprocess,
    gpu_run_fields,
)
from gemma4_spec.testing.kv_norms import add_missing_k_norms
from gemma4_spec.testing.tiny import build_tiny_assistant, build_tiny_e2b_like_target

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# One prompt alone, another alone, then three together: a one-sequence prefill and one of a
# count that is neither 1 nor a multiple of 16; most prompts longer than the sliding window (16).
# Then sixteen more of different lengths that stop after different numbers of tokens, as real
# traffic does (the trained pair's first pass at B=16 was slower than all its steady passes):
# the decode batch shrinks from 16 to 1, through sizes the first requests did not meet.
PROMPT_LENGTHS = (9, 60, 3, 40, 70, *range(5, 85, 5))
REQUEST_BATCHES = [1, 1, 3, 16]
RAGGED_MAX_TOKENS = [4 + (5 * i) % 21 for i in range(16)]  # 4 to 24, all different


@pytest.fixture(scope="module")
def runs(tmp_path_factory):  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp("first-request")
    target = build_tiny_e2b_like_target(root / "e2b", multimodal=False)
    add_missing_k_norms(target)  # vLLM 0.26 wants one on the KV-shared layers too
    assistant = build_tiny_assistant(root / "e2b-assistant", target, centroids=True)
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 2048) for _ in range(n)] for n in PROMPT_LENGTHS]
    config = RunConfig(
        **gpu_run_fields(str(target), prompts, 24),
        assistant=str(assistant),
        num_speculative_tokens=3,
        request_batches=REQUEST_BATCHES,
        sampling=[{}] * 5 + [{"max_tokens": n} for n in RAGGED_MAX_TOKENS],
        count_triton_compiles=True,
    )
    envs = {"warmed": {}, "control": {PREFILL_WARMUP_ENV: "0"}}
    with ThreadPoolExecutor(len(envs)) as pool:
        futures = {
            name: pool.submit(
                generate_in_subprocess, [config], env={"VLLM_USE_V2_MODEL_RUNNER": "1", **env}
            )
            for name, env in envs.items()
        }
        return {name: future.result()[0] for name, future in futures.items()}


def test_first_requests_compile_no_triton_kernel(runs) -> None:  # type: ignore[no-untyped-def]
    warmed = runs["warmed"]
    assert warmed.drafter_class == PLUGIN_V2_SPECULATOR
    assert warmed.spec_metrics["vllm:spec_decode_num_drafts"] > 0
    assert warmed.triton_compiles == [], "\n".join(warmed.triton_compiles)
    # Nor capture a graph of the plugin's per-step launches (the draft-input staging): vLLM's
    # start-up capture stages over the same buffers.
    assert warmed.launch_graphs_captured_serving == 0
    # Nor any other CUDA graph, vLLM's or ours (verification, draft loop), at any batch size.
    assert warmed.cuda_graphs_captured_serving == 0
    assert [len(t) for t in warmed.token_ids[5:]] == RAGGED_MAX_TOKENS
    # Nor scan the installed distributions for logits-processor plugins: the front end did at
    # start-up (patch/patch_input_processor.py).
    assert warmed.logits_processors_loaded_at_startup


def test_without_our_warm_up_the_first_requests_compile(runs) -> None:  # type: ignore[no-untyped-def]
    # The control: vLLM's warm-up alone leaves the small prefill batches' attention to the
    # first requests, so the counter sees them (else the test above proves nothing).
    control = runs["control"]
    assert any("unified_attention" in kernel for kernel in control.triton_compiles), (
        control.triton_compiles
    )
    # The extra warm-up changes no output.
    assert runs["warmed"].token_ids == control.token_ids
