"""The draft layer's norms and activation in the small-rows matmul's prologue
(``ops/draft_prologue.py``, ``ops/small_linear_triton.py``) against their torch references, the
references against vLLM's modules, the ops under torch.compile, and the assistant's forward
with the fused chain (``GEMMA4_SPEC_FUSED_DRAFT=1``) against the forward without it.

On CPU the kernels run at small sizes under Triton's interpreter, in a subprocess (as in
``test_small_linear.py``). On CUDA: the same checks, the E2B assistant's shapes, and graph
capture.

What "equal" means (``_close``): in float32 the kernel and the reference differ by the order
of their sums; in bfloat16 each rounds its intermediates at the same places, but a different
order of a norm's sum can move one of them by a rounding step, which the next norm and the
matmul carry on: a few roundings at the row's scale.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

from gemma4_spec.ops.centroid_argmax_triton import HAS_TRITON
from gemma4_spec.ops.draft_prologue import (
    gelu_tanh_mul_linear,
    gelu_tanh_mul_linear_reference,
    gelu_tanh_mul_reference,
    prologue_fuses,
    residual_rms_norm_linear,
    residual_rms_norm_linear_reference,
    rms_norm_linear,
    rms_norm_linear_reference,
    rms_norm_reference,
)

needs_cuda = pytest.mark.skipif(
    not (torch.cuda.is_available() and HAS_TRITON),
    reason="needs a CUDA GPU and triton (the CPU side runs under the interpreter)",
)
# Roundings of the activations' dtype, at the row's scale, that a bfloat16 result may be off by.
ROUNDINGS = 3
# (rows, width, N): one row and a few through the fused launch, its most rows, then the
# standalone prologue and F.linear; widths read as whole rows in one K step (64, 200) and, past
# WHOLE_ROW_MAX_K, by steps (600, the last partial).
NORM_SHAPES = (
    (1, 64, 48), (5, 200, 20), (32, 64, 16), (33, 64, 24), (70, 200, 20), (3, 600, 16),
)  # fmt: skip
# (rows, I, N): unsplit, split over K (the interpreter's 4 "SMs"), past the row limit.
ACT_SHAPES = ((5, 80, 48), (3, 600, 16), (40, 80, 24))
# The E2B assistant: hidden, MLP width, and the N of the matmuls each prologue feeds.
E2B_HIDDEN, E2B_MLP = 256, 2048
E2B_NORM_N = (2048, 4096, 4096, 1536)  # q_proj sliding / full, gate_up, post_projection
E2B_DOWN_N = 256


def _excess(out: torch.Tensor, ref: torch.Tensor) -> float:
    """How far ``out`` is beyond its tolerance of ``ref`` (<= 0: within)."""
    assert out.dtype == ref.dtype and out.shape == ref.shape, (out.shape, ref.shape)
    diff = (out.float() - ref.float()).abs()
    if out.dtype == torch.float32:
        return (diff - (1e-5 + 1e-5 * ref.abs())).max().item()
    row_scale = ref.float().pow(2).mean(dim=-1, keepdim=True).sqrt()
    step = ROUNDINGS * torch.finfo(out.dtype).eps * (ref.float().abs() + row_scale) + 1e-6
    return (diff - step).max().item()


def _assert_close(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    worst = _excess(out, ref)
    assert worst <= 0, f"{what}: off by {worst} beyond the tolerance"


def _randn(gen: torch.Generator, *shape: int, scale: float = 1.0, shift: float = 0.0):  # type: ignore[no-untyped-def]
    return torch.randn(*shape, generator=gen) * scale + shift


def _norm_operands(
    rows: int, width: int, n: int, dtype: torch.dtype, device: str, seed: int = 0
) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ops = {
        "a": _randn(gen, rows, width, scale=3.0),  # a sub-layer output, not unit scale
        "residual": _randn(gen, rows, width),
        "post_weight": _randn(gen, width, scale=0.25, shift=1.0),
        "pre_weight": _randn(gen, width, scale=0.25, shift=1.0),
        "scalar": torch.tensor([0.7]),
        "weight": _randn(gen, n, width, scale=width**-0.5),
    }
    return {k: v.to(device, dtype) for k, v in ops.items()}


def _check_norm(rows: int, width: int, n: int, dtype: torch.dtype, device: str) -> None:
    o = _norm_operands(rows, width, n, dtype, device)
    for write_x in (True, False):
        out, x = rms_norm_linear(o["a"], o["pre_weight"], 1e-6, o["weight"], write_x)
        want_out, want_x = rms_norm_linear_reference(o["a"], o["pre_weight"], 1e-6, o["weight"])
        _assert_close(out, want_out, f"NORM out {rows}x{width}")
        if write_x:
            _assert_close(x, want_x, f"NORM x {rows}x{width}")
        else:
            assert x.numel() == 0


def _check_residual_norm(rows: int, width: int, n: int, dtype: torch.dtype, device: str) -> None:
    o = _norm_operands(rows, width, n, dtype, device)
    for scalar, write_x in ((o["scalar"], True), (None, False)):
        args = (o["a"], o["residual"], o["post_weight"], 1e-6, scalar, o["pre_weight"], 1e-5)
        out, h, x = residual_rms_norm_linear(*args, o["weight"], write_x)
        want_out, want_h, want_x = residual_rms_norm_linear_reference(*args, o["weight"])
        what = f"RESIDUAL_NORM {rows}x{width} scalar={scalar is not None}"
        _assert_close(out, want_out, what + " out")
        _assert_close(h, want_h, what + " h")
        if write_x:
            _assert_close(x, want_x, what + " x")
        else:
            assert x.numel() == 0


def _act_operands(
    rows: int, inner: int, n: int, dtype: torch.dtype, device: str
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    gate_up = _randn(gen, rows, 2 * inner, scale=2.0).to(device, dtype)
    return gate_up, _randn(gen, n, inner, scale=inner**-0.5).to(device, dtype)


def _check_act_mul(rows: int, inner: int, n: int, dtype: torch.dtype, device: str) -> None:
    gate_up, w = _act_operands(rows, inner, n, dtype, device)
    want = gelu_tanh_mul_linear_reference(gate_up, w)
    _assert_close(gelu_tanh_mul_linear(gate_up, w), want, f"ACT_MUL {rows}x{inner}")


def _check_split_norms(dtype: torch.dtype, device: str) -> None:
    """The norms' prologue with its K split over programs (forced: the draft's hidden is too
    short to split): each split normalises its own K run and writes that part of h / x."""
    from gemma4_spec.ops.small_linear_triton import (
        PROLOGUE_RESIDUAL_NORM,
        Prologue,
        SmallLinearConfig,
        prologue_linear_kernel,
    )

    o = _norm_operands(3, 64, 40, dtype, device, seed=2)
    forced = SmallLinearConfig(16, 16, 16, 2, 2, num_warps=4, num_stages=2)
    prologue = Prologue(
        PROLOGUE_RESIDUAL_NORM, o["residual"], o["post_weight"], o["pre_weight"], o["scalar"],
        1e-6, 1e-5, write_x=True,
    )  # fmt: skip
    out, h, x = prologue_linear_kernel(o["a"], o["weight"], prologue, forced)
    args = (o["a"], o["residual"], o["post_weight"], 1e-6, o["scalar"], o["pre_weight"], 1e-5)
    for got, want, what in zip(
        (out, h, x),
        residual_rms_norm_linear_reference(*args, o["weight"]),
        "out h x".split(),
        strict=True,
    ):
        assert got is not None
        _assert_close(got, want, f"split RESIDUAL_NORM {what}")


def _check_controls(device: str) -> None:
    """The comparison catches a wrong eps and a dropped layer scalar."""
    o = _norm_operands(4, 64, 32, torch.float32, device)
    out, _ = rms_norm_linear(o["a"], o["pre_weight"], 1e-6, o["weight"], False)
    wrong_eps, _ = rms_norm_linear_reference(o["a"], o["pre_weight"], 1e-2, o["weight"])
    assert _excess(out, wrong_eps) > 0, "an eps of 1e-2 for 1e-6 went unnoticed"
    args = (o["a"], o["residual"], o["post_weight"], 1e-6)
    _, h, _ = residual_rms_norm_linear(
        *args, o["scalar"], o["pre_weight"], 1e-5, o["weight"], False
    )
    unscaled = residual_rms_norm_linear_reference(*args, None, o["pre_weight"], 1e-5, o["weight"])
    # (The normed x, so the matmul, hardly depends on h's scale: the residual h shows it.)
    assert _excess(h, unscaled[1]) > 0, "a dropped layer scalar went unnoticed"


def _check_prologues_against_references(device: str) -> None:
    from gemma4_spec.ops.small_linear_triton import _COUNTERS, small_linear_config

    assert prologue_fuses(torch.empty(32, 8)) and not prologue_fuses(torch.empty(33, 8))
    split = small_linear_config(3, 16, 600, torch.device(device)).splits
    assert split > 1, "the split ACT_MUL shape does not split"
    for dtype in (torch.float32, torch.bfloat16):
        for shape in NORM_SHAPES:
            _check_norm(*shape, dtype, device)
            _check_residual_norm(*shape, dtype, device)
        for shape in ACT_SHAPES:
            _check_act_mul(*shape, dtype, device)
        _check_split_norms(dtype, device)
        # Leading dimensions: [2, 3, K] rows.
        o = _norm_operands(6, 64, 16, dtype, device)
        out, _ = rms_norm_linear(o["a"].view(2, 3, 64), o["pre_weight"], 1e-6, o["weight"], False)
        want, _ = rms_norm_linear_reference(o["a"], o["pre_weight"], 1e-6, o["weight"])
        _assert_close(out, want.view(2, 3, 16), "NORM [2, 3, K]")
    _check_controls(device)
    for counters in _COUNTERS.values():
        assert not counters.any(), counters.nonzero().tolist()


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU only (the CUDA tests cover it)")
def test_prologues_match_references_under_interpreter(check_under_interpreter) -> None:  # type: ignore[no-untyped-def]
    check_under_interpreter("test_draft_prologue", "_check_prologues_against_references")


@needs_cuda
def test_prologues_match_references_cuda() -> None:
    _check_prologues_against_references("cuda")


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 2, 4, 8, 16, 32, 33, 64])
def test_e2b_shapes_cuda(rows: int, dtype: torch.dtype) -> None:
    for n in E2B_NORM_N:
        _check_norm(rows, E2B_HIDDEN, n, dtype, "cuda")
        _check_residual_norm(rows, E2B_HIDDEN, n, dtype, "cuda")
    _check_act_mul(rows, E2B_MLP, E2B_DOWN_N, dtype, "cuda")


@needs_cuda
def test_graph_replay_cuda() -> None:
    """A layer's three fused ops captured once and replayed over new inputs: the replay's
    outputs are the eager calls'."""
    o = _norm_operands(4, E2B_HIDDEN, E2B_MLP * 2, torch.bfloat16, "cuda")
    gate_up, down = _act_operands(4, E2B_MLP, E2B_DOWN_N, torch.bfloat16, "cuda")

    def layer() -> tuple[torch.Tensor, ...]:
        q, _ = rms_norm_linear(o["a"], o["pre_weight"], 1e-6, o["weight"], False)
        up, h, _ = residual_rms_norm_linear(
            o["a"], o["residual"], o["post_weight"], 1e-6, o["scalar"], o["pre_weight"], 1e-6,
            o["weight"], False,
        )  # fmt: skip
        return q, up, h, gelu_tanh_mul_linear(gate_up, down)

    layer()  # outside capture: compiled, counters made
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = layer()
    for seed in range(3):
        fresh = _norm_operands(4, E2B_HIDDEN, E2B_MLP * 2, torch.bfloat16, "cuda", seed + 10)
        o["a"].copy_(fresh["a"])
        o["residual"].copy_(fresh["residual"])
        gate_up.copy_(gate_up.roll(1, dims=0))
        graph.replay()
        for got, want in zip(captured, layer(), strict=True):
            assert torch.equal(got, want)


def test_without_triton_the_references_run() -> None:
    """On a device Triton cannot run on (CPU without the interpreter), the ops are their
    references exactly."""
    if torch.cuda.is_available():
        pytest.skip("CPU only")
    o = _norm_operands(5, 64, 16, torch.float32, "cpu")
    out, x = rms_norm_linear(o["a"], o["pre_weight"], 1e-6, o["weight"], True)
    want = rms_norm_linear_reference(o["a"], o["pre_weight"], 1e-6, o["weight"])
    assert torch.equal(out, want[0]) and torch.equal(x, want[1])
    args = (o["a"], o["residual"], o["post_weight"], 1e-6, o["scalar"], o["pre_weight"], 1e-5)
    got = residual_rms_norm_linear(*args, o["weight"], True)
    for g, w in zip(got, residual_rms_norm_linear_reference(*args, o["weight"]), strict=True):
        assert torch.equal(g, w)
    gate_up, w = _act_operands(5, 80, 16, torch.float32, "cpu")
    assert torch.equal(gelu_tanh_mul_linear(gate_up, w), gelu_tanh_mul_linear_reference(gate_up, w))


def test_references_are_vllms_modules() -> None:
    """The references compute what the assistant's modules do: vLLM's ``RMSNorm`` and the
    ``gelu_pytorch_tanh`` activation-and-mul, bit for bit in bfloat16."""
    pytest.importorskip("vllm")
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.activation import get_act_and_mul_fn
    from vllm.model_executor.layers.layernorm import RMSNorm

    with set_current_vllm_config(VllmConfig()):
        norm = RMSNorm(64, eps=1e-6).to(torch.bfloat16)
        act = get_act_and_mul_fn("gelu_pytorch_tanh")
    o = _norm_operands(7, 64, 16, torch.bfloat16, "cpu")
    with torch.no_grad():
        norm.weight.copy_(o["pre_weight"])
        assert torch.equal(norm(o["a"]), rms_norm_reference(o["a"], norm.weight, 1e-6))
        gate_up, _ = _act_operands(7, 80, 16, torch.bfloat16, "cpu")
        assert torch.equal(act(gate_up), gelu_tanh_mul_reference(gate_up))


def test_ops_compile_with_dynamic_rows() -> None:
    """The fakes let torch.compile trace the three ops with a dynamic row count; one compiled
    graph serves the fused and the unfused row counts."""
    torch._dynamo.reset()
    o = _norm_operands(1, 64, 160, torch.float32, "cpu")
    down = torch.randn(64, 80)

    def chain(a: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q, _ = torch.ops.gemma4_spec.rms_norm_linear(a, o["pre_weight"], 1e-6, o["weight"], False)
        gate_up, h, x = torch.ops.gemma4_spec.residual_rms_norm_linear(
            a, residual, o["post_weight"], 1e-6, o["scalar"], o["pre_weight"], 1e-6,
            o["weight"], True,
        )  # fmt: skip
        return q + 1, h, x, torch.ops.gemma4_spec.gelu_tanh_mul_linear(gate_up, down)

    compiled = torch.compile(chain, dynamic=True, backend="aot_eager", fullgraph=True)
    for rows in (3, 5, 40):
        a, residual = torch.randn(rows, 64), torch.randn(rows, 64)
        for got, want in zip(compiled(a, residual), chain(a, residual), strict=True):
            assert torch.equal(got, want)


# --------------------------------------------------------------------------------------------
# The assistant's forward, fused and not
# --------------------------------------------------------------------------------------------


class _StandInAttention(torch.nn.Module):
    """Stands for vLLM's paged attention (which needs an engine): a fixed function of the
    query, the same in both forwards."""

    def forward(self, q: torch.Tensor, k: None, v: None) -> torch.Tensor:
        return torch.tanh(q) * 2


def _tiny_draft(root: Path):  # type: ignore[no-untyped-def]
    """Our assistant on a tiny random checkpoint, built as ``test_model_vs_transformers``
    builds it, without vLLM's post-loading step: on CPU that packs the weights for vLLM's CPU
    GEMM and drops ``weight``, which the small-rows method and the fused ops read."""
    from unittest import mock

    import vllm.model_executor.model_loader.utils as loader_utils
    from test_model_vs_transformers import _assistant_module

    from gemma4_spec.testing.tiny import build_tiny_pair

    target_dir, assistant_dir = build_tiny_pair(root / "pair", centroids=False, style="random")
    with mock.patch.object(loader_utils, "process_weights_after_loading", lambda *_: None):
        _, draft = _assistant_module(target_dir, assistant_dir, root)
    return draft


def _randomise_norms(draft, gen: torch.Generator) -> None:  # type: ignore[no-untyped-def]
    """Norm gains and layer scalars away from 1 (a random checkpoint has them at 1): a norm or
    scalar applied to the wrong value, or not at all, shows."""
    with torch.no_grad():
        for name, param in draft.named_parameters():
            if name.endswith("layernorm.weight") or name == "model.norm.weight":
                param.copy_(_randn(gen, *param.shape, scale=0.3, shift=1.0))
        for layer in draft.model.layers:
            layer.layer_scalar.fill_(0.5 + torch.rand(1, generator=gen).item())


def _check_fused_forward(device: str) -> None:
    """The assistant's forward with the fused chain gives the unfused forward's
    (draft hidden, backbone hidden), both with their matmuls on the small-rows kernel."""
    import gemma4_spec.models.gemma4_mtp as mtp
    from gemma4_spec.ops.small_linear import use_small_rows_linear

    with tempfile.TemporaryDirectory() as tmp:
        draft = _tiny_draft(Path(tmp))
    # As on CUDA: the small-rows linear method (a kernel under the interpreter on CPU).
    assert use_small_rows_linear(draft, "cuda") > 0
    gen = torch.Generator().manual_seed(3)
    _randomise_norms(draft, gen)
    for layer in draft.model.layers:
        layer.self_attn.attn = _StandInAttention()
    draft.to(device)
    calls = []
    chain = mtp.fused_layer_chain

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        return chain(*args, **kwargs)

    mtp.fused_layer_chain = counted
    backbone = draft.config.backbone_hidden_size
    with torch.no_grad():
        for rows in (1, 3, 40):
            embeds = _randn(gen, rows, backbone).to(device)
            hidden = _randn(gen, rows, backbone).to(device)
            positions = torch.arange(rows, device=device) + 5
            outputs = []
            for fused in (False, True):
                draft.fused_draft = fused
                outputs.append(draft(None, positions, hidden, inputs_embeds=embeds))
            for got, want, what in zip(outputs[1], outputs[0], ("draft", "backbone"), strict=True):
                _assert_close(got, want, f"{what} hidden at {rows} rows")
    assert len(calls) == 3, "the fused chain did not run"


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU only (the CUDA test covers it)")
def test_fused_forward_matches_under_interpreter(check_under_interpreter) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("vllm")
    check_under_interpreter("test_draft_prologue", "_check_fused_forward")


@needs_cuda
def test_fused_forward_matches_cuda() -> None:
    pytest.importorskip("vllm")
    _check_fused_forward("cuda")


def test_fused_draft_is_opt_in(set_env, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The fused chain runs only when switched on, on the small-rows method, on one
    tensor-parallel rank, for the GELU-tanh MLP."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    import gemma4_spec.models.gemma4_mtp as mtp

    config = SimpleNamespace(hidden_activation="gelu_pytorch_tanh")
    monkeypatch.setattr(mtp, "get_tensor_model_parallel_world_size", lambda: 1)
    set_env(mtp.FUSED_DRAFT_ENV, None)
    assert not mtp.fused_draft_applies(config, True)
    set_env(mtp.FUSED_DRAFT_ENV, "1")
    assert mtp.fused_draft_applies(config, True)
    assert not mtp.fused_draft_applies(config, False)
    assert not mtp.fused_draft_applies(SimpleNamespace(hidden_activation="silu"), True)
    monkeypatch.setattr(mtp, "get_tensor_model_parallel_world_size", lambda: 2)
    assert not mtp.fused_draft_applies(config, True)
