"""Run ``vllm.LLM`` generation with or without Gemma 4 MTP and collect tokens and counters.

``generate`` runs in the calling process (the demo uses it). ``generate_in_subprocess`` runs
a list of configurations in one fresh Python process, so tests can choose ``VLLM_PLUGINS`` (our
plugin vs vLLM's in-tree gemma4_mtp) and other environment variables per process. There the
engine core and its worker run in that process too (vLLM's single-process mode), which makes
each further engine start in seconds instead of the ~30 s a new worker process costs on a small
CPU machine. With ``tensor_parallel_size`` > 1 the engine core still runs there, and vLLM's
multiprocessing executor starts one worker process per rank.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gemma4_spec.metrics import Acceptance, spec_metrics
from gemma4_spec.ops.graphed_launch import captures_in_process
from gemma4_spec.ops.small_linear import target_rows_layers
from gemma4_spec.patch.patch_gpu_model_runner import RUNNER_MODULE
from gemma4_spec.patch.patch_input_processor import logitsprocs_cache
from gemma4_spec.patch.patch_rejection_sampler import GREEDY_VERIFY_ATTR
from gemma4_spec.patch.patch_split_attention import own_split_calls
from gemma4_spec.patch.patch_triton_attn import rewrites_of
from gemma4_spec.spec_decode.computed_tokens import CORRECTION_NAME, GraphedCorrection

# Values of RunResult.proposer_class: this plugin's proposer, and vLLM's own.
PLUGIN_PROPOSER = "gemma4_spec.spec_decode.proposer.Gemma4Proposer"
IN_TREE_PROPOSER = "vllm.v1.spec_decode.gemma4.Gemma4Proposer"
# RunResult.draft_model_class when the drafter runs this plugin's assistant model (either runner).
PLUGIN_DRAFT_MODEL = "gemma4_spec.models.gemma4_mtp.Gemma4AssistantForDrafting"
# Model Runner V2's drafter where our draft loop is installed (patch/patch_v2_speculator.py).
PLUGIN_V2_SPECULATOR = "gemma4_spec.spec_decode.runner_v2.Gemma4LoopSpeculator"
# Engine arguments of the GPU engine tests: TRITON_ATTN runs on every CUDA GPU vLLM supports
# (vLLM's own pick on an H200 may need extra packages); a fixed KV budget skips memory profiling.
GPU_ENGINE_KWARGS: dict[str, Any] = {
    "attention_config": {"backend": "TRITON_ATTN"},
    "kv_cache_memory_bytes": 1 << 30,
}


def gpu_attention() -> dict[str, Any]:
    """On a CUDA machine, the attention backend of the GPU engine tests (as engine arguments);
    nothing elsewhere (the CPU backend has its own)."""
    import torch

    if not torch.cuda.is_available():
        return {}
    return {"attention_config": GPU_ENGINE_KWARGS["attention_config"]}


def gpu_run_fields(target: str, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    """The ``RunConfig`` fields of a GPU engine test's engine: CUDA graphs on,
    ``GPU_ENGINE_KWARGS``; the speculative fields are added per engine."""
    return dict(
        target=target,
        prompts=prompts,
        max_tokens=max_tokens,
        enforce_eager=False,
        extra_engine_kwargs=GPU_ENGINE_KWARGS,
    )


@dataclass(frozen=True)
class RunConfig:
    target: str
    prompts: list[list[int]]
    assistant: str | None = None
    num_speculative_tokens: int = 3
    max_tokens: int = 32
    temperature: float = 0.0
    dtype: str = "float32"
    enforce_eager: bool = True
    seed: int = 0
    max_model_len: int = 512
    # Ranks of tensor parallelism (vLLM's tensor_parallel_size): one worker process each.
    tensor_parallel_size: int = 1
    # Small values force chunked prefill of long prompts; None keeps vLLM's default.
    max_num_batched_tokens: int | None = None
    # Further ``speculative_config`` entries over the ones ``assistant`` and
    # ``num_speculative_tokens`` give (e.g. ``{"rejection_sample_method": "synthetic"}``).
    speculative_options: dict[str, Any] = field(default_factory=dict)
    # Further ``vllm.LLM`` keyword arguments (JSON-serialisable), applied last.
    extra_engine_kwargs: dict[str, Any] = field(default_factory=dict)
    # One dict of ``SamplingParams`` arguments per prompt, over the defaults above (e.g.
    # ``{"seed": None, "top_k": 64}``); empty: every prompt gets the defaults. A
    # ``structured_outputs`` entry is a dict of ``StructuredOutputsParams`` arguments (JSON
    # carries no such object to the subprocess), and ``logit_bias`` keys may be strings.
    sampling: list[dict[str, Any]] = field(default_factory=list)
    # The prompts as successive ``generate`` calls of these many requests each, in order (e.g.
    # ``[1, 3]``: the first prompt alone, then the next three together); empty: one call.
    request_batches: list[int] = field(default_factory=list)
    # Record the Triton kernels the worker compiles and the CUDA graphs it captures while
    # generating (after start-up).
    count_triton_compiles: bool = False
    # Record vLLM's refusal of the requests (the validation error it raises while adding them,
    # e.g. a sampling parameter speculative decoding does not support) in RunResult.refusal
    # instead of failing the run; the run then generates nothing.
    record_refusal: bool = False
    # Model classes to register with vLLM before the engine starts (architecture ->
    # "module:Class", e.g. a test target's, ``testing/suppressing_target.py``); single-process
    # engines only (other processes of a multiprocess engine would not have them).
    register_models: dict[str, str] = field(default_factory=dict)


@dataclass
class RunResult:
    token_ids: list[list[int]]
    # Every completion of every prompt (``n`` > 1 gives several); token_ids holds the first.
    all_token_ids: list[list[list[int]]] = field(default_factory=list)
    # Per prompt, the first completion's logprobs as vLLM returned them: per output position,
    # (token id, logprob) of the top ``logprobs`` tokens and the sampled one; empty for a prompt
    # that asked for none.
    logprobs: list[list[list[tuple[int, float]]]] = field(default_factory=list)
    # Per prompt, the drafts accepted in the first completion, with the engine argument
    # ``per_request_spec_decode_metrics`` (vLLM 0.32 on); None for a prompt without them.
    accepted_drafts: list[int | None] = field(default_factory=list)
    # With ``RunConfig.record_refusal``: the message of vLLM's validation error when it refused
    # the requests (None: it took them).
    refusal: str | None = None
    # vllm:spec_decode_* counters (per-position acceptance as a list); empty without a draft.
    spec_metrics: dict[str, Any] = field(default_factory=dict)
    # The class vLLM's runner module instantiates for gemma4_mtp in this process (ours when the
    # plugin is active, vLLM's own otherwise); None if the runner ran in another process.
    proposer_class: str | None = None
    # What the worker actually ran: its model runner's and drafter's classes, and the batch
    # sizes whose greedy draft sampling our proposer captured in CUDA graphs.
    runner_class: str | None = None
    drafter_class: str | None = None
    draft_model_class: str | None = None  # the model the drafter runs
    # Query heads each assistant layer computes on this rank (all of them without tensor
    # parallelism, a share of them with it); empty if the drafter's model has no such layers.
    draft_query_heads: list[int] = field(default_factory=list)
    sampler_graph_sizes: list[int] = field(default_factory=list)
    # (padded batch size, k) of the whole draft loops it replayed from CUDA graphs, and why it
    # drafted step by step instead (None if it did not).
    draft_loop_graphs: list[tuple[int, int]] = field(default_factory=list)
    draft_loop_graphs_off: str | None = None
    # Whether those graphs were captured at engine start-up; how many draft loops were replayed,
    # how many batches found no graph of their size (drafted step by step), and whether replays
    # skipped rebuilding the draft attention metadata (compat.REBUILD_FREE_DRAFT_METADATA).
    draft_loop_captured_at_startup: bool = False
    draft_loop_replays: int = 0
    draft_loop_misses: int = 0
    draft_loop_rebuild_free: bool = False
    # Model Runner V2 (spec_decode/runner_v2.py): proposals replayed from a draft-loop graph
    # captured at start-up, and proposals run eagerly through the same loop.
    v2_loop_replays: int = 0
    v2_loop_eager: int = 0
    # Target attention builds whose verification batch ran on the split-key kernel
    # (patch/patch_triton_attn.py), summed over the runner's attention builders.
    flat_verify_rewrites: int = 0
    # Attention calls of those batches run by our split kernel (patch/patch_split_attention.py,
    # opt-in), at capture or eagerly.
    own_split_calls: int = 0
    # Target linear layers through target_linear (ops/small_linear.py, opt-in).
    target_rows_layers: int = 0
    # Verification steps whose index arrays our builder made (spec_decode/verify_metadata.py),
    # and greedy batches verified without vLLM's rejection sampler (patch_rejection_sampler.py).
    verify_metadata_builds: int = 0
    greedy_verify_batches: int = 0
    # Of those, on Model Runner V2: batches whose logits skipped the soft-cap's passes
    # (patch/patch_v2_sample.py).
    greedy_verify_uncapped: int = 0
    # Of those, on Model Runner V2: batches verified by replaying a start-up graph
    # (spec_decode/verify_graphs.py).
    greedy_verify_graphed: int = 0
    # Steps whose carried tokens (async scheduling: GPU only) our writer put into the input
    # ids (spec_decode/verify_input_ids.py).
    verify_input_ids_writes: int = 0
    # Of those, steady-state steps written as two block copies.
    verify_input_ids_uniform: int = 0
    # Index-array builds that reused the previous step's arrays.
    verify_metadata_reuses: int = 0
    # Verified steps whose next tokens and draft rows our launches gave
    # (spec_decode/draft_start.py), and how many of those launches replayed a CUDA graph.
    draft_start_calls: int = 0
    draft_start_graph_replays: int = 0
    # V1 proposals that sampled their drafts and handed their probabilities on (spec_decode/
    # proposer.py; draft_sample_method "probabilistic", some request not greedy).
    probabilistic_proposals: int = 0
    # Async scheduling's computed-token corrections replayed from CUDA graphs
    # (spec_decode/computed_tokens.py).
    correction_graph_replays: int = 0
    # Graphs of the plugin's small per-step launches (``ops/graphed_launch.py``) captured while
    # generating, after start-up (the most of any rank): captures in a request's path.
    launch_graphs_captured_serving: int = 0
    # With ``count_triton_compiles``: the kernel (and specialisation) of every Triton
    # compilation the worker ran while generating, after its start-up.
    triton_compiles: list[str] = field(default_factory=list)
    # With ``count_triton_compiles``: CUDA graphs of any kind (vLLM's, ours) the worker began
    # to capture while generating (the most of any rank).
    cuda_graphs_captured_serving: int = 0
    # Whether the front end had loaded the logits-processor plugins when its engine finished
    # starting (patch/patch_input_processor.py; vLLM 0.26 loads them in the first request).
    logits_processors_loaded_at_startup: bool = False
    # The facts above as every worker reported them, in rank order (the fields hold rank 0's):
    # under tensor parallelism every rank drafts, and must take the same paths.
    rank_facts: list[dict[str, Any]] = field(default_factory=list)

    @property
    def acceptance(self) -> Acceptance:
        return Acceptance.of(self.spec_metrics)

    @property
    def acceptance_rate(self) -> float:
        return self.acceptance.acceptance_rate

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens produced per target step: 1 + accepted drafts per drafting step."""
        return self.acceptance.mean_accepted_length


def engine_kwargs(config: RunConfig, *, single_process: bool = False) -> dict[str, Any]:
    """Keyword arguments of ``vllm.LLM`` for a run (CPU-friendly memory settings)."""
    kwargs: dict[str, Any] = dict(
        model=config.target,
        skip_tokenizer_init=True,
        dtype=config.dtype,
        max_model_len=config.max_model_len,
        enforce_eager=config.enforce_eager,
        seed=config.seed,
        gpu_memory_utilization=0.3,
        disable_log_stats=False,
    )
    if config.tensor_parallel_size != 1:
        kwargs["tensor_parallel_size"] = config.tensor_parallel_size
    if config.max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = config.max_num_batched_tokens
    if single_process:
        # One worker in this process; several ranks need a process each.
        kwargs["distributed_executor_backend"] = "uni" if config.tensor_parallel_size == 1 else "mp"
    if config.assistant is not None:
        kwargs["speculative_config"] = {
            "method": "gemma4_mtp",
            "model": config.assistant,
            "num_speculative_tokens": config.num_speculative_tokens,
            **config.speculative_options,
        }
    kwargs.update(config.extra_engine_kwargs)
    return kwargs


def generate(config: RunConfig, *, single_process: bool = False) -> RunResult:
    """Generate in this process. ``single_process`` runs vLLM's engine core and worker here too
    (it must be chosen before vLLM is first imported in this process)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if single_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM
    from vllm.exceptions import VLLMValidationError

    if config.request_batches and sum(config.request_batches) != len(config.prompts):
        raise ValueError(
            f"request_batches {config.request_batches} do not add up to "
            f"{len(config.prompts)} prompts"
        )
    if config.sampling and len(config.sampling) != len(config.prompts):
        raise ValueError(f"{len(config.sampling)} sampling dicts for {len(config.prompts)} prompts")
    if config.register_models:
        from vllm import ModelRegistry

        for architecture, model_class in config.register_models.items():
            ModelRegistry.register_model(architecture, model_class)
    cache = logitsprocs_cache()
    if cache is not None:
        cache.cache_clear()  # an earlier engine of this process may have filled it
    llm = LLM(**engine_kwargs(config, single_process=single_process))
    loaded_at_startup = cache is not None and cache.cache_info().currsize > 0
    defaults: dict[str, Any] = dict(
        max_tokens=config.max_tokens,
        temperature=config.temperature,
        seed=config.seed,
        ignore_eos=True,
    )
    per_prompt = config.sampling or [{}] * len(config.prompts)
    params = [_sampling_params({**defaults, **changes}) for changes in per_prompt]
    if config.count_triton_compiles:
        llm.collective_rpc(_count_triton_compiles)
    llm.collective_rpc(_mark_serving_start)
    requests = [{"prompt_token_ids": p} for p in config.prompts]
    batches = config.request_batches or [len(requests)]
    outputs, refusal = [], None
    try:
        for size in batches:
            start = len(outputs)
            outputs += llm.generate(
                requests[start : start + size], params[start : start + size], use_tqdm=False
            )
    except VLLMValidationError as error:
        if not config.record_refusal:
            raise
        refusal = str(error)
    result = RunResult(
        token_ids=[list(o.outputs[0].token_ids) for o in outputs],
        all_token_ids=[[list(c.token_ids) for c in o.outputs] for o in outputs],
        logprobs=[_logprobs(o.outputs[0].logprobs) for o in outputs],
        accepted_drafts=[_accepted_drafts(o.outputs[0]) for o in outputs],
        refusal=refusal,
    )
    result.spec_metrics = spec_metrics(llm.get_metrics())
    result.logits_processors_loaded_at_startup = loaded_at_startup
    runner = sys.modules.get("vllm.v1.worker.gpu_model_runner")
    if runner is not None:
        result.proposer_class = _class_path(runner.Gemma4Proposer)
    result.rank_facts = llm.collective_rpc(_worker_facts)
    for name, value in result.rank_facts[0].items():  # named as the fields they fill
        if not hasattr(result, name):
            raise AttributeError(f"worker fact {name!r} is no field of {type(result).__name__}")
        setattr(result, name, value)
    result.draft_loop_graphs = [tuple(x) for x in result.rank_facts[0]["draft_loop_graphs"]]
    for name in ("launch_graphs_captured_serving", "cuda_graphs_captured_serving"):
        setattr(result, name, max(facts[name] for facts in result.rank_facts))  # of any rank
    del llm
    return result


def _sampling_params(arguments: Mapping[str, Any]) -> Any:
    """``vllm.SamplingParams`` of JSON-shaped arguments: a ``structured_outputs`` dict becomes
    the ``StructuredOutputsParams`` it describes, and ``logit_bias`` keys (strings after JSON)
    token ids again."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    arguments = dict(arguments)
    structured = arguments.get("structured_outputs")
    if isinstance(structured, Mapping):
        arguments["structured_outputs"] = StructuredOutputsParams(**structured)
    if arguments.get("logit_bias"):
        arguments["logit_bias"] = {int(t): bias for t, bias in arguments["logit_bias"].items()}
    return SamplingParams(**arguments)


def _logprobs(positions: Any) -> list[list[tuple[int, float]]]:
    """A completion's logprobs (vLLM's per-position dicts of ``Logprob``, or None) as
    (token id, logprob) pairs per position."""
    if positions is None:
        return []
    return [[(token, entry.logprob) for token, entry in position.items()] for position in positions]


def _accepted_drafts(completion: Any) -> int | None:
    """The drafts accepted in a completion, from its per-request speculative decoding metrics
    (None where the engine kept none)."""
    metrics = getattr(completion, "spec_decode_metrics", None)
    return None if metrics is None else metrics.to_dict()["num_accepted_draft_tokens"]


def _class_path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _worker_facts(worker: Any) -> dict[str, Any]:
    """Runs in the worker (``LLM.collective_rpc``): which runner and drafter it uses."""
    runner = getattr(worker, "model_runner", None)
    drafter = getattr(runner, "drafter", None) or getattr(runner, "speculator", None)
    sampler = getattr(drafter, "sampler", None)
    loops = getattr(drafter, "loop_graphs", None)
    verify_metadata = getattr(drafter, "verify_metadata", None)
    input_ids = getattr(drafter, "verify_input_ids", None)
    start = getattr(drafter, "draft_start", None)
    correction = getattr(sys.modules.get(RUNNER_MODULE), CORRECTION_NAME, None)
    greedy = getattr(getattr(runner, "rejection_sampler", None), GREEDY_VERIFY_ATTR, None)
    builders = [
        builder
        for groups in getattr(runner, "attn_groups", None) or []
        for group in groups
        for builder in group.metadata_builders
    ]
    return {
        "runner_class": None if runner is None else _class_path(type(runner)),
        "drafter_class": None if drafter is None else _class_path(type(drafter)),
        "draft_model_class": None
        if getattr(drafter, "model", None) is None
        else _class_path(type(drafter.model)),
        "draft_query_heads": _draft_query_heads(getattr(drafter, "model", None)),
        "sampler_graph_sizes": list(getattr(sampler, "captured_sizes", [])),
        "draft_loop_graphs": [] if loops is None else loops.captured,
        "draft_loop_graphs_off": None if loops is None else loops.disabled,
        "draft_loop_captured_at_startup": loops is not None and loops.captured_at_startup,
        "draft_loop_replays": 0 if loops is None else loops.replays,
        "draft_loop_misses": 0 if loops is None else loops.misses,
        "draft_loop_rebuild_free": False if loops is None else loops.rebuild_free,
        "v2_loop_replays": getattr(drafter, "loop_replays", 0),
        "v2_loop_eager": getattr(drafter, "loop_eager", 0),
        "flat_verify_rewrites": sum(rewrites_of(builder) for builder in builders),
        "own_split_calls": own_split_calls(),
        "target_rows_layers": target_rows_layers(getattr(runner, "model", None)),
        "verify_metadata_builds": 0 if verify_metadata is None else verify_metadata.builds,
        "greedy_verify_batches": 0 if greedy is None else greedy.batches,
        "greedy_verify_uncapped": 0 if greedy is None else greedy.uncapped,
        "greedy_verify_graphed": 0 if greedy is None else greedy.graphed,
        "verify_input_ids_writes": 0 if input_ids is None else input_ids.writes,
        "verify_input_ids_uniform": 0 if input_ids is None else input_ids.uniform_writes,
        "verify_metadata_reuses": 0 if verify_metadata is None else verify_metadata.reuses,
        "draft_start_calls": 0 if start is None else start.calls,
        "probabilistic_proposals": getattr(drafter, "probabilistic_proposals", 0),
        "draft_start_graph_replays": 0
        if start is None
        else start.next_launches.replays + start.row_launches.replays,
        "correction_graph_replays": correction.launches.replays
        if isinstance(correction, GraphedCorrection)
        else 0,
        "triton_compiles": list(_triton_compiles or []),
        "cuda_graphs_captured_serving": _GraphCaptures.since_start(),
        "launch_graphs_captured_serving": captures_in_process() - _captures_at_serving_start,
    }


def watch_triton_compiles(note: Callable[[str], None]) -> None:
    """From now on, hand ``note`` the kernel (and specialisation) of every Triton JIT
    compilation in this process (Triton calls its ``jit_cache_hook`` before compiling a
    specialisation it does not hold in memory), then call the hook that was there before (vLLM's
    JIT monitor installs one). Needs Triton (ImportError otherwise)."""
    from triton import knobs

    previous = knobs.runtime.jit_cache_hook

    def hook(**kwargs: Any) -> Any:
        note(str(kwargs.get("repr", kwargs.get("key"))))
        return previous(**kwargs) if previous is not None else False  # False: compile

    knobs.runtime.jit_cache_hook = hook


def watch_graph_captures(note: Callable[[], None]) -> None:
    """From now on, call ``note`` at every CUDA graph capture this process begins: vLLM's and
    ours all go through ``torch.cuda.CUDAGraph.capture_begin``."""
    import torch

    graph_class = torch.cuda.CUDAGraph
    begin = graph_class.capture_begin

    def counted(graph: Any, *args: Any, **kwargs: Any) -> Any:
        note()
        return begin(graph, *args, **kwargs)

    graph_class.capture_begin = counted  # type: ignore[method-assign]


# Launch graphs this worker's process had captured when generating began
# (``_mark_serving_start``).
_captures_at_serving_start = 0


def _mark_serving_start(worker: Any) -> None:
    """Runs in the worker, after start-up: what it captures from now on is in requests' path."""
    del worker
    global _captures_at_serving_start
    _captures_at_serving_start = captures_in_process()


# Triton compilations in this worker since ``_count_triton_compiles`` (None: not counting).
_triton_compiles: list[str] | None = None


class _GraphCaptures:
    """CUDA graph captures in this worker's process: counted from the first
    ``_count_triton_compiles`` (watched once however many engines the process starts), read
    from the latest one."""

    total = 0
    at_start: int | None = None

    @classmethod
    def start(cls) -> None:
        if cls.at_start is None:
            watch_graph_captures(cls._captured)
        cls.at_start = cls.total

    @classmethod
    def _captured(cls) -> None:
        cls.total += 1

    @classmethod
    def since_start(cls) -> int:
        return 0 if cls.at_start is None else cls.total - cls.at_start


def _count_triton_compiles(worker: Any) -> None:
    """Runs in the worker: from now on, note every Triton JIT compilation and every CUDA graph
    capture."""
    del worker
    global _triton_compiles
    _triton_compiles = []
    watch_triton_compiles(_triton_compiles.append)
    _GraphCaptures.start()


def _draft_query_heads(model: Any) -> list[int]:
    layers = getattr(getattr(model, "model", None), "layers", None) or []
    heads = [getattr(getattr(layer, "self_attn", None), "num_heads", None) for layer in layers]
    return [h for h in heads if isinstance(h, int)]


def generate_in_subprocess(
    configs: list[RunConfig],
    *,
    plugins: str | None = None,
    timeout: float = 1200,
    env: Mapping[str, str] | None = None,
) -> list[RunResult]:
    """Run ``generate`` for each config, in order, in a new interpreter; ``plugins`` sets
    ``VLLM_PLUGINS`` (``None`` leaves it unset: every installed plugin loads), ``env`` sets
    further environment variables of that interpreter (and of vLLM's worker processes)."""
    child_env = {**os.environ, **(env or {})}
    child_env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    child_env.pop("VLLM_PLUGINS", None)
    if plugins is not None:
        child_env["VLLM_PLUGINS"] = plugins
    data = run_json_module(
        __name__, [asdict(c) for c in configs], env=child_env, timeout=timeout, what="engine run"
    )
    return [RunResult(**d) for d in data]


def run_json_module(
    module: str, payload: Any, *, env: Mapping[str, str], timeout: float, what: str
) -> Any:
    """Run ``python -m module REQUEST RESPONSE`` in a new interpreter with environment ``env``:
    ``payload`` goes in REQUEST as JSON, and what the module writes to RESPONSE comes back.
    A failing run raises with the end of its output (``what`` names it)."""
    with tempfile.TemporaryDirectory() as tmp:
        request, response = Path(tmp) / "config.json", Path(tmp) / "result.json"
        request.write_text(json.dumps(payload))
        proc = subprocess.run(
            [sys.executable, "-m", module, str(request), str(response)],
            env=dict(env),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if proc.returncode != 0:
            raise RuntimeError(
                f"{what} failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}\n"
                f"{proc.stderr[-20000:]}"
            )
        return json.loads(response.read_text())


_ERROR_LINE = re.compile(r"^(?:\[rank\d+\]:\s*)?((?:[\w.]+\.)?\w*(?:Error|Exception): .*)$")


def error_lines(text: str, limit: int = 3) -> list[str]:
    """The distinct exception lines (``SomeError: message``) of a failed run's output, last
    ``limit`` of them in order, without the ``[rankN]:`` prefixes of vLLM's workers: what a
    report of a failure should name, rather than the warnings that follow it."""
    found: list[str] = []
    for line in text.splitlines():
        match = _ERROR_LINE.match(line.strip())
        if match and match.group(1) not in found:
            found.append(match.group(1))
    return found[-limit:]


def run_tensor_parallel_three_ways(
    common: Mapping[str, Any],
    assistant: str,
    *,
    tensor_parallel_size: int,
    num_speculative_tokens: int,
    env: Mapping[str, str] | None = None,
) -> dict[str, RunResult]:
    """Plain and ours at ``tensor_parallel_size`` ranks, then ours on one rank, in one process
    (the one-rank engine runs its worker in that process, after the others' worker processes
    have gone): ``plain-tp``, ``ours-tp`` and ``ours-tp1``. ``common``: the RunConfig fields the
    three share."""
    tp, k = tensor_parallel_size, num_speculative_tokens
    configs = [
        RunConfig(**common, tensor_parallel_size=tp),
        RunConfig(**common, assistant=assistant, num_speculative_tokens=k, tensor_parallel_size=tp),
        RunConfig(**common, assistant=assistant, num_speculative_tokens=k),
    ]
    names = ["plain-tp", "ours-tp", "ours-tp1"]
    return dict(zip(names, generate_in_subprocess(configs, env=env), strict=True))


def _main(request: str, response: str) -> None:
    configs = [RunConfig(**c) for c in json.loads(Path(request).read_text())]
    results = [generate(c, single_process=True) for c in configs]
    Path(response).write_text(json.dumps([asdict(r) for r in results]))


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2])
