"""Host time of a decode step by scope: wall and thread-CPU time spent inside chosen methods of
vLLM's engine, runner and scheduler and of our proposer, measured by wrapping those methods
with two clocks each (about a microsecond a call, unlike torch.profiler, which slows the host
several times over). ``e2e_decode.py --scopes`` installs them in each engine and prints the
figures per decode step, side by side with the step time.

Times are inclusive (a scope contains the scopes indented under it). Wall time beyond CPU time
in a scope is time the thread waited (for the GPU, mostly); with the engine in one process, the
CPU time of the outermost scopes adds up to the host's work per step.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import time
from collections.abc import Callable
from typing import Any

# (depth, "module:Class.method"): the tree as printed; absent ones (other vLLM versions,
# the other runner) are left out.
SCOPES: tuple[tuple[int, str], ...] = (
    (0, "vllm.v1.engine.llm_engine:LLMEngine.step"),
    # The engine core's step (the client holds it as a bound method: wrapped from outside).
    (1, "vllm.v1.engine.core_client:InprocClient.get_output"),
    (2, "vllm.v1.core.sched.scheduler:Scheduler.schedule"),
    # One call a running request a step: the KV-cache groups' block accounting.
    (3, "vllm.v1.core.kv_cache_manager:KVCacheManager.allocate_slots"),
    # Ours' short cut of it (patch/patch_allocate_slots.py): every call of an engine that has
    # it; the one above then counts the calls it leaves to vLLM's method.
    (3, "gemma4_spec.patch.patch_allocate_slots:FastAllocateSlots.__call__"),
    (2, "vllm.v1.core.sched.scheduler:Scheduler.update_from_output"),
    (2, "vllm.v1.core.sched.scheduler:Scheduler.update_draft_token_ids"),
    (2, "vllm.v1.worker.gpu_model_runner:GPUModelRunner.execute_model"),
    (3, "vllm.v1.worker.gpu_model_runner:GPUModelRunner._update_states"),
    (3, "vllm.v1.worker.gpu_model_runner:GPUModelRunner._prepare_inputs"),
    (4, "gemma4_spec.spec_decode.computed_tokens:GraphedCorrection.__call__"),
    (4, "vllm.v1.worker.gpu_model_runner:GPUModelRunner._prepare_input_ids"),
    (4, "vllm.v1.worker.gpu_model_runner:GPUModelRunner._calc_spec_decode_metadata"),
    (3, "vllm.v1.worker.gpu_model_runner:GPUModelRunner._determine_batch_execution_and_padding"),
    (3, "vllm.v1.worker.gpu_model_runner:GPUModelRunner._build_attention_metadata"),
    (4, "vllm.v1.attention.backends.triton_attn:TritonAttentionMetadataBuilder.build"),
    (3, "vllm.v1.worker.gpu_model_runner:GPUModelRunner._preprocess"),
    (3, "vllm.v1.worker.gpu_model_runner:GPUModelRunner._model_forward"),
    # After the forward's launch: waits for the previous step's accepted counts (a spinning
    # event wait: it counts as CPU time).
    (3, "vllm.v1.worker.gpu_model_runner:GPUModelRunner._get_valid_sampled_token_count"),
    (2, "vllm.v1.worker.gpu_model_runner:GPUModelRunner.sample_tokens"),
    (3, "vllm.v1.worker.gpu_model_runner:GPUModelRunner._sample"),
    (4, "vllm.v1.sample.rejection_sampler:RejectionSampler.forward"),
    (3, "vllm.v1.worker.gpu_model_runner:GPUModelRunner._bookkeeping_sync"),
    (3, "vllm.v1.worker.gpu_model_runner:GPUModelRunner.propose_draft_token_ids"),
    (
        4,
        "vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer.prepare_next_token_ids_padded",
    ),
    (4, "vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer.prepare_inputs_padded"),
    (4, "gemma4_spec.spec_decode.draft_start:DraftStart.next_tokens"),
    (4, "gemma4_spec.spec_decode.draft_start:DraftStart.rows"),
    (4, "gemma4_spec.spec_decode.proposer:Gemma4Proposer.propose"),
    (5, "gemma4_spec.spec_decode.proposer:Gemma4Proposer._determine_batch_execution_and_padding"),
    (5, "gemma4_spec.spec_decode.draft_graphs:DraftLoopGraphs.draft"),
    (6, "gemma4_spec.spec_decode.draft_graphs:DraftLoopGraphs._metadata"),
    (6, "gemma4_spec.spec_decode.draft_graphs:DraftLoopGraphs._replay"),
    (3, "vllm.v1.worker.gpu_model_runner:GPUModelRunner._copy_draft_token_ids_to_cpu"),
    (2, "vllm.v1.worker.gpu_model_runner:GPUModelRunner.take_draft_token_ids"),
    (2, "vllm.v1.worker.gpu_model_runner:GPUModelRunner._get_draft_token_ids_cpu"),
    # Model Runner V2 (vLLM's default for Gemma 4, where the in-tree gemma4_mtp runs)
    (2, "vllm.v1.worker.gpu.model_runner:GPUModelRunner.execute_model"),
    (3, "vllm.v1.worker.gpu.model_runner:GPUModelRunner.add_requests"),
    (3, "vllm.v1.worker.gpu.model_runner:GPUModelRunner.update_requests"),
    (3, "vllm.v1.worker.gpu.block_table:BlockTables.apply_staged_writes"),
    (3, "vllm.v1.worker.gpu.model_runner:GPUModelRunner.prepare_inputs"),
    (3, "vllm.v1.worker.gpu.model_runner:GPUModelRunner.prepare_attn"),
    (3, "vllm.v1.worker.gpu.model_states.default:DefaultModelState.prepare_attn"),
    # The target's replay (the first launch of each graph uploads it: first-pass cost).
    (3, "vllm.v1.worker.gpu.cudagraph_utils:ModelCudaGraphManager.run_fullgraph"),
    (2, "vllm.v1.worker.gpu.model_runner:GPUModelRunner.sample_tokens"),
    (3, "vllm.v1.worker.gpu.model_runner:GPUModelRunner.sample"),
    (3, "vllm.v1.worker.gpu.model_runner:GPUModelRunner.postprocess_sampled"),
    # The device-to-host copies of a step's output, started after sampling.
    (3, "vllm.v1.worker.gpu.async_utils:AsyncOutput.__init__"),
    (3, "vllm.v1.worker.gpu.spec_decode.utils:DraftTokensHandler.set_draft_tokens"),
    (
        3,
        "vllm.v1.worker.gpu.spec_decode.autoregressive.speculator:AutoRegressiveSpeculator.propose",
    ),
    # The in-tree gemma4_mtp's V2 speculator, and ours (its subclass, our draft loop).
    (3, "vllm.v1.worker.gpu.spec_decode.gemma4.speculator:Gemma4Speculator.propose"),
    (3, "gemma4_spec.spec_decode.runner_v2:Gemma4LoopSpeculator.propose"),
    (2, "vllm.v1.worker.gpu.model_runner:GPUModelRunner.take_draft_token_ids"),
    # The engine core's wait for a step's sampled tokens on the host (V2: a blocking event,
    # so wall beyond CPU here is the host idle for the GPU; near zero: the host is the
    # bottleneck, and GPU work saved does not shorten the step).
    (2, "vllm.v1.worker.gpu.async_utils:AsyncOutput.get_output"),
    (2, "vllm.v1.engine.core:EngineCore.post_step"),
    (1, "vllm.v1.engine.output_processor:OutputProcessor.process_outputs"),
    # Waits for the GPU, wherever they happen (inside the scopes above). CUDA's default event
    # synchronization spins, so a wait counts as thread CPU time too: these say how much of
    # the scopes' CPU time was waiting rather than work.
    (0, "torch.cuda.streams:Event.synchronize"),
    (0, "torch.cuda.streams:Stream.synchronize"),
    (0, "torch:Tensor.tolist"),
    (0, "torch:Tensor.item"),
)

# name -> [calls, wall ns, thread-CPU ns]
_totals: dict[str, list[int]] = {}


def _timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    totals = _totals.setdefault(name, [0, 0, 0])
    wall, cpu = time.perf_counter_ns, time.thread_time_ns

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        w0, c0 = wall(), cpu()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[0] += 1
            totals[1] += wall() - w0
            totals[2] += cpu() - c0

    return wrapper


def _name(spec: str) -> str:
    """A scope's printed name: the last part of its module, then the method's qualified name
    (both runners have a ``GPUModelRunner``)."""
    module_name, qualname = spec.split(":")
    return module_name.rsplit(".", 1)[-1] + ":" + qualname


def install() -> list[str]:
    """Wrap every scope that exists here; returns their names in print order."""
    installed = []
    for _, spec in SCOPES:
        module_name, qualname = spec.split(":")
        class_name, method = qualname.split(".")
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError):
            continue
        fn = inspect.getattr_static(cls, method, None)
        if fn is None or not (inspect.isfunction(fn) or inspect.ismethoddescriptor(fn)):
            continue  # absent here, or a static/class method (none of those are listed)
        setattr(cls, method, _timed(_name(spec), fn))
        installed.append(_name(spec))
    return installed


def snapshot() -> dict[str, tuple[int, int, int]]:
    """Running totals: name -> (calls, wall ns, thread-CPU ns)."""
    return {name: (t[0], t[1], t[2]) for name, t in _totals.items()}


def delta(
    before: dict[str, tuple[int, int, int]], after: dict[str, tuple[int, int, int]]
) -> dict[str, tuple[int, int, int]]:
    """What accrued between two snapshots."""
    zero = (0, 0, 0)
    return {
        n: tuple(a - b for a, b in zip(t, before.get(n, zero), strict=True))
        for n, t in after.items()
    }  # type: ignore[misc]


def per_step(
    run: dict[str, tuple[int, int, int]], baseline: dict[str, tuple[int, int, int]], steps: int
) -> dict[str, list[float]]:
    """name -> [calls, wall ms, CPU ms] per step: a run of ``steps`` more decode steps than
    ``baseline`` (the same prompts with one new token), the difference divided by ``steps``."""
    zero = (0, 0, 0)
    out = {}
    for name, (calls, wall, cpu) in run.items():
        c0, w0, u0 = baseline.get(name, zero)
        out[name] = [(calls - c0) / steps, (wall - w0) / steps / 1e6, (cpu - u0) / steps / 1e6]
    return out


def depth_of(name: str) -> int:
    """Nesting depth of a scope, by its printed name."""
    return next(d for d, spec in SCOPES if _name(spec) == name)


def print_table(title: str, scopes: dict[str, dict[str, list[float]]], batches: list[str]) -> None:
    """Scopes per decode step, ms, wall / thread CPU (calls), indented by nesting: ``scopes``
    is batch -> scope -> [calls, wall ms, CPU ms] (``per_step``'s rows, or medians of them);
    scopes never called at any batch size are left out."""
    print(f"\n{title}: host scopes per decode step, ms: wall / thread CPU (calls)")
    print(f"{'scope':80}" + "".join(f"{'B=' + b:>24}" for b in batches))
    for scope in scopes[batches[0]]:
        if not any(scopes[b].get(scope, (0.0,))[0] for b in batches):
            continue  # never called here (the other runner's, another drafter's)
        label = "  " * depth_of(scope) + scope
        cells = []
        for b in batches:
            calls, wall, cpu = scopes[b].get(scope, (0.0, 0.0, 0.0))
            cells.append(f"{wall:6.3f} / {cpu:6.3f} ({calls:3.1f})")
        print(f"{label:80}" + "".join(f"{c:>24}" for c in cells))


# The two outermost scopes hold every other one: a difference there says nothing of where.
OUTERMOST = frozenset({"llm_engine:LLMEngine.step", "core_client:InprocClient.get_output"})


def largest_differences(
    more: dict[str, list[float]], less: dict[str, list[float]], top: int
) -> str:
    """The ``top`` scopes whose wall ms per step differ most between two rows of scopes
    (scope -> [calls, wall ms, CPU ms]), ``more`` minus ``less``, the outermost two left out:
    "scope +0.123, ..."."""
    diffs = {
        scope: more[scope][1] - less[scope][1]
        for scope in more
        if scope in less and scope not in OUTERMOST
    }
    largest = sorted(diffs.items(), key=lambda item: -abs(item[1]))[:top]
    return ", ".join(f"{scope} {diff:+.3f}" for scope, diff in largest)
