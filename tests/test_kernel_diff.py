"""``benchmarks/kernel_diff.py`` and ``profile_decode.py --kernels-json``'s kernel times: the
families kernels are counted in and the differences printed, on saved files, on any machine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import kernel_diff  # noqa: E402


@pytest.mark.parametrize(
    ("name", "family"),
    [
        ("nvjet_sm90_tst_64x8_64x16_4x1_v_bz_splitK_TNT", "matmul (cuBLAS)"),
        ("void cublasLt::splitKreduce_kernel<32, 16, int, float>", "matmul (cuBLAS)"),
        ("_small_linear_kernel", "matmul (ours)"),
        ("kernel_unified_attention", "attention"),
        ("reduce_segments", "attention"),
        ("_centroid_argmax_kernel", "draft argmax (ours)"),
        ("_select_rank_kernel", "draft argmax (ours)"),
        ("_verify_rows_kernel", "verification and staging (ours)"),
        ("_stage_kernel", "verification and staging (ours)"),
        # Inductor names its kernels after what they fuse, ours included: the prefix decides.
        ("triton_per_fused_add_rms_norm_small_linear_0", "Inductor fused"),
        ("Memcpy DtoH (Device -> Pinned)", "copies and fills"),
        ("void at::native::reduce_kernel<512, 1, ArgMaxOps>", "reductions and sampling"),
        ("_gumbel_sample_kernel", "reductions and sampling"),
        ("something_else", "other"),
    ],
)
def test_families(name: str, family: str) -> None:
    assert kernel_diff.family(name) == family


def _write(path: Path, kernels: dict[str, list[float]]) -> str:
    path.write_text(json.dumps({"variant": path.stem, "k": 2, "batch": 8, "kernels": kernels}))
    return str(path)


def test_differences_by_family_and_by_kernel(tmp_path: Path) -> None:
    base = _write(
        tmp_path / "plain.json",
        {"nvjet_a": [10.0, 100.0], "kernel_unified_attention": [35.0, 200.0]},
    )
    other = _write(
        tmp_path / "ours.json",
        {
            "nvjet_a": [10.0, 90.0],
            "kernel_unified_attention": [43.0, 280.0],
            "_small_linear_kernel": [36.0, 120.0],
        },
    )
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "kernel_diff.py"), base, other],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    lines = out.splitlines()
    rows = {line[:34].strip(): line for line in lines if line[:34].strip()}
    # The largest increase first; the totals last.
    families = [line[:34].strip() for line in lines[2:6]]
    assert families == ["matmul (ours)", "attention", "matmul (cuBLAS)", "all"]
    assert rows["matmul (ours)"].split()[-1] == "+120.0"
    assert rows["attention"].split()[-1] == "+80.0"
    assert rows["matmul (cuBLAS)"].split()[-1] == "-10.0"
    assert rows["all"].split()[-1] == "+190.0"
    ranked = lines[lines.index(next(x for x in lines if x.startswith("kernels that"))) + 1 :]
    assert ranked[0].split()[0] == "+120.0" and ranked[0].endswith("_small_linear_kernel")
    assert ranked[-1].split()[0] == "-10.0" and ranked[-1].endswith("nvjet_a")


def test_kernel_times_count_device_events_only() -> None:
    import profile_decode

    def event(name: str, device: str, start: float, end: float) -> SimpleNamespace:
        return SimpleNamespace(
            name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end)
        )

    events = [
        event("nvjet_a", "DeviceType.CUDA", 0.0, 5.0),
        event("nvjet_a", "DeviceType.CUDA", 10.0, 12.5),
        event("_stage_kernel", "DeviceType.CUDA", 20.0, 21.0),
        # A CPU range, and its GPU annotation of the same name: not a kernel.
        event("gpu_model_runner: forward", "DeviceType.CPU", 0.0, 30.0),
        event("gpu_model_runner: forward", "DeviceType.CUDA", 0.0, 30.0),
    ]
    assert profile_decode._kernel_times(events) == {
        "nvjet_a": (2, 7.5),
        "_stage_kernel": (1, 1.0),
    }

    # With the profiler's flag for annotations: an Inductor kernel launched inside a CPU scope
    # of its own name (as Inductor's generated code does under the profiler) is still a kernel.
    def flagged(name: str, device: str, start: float, end: float, note: bool = False) -> Any:
        return SimpleNamespace(**vars(event(name, device, start, end)), is_user_annotation=note)

    fused = "triton_red_fused_add_rms_norm_0"
    events = [
        flagged("nvjet_a", "DeviceType.CUDA", 0.0, 5.0),
        flagged(fused, "DeviceType.CPU", 5.0, 6.0),
        flagged(fused, "DeviceType.CUDA", 6.0, 8.0),
        flagged("gemma4_spec: V2 draft loop", "DeviceType.CPU", 0.0, 30.0, note=True),
        flagged("gemma4_spec: V2 draft loop", "DeviceType.CUDA", 0.0, 30.0, note=True),
    ]
    assert profile_decode._kernel_times(events) == {"nvjet_a": (1, 5.0), fused: (1, 2.0)}
