"""The centroid argmax kernels compile for Hopper (sm_90) without a GPU.

Triton's CPU interpreter runs the kernels' logic but not the compiler, which is stricter (loop
carried types, layouts, the barrier's atomics); this compiles each kernel at the real E2B / E4B
block sizes to PTX, and checks the persistent kernel's grid barrier became a releasing arrive
and an acquiring spin.
"""

from __future__ import annotations

import inspect

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from gemma4_spec.ops import centroid_argmax_triton as m  # noqa: E402

# pointer arguments' element types (bfloat16 model); everything else not listed is int32
POINTERS = {
    "h_ptr": "*bf16", "cw_ptr": "*bf16", "w_ptr": "*bf16", "ordering_ptr": "*i32",
    "sup_ptr": "*i8", "scores_ptr": "*fp32", "sel_ptr": "*i32", "part_val_ptr": "*fp32",
    "part_idx_ptr": "*i32", "bar1_ptr": "*i32", "bar2_ptr": "*i32", "done_ptr": "*i32",
    "out_ptr": "*i64", "count_ptr": "*i32", "pick_ptr": "*i32", "cand_idx_ptr": "*i32",
    "cand_key_ptr": "*i32", "counter_ptr": "*i32",
}  # fmt: skip


def _compile(kernel, constexprs: dict, num_warps: int = 4) -> str:  # type: ignore[no-untyped-def]
    names = inspect.signature(kernel.fn).parameters
    sig = {n: "constexpr" if n in constexprs else POINTERS.get(n, "i32") for n in names}
    try:
        compiled = triton.compile(
            ASTSource(fn=kernel, signature=sig, constexprs=constexprs),
            target=GPUTarget("cuda", 90, 32),
            options={"num_warps": num_warps},
        )
    except RuntimeError as exc:  # no ptxas / backend on this install
        if "ptxas" in str(exc).lower():
            pytest.skip(str(exc))
        raise
    return compiled.asm["ptx"]


REAL_V = 262144


@pytest.mark.parametrize("progs", [128, 32])
def test_persistent_kernel_compiles_with_barriers(progs: int) -> None:
    block_c = 2048 // progs
    rows = 32 * 128 // progs
    block_r = min(m.PERSISTENT_BLOCK_R, rows)
    ptx = _compile(
        m._persistent_kernel,
        dict(P=progs, BLOCK_C=block_c, ROWS=rows, BLOCK_R=block_r,
             BLOCK_D=256, RANK_CHUNK=max(16, min(2048, 8192 // block_c)), BLOCK_P=progs,
             V=REAL_V, PHASE=0),
        8 if block_r * 256 >= 16384 else 4,
    )  # fmt: skip
    assert ptx.count("release") >= 2 and ptx.count("acquire") >= 2


def test_centroid_path_kernels_compile() -> None:
    _compile(
        m._scores_dot_kernel,
        dict(BLOCK_T=64, BLOCK_C=m.SCORES_DOT_BLOCK_C, BLOCK_D=64, PRECISION="tf32",
             UPCAST=False),
    )  # fmt: skip
    _compile(m._select_rank_kernel, dict(BLOCK_ALL_C=2048, GROUPS=32, BLOCK_I=m.SELECT_BLOCK_I), 8)
    _compile(
        m._select_rank_wide_kernel,
        dict(BLOCK_ALL_C=2048, GROUPS=32, BLOCK_OWN=m.SELECT_WIDE_BLOCK,
             CHUNK=8192 // m.SELECT_WIDE_BLOCK),
    )  # fmt: skip
    _compile(
        m._centroid_argmax_kernel,
        dict(SPLIT=m.CENTROID_SPLIT, ROWS=128 // m.CENTROID_SPLIT, BLOCK_T=m.CENTROID_BLOCK_T,
             BLOCK_R=min(m.CENTROID_BLOCK_R, 128 // m.CENTROID_SPLIT),
             BLOCK_D=m.CENTROID_BLOCK_D, BLOCK_P=triton.next_power_of_2(32 * m.CENTROID_SPLIT),
             V=REAL_V, PRECISION="tf32", UPCAST=False),
    )  # fmt: skip
