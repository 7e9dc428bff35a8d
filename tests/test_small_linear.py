"""The draft step's small matmul (``ops/small_linear*.py``) against its torch reference, its
fallback, its custom op under torch.compile, and the linear method that routes a model's
layers through it.

On CPU the kernel runs at small sizes under Triton's interpreter, in a subprocess
(``TRITON_INTERPRET=1`` must be set before triton is imported). On CUDA: the same checks at the
assistant's shapes, and CUDA-graph capture and replay.

What "equal" means (``_assert_close``): the reference sums in float32 in torch's order, the
kernel in the MMA's, each rounding once to the output dtype: in bfloat16 the two may differ by
one rounding step, in float32 by the order of the sums.
"""

from __future__ import annotations

import pytest
import torch

from gemma4_spec.ops.centroid_argmax_triton import HAS_TRITON
from gemma4_spec.ops.small_linear import (
    FUSED_ACTIVATION,
    FUSED_GELU_ENV,
    SMALL_LINEAR_MAX_ROWS,
    TARGET_LINEAR_ENV,
    TARGET_MAX_ROWS,
    fuses_gelu,
    small_linear,
    small_linear_applies,
    small_linear_gelu_and_mul,
    small_linear_gelu_and_mul_applies,
    small_linear_gelu_and_mul_reference,
    small_linear_reference,
    target_linear,
    target_rows_layers,
    use_small_rows_linear,
    use_target_rows_linear,
)
from gemma4_spec.testing.closeness import (
    largest_value_excess,
    one_rounding_excess,
    reordered_sum_excess,
)

needs_cuda = pytest.mark.cuda_triton  # conftest.py skips these without both
# (rows, N, K): one tile and many; K neither a multiple of the step nor of 16; few columns and a
# long K (the split launch, also under the interpreter's 4 "SMs"); the most rows it runs for.
SMALL_SHAPES = ((1, 16, 600), (3, 96, 40), (17, 20, 1000), (5, 48, 256), (32, 32, 300))
# The E2B assistant's (N, K): pre-projection, q / o (sliding, full), gate_up, down, post.
ASSISTANT_SHAPES = (
    (256, 3072), (2048, 256), (256, 2048), (4096, 256), (256, 4096), (1536, 256),
)  # fmt: skip


def _assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    worst = one_rounding_excess(out, ref)
    assert worst <= 0, f"off by {worst} beyond one rounding"


def _operands(
    rows: int, n: int, k: int, dtype: torch.dtype, device: str, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen).to(device, dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(device, dtype)
    return x, w


def _check_kernel_against_reference(device: str) -> None:
    from gemma4_spec.ops.device_counters import counters_of
    from gemma4_spec.ops.small_linear_triton import (
        SmallLinearConfig,
        small_linear_config,
        small_linear_kernel,
    )

    split_seen = False
    for dtype in (torch.float32, torch.bfloat16):
        for rows, n, k in SMALL_SHAPES:
            x, w = _operands(rows, n, k, dtype, device)
            assert small_linear_applies(x, w)
            split_seen |= small_linear_config(rows, n, k, x.device).splits > 1
            out = small_linear(x, w)
            _assert_close(out, small_linear_reference(x, w))
            assert torch.equal(out, small_linear(x, w)), "a second launch differs"
        # The kernel's largest tile of rows (64), launched directly.
        x, w = _operands(64, 24, 300, dtype, device)
        _assert_close(small_linear_kernel(x, w), small_linear_reference(x, w))
        # Leading dimensions and a strided (row-sliced) input.
        x, w = _operands(6, 40, 72, dtype, device)
        want = small_linear_reference(x, w).view(2, 3, 40)
        _assert_close(small_linear(x.view(2, 3, 72), w), want)
        wide = torch.randn(5, 100, device=device).to(dtype)
        _assert_close(small_linear(wide[:, :72], w), small_linear_reference(wide[:, :72], w))
        # The target's op (64-column tiles; split over K under the interpreter's 4 "SMs" too).
        for rows, n, k in ((1, 96, 1000), (5, 130, 300), (TARGET_MAX_ROWS, 64, 40)):
            x, w = _operands(rows, n, k, dtype, device)
            assert small_linear_applies(x, w, TARGET_MAX_ROWS)
            _assert_close(target_linear(x, w), small_linear_reference(x, w))
        # Many splits of one step each, launched back to back over the same counters.
        forced = SmallLinearConfig(16, 16, 16, 7, 1, num_warps=4, num_stages=2)
        for seed in range(3):
            x, w = _operands(3, 40, 100, dtype, device, seed)
            _assert_close(small_linear_kernel(x, w, forced), small_linear_reference(x, w))
    assert split_seen, "no shape took the split launch"
    # Every tile counter is back at zero after each split launch: the next starts clean.
    for counters in counters_of("small_linear"):
        assert not counters.any(), counters.nonzero().tolist()


# Gated (gate/up stacked) shapes: (rows, N of each half, K).
GATED_SHAPES = ((1, 16, 40), (3, 40, 72), (17, 24, 256), (32, 48, 100))


def _assert_gated_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Within a few roundings of the largest value (``largest_value_excess``)."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    worst = largest_value_excess(out, ref)
    assert worst <= 0, f"off by {worst} beyond two roundings of the largest value"


def _check_gated_against_reference(device: str) -> None:
    from gemma4_spec.ops.small_linear_triton import small_linear_gelu_and_mul_kernel

    for dtype in (torch.float32, torch.bfloat16):
        for rows, n, k in GATED_SHAPES:
            x, w = _operands(rows, 2 * n, k, dtype, device, seed=rows)
            assert small_linear_gelu_and_mul_applies(x, w)
            out = small_linear_gelu_and_mul(x, w)
            _assert_gated_close(out, small_linear_gelu_and_mul_reference(x, w))
            assert torch.equal(out, small_linear_gelu_and_mul(x, w)), "a second launch differs"
        # Large gates of both signs (the activation's tails) and leading dimensions.
        x, w = _operands(6, 32, 64, dtype, device, seed=7)
        x = (x * 8).view(2, 3, 64)
        want = small_linear_gelu_and_mul_reference(x, w)
        _assert_gated_close(small_linear_gelu_and_mul(x, w), want)
        # The kernel alone at its largest tile of rows.
        x, w = _operands(64, 48, 80, dtype, device)
        _assert_gated_close(
            small_linear_gelu_and_mul_kernel(x, w), small_linear_gelu_and_mul_reference(x, w)
        )


# The E2B target's (N, K) with the most weight: q/k/v of a sliding layer, the wide layers'
# gate/up (N past 4096) and down (few column tiles over a long K: split).
TARGET_SHAPES = ((2560, 1536), (24576, 1536), (1536, 12288))


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 3, 8, TARGET_MAX_ROWS])
def test_target_shapes_cuda(rows: int, dtype: torch.dtype) -> None:
    """``target_linear`` at the target's shapes and verification row counts, within
    ``reordered_sum_excess`` of the reference; the rule catches a block of K left out."""
    for n, k in TARGET_SHAPES:
        x, w = _operands(rows, n, k, dtype, "cuda")
        out, ref = target_linear(x, w), small_linear_reference(x, w)
        assert reordered_sum_excess(out, ref, x, w) <= 0
        short = x.clone()
        short[:, -128:] = 0  # the product without its last 128 of K
        assert reordered_sum_excess(small_linear_reference(short, w), ref, x, w) > 0


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 3, 8, 16, 24, 32])
def test_gated_assistant_shape_cuda(rows: int, dtype: torch.dtype) -> None:
    x, w = _operands(rows, 4096, 256, dtype, "cuda", seed=rows)  # E2B's gate_up_proj
    assert small_linear_gelu_and_mul_applies(x, w)
    out = small_linear_gelu_and_mul(x, w)
    _assert_gated_close(out, small_linear_gelu_and_mul_reference(x, w))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = small_linear_gelu_and_mul(x, w)
    graph.replay()
    assert torch.equal(replayed, out)


def test_gated_falls_back_past_the_row_limit() -> None:
    """Past the row limit (or where the kernel cannot run) it is a matmul and the activation:
    the reference's value."""
    x, w = _operands(SMALL_LINEAR_MAX_ROWS + 1, 48, 40, torch.float32, "cpu")
    assert not small_linear_gelu_and_mul_applies(x, w)
    _assert_gated_close(small_linear_gelu_and_mul(x, w), small_linear_gelu_and_mul_reference(x, w))
    odd = torch.randn(47, 40)
    assert not small_linear_gelu_and_mul_applies(x[:3], odd), "no even split into gate and up"


def test_fused_gelu_is_on_unless_turned_off_and_needs_the_small_rows_method(set_env) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    from gemma4_spec.ops.small_linear import small_rows_linear_method

    layer = torch.nn.Module()
    layer.quant_method = small_rows_linear_method()
    layer.bias = None
    set_env(FUSED_GELU_ENV, None)
    assert fuses_gelu(layer, FUSED_ACTIVATION)  # on unless turned off
    set_env(FUSED_GELU_ENV, "0")
    assert not fuses_gelu(layer, FUSED_ACTIVATION)
    set_env(FUSED_GELU_ENV, "1")
    assert fuses_gelu(layer, FUSED_ACTIVATION)
    assert not fuses_gelu(layer, "gelu")  # another activation than the kernel's
    layer.quant_method = UnquantizedLinearMethod()  # cuBLAS's layer (CPU, or the switch off)
    assert not fuses_gelu(layer, FUSED_ACTIVATION)


# The plain product's checks and the gated (gate/up and activation) form's.
CHECKS = ("_check_kernel_against_reference", "_check_gated_against_reference")


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU only (the CUDA tests cover it)")
@pytest.mark.parametrize("check", CHECKS)
def test_kernel_matches_reference_under_interpreter(check_under_interpreter, check: str) -> None:  # type: ignore[no-untyped-def]
    check_under_interpreter("test_small_linear", check)


@needs_cuda
@pytest.mark.parametrize("check", CHECKS)
def test_kernel_matches_reference_cuda_small(check: str) -> None:
    globals()[check]("cuda")


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 16, 24, 33, 64])
def test_assistant_shapes_cuda(rows: int, dtype: torch.dtype) -> None:
    for n, k in ASSISTANT_SHAPES:
        x, w = _operands(rows, n, k, dtype, "cuda", seed=rows)
        _assert_close(small_linear(x, w), small_linear_reference(x, w))


@needs_cuda
def test_graph_replay_cuda() -> None:
    """Captured once, replayed over new inputs: the replay's output is the eager call's."""
    x, w = _operands(4, 256, 2048, torch.bfloat16, "cuda")  # a split launch
    small_linear(x, w)  # outside capture: the counters exist
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = small_linear(x, w)
    for seed in range(3):
        fresh, _ = _operands(4, 256, 2048, torch.bfloat16, "cuda", seed=seed + 10)
        x.copy_(fresh)
        graph.replay()
        assert torch.equal(out, small_linear(x, w))


def test_falls_back_to_linear() -> None:
    """Past the row limit, and on a device the kernel cannot run on, it is F.linear exactly."""
    x, w = _operands(SMALL_LINEAR_MAX_ROWS + 1, 24, 40, torch.float32, "cpu")
    assert not small_linear_applies(x, w)
    assert torch.equal(small_linear(x, w), torch.nn.functional.linear(x, w))
    if not torch.cuda.is_available():
        few, _ = _operands(3, 24, 40, torch.float32, "cpu")
        assert torch.equal(small_linear(few, w), torch.nn.functional.linear(few, w))
    assert not small_linear_applies(x[:3], w.to(torch.float64)), "dtypes differ"
    x, w = _operands(TARGET_MAX_ROWS + 1, 24, 40, torch.float32, "cpu")
    assert torch.equal(target_linear(x, w), torch.nn.functional.linear(x, w))


def test_custom_op_compiles_with_dynamic_rows() -> None:
    """The op's fake implementation lets torch.compile trace it with a dynamic row count, and
    one compiled graph serves every row count."""
    torch._dynamo.reset()
    w = torch.randn(24, 40)
    gate_up = torch.randn(48, 40)

    def project(x: torch.Tensor) -> torch.Tensor:
        hidden = torch.ops.gemma4_spec.small_linear_gelu_and_mul(x, gate_up)
        target = torch.ops.gemma4_spec.target_linear(x, w)
        return torch.relu(torch.ops.gemma4_spec.small_linear(x, w)) + hidden + target

    compiled = torch.compile(project, dynamic=True, backend="aot_eager", fullgraph=True)
    x = torch.randn(3, 40)
    assert torch.equal(compiled(x), project(x))
    with torch._dynamo.config.patch(error_on_recompile=True):  # a row count in the graph fails
        for rows in (5, 70):
            x = torch.randn(rows, 40)
            assert torch.equal(compiled(x), project(x))


class _Layer(torch.nn.Module):
    """A linear layer as vLLM holds one: its method and an [8, 12] weight."""

    def __init__(self, method: object) -> None:
        super().__init__()
        self.quant_method = method
        self.weight = torch.nn.Parameter(torch.randn(8, 12), requires_grad=False)


def test_linear_method_routes_unquantized_layers(set_env) -> None:  # type: ignore[no-untyped-def]
    """``use_small_rows_linear`` swaps vLLM's unquantized method only (CUDA models, switch on);
    the swapped method's ``apply`` is the matmul plus bias."""
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    class Other(UnquantizedLinearMethod):  # a subclass: someone else's method, left alone
        pass

    model = torch.nn.Sequential(_Layer(UnquantizedLinearMethod()), _Layer(Other()))
    assert use_small_rows_linear(model, "cpu") == 0
    assert use_small_rows_linear(model, None) == 0
    set_env("GEMMA4_SPEC_SMALL_LINEAR", "0")
    assert use_small_rows_linear(model, "cuda") == 0
    set_env("GEMMA4_SPEC_SMALL_LINEAR", None)
    assert use_small_rows_linear(model, "cuda") == 1
    assert type(model[1].quant_method) is Other
    layer = model[0]
    x, bias = torch.randn(3, 12), torch.randn(8)
    want = torch.nn.functional.linear(x, layer.weight, bias)
    torch.testing.assert_close(layer.quant_method.apply(layer, x, bias), want)


def test_target_rows_are_opt_in(set_env) -> None:  # type: ignore[no-untyped-def]
    """``use_target_rows_linear`` swaps the target's unquantized layers to ``target_linear``
    only with ``GEMMA4_SPEC_TARGET_LINEAR=1`` (and the kernel's own switch on)."""
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    target = torch.nn.Sequential(
        _Layer(UnquantizedLinearMethod()), _Layer(UnquantizedLinearMethod())
    )
    set_env(TARGET_LINEAR_ENV, None)
    assert use_target_rows_linear(target, "cuda") == 0
    assert target_rows_layers(target) == 0
    set_env("GEMMA4_SPEC_SMALL_LINEAR", "0")
    set_env(TARGET_LINEAR_ENV, "1")
    assert use_target_rows_linear(target, "cuda") == 0
    set_env("GEMMA4_SPEC_SMALL_LINEAR", None)
    assert use_target_rows_linear(target, "cuda") == 2
    assert target_rows_layers(target) == 2
    draft = torch.nn.Sequential(_Layer(UnquantizedLinearMethod()))
    assert use_small_rows_linear(draft, "cuda") == 1
    assert target_rows_layers(draft) == 0  # the draft's method is not the target's
    layer = target[0]
    x, bias = torch.randn(3, 12), torch.randn(8)
    want = torch.nn.functional.linear(x, layer.weight, bias)
    torch.testing.assert_close(layer.quant_method.apply(layer, x, bias), want)
