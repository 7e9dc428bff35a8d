"""Verify all-greedy batches on Model Runner V2 from the target's logits before the soft-cap.

V2's ``GPUModelRunner.sample`` computes the logits of every verified row and hands them to
the rejection sampler. For Gemma 4 the logits are the lm_head's output soft-capped by vLLM's
``LogitsProcessor`` in three elementwise passes over ``[rows, V]`` (V = 262144; rows = B (k + 1)
in a verification step), and our all-greedy path (``patch_v2_rejection_sampler.py``) reads them
a fourth time for the argmax. For the batches that path takes, and with no grammar to apply, this
wrapper computes the logits with the cap left out and takes ``ops/capped_argmax``'s argmax of the
capped values: the same tokens from one read of the logits. Everything else (sampled requests,
logprobs, penalties, grammars, NaN counting, engines that do not draft with gemma4_mtp) runs
vLLM's method as it is; so do batches whose kernel cannot run exactly (``capped_argmax`` then
runs torch's formula, the same cost as vLLM's path).

The target's ``LogitsProcessor`` is found once per runner (the one module of that class in the
target, with a soft-cap, no scale and no logits as input); the cap is set to ``None`` for the one
call and restored. ``GEMMA4_SPEC_UNCAPPED_VERIFY=0`` keeps vLLM's capped logits.

vLLM's multimodal Gemma 4 (``Gemma4ForConditionalGeneration``, the class of the published
checkpoints) computes its language model's logits and then sets the checkpoint's
``suppress_tokens`` (its generation config's; ``<image|>`` and ``<audio|>`` in Gemma 4's) to
``-inf``; vLLM 0.26 does it by indexing with a Python list, a host-to-device copy at each call,
which a CUDA graph capture refuses. For such a target the verification computes the language
model's logits and sets the same tokens to ``-inf`` from a device tensor made once
(``LogitsSource``): the same logits, eager or replayed (``capped_argmax`` keeps ``-inf`` below
every capped value, as vLLM's cap-then-suppress order does).

A decode batch (every request with its k drafts) replays this verification from a graph
captured at start-up by ``prepare`` (``spec_decode/verify_graphs.py``): the same kernels
without their host launches; ``GEMMA4_SPEC_GRAPHED_VERIFY=0`` runs them eagerly.

Wraps: ``vllm.v1.worker.gpu.model_runner.GPUModelRunner.sample``. vLLM versions:
``compat.V2_GREEDY_VERIFY_VLLM`` (0.26), as the greedy path it feeds.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from gemma4_spec.compat import v2_greedy_verify_supported
from gemma4_spec.log import get_logger
from gemma4_spec.patch.hooks import is_ours, ours
from gemma4_spec.patch.patch_rejection_sampler import GREEDY_VERIFY_ATTR
from gemma4_spec.patch.patch_v2_rejection_sampler import (
    V2_REJECTION_SAMPLER_MODULE,
    VERIFY_GREEDY_TOKENS,
    greedy_verify_applies,
    request_arrays,
    sampler_output,
    verify_rows,
)
from gemma4_spec.spec_decode.verify_graphs import GRAPHED_VERIFY_ENV, MAX_GRAPHED_ROWS
from gemma4_spec.switches import turned_off

logger = get_logger(__name__)
V2_RUNNER_MODULE = "vllm.v1.worker.gpu.model_runner"
UNCAPPED_VERIFY_ENV = "GEMMA4_SPEC_UNCAPPED_VERIFY"
CAPPED_HEAD_ATTR = "gemma4_spec_capped_head"
LOGITS_SOURCE_ATTR = "gemma4_spec_logits_source"
VERIFY_GRAPHS_ATTR = "gemma4_spec_verify_graphs"


@dataclass(frozen=True)
class CappedHead:
    """The target's logits processor and the soft-cap it applies."""

    processor: Any
    cap: float


def find_capped_head(model: Any) -> CappedHead | None:
    """The target's one ``LogitsProcessor`` if it soft-caps and does nothing else to the logits
    (no scale, logits computed from hidden states); ``None`` otherwise."""
    from vllm.model_executor.layers.logits_processor import LogitsProcessor

    found = [m for m in model.modules() if isinstance(m, LogitsProcessor)]
    if len(found) != 1:
        return None
    processor = found[0]
    cap = getattr(processor, "soft_cap", None)
    if not cap or processor.scale != 1.0 or processor.logits_as_input:
        return None
    return CappedHead(processor, float(cap))


def capped_head(runner: Any) -> CappedHead | None:
    """``find_capped_head`` of the runner's target, looked up once."""
    if not hasattr(runner, CAPPED_HEAD_ATTR):
        setattr(runner, CAPPED_HEAD_ATTR, find_capped_head(runner.model))
    return getattr(runner, CAPPED_HEAD_ATTR)


@dataclass(frozen=True)
class LogitsSource:
    """How the verification computes the target's logits: ``model.compute_logits``, then the
    ``suppressed`` token ids (int64, on the runner's device; ``None``: none) set to ``-inf``."""

    model: Any
    suppressed: Any


def find_logits_source(model: Any, device: Any) -> LogitsSource:
    """For a target that suppresses tokens after its language model's logits (vLLM's multimodal
    Gemma 4: ``_suppress_token_ids``, the list its ``compute_logits`` indexes with), the language
    model and those ids on ``device``; for any other target, the target and no ids."""
    import torch

    ids = getattr(model, "_suppress_token_ids", None)
    language_model = getattr(model, "get_language_model", None)
    if not ids or not callable(language_model):
        return LogitsSource(model, None)
    return LogitsSource(language_model(), torch.tensor(list(ids), dtype=torch.int64, device=device))


def logits_source(runner: Any) -> LogitsSource:
    """``find_logits_source`` of the runner's target, looked up once (at start-up, by
    ``prepare``: the ids' copy to the device is not graph-safe)."""
    if not hasattr(runner, LOGITS_SOURCE_ATTR):
        setattr(runner, LOGITS_SOURCE_ATTR, find_logits_source(runner.model, runner.device))
    return getattr(runner, LOGITS_SOURCE_ATTR)


def target_logits(source: LogitsSource, rows: Any) -> Any:
    """The target's logits of ``rows`` as vLLM's ``compute_logits`` gives them (the cap as the
    processor is set), suppressed tokens at ``-inf``."""
    logits = source.model.compute_logits(rows)
    if source.suppressed is not None:
        logits.index_fill_(1, source.suppressed, float("-inf"))
    return logits


@contextlib.contextmanager
def uncapped(head: CappedHead) -> Iterator[None]:
    """The processor computes logits without its soft-cap inside the block."""
    head.processor.soft_cap = None
    try:
        yield
    finally:
        head.processor.soft_cap = head.cap


def has_greedy_path(runner: Any) -> bool:
    """Whether the runner's rejection sampler carries our all-greedy path and nothing makes
    the runner read the logits besides it (NaN counting), in a drafting engine."""
    rs = getattr(runner, "rejection_sampler", None)
    if rs is None or getattr(rs, GREEDY_VERIFY_ATTR, None) is None:
        return False
    if not hasattr(rs, VERIFY_GREEDY_TOKENS):
        return False
    return not rs.sampler.compute_nans and runner.speculator is not None


def greedy_batch(runner: Any, input_batch: Any, grammar_output: Any) -> bool:
    """Whether the all-greedy path verifies this batch (``greedy_verify_applies``) and nothing
    else reads its logits."""
    if grammar_output is not None or input_batch.num_draft_tokens == 0:
        return False
    if not has_greedy_path(runner):
        return False
    rs = runner.rejection_sampler
    return greedy_verify_applies(rs, input_batch, runner.speculator.draft_logits)


def greedy_tokens(runner: Any, head: CappedHead | None, rows: Any) -> Any:
    """``[rows]`` int64: each hidden row's greedy token under the target's capped logits, the
    logits computed without the cap and ``ops/capped_argmax`` taking the capped argmax where
    ``head`` is given, vLLM's logits and their argmax otherwise (``target_logits`` both)."""
    source = logits_source(runner)
    if head is None:
        return target_logits(source, rows).argmax(dim=-1)
    from gemma4_spec.ops.capped_argmax import capped_argmax

    with uncapped(head):
        logits = target_logits(source, rows)
    return capped_argmax(logits, head.cap)


def prepare(runner: Any) -> None:
    """At start-up (vLLM's warm-up samples, so it never takes these paths): compile the capped
    argmax and run its exactness check for the runner's logits, and capture the verification
    graphs; nothing of it in a request."""
    import torch

    from gemma4_spec.ops.capped_argmax import capped_argmax

    if not v2_greedy_verify_supported():
        return
    logits_source(runner)
    head = capped_head(runner) if not turned_off(UNCAPPED_VERIFY_ENV) else None
    if head is not None:
        vocab = runner.model_config.get_vocab_size()
        dtype = getattr(head.processor, "head_dtype", None) or runner.dtype
        with torch.inference_mode():
            capped_argmax(torch.zeros(1, vocab, dtype=dtype, device=runner.device), head.cap)
    if not turned_off(GRAPHED_VERIFY_ENV) and graphs_serve(runner):
        try:
            with torch.inference_mode():
                graphs = build_verify_graphs(runner, head)
                graphs.capture()
        except Exception as exc:  # the engine still serves: the eager path computes the same
            logger.warning(
                "gemma4_spec: greedy verification runs without graphs (capture failed: %s: %s)",
                type(exc).__name__,
                exc,
            )
            return
        setattr(runner, VERIFY_GRAPHS_ATTR, graphs)


def graphs_serve(runner: Any) -> bool:
    """Whether verification graphs can serve the runner: our greedy path, greedy drafts, one
    CUDA device (no tensor, pipeline or context parallelism), no LoRA (whose per-step adapter
    state a graph would bake in), and CUDA graphs wanted (not ``enforce_eager`` or
    ``cudagraph_mode`` NONE, which ask for none)."""
    from vllm.config.compilation import CUDAGraphMode

    parallel = runner.vllm_config.parallel_config
    graphs = runner.vllm_config.compilation_config.cudagraph_mode
    return (
        runner.device.type == "cuda"
        and graphs != CUDAGraphMode.NONE
        and getattr(runner, "lora_config", None) is None
        and has_greedy_path(runner)
        and runner.speculator.draft_logits is None
        and parallel.tensor_parallel_size == 1
        and parallel.pipeline_parallel_size == 1
        and getattr(runner, "pcp_manager", None) is None
    )


def build_verify_graphs(runner: Any, head: CappedHead | None) -> Any:
    """The runner's ``VerifyGraphs`` (not yet captured): ``greedy_tokens`` and
    ``patch_v2_rejection_sampler.verify_rows``, as the eager path runs them (``head``: the
    logits without the cap, where the target has one and the switch allows), over the runner's
    persistent input buffers and copies of the sampler's per-request arrays
    (``patch_v2_rejection_sampler.request_arrays``)."""
    import importlib

    from gemma4_spec.spec_decode.verify_graphs import Persistent, VerifyGraphs

    rs = runner.rejection_sampler
    module = importlib.import_module(V2_REJECTION_SAMPLER_MODULE)
    buffers = runner.input_buffers
    persistent = Persistent(buffers.input_ids, buffers.positions, buffers.seq_lens)

    def verify(
        rows: Any, width: int, logits_indices: Any, cu_num_logits: Any, idx: Any, *arrays: Any
    ) -> Any:
        del width  # the sampler's own k + 1
        return verify_rows(
            module,
            rs,
            greedy_tokens(runner, head, rows),
            persistent.input_ids,
            persistent.positions,
            persistent.seq_lens,
            logits_indices,
            cu_num_logits,
            idx,
            *arrays,
        )

    width = rs.num_speculative_steps + 1
    return VerifyGraphs(
        verify,
        persistent,
        lambda: request_arrays(rs),
        max_reqs=min(runner.max_num_reqs, MAX_GRAPHED_ROWS // width),
        width=width,
        uncapped=head is not None,
        hidden_size=runner.model_config.get_hidden_size(),
        dtype=runner.dtype,
        device=runner.device,
    )


def apply(module: ModuleType) -> None:
    runner_class = getattr(module, "GPUModelRunner", None)
    if runner_class is None or is_ours(getattr(runner_class, "sample", None)):
        return
    if not v2_greedy_verify_supported():
        return
    vllms_sample = runner_class.sample
    from vllm.v1.utils import record_function_or_nullcontext as scope

    @functools.wraps(vllms_sample)
    def sample(self: Any, hidden_states: Any, input_batch: Any, grammar_output: Any) -> Any:
        # A profiler scope (under VLLM_CUSTOM_SCOPES_FOR_PROFILING): the verification's GPU
        # span, apart from the target's forward and the draft loop (benchmarks/profile_decode.py).
        with scope("gemma4_spec: V2 verification"):
            return verify(self, hidden_states, input_batch, grammar_output)

    def verify(self: Any, hidden_states: Any, input_batch: Any, grammar_output: Any) -> Any:
        graphs = getattr(self, VERIFY_GRAPHS_ATTR, None)
        # Looked up once per runner; a target without a cap and no graphs stop here each step.
        head = capped_head(self) if not turned_off(UNCAPPED_VERIFY_ENV) else None
        if graphs is None and head is None:
            return vllms_sample(self, hidden_states, input_batch, grammar_output)
        if not greedy_batch(self, input_batch, grammar_output):
            return vllms_sample(self, hidden_states, input_batch, grammar_output)
        if graphs is not None:
            replayed = graphs.run(hidden_states, input_batch)
            if replayed is not None:
                return graphed_output(self, graphs, *replayed)
        if head is None:
            return vllms_sample(self, hidden_states, input_batch, grammar_output)
        rs = self.rejection_sampler
        getattr(rs, GREEDY_VERIFY_ATTR).uncapped += 1
        best = greedy_tokens(self, head, hidden_states[input_batch.logits_indices])
        out = getattr(rs, VERIFY_GREEDY_TOKENS)(best, input_batch)
        return out, out.num_sampled, out.num_rejected

    runner_class.sample = ours(sample)


def graphed_output(
    runner: Any, graphs: Any, sampled: Any, num_sampled: Any, num_rejected: Any
) -> Any:
    """``sample``'s return from a replayed verification: V2's ``SamplerOutput`` and counts."""
    import importlib

    rs = runner.rejection_sampler
    stats = getattr(rs, GREEDY_VERIFY_ATTR)
    stats.graphed += 1
    if graphs.uncapped:  # its logits were computed without the cap
        stats.uncapped += 1
    module = importlib.import_module(V2_REJECTION_SAMPLER_MODULE)
    out = sampler_output(module, rs, sampled, num_sampled, num_rejected, None)
    return out, num_sampled, num_rejected
