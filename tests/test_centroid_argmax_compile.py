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
    "h_ptr": "*bf16", "cw_ptr": "*bf16", "w_ptr": "*bf16", "draft_ids_ptr": "*i32",
    "rows_ptr": "*i32", "scores_ptr": "*fp32", "sel_ptr": "*i32", "part_val_ptr": "*fp32",
    "part_idx_ptr": "*i32", "bar1_ptr": "*i32", "bar2_ptr": "*i32", "done_ptr": "*i32",
    "out_ptr": "*i64", "count_ptr": "*i32", "pick_ptr": "*i32", "cand_idx_ptr": "*i32",
    "cand_key_ptr": "*i32", "counter_ptr": "*i32", "picked_ptr": "*i32",
}  # fmt: skip


def _compile(kernel, constexprs: dict, num_warps: int = 4):  # type: ignore[no-untyped-def]
    names = inspect.signature(kernel.fn).parameters
    sig = {n: "constexpr" if n in constexprs else POINTERS.get(n, "i32") for n in names}
    try:
        return triton.compile(
            ASTSource(fn=kernel, signature=sig, constexprs=constexprs),
            target=GPUTarget("cuda", 90, 32),
            options={"num_warps": num_warps},
        )
    except RuntimeError as exc:  # no ptxas / backend on this install
        if "ptxas" in str(exc).lower():
            pytest.skip(str(exc))
        raise


REAL_V = 262144


@pytest.mark.parametrize("progs", [128, 64, 32, 16, 8])
def test_persistent_kernel_compiles_with_barriers(progs: int) -> None:
    """At every P the launcher may pick for the real dims; the metadata the occupancy sizing
    reads (shared memory, warps) is there."""
    meta = m.persistent_meta(progs, 2048, 256, 32, REAL_V)
    num_warps = meta.pop("num_warps")
    compiled = _compile(m._persistent_kernel, dict(meta, PHASE=0), num_warps)
    ptx = compiled.asm["ptx"]
    assert ptx.count("release") >= 2 and ptx.count("acquire") >= 2
    assert compiled.metadata.num_warps == num_warps
    assert isinstance(compiled.metadata.shared, int)
    assert m.programs_per_sm(0, compiled.metadata.shared, num_warps) >= 1


def test_centroid_path_kernels_compile() -> None:
    _compile(
        m._scores_dot_kernel,
        dict(BLOCK_T=64, BLOCK_C=m.SCORES_DOT_BLOCK_C, BLOCK_D=64, PRECISION="tf32",
             UPCAST=False),
    )  # fmt: skip
    groups = min(2048, m.SELECT_GROUPS_PER_K * 32)  # as select_centroids_ranked sizes it
    _compile(
        m._select_rank_kernel, dict(BLOCK_ALL_C=2048, GROUPS=groups, BLOCK_I=m.SELECT_BLOCK_I), 8
    )
    _compile(
        m._centroid_argmax_kernel,
        dict(SPLIT=m.CENTROID_SPLIT, ROWS=128 // m.CENTROID_SPLIT, BLOCK_T=m.CENTROID_BLOCK_T,
             BLOCK_R=min(m.CENTROID_BLOCK_R, 128 // m.CENTROID_SPLIT),
             BLOCK_D=m.CENTROID_BLOCK_D, BLOCK_P=triton.next_power_of_2(32 * m.CENTROID_SPLIT),
             V=REAL_V, PRECISION="tf32", UPCAST=False),
    )  # fmt: skip
