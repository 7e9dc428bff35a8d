"""``x @ weight^T`` for the few rows of a draft step, and the linear method that uses it.

A Gemma 4 assistant step multiplies a handful of rows (one per drafted request) by small
matrices: 4 layers of hidden 256, each with its query, output, gate/up and down projections,
plus the pre- and post-projections to the target's width. Their weights are 0.1-1.5 MiB each,
so the matmuls cost their kernels' latency, not their bytes; cuBLAS's kernels for these shapes
(several of them split over K, with a second kernel to sum the splits) are its fixed cost
several times over. ``ops/small_linear_triton.py`` computes the same product in one launch.

``small_linear_reference`` defines it: float32 sums of the given values, rounded once to the
input's dtype (what cuBLAS computes, up to the order of the sums). ``small_linear`` runs the
kernel where it applies (``small_linear_applies``: CUDA or Triton's CPU interpreter, at most
``SMALL_LINEAR_MAX_ROWS`` rows) and ``torch.nn.functional.linear`` elsewhere, as the custom op
``gemma4_spec::small_linear``, opaque to torch.compile: the row count is a dynamic dimension
of the draft's compiled graph, and the choice between the two is made at run time (at capture,
for a CUDA graph), so the compiled graph does not specialise on it.

``small_linear_gelu_and_mul`` (the custom op ``gemma4_spec::small_linear_gelu_and_mul``) is
the draft MLP's gate/up matmul and its activation in one launch: ``gelu_tanh(gate) * up`` from
the stacked ``[gate; up]`` weight, defined by ``small_linear_gelu_and_mul_reference``; where the
kernel does not apply, ``F.linear`` and vLLM's fused activation kernel (or torch's formula
without it).

``SmallRowsLinearMethod`` is vLLM's unquantized linear method with its matmul through that op;
``use_small_rows_linear`` gives it to a model's unquantized linear layers (their parallel
layout and all-reduces are unchanged: only the local matmul changes). The draft's tokens may
change where two draft logits are within rounding of each other; the target verifies every
draft, so the output does not.

``target_linear`` (the custom op ``gemma4_spec::target_linear``) is the same kernel for the
target's matmuls at up to ``TARGET_MAX_ROWS`` rows, with tiles for its wide weights
(``target_config``); ``use_target_rows_linear`` gives it to the target's unquantized layers
when ``GEMMA4_SPEC_TARGET_LINEAR=1`` (opt-in). In one CUDA graph of an E2B forward's 212
matmuls on the H100 it took 2166-2235 us at 1-16 rows against cuBLAS's 2302-2351, tied at
24-32 and lost past (benchmarks/small_linear.py --target --forward). The target's sums decide
the output: a value may differ from cuBLAS's by the order of the float32 sums, as cuBLAS's own
kernels for different row counts do; greedy float32 output stays plain decoding's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from gemma4_spec.log import get_logger
from gemma4_spec.ops.centroid_argmax_triton import triton_usable
from gemma4_spec.ops.custom_ops import custom_op
from gemma4_spec.switches import turned_off, turned_on

logger = get_logger(__name__)

SMALL_LINEAR_ENV = "GEMMA4_SPEC_SMALL_LINEAR"
# "0" turns off the draft MLP's gate/up matmul and activation in one launch
# (small_linear_gelu_and_mul), the default on CUDA.
FUSED_GELU_ENV = "GEMMA4_SPEC_FUSED_GELU"
# The activation the fused kernel computes (Gemma 4's, vLLM's GeluAndMul(approximate="tanh")).
FUSED_ACTIVATION = "gelu_pytorch_tanh"
# Up to this many rows the kernel runs: on the H200 it was faster than cuBLAS for a whole
# draft step's matmuls up to 32 rows and slower at 64 (benchmarks/small_linear.py, figures in
# benchmarks/results/h200).
SMALL_LINEAR_MAX_ROWS = 32
# Opt-in: the target's unquantized layers through the kernel up to TARGET_MAX_ROWS rows
# (verification batches of B (k + 1) <= 16 tokens; larger ones and prefill stay on cuBLAS).
TARGET_LINEAR_ENV = "GEMMA4_SPEC_TARGET_LINEAR"
TARGET_MAX_ROWS = 16
SMALL_LINEAR_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def small_linear_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x [..., K] @ weight [N, K]^T`` by definition: float32 products and sums, the result
    in ``x``'s dtype."""
    return (x.float() @ weight.float().t()).to(x.dtype)


def small_linear_applies(
    x: torch.Tensor, weight: torch.Tensor, max_rows: int = SMALL_LINEAR_MAX_ROWS
) -> bool:
    """Whether ``small_linear`` (``target_linear`` with ``TARGET_MAX_ROWS``) runs the kernel
    for these operands (else F.linear)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return (
        triton_usable(x.device)
        and 0 < rows <= max_rows
        and x.dtype in SMALL_LINEAR_DTYPES
        and weight.dtype == x.dtype
        and weight.dim() == 2
        and weight.shape[1] == x.shape[-1]
        and weight.stride(1) == 1
    )


def _linear_like(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """What ``small_linear`` and ``target_linear`` return, for torch.compile's tracing."""
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@custom_op("small_linear", fake=_linear_like)
def small_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x [..., K] @ weight [N, K]^T`` in ``x``'s dtype: the Triton kernel for a few rows,
    ``F.linear`` otherwise (module docstring)."""
    if not small_linear_applies(x, weight):
        return nn.functional.linear(x, weight)
    from gemma4_spec.ops.small_linear_triton import small_linear_kernel

    return _on_rows(small_linear_kernel, x, weight)


@custom_op("target_linear", fake=_linear_like)
def target_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x [..., K] @ weight [N, K]^T`` in ``x``'s dtype for the target's layers: the kernel
    with the target's tiles up to ``TARGET_MAX_ROWS`` rows, ``F.linear`` otherwise."""
    if not small_linear_applies(x, weight, TARGET_MAX_ROWS):
        return nn.functional.linear(x, weight)
    from gemma4_spec.ops.small_linear_triton import small_linear_kernel, target_config

    def kernel(rows: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        config = target_config(rows.shape[0], w.shape[0], w.shape[1], rows.device)
        return small_linear_kernel(rows, w, config)

    return _on_rows(kernel, x, weight)


def _on_rows(
    kernel: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    weight: torch.Tensor,
) -> torch.Tensor:
    """``kernel`` (on ``[T, K]`` rows, unit stride along K) applied to ``x [..., K]``, its
    output given ``x``'s leading dimensions back."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = kernel(rows, weight)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def small_linear_gelu_and_mul_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(x @ gate^T) * (x @ up^T)`` for ``weight = [gate; up]`` by definition: each
    product as ``small_linear_reference`` gives it, the activation and product in float32,
    rounded once to ``x``'s dtype (vLLM's ``GeluAndMul(approximate="tanh")`` on the matmul's
    output)."""
    return gelu_and_mul_formula(small_linear_reference(x, weight))


def gelu_and_mul_formula(gate_up: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(gate) * up`` of ``gate_up = [gate, up]`` (last dimension) in float32,
    rounded once to its dtype."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (nn.functional.gelu(gate, approximate="tanh") * up).to(gate_up.dtype)


def gelu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(gate) * up`` as a kernel of its own: vLLM's ``gelu_tanh_and_mul`` on CUDA
    where vLLM's kernels are installed, else torch's formula."""
    fused = getattr(getattr(torch.ops, "_C", None), "gelu_tanh_and_mul", None)
    if fused is None or not gate_up.is_cuda:
        return gelu_and_mul_formula(gate_up)
    out = gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))
    fused(out, gate_up)
    return out


def small_linear_gelu_and_mul_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``small_linear_gelu_and_mul`` runs the kernel for these operands."""
    if not small_linear_applies(x, weight) or weight.shape[0] % 2:
        return False
    from gemma4_spec.ops.small_linear_triton import gated_fits

    rows = x.numel() // x.shape[-1]
    return gated_fits(rows, weight.shape[0] // 2, x.shape[-1], x.device)


def _gelu_and_mul_like(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """What ``small_linear_gelu_and_mul`` returns, for torch.compile's tracing."""
    return x.new_empty((*x.shape[:-1], weight.shape[0] // 2))


@custom_op("small_linear_gelu_and_mul", fake=_gelu_and_mul_like)
def small_linear_gelu_and_mul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(x @ gate^T) * (x @ up^T)`` for ``weight = [gate; up]`` in ``x``'s dtype: one
    Triton launch for a few rows, else a matmul and an activation kernel (module docstring)."""
    if not small_linear_gelu_and_mul_applies(x, weight):
        return gelu_and_mul(nn.functional.linear(x, weight))
    from gemma4_spec.ops.small_linear_triton import small_linear_gelu_and_mul_kernel

    return _on_rows(small_linear_gelu_and_mul_kernel, x, weight)


def _unquantized_method() -> type:
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    return UnquantizedLinearMethod


def small_rows_linear_method() -> object:
    """A ``SmallRowsLinearMethod`` (the class is built on first use: vLLM is imported then)."""
    global _METHOD_CLASS
    if _METHOD_CLASS is None:
        base = _unquantized_method()

        class SmallRowsLinearMethod(base):  # type: ignore[misc, valid-type]
            """vLLM's unquantized linear method, its matmul through ``small_linear`` (the
            ``gemma4_spec`` op named by ``op``)."""

            op = "small_linear"

            def process_weights_after_loading(self, layer: nn.Module) -> None:
                super().process_weights_after_loading(layer)
                from gemma4_spec.ops.small_linear_triton import prepare_small_linear

                prepare_small_linear(layer.weight.device)  # counters, outside any capture

            def apply(
                self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
            ) -> torch.Tensor:
                out = getattr(torch.ops.gemma4_spec, self.op)(x, layer.weight)
                return out if bias is None else out + bias

        _METHOD_CLASS = SmallRowsLinearMethod
    return _METHOD_CLASS()


_METHOD_CLASS: type | None = None


def target_rows_linear_method() -> object:
    """A ``TargetRowsLinearMethod``: the small-rows method through ``target_linear``."""
    global _TARGET_METHOD_CLASS
    if _TARGET_METHOD_CLASS is None:
        small_rows_linear_method()  # builds the base class

        class TargetRowsLinearMethod(_METHOD_CLASS):  # type: ignore[misc, valid-type]
            """vLLM's unquantized linear method, its matmul through ``target_linear``."""

            op = "target_linear"

        _TARGET_METHOD_CLASS = TargetRowsLinearMethod
    return _TARGET_METHOD_CLASS()


_TARGET_METHOD_CLASS: type | None = None


def fuses_gelu(layer: nn.Module, activation: str) -> bool:
    """Whether a merged gate/up ``layer`` followed by ``activation`` runs as
    ``small_linear_gelu_and_mul``: the layer has the small-rows method (unquantized, on
    CUDA), the activation is the kernel's, and ``GEMMA4_SPEC_FUSED_GELU`` is not "0"."""
    return (
        not turned_off(FUSED_GELU_ENV)
        and activation == FUSED_ACTIVATION
        and _METHOD_CLASS is not None
        and isinstance(getattr(layer, "quant_method", None), _METHOD_CLASS)
        and getattr(layer, "bias", None) is None
    )


def use_small_rows_linear(model: nn.Module, device: torch.device | str | None) -> int:
    """Gives every unquantized linear layer of ``model`` the small-rows method, on CUDA and
    unless ``GEMMA4_SPEC_SMALL_LINEAR=0``; returns how many layers got it."""
    return len(_swap_unquantized(model, device, small_rows_linear_method))


def target_rows_wanted() -> bool:
    """Whether the target's matmuls are asked onto our kernel: ``GEMMA4_SPEC_TARGET_LINEAR=1``
    and the kernel not turned off (``GEMMA4_SPEC_SMALL_LINEAR=0``)."""
    return turned_on(TARGET_LINEAR_ENV) and not turned_off(SMALL_LINEAR_ENV)


def use_target_rows_linear(target: nn.Module, device: torch.device | str | None) -> int:
    """With ``GEMMA4_SPEC_TARGET_LINEAR=1``, every unquantized linear layer of the target
    through ``target_linear`` (module docstring), on CUDA and unless
    ``GEMMA4_SPEC_SMALL_LINEAR=0``; returns how many layers got it (0 when off). The compiled
    graphs past ``TARGET_MAX_ROWS`` tokens keep ``mm`` (``ops/target_linear_ranges.py``)."""
    if not target_rows_wanted():
        return 0
    swapped = _swap_unquantized(target, device, target_rows_linear_method)
    if swapped:
        # The target's weights loaded before the swap, so the method's own hook never ran:
        # the split launches' counters now, on the weights' devices, outside any capture.
        from gemma4_spec.ops.small_linear_triton import prepare_small_linear

        for weight_device in {layer.weight.device for layer in swapped}:
            prepare_small_linear(weight_device)
        logger.info(
            "gemma4_spec: %d target linear layers on the small-rows kernel up to %d rows (%s=1).",
            len(swapped), TARGET_MAX_ROWS, TARGET_LINEAR_ENV,
        )  # fmt: skip
    return len(swapped)


def target_rows_layers(model: nn.Module | None) -> int:
    """How many layers of ``model`` run through ``target_linear``."""
    if model is None or _TARGET_METHOD_CLASS is None:
        return 0
    return sum(
        isinstance(getattr(m, "quant_method", None), _TARGET_METHOD_CLASS) for m in model.modules()
    )


def _swap_unquantized(
    model: nn.Module, device: torch.device | str | None, method: Callable[[], object]
) -> list[nn.Module]:
    """``method()`` for every layer of ``model`` whose method is exactly vLLM's unquantized one,
    on CUDA with triton and unless ``GEMMA4_SPEC_SMALL_LINEAR=0``; the layers it swapped."""
    if device is None or turned_off(SMALL_LINEAR_ENV):
        return []
    device = torch.device(device)
    if device.type != "cuda" or not triton_usable(device):
        return []
    base = _unquantized_method()
    swapped = [m for m in model.modules() if type(getattr(m, "quant_method", None)) is base]
    for module in swapped:
        module.quant_method = method()
    return swapped
