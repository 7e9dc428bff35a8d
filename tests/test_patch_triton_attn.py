"""``patch/patch_triton_attn.py``: which builds are rewritten, and what the rewrite produces
(CPU tensors; the kernel's own tests and the GPU engine test cover CUDA)."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch
from vllm.config import CUDAGraphMode

from gemma4_spec.patch import patch_triton_attn
from gemma4_spec.patch.patch_split_attention import OWN_SPLIT_ATTR, OWN_SPLIT_ENV
from gemma4_spec.patch.patch_triton_attn import (
    FLAT_VERIFY_ENV,
    LARGE_TOKENS_ENV,
    LARGE_VERIFY_SEGMENTS,
    SplitKeyVerify,
)


@dataclass
class FakeMetadata:  # the fields of TritonAttentionMetadata the rewrite reads or writes
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    max_query_len: int
    use_cascade: bool = False
    causal: Any = True
    mm_prefix_range_tensor: Any = None
    rswa_prefix_lens: Any = None
    built: int = field(default=0)


def _common(max_query_len: int, num_tokens: int) -> SimpleNamespace:
    return SimpleNamespace(max_query_len=max_query_len, num_actual_tokens=num_tokens)


def _verification_batch() -> FakeMetadata:
    # Two requests of 3 query tokens (k = 2), then one padded request.
    return FakeMetadata(
        query_start_loc=torch.tensor([0, 3, 6, 6], dtype=torch.int32),
        seq_lens=torch.tensor([10, 7, 0], dtype=torch.int32),
        block_table=torch.arange(12, dtype=torch.int32).view(3, 4),
        max_query_len=3,
    )


def test_rewrite_sends_the_batch_to_the_split_kernel() -> None:
    # The split-key kernel takes multi-token requests as they are: only max_query_len, which
    # vLLM picks the kernel by, changes.
    flat = SplitKeyVerify(max_query_len=3, capacity=16)
    metadata = _verification_batch()
    before = (metadata.query_start_loc, metadata.seq_lens, metadata.block_table)
    out = flat.rewrite(_common(3, 9), metadata)
    assert out.max_query_len == 1 and flat.rewrites == 1
    assert (out.query_start_loc, out.seq_lens, out.block_table) == before
    assert out.query_start_loc.tolist() == [0, 3, 6, 6]


def test_metadata_without_cascade_field_is_rewritten() -> None:
    # From vLLM 0.32 the Triton backend's metadata has no use_cascade field.
    @dataclass
    class NoCascade:
        query_start_loc: torch.Tensor
        seq_lens: torch.Tensor
        block_table: torch.Tensor
        max_query_len: int
        causal: Any = True

    batch = _verification_batch()
    metadata = NoCascade(batch.query_start_loc, batch.seq_lens, batch.block_table, 3)
    out = SplitKeyVerify(max_query_len=3, capacity=16).rewrite(_common(3, 9), metadata)
    assert out.max_query_len == 1


@pytest.mark.parametrize(
    ("change", "common"),
    [
        ({}, _common(1, 9)),  # decode: nothing to do
        ({}, _common(4, 9)),  # more query tokens than a verification step has
        ({}, _common(3, 17)),  # more tokens than the decode kernel takes
        ({"use_cascade": True}, _common(3, 9)),
        ({"causal": torch.ones(3, dtype=torch.bool)}, _common(3, 9)),
        ({"mm_prefix_range_tensor": torch.zeros(3, 1, 2)}, _common(3, 9)),
        ({"rswa_prefix_lens": torch.zeros(3)}, _common(3, 9)),
    ],
)
def test_other_batches_are_left_alone(change: dict, common: SimpleNamespace) -> None:
    metadata = _verification_batch()
    for name, value in change.items():
        setattr(metadata, name, value)
    # The rewrite works in place on the metadata it is given: compare with values saved first.
    before = [
        t.tolist() for t in (metadata.query_start_loc, metadata.seq_lens, metadata.block_table)
    ]
    split = SplitKeyVerify(max_query_len=3, capacity=16)
    out = split.rewrite(common, metadata)
    assert split.rewrites == 0
    assert out.max_query_len == 3
    assert [t.tolist() for t in (out.query_start_loc, out.seq_lens, out.block_table)] == before


def _builder(**overrides: Any) -> SimpleNamespace:
    spec = SimpleNamespace(method="gemma4_mtp", num_speculative_tokens=2)
    config = SimpleNamespace(
        speculative_config=spec,
        parallel_config=SimpleNamespace(decode_context_parallel_size=1, enable_dbo=False),
        cache_config=SimpleNamespace(kv_sharing_fast_prefill=False),
        compilation_config=SimpleNamespace(cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE),
    )
    builder = SimpleNamespace(
        vllm_config=config,
        device=torch.device("cuda"),
        rswa_window=None,
        softmax_segm_output=torch.empty(0),
        seq_threshold_3D=128,
    )
    for name, value in overrides.items():
        target = builder
        *path, last = name.split(".")
        for part in path:
            target = getattr(target, part)
        setattr(target, last, value)
    return builder


@pytest.fixture
def vllm_026(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """vLLM 0.26 as far as the rewrite asks, the settings unset; our kernel's set-up (its
    counters on the builder's CUDA device, its routing) recorded, not run."""
    from gemma4_spec.ops import split_attention_triton

    prepared: list[Any] = []
    monkeypatch.setattr(patch_triton_attn, "flat_verify_supported", lambda: True)
    monkeypatch.setattr(split_attention_triton, "prepare_split_attention", prepared.append)
    monkeypatch.setattr(patch_triton_attn.patch_split_attention, "apply", prepared.append)
    for name in (FLAT_VERIFY_ENV, patch_triton_attn.SEGMENTS_ENV, LARGE_TOKENS_ENV, OWN_SPLIT_ENV):
        monkeypatch.delenv(name, raising=False)
    return prepared


def test_enabled_for_gemma4_mtp_on_cuda(vllm_026: list[Any]) -> None:
    flat = patch_triton_attn._make_split_verify(_builder())
    assert flat is not None and flat.max_query_len == 3
    assert flat.capacity == min(128, patch_triton_attn.SPLIT_VERIFY_MAX_TOKENS)
    # The defaults: large batches get fewer segments, and our kernel on their sliding layers
    # (its counters made now, before any graph capture).
    assert flat.segments is None and flat.own_split == "auto"
    assert flat.large_tokens == patch_triton_attn.LARGE_VERIFY_TOKENS
    assert vllm_026[0] == torch.device("cuda")


@pytest.mark.parametrize(
    "override",
    [
        {"device": torch.device("cpu")},
        {"vllm_config.speculative_config": None},
        {"vllm_config.speculative_config.method": "eagle"},
        {"vllm_config.compilation_config.cudagraph_mode": CUDAGraphMode.FULL},
        {"vllm_config.parallel_config.decode_context_parallel_size": 2},
        {"vllm_config.parallel_config.enable_dbo": True},
        {"vllm_config.cache_config.kv_sharing_fast_prefill": True},
        {"rswa_window": 512},
        {"softmax_segm_output": None},
    ],
)
def test_disabled_where_capture_and_replay_could_differ(
    vllm_026: list[Any], override: dict
) -> None:
    assert patch_triton_attn._make_split_verify(_builder(**override)) is None


def test_enabled_when_vllm_renames_the_method_mtp(vllm_026: list[Any]) -> None:
    # vLLM 0.26 rewrites method "gemma4_mtp" to "mtp"; use_gemma4_mtp() tells them apart.
    builder = _builder()
    spec = builder.vllm_config.speculative_config
    spec.method = "mtp"
    spec.use_gemma4_mtp = lambda: True
    assert patch_triton_attn._make_split_verify(builder) is not None
    spec.use_gemma4_mtp = lambda: False
    assert patch_triton_attn._make_split_verify(builder) is None


def test_disabled_by_environment(vllm_026: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FLAT_VERIFY_ENV, "0")
    assert patch_triton_attn._make_split_verify(_builder()) is None


def test_enabled_on_both_model_runners(vllm_026: list[Any]) -> None:
    # Both runners build a step's metadata before replaying the graph that reads it.
    for v2 in (False, True):
        builder = _builder(**{"vllm_config.use_v2_model_runner": v2})
        assert patch_triton_attn._make_split_verify(builder) is not None


def test_disabled_on_untested_vllm_versions(monkeypatch: pytest.MonkeyPatch) -> None:
    from packaging.version import Version

    from gemma4_spec.compat import flat_verify_supported

    assert flat_verify_supported(Version("0.26.0"))
    assert not flat_verify_supported(Version("0.32.0"))
    monkeypatch.delenv(FLAT_VERIFY_ENV, raising=False)
    monkeypatch.setattr(patch_triton_attn, "flat_verify_supported", lambda: False)
    assert patch_triton_attn._make_split_verify(_builder()) is None


def test_disabled_without_the_split_kernels_scratch_size(vllm_026: list[Any]) -> None:
    # Builders that size no 3D scratch (seq_threshold_3D 0 or missing) have no room for it.
    assert patch_triton_attn._make_split_verify(_builder(seq_threshold_3D=0)) is None
    builder = _builder()
    del builder.seq_threshold_3D
    assert patch_triton_attn._make_split_verify(builder) is None


def test_apply_wraps_build_once_and_rewrites_verification_batches(vllm_026: list[Any]) -> None:
    class Builder:
        def __init__(self) -> None:
            vars(self).update(vars(_builder(device=torch.device("cpu"))))

        def build(self, common_prefix_len: int, common_attn_metadata: Any, fast_build=False):
            return _verification_batch()

    module = ModuleType("fake_triton_attn")
    module.TritonAttentionMetadataBuilder = Builder  # type: ignore[attr-defined]
    patch_triton_attn.apply(module)
    wrapped = Builder.build
    patch_triton_attn.apply(module)
    assert Builder.build is wrapped

    builder = Builder()
    # CPU builders are left alone...
    assert builder.build(0, _common(3, 9)).max_query_len == 3
    assert patch_triton_attn.rewrites_of(builder) == 0
    # ...a CUDA one (here with CPU tensors) is rewritten, called either way.
    builder = Builder()
    builder.device = torch.device("cuda")
    assert builder.build(0, _common(3, 9)).max_query_len == 1
    assert builder.build(common_prefix_len=0, common_attn_metadata=_common(3, 9)).max_query_len == 1
    assert patch_triton_attn.rewrites_of(builder) == 2


# Softmax segments of verification batches (GEMMA4_SPEC_VERIFY_SEGMENTS).


@dataclass
class ScratchMetadata(FakeMetadata):
    # The split kernel's scratch as vLLM's builder makes it: rows x heads x 16 segments.
    num_par_softmax_segments: int = 16
    softmax_segm_output: torch.Tensor = field(default_factory=lambda: torch.zeros(4, 2, 16, 8))
    softmax_segm_max: torch.Tensor = field(default_factory=lambda: torch.zeros(4, 2, 16))
    softmax_segm_expsum: torch.Tensor = field(default_factory=lambda: torch.zeros(4, 2, 16))


def _scratch_batch() -> ScratchMetadata:
    batch = _verification_batch()
    return ScratchMetadata(batch.query_start_loc, batch.seq_lens, batch.block_table, 3)


def test_fewer_segments_view_the_same_scratch_with_more_rows() -> None:
    metadata = _scratch_batch()
    scratch = (
        metadata.softmax_segm_output,
        metadata.softmax_segm_max,
        metadata.softmax_segm_expsum,
    )
    # 9 query tokens: over the 4 rows the scratch has at 16 segments, within its 16 at 4.
    assert SplitKeyVerify(3, capacity=4).rewrite(_common(3, 9), _scratch_batch()).max_query_len == 3
    split = SplitKeyVerify(3, capacity=4, segments=4)
    out = split.rewrite(_common(3, 9), metadata)
    assert out.max_query_len == 1 and out.num_par_softmax_segments == 4
    assert out.softmax_segm_output.shape == (16, 2, 4, 8)
    assert out.softmax_segm_max.shape == out.softmax_segm_expsum.shape == (16, 2, 4)
    for view, built in zip(
        (out.softmax_segm_output, out.softmax_segm_max, out.softmax_segm_expsum),
        scratch,
        strict=True,
    ):
        assert view.data_ptr() == built.data_ptr() and view.numel() == built.numel()
    # Beyond the rows at 4 segments too: left on vLLM's kernel, scratch untouched.
    big = split.rewrite(_common(3, 17), _scratch_batch())
    assert big.max_query_len == 3 and big.num_par_softmax_segments == 16


def test_segments_above_the_builders_are_not_used() -> None:
    out = SplitKeyVerify(3, capacity=4, segments=16).rewrite(_common(3, 3), _scratch_batch())
    assert out.num_par_softmax_segments == 16 and out.softmax_segm_max.shape == (4, 2, 16)


def test_unset_segments_keep_the_builders() -> None:
    out = SplitKeyVerify(3, capacity=4).rewrite(_common(3, 3), _scratch_batch())
    assert out.max_query_len == 1 and out.num_par_softmax_segments == 16


def test_large_batches_get_fewer_segments_by_default() -> None:
    split = SplitKeyVerify(3, capacity=4, large_tokens=3)
    small = split.rewrite(_common(2, 2), _scratch_batch())
    assert small.max_query_len == 1 and small.num_par_softmax_segments == 16
    large = split.rewrite(_common(3, 3), _scratch_batch())
    assert large.max_query_len == 1
    assert large.num_par_softmax_segments == LARGE_VERIFY_SEGMENTS
    assert large.softmax_segm_max.shape == (16, 2, LARGE_VERIFY_SEGMENTS)
    assert not hasattr(large, OWN_SPLIT_ATTR)  # our kernel only where its mode says
    # Past the builder's split (4 tokens at 16 segments) the default leaves a batch on vLLM's
    # one-pass kernel, as before; only a segments setting takes it onto the split.
    beyond = split.rewrite(_common(3, 9), _scratch_batch())
    assert beyond.max_query_len == 3 and beyond.num_par_softmax_segments == 16
    fixed = SplitKeyVerify(3, capacity=4, segments=4, large_tokens=3)
    assert fixed.rewrite(_common(3, 9), _scratch_batch()).num_par_softmax_segments == 4
    # A segments setting holds at every size.
    eight = SplitKeyVerify(3, capacity=4, segments=8, large_tokens=8)
    for tokens in (3, 8):
        out = eight.rewrite(_common(3, tokens), _scratch_batch())
        assert out.max_query_len == 1 and out.num_par_softmax_segments == 8


@pytest.mark.parametrize(("value", "parsed"), [("", None), ("1", 1), ("4", 4), (" 16", 16)])
def test_segments_setting(monkeypatch: pytest.MonkeyPatch, value: str, parsed: int | None) -> None:
    monkeypatch.setenv(patch_triton_attn.SEGMENTS_ENV, value)
    assert patch_triton_attn.verify_segments_setting() == parsed


@pytest.mark.parametrize("value", ["3", "32", "0", "auto"])
def test_bad_segments_setting_is_refused_before_the_engine(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    from gemma4_spec.checks import UnsupportedConfigurationError, _check_environment

    monkeypatch.setenv(patch_triton_attn.SEGMENTS_ENV, value)
    with pytest.raises(UnsupportedConfigurationError, match="GEMMA4_SPEC_VERIFY_SEGMENTS"):
        _check_environment()


@pytest.mark.parametrize(
    ("value", "parsed"), [("", patch_triton_attn.LARGE_VERIFY_TOKENS), ("8", 8), (" 96 ", 96)]
)
def test_large_tokens_setting(monkeypatch: pytest.MonkeyPatch, value: str, parsed: int) -> None:
    monkeypatch.setenv(LARGE_TOKENS_ENV, value)
    assert patch_triton_attn.large_verify_tokens() == parsed


@pytest.mark.parametrize("value", ["0", "-4", "many"])
def test_bad_large_tokens_setting_is_refused_before_the_engine(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    from gemma4_spec.checks import UnsupportedConfigurationError, _check_environment

    monkeypatch.setenv(LARGE_TOKENS_ENV, value)
    with pytest.raises(UnsupportedConfigurationError, match=LARGE_TOKENS_ENV):
        _check_environment()


def test_builder_reads_the_settings(vllm_026: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(patch_triton_attn.SEGMENTS_ENV, "8")
    monkeypatch.setenv(LARGE_TOKENS_ENV, "64")
    monkeypatch.setenv(OWN_SPLIT_ENV, "0")
    flat = patch_triton_attn._make_split_verify(_builder())
    assert flat is not None
    assert (flat.segments, flat.large_tokens, flat.own_split) == (8, 64, None)
    assert vllm_026 == []  # our kernel off: nothing made, nothing routed
