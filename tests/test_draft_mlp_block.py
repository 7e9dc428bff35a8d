"""The draft layer's work between two attentions in one launch (``ops/draft_mlp_block*.py``)
against its torch reference: staged (a launch a stage) and persistent (grid barriers) alike.

On CPU the kernel runs under Triton's interpreter, in a subprocess (``TRITON_INTERPRET=1`` must
be set before triton is imported), where programs run one after another: the stages run as
launches of their own, and the persistent form with one program (whose barriers open at once),
which must give the staged form's values exactly. On CUDA: the assistant's shapes, the
persistent form with all its programs, CUDA-graph replay, and the counters back at zero.

What "close" means (``row_rms_excess``): the reference computes in float32 throughout, the
kernel rounds each intermediate to the model dtype as the unfused layer does (in bfloat16 up to
about 4.5 rounding steps of a value plus its row's RMS at the shapes below, under the
interpreter); in float32 the two differ by the order of the sums.
"""

from __future__ import annotations

import pytest
import torch

from gemma4_spec.ops.centroid_argmax_triton import HAS_TRITON
from gemma4_spec.ops.draft_mlp_block import (
    DRAFT_BLOCK_ENV,
    MlpBlockWeights,
    draft_mlp_block_applies,
    draft_mlp_block_reference,
    draft_mlp_block_unfused,
    uses_draft_block,
)
from gemma4_spec.testing.closeness import row_rms_excess

needs_cuda = pytest.mark.cuda_triton  # conftest.py skips these without both
EPS = 1e-6
# (rows, hidden H, attention width Q, MLP width I): the output projection split over K (under
# the interpreter's 4 "SMs"); the down projection split; H not a power of two and I not a
# multiple of the column tile; the most rows the kernel takes; the down projection split into
# runs short enough to prefetch, and unsplit but short enough.
SMALL_SHAPES = (
    (1, 32, 512, 320), (3, 16, 300, 600), (17, 48, 200, 72), (64, 32, 130, 40),
    (4, 16, 256, 512), (5, 32, 512, 256),
)  # fmt: skip
# The E2B assistant: H 256, Q 2048 (sliding layers) or 4096 (full), I 2048.
ASSISTANT_SHAPES = ((256, 2048, 2048), (256, 4096, 2048))
# Rounding steps allowed in bfloat16: the block rounds about ten intermediates.
BF16_STEPS = 8


def _operands(
    rows: int, hidden: int, depth: int, width: int, dtype: torch.dtype, device: str, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, MlpBlockWeights]:
    gen = torch.Generator().manual_seed(seed)

    def t(*shape: int, scale: float = 1.0, offset: float = 0.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale + offset).to(device, dtype)

    w = MlpBlockWeights(
        o_proj=t(hidden, depth, scale=depth**-0.5),
        gate_up=t(2 * width, hidden, scale=hidden**-0.5),
        down=t(hidden, width, scale=width**-0.5),
        post_attention_norm=t(hidden, scale=0.2, offset=1.0),
        pre_feedforward_norm=t(hidden, scale=0.2, offset=1.0),
        post_feedforward_norm=t(hidden, scale=0.2, offset=1.0),
        next_norm=t(hidden, scale=0.2, offset=1.0),
        layer_scalar=t(1, scale=0.1, offset=0.7),
    )
    return t(rows, depth), t(rows, hidden), w


def _op(attn: torch.Tensor, h: torch.Tensor, w: MlpBlockWeights) -> tuple[torch.Tensor, ...]:
    return torch.ops.gemma4_spec.draft_mlp_block(attn, h, *w, EPS)


def _assert_close(out: tuple[torch.Tensor, ...], ref: tuple[torch.Tensor, ...]) -> None:
    for got, want in zip(out, ref, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        steps = 1 if got.dtype == torch.float32 else BF16_STEPS
        worst = row_rms_excess(got, want, steps)
        assert worst <= 0, f"off by {worst} beyond {steps} roundings"


def _check_block_against_reference(device: str) -> None:
    from gemma4_spec.ops.device_counters import counters_of
    from gemma4_spec.ops.draft_mlp_block_triton import (
        BLOCK_K,
        block_config,
        draft_mlp_block_kernel,
        prefetch_fits,
    )

    seen = set()
    for dtype in (torch.float32, torch.bfloat16):
        for rows, hidden, depth, width in SMALL_SHAPES:
            attn, h, w = _operands(rows, hidden, depth, width, dtype, device, seed=rows)
            cfg = block_config(rows, hidden, depth, width, attn.device)
            seen |= {"o split"} if cfg.o_splits > 1 else set()
            seen |= {"down split"} if cfg.d_splits > 1 else set()
            fits = prefetch_fits(hidden, cfg.d_steps * BLOCK_K)
            seen |= {"prefetch"} if fits else set()
            want = draft_mlp_block_reference(attn, h, w, EPS)
            for prefetch in (False, True) if fits else (False,):
                staged = draft_mlp_block_kernel(attn, h, w, EPS, prefetch=prefetch)
                _assert_close(staged, want)
                # One program through every stage and barrier: the same sums in the same order.
                persistent = draft_mlp_block_kernel(attn, h, w, EPS, programs=1, prefetch=prefetch)
                for got, same in zip(persistent, staged, strict=True):
                    assert torch.equal(got, same), "the persistent form differs from the staged"
    assert seen == {"o split", "down split", "prefetch"}, f"seen: {seen}"
    # The custom op runs the kernel where it applies (here: the interpreter's CPU tensors).
    attn, h, w = _operands(3, 32, 512, 320, torch.bfloat16, device)
    assert draft_mlp_block_applies(attn, h, w)
    for got, want in zip(_op(attn, h, w), draft_mlp_block_kernel(attn, h, w, EPS), strict=True):
        assert torch.equal(got, want)
    for counters in counters_of("draft_mlp_block"):
        assert not counters.any(), counters.tolist()


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU only (the CUDA tests cover it)")
def test_block_matches_reference_under_interpreter(check_under_interpreter) -> None:  # type: ignore[no-untyped-def]
    check_under_interpreter("test_draft_mlp_block", "_check_block_against_reference")


def test_a_wrong_block_fails_the_closeness_check() -> None:
    """The allowance is tight enough to see a dropped split of the output projection."""
    attn, h, w = _operands(3, 32, 512, 320, torch.bfloat16, "cpu")
    want = draft_mlp_block_reference(attn, h, w, EPS)
    half = attn.clone()
    half[:, 256:] = 0  # the second of two K splits lost
    with pytest.raises(AssertionError, match="beyond"):
        _assert_close(draft_mlp_block_reference(half, h, w, EPS), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 100])
def test_op_runs_the_unfused_ops_where_the_kernel_does_not_apply(
    rows: int, dtype: torch.dtype
) -> None:
    """On CPU without the interpreter (and past the kernel's rows): the layer's own ops, close
    to the reference."""
    attn, h, w = _operands(rows, 48, 96, 80, dtype, "cpu", seed=rows)
    assert not draft_mlp_block_applies(attn, h, w)
    got = _op(attn, h, w)
    for g, u in zip(got, draft_mlp_block_unfused(attn, h, w, EPS), strict=True):
        assert torch.equal(g, u)
    _assert_close(got, draft_mlp_block_reference(attn, h, w, EPS))


def test_the_block_is_opt_in_and_cuda_only(set_env) -> None:  # type: ignore[no-untyped-def]
    tanh = "gelu_pytorch_tanh"
    set_env(DRAFT_BLOCK_ENV, None)
    assert not uses_draft_block("cuda", 1, tanh, False)
    set_env(DRAFT_BLOCK_ENV, "1")
    assert not uses_draft_block("cpu", 1, tanh, False)
    assert not uses_draft_block(None, 1, tanh, False)
    if torch.cuda.is_available() and HAS_TRITON:
        assert uses_draft_block("cuda", 1, tanh, False)
        assert not uses_draft_block("cuda", 2, tanh, False)  # the projections are sharded
        assert not uses_draft_block("cuda", 1, "gelu", False)
        assert not uses_draft_block("cuda", 1, tanh, True)


def _hopper_compiler():  # type: ignore[no-untyped-def]
    """Triton's compiler and an sm_90 target, or None where its CUDA backend is missing."""
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError:
        return None
    return triton.compile, ASTSource, GPUTarget("cuda", 90, 32)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU only (on a GPU the kernel runs)")
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("form", ["persistent", "prefetch", "staged"])
def test_kernel_compiles_for_hopper_without_a_gpu(form: str, dtype: str) -> None:
    """The interpreter runs Python, not the compiler: this compiles the kernel to an H100's
    code (ptxas included) with the assistant's sizes, so that a construct the compiler rejects
    shows before a GPU session does."""
    found = _hopper_compiler()
    if found is None:
        pytest.skip("triton has no CUDA backend here")
    compile_, source, target = found
    from gemma4_spec.ops.draft_mlp_block_triton import BLOCK_K, BLOCK_N, _mlp_block_kernel

    kernel = _mlp_block_kernel
    constants = {
        "BLOCK_T": 16, "BLOCK_N": BLOCK_N, "BLOCK_K": BLOCK_K, "BLOCK_H": 256,
        "PRECISION": "ieee" if dtype == "fp32" else "tf32", "UPCAST": False,
        "FIRST": 0, "LAST": 4, "BARRIERS": True, "PREFETCH": form == "prefetch", "D_RUN": 256,
    }  # fmt: skip
    stages = [(s, s) for s in range(5)] if form == "staged" else [(0, 4)]
    for first, last in stages:
        constants.update(FIRST=first, LAST=last, BARRIERS=first != last)
        signature = {}
        for name in kernel.arg_names:
            if name in constants:
                signature[name] = "constexpr"
            elif name == "part_ptr":
                signature[name] = "*fp32"
            elif name == "bar_ptr":
                signature[name] = "*i32"
            elif name.endswith("_ptr"):
                signature[name] = "*" + dtype
            else:
                signature[name] = "fp32" if name == "eps" else "i32"
        fixed = {(kernel.arg_names.index(k),): v for k, v in constants.items()}
        compiled = compile_(source(fn=kernel, signature=signature, constexprs=fixed), target=target)
        assert compiled.asm.get("cubin"), "no H100 code"


def test_prefetch_that_does_not_fit_is_an_error() -> None:
    from gemma4_spec.ops.draft_mlp_block_triton import draft_mlp_block_kernel

    attn, h, w = _operands(2, 512, 32, 32, torch.float32, "cpu")  # a 512-wide gate/up tile
    with pytest.raises(ValueError, match="prefetch"):
        draft_mlp_block_kernel(attn, h, w, EPS, prefetch=True)


def test_too_many_rows_is_an_error() -> None:
    from gemma4_spec.ops.draft_mlp_block_triton import MAX_ROWS, draft_mlp_block_kernel

    attn, h, w = _operands(MAX_ROWS + 1, 16, 32, 32, torch.float32, "cpu")
    with pytest.raises(ValueError, match="rows"):
        draft_mlp_block_kernel(attn, h, w, EPS)


def test_strided_operands_are_an_error() -> None:
    from gemma4_spec.ops.draft_mlp_block_triton import draft_mlp_block_kernel

    attn, h, w = _operands(2, 16, 32, 32, torch.float32, "cpu")
    with pytest.raises(ValueError, match="contiguous"):
        draft_mlp_block_kernel(attn.t().contiguous().t(), h, w, EPS)
    with pytest.raises(ValueError, match="contiguous"):
        draft_mlp_block_kernel(attn, h, w._replace(down=w.down.t().contiguous().t()), EPS)


@needs_cuda
def test_block_matches_reference_cuda_small() -> None:
    _check_block_against_reference("cuda")


# Each case compiles the kernel up to twelve times (persistent and five staged launches, with and
# without prefetch), float32 at 64 rows the slowest (benchmarks/results/h100, fortieth session).
# The staged comparison runs in bfloat16 only, so the file stays within the device step's limit.
@needs_cuda
@pytest.mark.parametrize(
    ("rows", "dtype"),
    [(1, torch.bfloat16), (3, torch.bfloat16), (16, torch.bfloat16), (64, torch.bfloat16),
     (3, torch.float32), (64, torch.float32)],
)  # fmt: skip
def test_assistant_shapes_cuda(rows: int, dtype: torch.dtype) -> None:
    from gemma4_spec.ops.device_counters import counters_of
    from gemma4_spec.ops.draft_mlp_block_triton import draft_mlp_block_kernel

    for hidden, depth, width in ASSISTANT_SHAPES:
        attn, h, w = _operands(rows, hidden, depth, width, dtype, "cuda", seed=rows)
        want = draft_mlp_block_reference(attn, h, w, EPS)
        for prefetch in (False, True):  # both fit the assistant's shapes on a GPU
            persistent = draft_mlp_block_kernel(attn, h, w, EPS, prefetch=prefetch)
            _assert_close(persistent, want)
            if dtype == torch.float32:
                continue
            staged = draft_mlp_block_kernel(attn, h, w, EPS, staged=True, prefetch=prefetch)
            for got, same in zip(persistent, staged, strict=True):
                assert torch.equal(got, same), "the persistent form differs from the staged"
    for counters in counters_of("draft_mlp_block"):
        assert not counters.any(), counters.tolist()


@needs_cuda
def test_counters_are_one_set_however_the_device_is_named_cuda() -> None:
    """The model makes the counters from vLLM's device config ("cuda"), the kernel asks for
    them by its tensors' device ("cuda:0"): the same counters."""
    from gemma4_spec.ops.draft_mlp_block_triton import prepare_draft_mlp_block

    indexed = torch.device("cuda", torch.cuda.current_device())
    assert prepare_draft_mlp_block("cuda") is prepare_draft_mlp_block(indexed)


@needs_cuda
def test_graph_replay_cuda() -> None:
    """Captured once, replayed over new inputs: the replay's outputs are the eager call's."""
    from gemma4_spec.ops.draft_mlp_block_triton import draft_mlp_block_kernel

    attn, h, w = _operands(8, 256, 2048, 2048, torch.bfloat16, "cuda")
    draft_mlp_block_kernel(attn, h, w, EPS)  # outside capture: the counters exist
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = draft_mlp_block_kernel(attn, h, w, EPS)
    for seed in range(3):
        fresh_attn, fresh_h, _ = _operands(8, 256, 2048, 2048, torch.bfloat16, "cuda", seed + 10)
        attn.copy_(fresh_attn)
        h.copy_(fresh_h)
        graph.replay()
        for got, want in zip(out, draft_mlp_block_kernel(attn, h, w, EPS), strict=True):
            assert torch.equal(got, want)
