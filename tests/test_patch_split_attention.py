"""``patch/patch_split_attention.py``: which attention calls go to our split kernel, and that a
call as vLLM's Triton backend makes it (packed K/V cache views, window and scratch as vLLM
passes them) computes the reference attention (CPU: under Triton's interpreter, in a
subprocess)."""

from __future__ import annotations

import sys
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch

from gemma4_spec.ops.centroid_argmax_triton import HAS_TRITON
from gemma4_spec.ops.split_attention import split_attention_reference
from gemma4_spec.patch import patch_split_attention, patch_triton_attn
from gemma4_spec.patch.patch_split_attention import OWN_SPLIT_ATTR, OWN_SPLIT_ENV


def _vllm_call(device: str, dtype: torch.dtype = torch.float32, window: int = 40) -> dict:
    """unified_attention's keyword arguments as vLLM 0.26's TritonAttentionImpl.forward passes
    them for a verification batch (3 requests of 4 query tokens, 8 query heads on 1 KV head,
    then a padded request), with K and V views of one packed cache."""
    gen = torch.Generator().manual_seed(3)
    requests, q_len, heads, head, block, per_request = 3, 4, 8, 32, 16, 12
    blocks = requests * per_request + 1
    packed = torch.randn(blocks, 1, block, 2 * head, generator=gen).to(dtype).to(device)
    key_cache, value_cache = packed.transpose(1, 2).split(head, dim=-1)
    table = torch.arange(1, blocks, dtype=torch.int32).view(requests, per_request)
    table = torch.cat([table, table.new_zeros(1, per_request)]).to(device)
    seq_lens = torch.tensor([150, 37, 190, 0], dtype=torch.int32, device=device)
    starts = torch.tensor([0, 4, 8, 12, 12], dtype=torch.int32, device=device)
    q = torch.randn(requests * q_len + 2, heads, head, generator=gen).to(dtype).to(device)
    # vLLM sizes the scratch for the model's largest head, on every layer (Gemma 4: 512 on its
    # 256-wide sliding layers): here twice this layer's.
    rows, padded = 128, 2 * head
    return dict(
        q=q, k=key_cache, v=value_cache, out=torch.full_like(q, float("nan")),
        cu_seqlens_q=starts, max_seqlen_q=1, seqused_k=seq_lens, max_seqlen_k=190,
        softmax_scale=head**-0.5, causal=True, alibi_slopes=None, use_alibi_sqrt=False,
        window_size=(window - 1, 0) if window else (-1, -1), block_table=table, softcap=0,
        q_descale=None, k_descale=None, v_descale=None, seq_threshold_3D=128,
        num_par_softmax_segments=16,
        softmax_segm_output=torch.empty(rows, heads, 16, padded, device=device),
        softmax_segm_max=torch.empty(rows, heads, 16, device=device),
        softmax_segm_expsum=torch.empty(rows, heads, 16, device=device),
        sinks=None, output_scale=None, mm_prefix_range=None, rswa_prefix_lens=None,
        rswa_window=None, kv_quant_mode=None, k_scale_cache=None, v_scale_cache=None,
        chunk_lookback=-1, use_td=False,
    )  # fmt: skip


def _check_vllm_call_mapping(device: str) -> None:
    for window, segments in ((0, 16), (40, 16), (40, 8)):
        kwargs = _vllm_call(device, window=window)
        if segments != 16:  # GEMMA4_SPEC_VERIFY_SEGMENTS's views of the scratch
            names = ("softmax_segm_output", "softmax_segm_max", "softmax_segm_expsum")
            views = patch_triton_attn.segment_views(*(kwargs[n] for n in names), segments)
            kwargs.update(zip(names, views, strict=True))
        out = patch_split_attention.run_split_attention(kwargs, rows=4)
        real = 12  # the padding tokens' rows are not written
        want = split_attention_reference(
            kwargs["q"], kwargs["k"], kwargs["v"], kwargs["block_table"], kwargs["seqused_k"],
            kwargs["cu_seqlens_q"], kwargs["softmax_scale"], window,
        )  # fmt: skip
        assert out is kwargs["out"]
        torch.testing.assert_close(out[:real], want[:real], atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU only (the CUDA test covers it)")
def test_vllm_call_computes_the_reference_under_interpreter(check_under_interpreter) -> None:  # type: ignore[no-untyped-def]
    check_under_interpreter("test_patch_split_attention", "_check_vllm_call_mapping")


@pytest.mark.cuda_triton  # conftest.py skips it without both
def test_vllm_call_computes_the_reference_cuda() -> None:
    _check_vllm_call_mapping("cuda")


def _fake_backend() -> tuple[ModuleType, list[str]]:
    """A module with TritonAttentionImpl.forward calling the module's unified_attention, as
    vLLM's does; ``calls`` records which kernel ran."""
    calls: list[str] = []
    module = ModuleType("fake_triton_attn")

    def unified_attention(**kwargs: Any) -> str:
        calls.append("vllm")
        return "vllm"

    class TritonAttentionImpl:
        def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, **kw):  # type: ignore[no-untyped-def]
            return module.unified_attention(**self.kwargs)

    module.unified_attention = unified_attention  # type: ignore[attr-defined]
    module.TritonAttentionImpl = TritonAttentionImpl  # type: ignore[attr-defined]
    return module, calls


def _recording_backend(monkeypatch: pytest.MonkeyPatch) -> tuple[ModuleType, list[str]]:
    """``_fake_backend``, with our kernel's calls recorded in ``calls`` too (not run)."""
    module, calls = _fake_backend()
    monkeypatch.setattr(
        patch_split_attention,
        "run_split_attention",
        lambda kwargs, rows, sizes="": calls.append(f"ours {rows} {sizes}".strip()) or "ours",
    )
    return module, calls


def _route(monkeypatch: pytest.MonkeyPatch, setting: str) -> tuple[ModuleType, list[str]]:
    monkeypatch.setenv(OWN_SPLIT_ENV, setting)
    module, calls = _recording_backend(monkeypatch)
    patch_split_attention.apply(module)
    return module, calls


@pytest.fixture
def routed(monkeypatch: pytest.MonkeyPatch) -> tuple[ModuleType, list[str]]:
    return _route(monkeypatch, "1")


def _forward(module: ModuleType, metadata: Any, **changes: Any) -> Any:
    impl = module.TritonAttentionImpl()
    impl.kwargs = {**_vllm_call("cpu"), **changes}
    return impl.forward(None, None, None, None, None, metadata, None)


def test_marked_verification_batches_run_our_kernel(routed: tuple) -> None:
    module, calls = routed
    assert _forward(module, SimpleNamespace(**{OWN_SPLIT_ATTR: 4})) == "ours"
    assert _forward(module, SimpleNamespace()) == "vllm"  # not a rewritten verification batch
    assert calls == ["ours 4", "vllm"]


def test_sliding_setting_sends_only_windowed_layers_to_our_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    module, calls = _route(monkeypatch, "sliding")
    marked = SimpleNamespace(**{OWN_SPLIT_ATTR: 4})
    assert _forward(module, marked, window_size=(39, 0)) == "ours"  # a sliding layer
    assert _forward(module, marked, window_size=(-1, -1)) == "vllm"  # a full-attention layer
    assert calls == ["ours 4", "vllm"]


def test_default_sends_the_sliding_layers_of_marked_batches_to_our_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Unset or "auto": the sliding-window layers (the rewrite marks only large batches).
    for setting in ("", "auto"):
        module, calls = _route(monkeypatch, setting)
        marked = SimpleNamespace(**{OWN_SPLIT_ATTR: 4})
        assert _forward(module, marked, window_size=(39, 0)) == "ours"
        assert _forward(module, marked, window_size=(-1, -1)) == "vllm"
        assert _forward(module, SimpleNamespace(), window_size=(39, 0)) == "vllm"
        assert calls == ["ours 4", "vllm", "vllm"]


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        (OWN_SPLIT_ENV, "expected auto .* 1 .* sliding"),
        (patch_split_attention.DRAFT_ENV, "expected 0 .* 1 .* sliding"),
    ],
)
@pytest.mark.parametrize("value", ["2", "full", "yes", "on"])
def test_unknown_setting_is_a_clear_error_before_start_up(
    monkeypatch: pytest.MonkeyPatch, name: str, expected: str, value: str
) -> None:
    from gemma4_spec.checks import _check_environment
    from gemma4_spec.validation import UnsupportedConfigurationError

    monkeypatch.setenv(name, value)
    with pytest.raises(UnsupportedConfigurationError, match=expected):
        _check_environment()
    monkeypatch.setenv(name, "0")
    _check_environment()  # off: nothing to say


def test_sizes_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    """GEMMA4_SPEC_SPLIT_ATTENTION_SIZES: passed on as set; anything else than sizes refused
    before start-up, saying what is accepted and how to go back to the kernel's own."""
    from gemma4_spec.checks import _check_environment
    from gemma4_spec.validation import UnsupportedConfigurationError

    assert patch_split_attention.split_sizes() == ""  # unset: the kernel's own
    monkeypatch.setenv(patch_split_attention.SIZES_ENV, " m128_w4 ")
    _check_environment()
    assert patch_split_attention.split_sizes() == "m128_w4"
    module, calls = _route(monkeypatch, "1")  # the setting reaches our kernel's calls
    assert _forward(module, SimpleNamespace(**{OWN_SPLIT_ATTR: 4})) == "ours"
    assert calls == ["ours 4 m128_w4"]
    for bad in ("fast", "m128,w4", "w0"):
        monkeypatch.setenv(patch_split_attention.SIZES_ENV, bad)
        with pytest.raises(UnsupportedConfigurationError, match="t64, m128, w4, s2, c2.*unset it"):
            _check_environment()


@pytest.mark.parametrize(
    "change",
    [
        {"alibi_slopes": torch.ones(8)},
        {"sinks": torch.ones(8)},
        {"q_descale": torch.ones(1)},
        {"output_scale": torch.ones(1)},
        {"k": torch.zeros(2, 16, 1, 32, dtype=torch.uint8)},  # a quantized cache
        {"causal": False},
        {"chunk_lookback": 1},
        {"softmax_segm_output": None},
        {"softmax_segm_output": torch.empty(128, 8, 16, 16)},  # narrower than the head's tiles
        {"softmax_segm_output": torch.empty(128, 8, 64, 16).transpose(2, 3)},  # not contiguous
    ],
)
def test_what_our_kernel_does_not_do_stays_on_vllms(routed: tuple, change: dict) -> None:
    module, calls = routed
    assert _forward(module, SimpleNamespace(**{OWN_SPLIT_ATTR: 4}), **change) == "vllm"


def test_off_when_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(OWN_SPLIT_ENV, "0")
    module, calls = _fake_backend()
    original = module.unified_attention
    patch_split_attention.apply(module)
    assert module.unified_attention is original
    assert _forward(module, SimpleNamespace(**{OWN_SPLIT_ATTR: 4})) == "vllm"


@pytest.mark.parametrize("verification", ["0", "auto", "1"])
def test_marked_draft_batches_run_our_kernel_on_the_layers_their_mode_names(
    monkeypatch: pytest.MonkeyPatch, verification: str
) -> None:
    # The draft's marks (one query a request) route by their own mode, whatever the
    # verification's: installed for the draft alone where the verification's is off.
    monkeypatch.setenv(OWN_SPLIT_ENV, verification)
    module, calls = _recording_backend(monkeypatch)
    patch_split_attention.apply(module, draft=True)
    every, sliding = SimpleNamespace(), SimpleNamespace()
    patch_split_attention.mark_draft(every, "all")
    patch_split_attention.mark_draft(sliding, "sliding")
    assert _forward(module, every, window_size=(-1, -1)) == "ours"
    assert _forward(module, every, window_size=(39, 0)) == "ours"
    assert _forward(module, sliding, window_size=(-1, -1)) == "vllm"
    assert _forward(module, sliding, window_size=(39, 0)) == "ours"
    assert _forward(module, SimpleNamespace(), window_size=(39, 0)) == "vllm"  # unmarked
    assert calls == ["ours 1", "ours 1", "vllm", "ours 1", "vllm"]
    # Verification marks still follow the verification's mode ("0": never ours).
    expected = "vllm" if verification == "0" else "ours"
    assert _forward(module, SimpleNamespace(**{OWN_SPLIT_ATTR: 4}), window_size=(39, 0)) == expected


def test_draft_setting_values(monkeypatch: pytest.MonkeyPatch) -> None:
    from gemma4_spec.checks import _check_environment

    for value, mode in (("0", None), ("1", "all"), ("sliding", "sliding"), ("auto", "auto")):
        monkeypatch.setenv(patch_split_attention.DRAFT_ENV, value)
        _check_environment()
        assert patch_split_attention.own_draft_mode() == mode
    monkeypatch.delenv(patch_split_attention.DRAFT_ENV)
    assert patch_split_attention.own_draft_mode() is None  # off by default


def test_auto_draft_mode_sends_large_batches_only() -> None:
    rows = patch_split_attention.DRAFT_AUTO_ROWS
    assert patch_split_attention.draft_layers("auto", rows - 1) is None
    assert patch_split_attention.draft_layers("auto", rows) == "all"
    assert patch_split_attention.draft_layers("auto", 4 * rows) == "all"
    for mode in ("all", "sliding", None):  # the other modes (None: off) whatever the batch
        for batch in (1, 4 * rows):
            assert patch_split_attention.draft_layers(mode, batch) == mode


def test_draft_routing_stays_off_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(patch_split_attention.DRAFT_ENV, "1")
    assert patch_split_attention.route_draft(torch.device("cpu")) is None


def test_apply_wraps_once(routed: tuple) -> None:
    module, _ = routed
    wrapped = module.unified_attention
    patch_split_attention.apply(module)
    assert module.unified_attention is wrapped


def test_the_rewrite_marks_verification_batches() -> None:
    from test_patch_triton_attn import _common, _scratch_batch

    def marked(split: patch_triton_attn.SplitKeyVerify, query: int, tokens: int) -> Any:
        return getattr(
            split.rewrite(_common(query, tokens), _scratch_batch()), OWN_SPLIT_ATTR, None
        )

    plain = patch_triton_attn.SplitKeyVerify(3, capacity=4)  # our kernel off
    assert marked(plain, 2, 2) is None and marked(plain, 3, 3) is None
    every = patch_triton_attn.SplitKeyVerify(3, capacity=4, own_split="sliding", large_tokens=3)
    assert marked(every, 2, 2) == 3 and marked(every, 3, 3) == 3
    assert marked(every, 1, 3) is None  # a decode batch: not rewritten
    assert marked(every, 3, 9) is None  # past the builder's split: vLLM's one-pass kernel
    auto = patch_triton_attn.SplitKeyVerify(3, capacity=4, own_split="auto", large_tokens=3)
    assert marked(auto, 2, 2) is None and marked(auto, 3, 3) == 3  # large batches only


def test_the_switch_is_read_once_per_builder(monkeypatch: pytest.MonkeyPatch) -> None:
    # The rewrite runs every step: it keeps the switch as read when its builder was set up,
    # where our kernel's counters are made (before any graph capture) and its routing
    # installed in vLLM's backend module.
    from test_patch_triton_attn import _builder

    from gemma4_spec.ops import split_attention_triton

    prepared: list[Any] = []
    monkeypatch.setattr(split_attention_triton, "prepare_split_attention", prepared.append)
    monkeypatch.setattr(patch_triton_attn, "flat_verify_supported", lambda: True)
    monkeypatch.delenv(patch_triton_attn.FLAT_VERIFY_ENV, raising=False)
    module, calls = _fake_backend()
    original = module.unified_attention
    monkeypatch.setitem(sys.modules, patch_triton_attn.TRITON_ATTN_MODULE, module)
    monkeypatch.setenv(OWN_SPLIT_ENV, "0")
    split = patch_triton_attn._make_split_verify(_builder())
    assert split is not None and split.own_split is None and prepared == []
    assert module.unified_attention is original
    monkeypatch.delenv(OWN_SPLIT_ENV)
    split = patch_triton_attn._make_split_verify(_builder())
    assert split is not None and split.own_split == "auto" and prepared == [torch.device("cuda")]
    assert module.unified_attention is not original  # routed from now on
    monkeypatch.setenv(OWN_SPLIT_ENV, "1")
    assert patch_triton_attn._make_split_verify(_builder()).own_split == "all"


def test_our_kernel_takes_the_scratch_back_to_its_segments() -> None:
    # GEMMA4_SPEC_VERIFY_SEGMENTS=4 views vLLM's scratch with 4 segments a row (for vLLM's
    # kernel, on the layers ours does not run); ours views it back to 16, where the rows suffice.
    kwargs = _vllm_call("cpu")  # 128 rows x 16 segments, 14 query tokens
    names = ("softmax_segm_output", "softmax_segm_max", "softmax_segm_expsum")
    four = patch_triton_attn.segment_views(*(kwargs[n] for n in names), 4)
    kwargs.update(zip(names, four, strict=True))
    scratch = patch_split_attention._scratch(kwargs)
    assert scratch.values.shape[:3] == (128, 8, 16) and scratch.maxima.shape == (128, 8, 16)
    assert scratch.values.data_ptr() == four[0].data_ptr()
    kwargs["q"] = torch.zeros(129, 8, 32)  # more query tokens than 16-segment rows: keep 4
    assert patch_split_attention._scratch(kwargs).values.shape[:3] == (512, 8, 4)


def test_by_default_only_large_batches_sliding_layers_reach_our_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # End to end on a fake backend, settings unset: the builder's set-up installs the routing;
    # a large verification batch runs our kernel on a sliding layer and vLLM's (at the
    # large-batch segments) on a full one; a small batch runs vLLM's on both.
    from test_patch_triton_attn import _builder, _common, _scratch_batch

    from gemma4_spec.ops import split_attention_triton

    monkeypatch.setattr(split_attention_triton, "prepare_split_attention", lambda device: None)
    monkeypatch.setattr(patch_triton_attn, "flat_verify_supported", lambda: True)
    for name in (OWN_SPLIT_ENV, patch_triton_attn.FLAT_VERIFY_ENV, patch_triton_attn.SEGMENTS_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(patch_triton_attn.LARGE_TOKENS_ENV, "3")
    module, calls = _recording_backend(monkeypatch)
    monkeypatch.setitem(sys.modules, patch_triton_attn.TRITON_ATTN_MODULE, module)
    split = patch_triton_attn._make_split_verify(_builder(seq_threshold_3D=4))
    assert split is not None and split.capacity == 4 and split.max_query_len == 3
    large = split.rewrite(_common(3, 3), _scratch_batch())
    small = split.rewrite(_common(2, 2), _scratch_batch())
    assert large.num_par_softmax_segments == patch_triton_attn.LARGE_VERIFY_SEGMENTS
    assert small.num_par_softmax_segments == 16
    for metadata in (large, small):
        for window in ((39, 0), (-1, -1)):  # a sliding layer, a full one
            _forward(module, metadata, window_size=window)
    assert calls == ["ours 3", "vllm", "vllm", "vllm"]
