"""``benchmarks/real_work.py``: which engines a run starts, and its tables from a saved run
(``--table``), on any machine. The timing itself needs a GPU (benchmarks/results/h200)."""

from __future__ import annotations

import json
import lzma
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import real_work  # noqa: E402
from engine_turns import process_tree  # noqa: E402


def test_configurations_cover_every_profile_k_and_variant() -> None:
    configs = real_work.configurations([2, 3], ["field", "zero"], ["in-tree", "ours-V1"])
    assert list(configs)[0] == "plain" and configs["plain"]["k"] == 0
    assert len(configs) == 1 + 2 * 2 * 2
    field = configs["ours-V1 k=2 field"]
    # Synthetic acceptance: the profile's first k unconditional rates.
    assert field["spec"]["rejection_sample_method"] == "synthetic"
    assert field["spec"]["synthetic_acceptance_rates"] == [0.85, 0.70]
    assert field["env"] == {"VLLM_USE_V2_MODEL_RUNNER": "0"}
    assert configs["in-tree k=3 zero"]["spec"] == {}  # standard verification
    assert configs["in-tree k=3 zero"]["env"] == {"VLLM_PLUGINS": "none"}


def test_variants_with_settings_by_name() -> None:
    """``ours-V2+sizes=m128_w4+large=48``: ours-V2 with those plugin settings; a name with
    an unknown setting or base is refused, listing what there is."""
    configs = real_work.configurations([2], ["field"], ["ours-V2+sizes=m128_w4+large=48"])
    env = configs["ours-V2+sizes=m128_w4+large=48 k=2 field"]["env"]
    assert env == {
        "VLLM_USE_V2_MODEL_RUNNER": "1",
        "GEMMA4_SPEC_SPLIT_ATTENTION_SIZES": "m128_w4",
        "GEMMA4_SPEC_LARGE_VERIFY_TOKENS": "48",
    }
    # A torch setting by its short name too: Inductor's one reduction configuration.
    env = real_work.variant("ours-V2+target=1+rfilter=1")["env"]
    assert env["TORCHINDUCTOR_FORCE_FILTER_REDUCTION_CONFIGS"] == "1"
    assert env["GEMMA4_SPEC_TARGET_LINEAR"] == "1"
    for bad in ("ours-V2+colour=red", "ours-V1+sizes=m128", "ours-V2+sizes=", "ours-V2+"):
        with pytest.raises(SystemExit, match="unknown variant.*sizes"):
            real_work.variant(bad)


def test_probabilistic_drafts_only_on_speculative_engines() -> None:
    configs = real_work.configurations([3], ["real"], ["in-tree", "ours-V2"], "probabilistic")
    assert "draft_sample_method" not in configs["plain"].get("spec", {})
    for name in ("in-tree k=3 real", "ours-V2 k=3 real"):
        assert configs[name]["spec"] == {"draft_sample_method": "probabilistic"}


def test_probabilistic_drafts_keep_the_synthetic_profile() -> None:
    configs = real_work.configurations([2], ["field"], ["ours-V2"], "probabilistic")
    assert configs["ours-V2 k=2 field"]["spec"] == {
        "draft_sample_method": "probabilistic",
        "rejection_sample_method": "synthetic",
        "synthetic_acceptance_rates": [0.85, 0.70],
    }


def test_real_shape_pairs_run_like_the_e2b_pair() -> None:
    # Random weights: no tokenizer to load, and every request runs its full length.
    for pair in ("e2b", "e4b", "26b-a4b", "31b"):
        kwargs = real_work.engine_kwargs(pair, Path("t"), Path("a"), 2)
        assert kwargs["skip_tokenizer_init"] is True
        assert len(real_work._prompts(pair, Path("t"), 3)) == 3
    assert (
        real_work.engine_kwargs("trained", Path("t"), Path("a"), 0)["skip_tokenizer_init"] is False
    )
    # The checkpoints that would not fit the GPU machine's disk: the engine draws the weights.
    assert real_work.engine_kwargs("31b", Path("t"), Path("a"), 2)["load_format"] == "dummy"
    assert "load_format" not in real_work.engine_kwargs("e4b", Path("t"), Path("a"), 2)


def test_tables_without_plain(tmp_path: Path) -> None:
    # --only "in-tree,ours-V2": two 52-62 GB engines fit one GPU, a third does not.
    saved = {
        "pair": "31b",
        "new_tokens": 128,
        "results": {
            "in-tree k=2 field": {"startup_s": 40, "runs": {"1": _runs([190, 200, 220], 2.3)}},
            "ours-V2 k=2 field": {"startup_s": 50, "runs": {"1": _runs([115, 230, 250], 2.3)}},
        },
    }
    out = _tables(saved, tmp_path)
    ours = next(line for line in out.splitlines() if line.startswith("ours-V2 k=2 field"))
    assert ours.split()[4:7] == ["240", "-", "1.14x"]  # no plain; median 240 over in-tree's 210


def test_start_column_says_compiled_or_loaded(tmp_path: Path) -> None:
    # An engine's start compiles its graphs or loads them from the compile cache; the column
    # says which, where the run recorded it (runs saved before the counter show neither, as do
    # 628f855's, which recorded vLLM's Inductor compile counter under another key).
    cell = {"runs": {"1": _runs([190, 200, 220], 2.3)}}
    saved = {
        "pair": "e2b",
        "new_tokens": 128,
        "results": {
            "in-tree k=2 field": {**cell, "startup_s": 172, "graphs_compiled": 30},
            "ours-V2 k=2 field": {**cell, "startup_s": 24, "graphs_compiled": 0},
            "ours-V2+target=1 k=2 field": {**cell, "startup_s": 25, "inductor_compiles": 28},
        },
    }
    out = _tables(saved, tmp_path)
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("configuration"))
    rows = {line.split()[0]: line for line in lines[header + 1 : header + 4]}
    assert "start s: c compiled" in out
    assert rows["in-tree"].split()[3] == "172c"
    assert rows["ours-V2"].split()[3] == "24l"
    assert rows["ours-V2+target=1"].split()[3] == "25"


def _tables(saved: dict, tmp_path: Path, xz: bool = False) -> str:
    """What ``real_work.py --table`` prints for ``saved`` (kept as ``.json.xz`` if ``xz``)."""
    raw = json.dumps(saved).encode()
    path = tmp_path / ("run.json.xz" if xz else "run.json")
    path.write_bytes(lzma.compress(raw) if xz else raw)
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "real_work.py"), "--table", str(path)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout


def _runs(tokens_per_s: list[float], length: float | None) -> list[dict]:
    return [
        {"tokens_per_s": t, "mean_accepted_length": length, "token_ids": [[1, 2], [3]]}
        for t in tokens_per_s
    ]


def _cells(tokens_per_s: list[float], length: float | None, **fields: list[Any]) -> list[dict]:
    """``_runs`` with more of each cell's fields, one list per field (a value per cell)."""
    runs = _runs(tokens_per_s, length)
    for i, cell in enumerate(runs):
        cell.update({name: values[i] for name, values in fields.items()})
    return runs


def _saved_run() -> dict:
    """A saved trained-pair run of three engines at batch 1, three rounds each."""
    return {
        "pair": "trained",
        "new_tokens": 128,
        "results": {
            "plain": {"startup_s": 30, "runs": {"1": _runs([50, 100, 100], None)}},
            "in-tree k=3 real": {"startup_s": 40, "runs": {"1": _runs([190, 200, 220], 3.3)}},
            "ours-V1 k=3 real": {"startup_s": 50, "runs": {"1": _runs([115, 230, 250], 3.3)}},
        },
    }


def test_tables_of_a_saved_run(tmp_path: Path) -> None:
    out = _tables(_saved_run(), tmp_path)
    ours = next(line for line in out.splitlines() if line.startswith("ours-V1 k=3 real"))
    # Steady state = the median of the rounds after the first: 240 tokens/s, 2.40x plain's 100,
    # 1.14x in-tree's 210; the first pass ran at 115 / 240 of it.
    assert "240 2.40x 1.14x | 0.48 | 3.30" in ours
    plain = next(line for line in out.splitlines() if line.startswith("plain"))
    assert "1.00x" in plain and "x in-tree" not in plain
    assert "ours-V1 k=3 real         6 / 6" in out
    # Paired with in-tree's rounds 1 and 2: 230 / 200 and 250 / 220.
    paired = out.split("steady rounds paired")[1].split("\ntargets:")[0].splitlines()
    (line,) = [row for row in paired if row.startswith("ours-V1 k=3 real")]
    assert "1.14x (1.14 - 1.15)" in line


def test_tables_of_a_compressed_run(tmp_path: Path) -> None:
    saved = _saved_run()
    assert _tables(saved, tmp_path, xz=True) == _tables(saved, tmp_path)
    assert "240 2.40x 1.14x" in _tables(saved, tmp_path, xz=True)


def test_tables_flag_an_engine_whose_greedy_tokens_change_between_rounds(tmp_path: Path) -> None:
    ours = _runs([115, 230, 250], 3.3)
    ours[2]["token_ids"] = [[1, 2], [4]]  # the third round's second request left the first's
    saved = {
        "pair": "trained",
        "new_tokens": 128,
        "results": {
            "in-tree k=3 real": {"startup_s": 40, "runs": {"1": _runs([190, 200, 220], 3.3)}},
            "ours-V2 k=3 real": {"startup_s": 50, "runs": {"1": ours}},
        },
    }
    repeats = _tables(saved, tmp_path).split("engine's own first pass")[1]
    assert "in-tree k=3 real         4 / 4\n" in repeats
    assert "ours-V2 k=3 real         3 / 4  DIFFER" in repeats


def test_first_pass_profile_lists_a_pass_compiles_beside_the_start_ups(
    capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    import first_pass_profile

    # Triton's hook slot, as ``triton.knobs`` has it (the CPU machines have no Triton).
    knobs = SimpleNamespace(runtime=SimpleNamespace(jit_cache_hook=None))
    monkeypatch.setitem(sys.modules, "triton", SimpleNamespace(knobs=knobs))
    compiles = first_pass_profile.TritonCompiles()
    assert compiles.install()
    hook = knobs.runtime.jit_cache_hook
    hook(repr="kernel_a[num_warps=4](n: i32D)")
    hook(repr="kernel_b[num_warps=4](n: i32)")
    compiles.phase = "B=1 first pass"
    assert hook(repr="kernel_a[num_warps=4](n: constexpr[1])") is False  # compiles
    compiles.report("B=1 first pass")
    out = capsys.readouterr().out.splitlines()
    assert out == [
        "Triton compilations in B=1 first pass: 1",
        "  kernel_a[num_warps=4](n: constexpr[1])",
        "    at start-up: kernel_a[num_warps=4](n: i32D)",
    ]


def test_each_engine_has_its_own_compile_caches(tmp_path: Path) -> None:
    # A kernel one engine compiled must not make another engine's first pass look fast.
    from engine_turns import engine_env

    a, b = (engine_env({}, tmp_path / name) for name in ("a", "b"))
    assert a["TRITON_CACHE_DIR"] != b["TRITON_CACHE_DIR"]
    assert a["VLLM_CACHE_ROOT"] != b["VLLM_CACHE_ROOT"]
    assert (
        "VLLM_PLUGINS" not in a and engine_env({"VLLM_PLUGINS": "none"}, tmp_path)["VLLM_PLUGINS"]
    )


def test_engine_core_in_its_own_process_as_vllm_runs_it(tmp_path: Path) -> None:
    # --engine-core own-process: vLLM's default (its core beside, not inside, the front end);
    # the table says which a saved run used.
    from engine_turns import engine_env

    assert engine_env({}, tmp_path)["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert engine_env({}, tmp_path, core_in_process=False)["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
    saved = {
        "pair": "trained",
        "new_tokens": 128,
        "engine_core": "own-process",
        "results": {"plain": {"startup_s": 30, "runs": {"1": _runs([50, 100, 100], None)}}},
    }
    assert "engine cores in their own processes" in _tables(saved, tmp_path)


def test_both_engine_cores_in_one_run(tmp_path: Path) -> None:
    # --engine-core both: each engine twice, the second in its own process, and each own-core
    # engine paired with the own-core in-tree one.
    configs = real_work.configurations([3], ["real"], ["in-tree", "ours-V2"])
    both = real_work.with_engine_cores(configs, "both")
    assert list(both) == [
        "plain",
        "plain own-core",
        "in-tree k=3 real",
        "in-tree k=3 real own-core",
        "ours-V2 k=3 real",
        "ours-V2 k=3 real own-core",
    ]
    assert [c["core_in_process"] for c in both.values()] == [True, False] * 3
    assert all(
        not c["core_in_process"]
        for c in real_work.with_engine_cores(configs, "own-process").values()
    )
    saved = {
        "pair": "trained",
        "new_tokens": 128,
        "engine_core": "both",
        "results": {
            name: {"startup_s": 30, "runs": {"1": _runs(tps, 3.0)}}
            for name, tps in [
                ("in-tree k=3 real", [100, 100, 100]),
                ("in-tree k=3 real own-core", [200, 200, 200]),
                ("ours-V2 k=3 real", [130, 130, 130]),
                ("ours-V2 k=3 real own-core", [220, 220, 220]),
            ]
        },
    }
    out = _tables(saved, tmp_path)
    assert "engines named 'own-core' with their cores in their own processes" in out
    steady = out.strip().split("\n\n")[0]  # the first table: steady tokens/s, x in-tree
    ours, ours_own = (line for line in steady.splitlines() if line.startswith("ours-V2"))
    assert "own-core" not in ours and "own-core" in ours_own
    assert "1.30x" in ours  # against in-tree in process
    assert "1.10x" in ours_own  # against in-tree in its own process


def _targets(results: dict, tmp_path: Path, **saved: Any) -> dict[str, str]:
    """The targets table of a saved run: each row's cells after its name, joined by ' | '."""
    text = _tables({"pair": "e2b", "new_tokens": 128, "results": results, **saved}, tmp_path)
    rows = {}
    for row in text.split("\ntargets:")[1].splitlines()[1:]:
        if not row.strip():
            continue
        name = next(
            (n for n in [*results, *saved.get("not_started", {})] if row.startswith(n + " ")), None
        )
        if name is not None and name.startswith("ours"):
            rows[name] = " | ".join(c.strip() for c in row[len(name) :].split("  ") if c.strip())
        elif row.startswith("not measured"):
            rows["left out"] = row
    return rows


def _engines(tps: dict[str, list[float]], batch: str = "1", length: float = 2.0) -> dict:
    return {
        name: {"startup_s": 40, "runs": {batch: _runs(t, None if name == "plain" else length)}}
        for name, t in tps.items()
    }


def test_targets_name_what_misses(tmp_path: Path) -> None:
    results = _engines(
        {
            "plain": [90, 100, 100],
            "in-tree k=2 zero": [70, 80, 80],
            "ours-V2 k=2 zero": [60, 95, 80],
            "in-tree k=2 field": [190, 200, 200],
            "ours-V2 k=2 field": [240, 240, 240],
        }
    )
    rows = _targets(results, tmp_path)
    # Nothing accepted: no target over in-tree (95/80 and 80/80 would be 1.09x); first pass 60
    # of a steady 87.5; a step costs 100/95 and 100/80 of plain's: median 1.15, 1.05 - 1.25.
    assert rows["ours-V2 k=2 zero"] == "first 0.686, step 1.151 (1.053-1.250)"
    assert rows["ours-V2 k=2 field"] == "met"  # 1.20x in-tree, first pass 1.00 of steady
    # B=1 only: the run leaves out the other batch sizes the targets ask for.
    assert rows["left out"].endswith("B = 8, 16, 32, 64")


@pytest.mark.parametrize(
    ("in_tree", "ours", "verdict"),
    [
        ([100, 115, 115], [114, 114, 114], "0.991x"),  # 114/115 in each steady round
        ([100, 100, 100], [114.9, 114.9, 114.9], "1.149x"),  # not shown as the threshold
        ([100, 100, 100], [112, 112, 112], "1.120x"),
        ([100, 100, 100], [115, 115, 115], "met"),
        ([100, 100, 100], [103.5, 115, 115], "met"),  # first pass 0.900 of steady
        ([100, 100, 100], [103.4, 115, 115], "first 0.899"),
    ],
)
def test_targets_at_their_thresholds(
    tmp_path: Path, in_tree: list[float], ours: list[float], verdict: str
) -> None:
    results = _engines({"in-tree k=3 field": in_tree, "ours-V2 k=3 field": ours})
    rows = _targets(results, tmp_path)
    assert rows["ours-V2 k=3 field"] == verdict


def test_paired_ratios_not_a_ratio_of_medians(tmp_path: Path) -> None:
    # Steady medians 140 and 120 (1.167x), but round by round 100/100, 140/130, 150/120:
    # median 1.077x.
    results = _engines(
        {"in-tree k=3 poor": [100, 100, 130, 120], "ours-V2 k=3 poor": [140, 100, 140, 150]}
    )
    assert _targets(results, tmp_path)["ours-V2 k=3 poor"] == "1.077x"


def test_zero_row_spread_alone_misses(tmp_path: Path) -> None:
    # Steps 100/99, 100/99, 100/95, 100/93: median 1.03 (within 1.08), but 0.065 apart.
    results = _engines({"plain": [100] * 5, "ours-V2 k=2 zero": [99, 99, 99, 95, 93]})
    for b in ("8", "32"):
        results["plain"]["runs"][b] = results["plain"]["runs"]["1"]
        results["ours-V2 k=2 zero"]["runs"][b] = results["ours-V2 k=2 zero"]["runs"]["1"]
    rows = _targets(results, tmp_path)
    assert rows["ours-V2 k=2 zero"] == " | ".join(["step 1.031 (1.010-1.075)"] * 3)
    assert "left out" not in rows  # B = 1, 8, 32: all the zero row asks


def test_zero_row_step_target_is_k2_at_its_batch_sizes(tmp_path: Path) -> None:
    slow = [80, 80, 80]  # a step 1.25x plain's
    results = _engines({"plain": [100] * 3, "ours-V2 k=3 zero": slow, "ours-V2 k=2 zero": slow})
    for name in results:
        results[name]["runs"]["16"] = results[name]["runs"]["1"]
    rows = _targets(results, tmp_path)
    assert rows["ours-V2 k=3 zero"] == "met | met"  # no step target at k=3
    assert rows["ours-V2 k=2 zero"] == "step 1.250 (1.250-1.250) | met"  # none at B=16


def test_targets_without_the_engines_to_compare_with(tmp_path: Path) -> None:
    results = _engines({"ours-V2 k=2 zero": [60, 60, 60], "ours-V2 k=2 field": [60, 60, 60]})
    rows = _targets(results, tmp_path, not_started={"ours-V1 k=2 field": ["error"]})
    assert rows["ours-V2 k=2 zero"] == "no plain run"
    assert rows["ours-V2 k=2 field"] == "no in-tree run"
    assert rows["ours-V1 k=2 field"] == "did not start: no target measured"


def test_own_core_engines_meet_the_targets_against_their_own_core_peers(tmp_path: Path) -> None:
    results = _engines(
        {
            "plain": [100] * 3,
            "plain own-core": [100] * 3,
            "in-tree k=2 zero own-core": [50] * 3,
            "ours-V2 k=2 zero own-core": [80, 80, 60],
        }
    )
    rows = _targets(results, tmp_path, engine_core="both")
    # Steady rounds: a step 100/80 and 100/60 of the own-core plain engine's.
    assert rows["ours-V2 k=2 zero own-core"] == "step 1.458 (1.250-1.667)"


def test_fastest_k_by_batch_size_as_a_schedule(tmp_path: Path) -> None:
    runs = {
        "ours-V2 k=1 poor": {"1": [100, 100, 100], "8": [500, 640, 640], "32": [900, 1000, 1000]},
        "ours-V2 k=3 poor": {"1": [100, 150, 150], "8": [500, 600, 600], "32": [900, 950, 950]},
    }
    saved = {
        "pair": "e2b",
        "new_tokens": 128,
        "results": {
            name: {"startup_s": 1, "runs": {b: _runs(t, 1.5) for b, t in by_b.items()}}
            for name, by_b in runs.items()
        },
    }
    out = _tables(saved, tmp_path).split("fastest k by batch size")[1]
    (row,) = [line for line in out.splitlines() if line.startswith("ours-V2 poor")]
    assert row.split()[2:] == ["k=3", "k=1", "k=1"]
    assert "num_speculative_tokens_per_batch_size: [[1, 7, 3], [8, 1024, 1]]" in out


def test_python_profile_reports_the_time_a_run_adds_per_token(capsys) -> None:  # type: ignore[no-untyped-def]
    import profile_decode

    def busy(n: int) -> None:
        deadline = time.perf_counter() + 0.002 * n
        while time.perf_counter() < deadline:
            pass

    def run(tokens: int) -> None:
        busy(1)  # the prefill, in both runs
        for _ in range(tokens - 1):
            busy(1)  # one decode step a token

    profile_decode._print_python_profile(run, 4, rows=3)
    out = capsys.readouterr().out
    (line,) = [row for row in out.splitlines() if "(busy)" in row and "cum" in row][:1]
    # 1 + 4 tokens minus 1 token, over 4: one busy() of ~2 ms a token.
    cumulative = float(line.split("us own")[1].split("us cum")[0])
    assert 1800 < cumulative < 4000
    assert "1.00 calls" in line


def test_tables_name_engines_that_did_not_start_and_batches_that_queued(tmp_path: Path) -> None:
    # vLLM's own path on the 26B-A4B pair does not start; the others are measured without it,
    # and a cache too small for a batch says so (that row is not the batch size it names).
    saved = {
        "pair": "26b-a4b",
        "new_tokens": 128,
        "results": {
            "plain": {"startup_s": 30, "runs": {"1": _runs([50, 100, 100], None)}},
            "ours-V2 k=3 field": {
                "startup_s": 50,
                "kv_capacity_requests": 4.5,
                "runs": {"1": _runs([115, 230, 250], 3.3), "8": _runs([115, 230, 250], 3.3)},
            },
        },
        "not_started": {"in-tree k=3 field": ["RuntimeError: a and b must have same reduction"]},
    }
    saved["results"]["plain"]["runs"]["8"] = _runs([50, 100, 100], None)
    out = _tables(saved, tmp_path)
    assert "in-tree k=3 field         did not start: RuntimeError: a and b must" in out
    assert "KV cache holds 4.5 requests at once: B=8 ran partly queued" in out
    targets = out.split("\ntargets:")[1]
    assert "no in-tree run" in targets and "met" not in targets


def test_engine_turns_leave_out_an_engine_that_does_not_start(tmp_path: Path) -> None:
    from engine_turns import EngineTurns

    turns = EngineTurns(tmp_path / "control")
    failing = tmp_path / "fails.py"
    failing.write_text("raise RuntimeError('a and b must have same reduction dim')\n")
    ready = tmp_path / "ready.py"  # ready, one round, a result
    ready.write_text(
        "import sys, pathlib, time\n"
        "a = sys.argv; i = a[a.index('--index') + 1]\n"
        "c = pathlib.Path(a[a.index('--control') + 1])\n"
        "(c / f'{i}.ready').touch()\n"
        "while not (c / f'{i}.go0').exists(): time.sleep(0.01)\n"
        "(c / f'{i}.done0').touch()\n"
        "pathlib.Path(a[a.index('--out') + 1]).write_text('{\"runs\": {}}')\n"
    )
    env = dict(os.environ)
    turns.start("in-tree", str(failing), [], env)
    turns.start("ours", str(ready), [], env)
    turns.wait_ready(60, drop_failed=True)
    assert turns.not_started == {"in-tree": ["RuntimeError: a and b must have same reduction dim"]}
    turns.take_turns(1)
    assert turns.results() == {"ours": {"runs": {}}}


def test_engine_turns_record_what_the_waiting_engines_burn(tmp_path: Path) -> None:
    from engine_turns import EngineTurns

    def engine(busy: bool) -> str:  # ready; one turn of about half a second; a result
        wait = "pass" if busy else "time.sleep(0.01)"
        return (
            "import sys, pathlib, time\n"
            "a = sys.argv; i = a[a.index('--index') + 1]\n"
            "c = pathlib.Path(a[a.index('--control') + 1])\n"
            "(c / f'{i}.ready').touch()\n"
            f"while not (c / f'{{i}}.go0').exists(): {wait}\n"
            "time.sleep(0.5)\n"
            "(c / f'{i}.done0').touch()\n"
            "pathlib.Path(a[a.index('--out') + 1]).write_text('{}')\n"
        )

    quiet, spinning = tmp_path / "quiet.py", tmp_path / "spinning.py"
    quiet.write_text(engine(busy=False))
    spinning.write_text(engine(busy=True))
    turns = EngineTurns(tmp_path / "control")
    turns.start("quiet", str(quiet), [], dict(os.environ))
    turns.start("spinning", str(spinning), [], dict(os.environ))
    turns.wait_ready(60)
    turns.take_turns(1)
    turns.results()
    first, second = turns.turn_log
    # While the quiet engine took its turn, the other spun on its go file: about a CPU.
    assert first["engine"] == "quiet" and first["others_cpu_s"] > 0.3 * first["wall_s"]
    assert second["engine"] == "spinning" and second["others_cpu_s"] < 0.2 * second["wall_s"]


def test_tables_show_what_waiting_engines_burn(tmp_path: Path) -> None:
    saved = {
        "pair": "trained",
        "new_tokens": 128,
        "results": {"plain": {"startup_s": 30, "runs": {"1": _runs([50, 100, 100], None)}}},
        "turns": [
            {"engine": "plain", "wall_s": 2.0, "others_cpu_s": 0.2},
            {"engine": "plain", "wall_s": 1.0, "others_cpu_s": 0.5},
            {"engine": "plain", "wall_s": 1.0, "others_cpu_s": 0.0},
        ],
    }
    idle = _tables(saved, tmp_path).split("engines waiting their turn")[1]
    assert "  plain                     0.10   0.50" in idle


def test_engine_turns_record_what_the_rest_of_the_machine_burns(tmp_path: Path) -> None:
    from engine_turns import EngineTurns

    script = tmp_path / "engine.py"  # ready; after a settling wait, a turn of half a second
    script.write_text(
        "import sys, pathlib, time\n"
        "a = sys.argv; i = a[a.index('--index') + 1]\n"
        "c = pathlib.Path(a[a.index('--control') + 1])\n"
        "(c / f'{i}.ready').touch()\n"
        "while not (c / f'{i}.go0').exists(): time.sleep(0.01)\n"
        "time.sleep(0.5)\n"
        "(c / f'{i}.done0').touch()\n"
        "pathlib.Path(a[a.index('--out') + 1]).write_text('{}')\n"
    )
    turns = EngineTurns(tmp_path / "control")
    turns.start("ours", str(script), [], dict(os.environ))
    turns.wait_ready(60)
    # A program that is not an engine spins on a core through the turn (and the settling).
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        started = time.perf_counter()
        turns.take_turns(1, settle_s=0.4)
        took = time.perf_counter() - started
    finally:
        spinner.kill()
        spinner.wait()
    turns.results()
    (turn,) = turns.turn_log
    assert took >= 0.4 + turn["wall_s"]
    assert turn["others_cpu_s"] == 0
    assert turn["rest_cpu_s"] > 0.3 * turn["wall_s"]  # about a core, the spinner's


def test_tables_show_the_host_of_round_0_against_the_later_rounds(tmp_path: Path) -> None:
    # Round 0's probe 1.5x the later rounds', the rest of the machine busy then and the GPU's
    # clock low: the first passes ran on a slower machine.
    probes = {"1": [0.9, 0.6, 0.61], "8": [0.9, 0.59, 0.6]}
    runs = {b: _runs([80, 100, 100], 3.0) for b in probes}
    for b, cells in runs.items():
        for cell, probe, mhz in zip(cells, probes[b], (1200, 1980, 1980), strict=True):
            cell.update(host_probe_ms=probe, sm_clock_mhz=mhz)
    turns = [
        {"engine": "ours-V2 k=3 real", "wall_s": 1.0, "others_cpu_s": 0.0, "rest_cpu_s": rest}
        for rest in (2.0, 1.0, 0.1, 0.1, 0.2, 0.1)
    ]
    saved = {
        "pair": "trained",
        "new_tokens": 128,
        "settle_s": 30,
        "results": {"ours-V2 k=3 real": {"startup_s": 50, "runs": runs}},
        "turns": turns,
    }
    text = _tables(saved, tmp_path).split("\nthe host in round 0, 30 s after")[1]
    line = text.splitlines()[1]
    assert line == (
        "  ours-V2 k=3 real         probe  0.900 |  0.600 (1.50x)   rest  1.50 |  0.10"
        "   SM  1200 |  1980"
    )


def test_host_matched_figures_leave_out_cells_on_a_slow_core(tmp_path: Path) -> None:
    # Two engines, batch 1, four rounds; the host probe is 0.4 ms on a fast core, 0.8 on a
    # slow one. In-tree's round 2 and ours' round 3 ran slow (after their passes, for ours):
    # only round 1 is fast on both sides, and ours' slow round 0 has no host-matched ratio.
    def cells(tps: list[float], before: list[float], after: list[float]) -> list[dict]:
        return _cells(tps, 3.0, host_probe_ms=before, host_probe_after_ms=after)

    saved = {
        "pair": "trained",
        "new_tokens": 128,
        "results": {
            "in-tree k=3 real": {
                "startup_s": 40,
                "runs": {"1": cells([90, 100, 50, 100], [0.4, 0.4, 0.8, 0.4], [0.4] * 4)},
            },
            "ours-V2 k=3 real": {
                "startup_s": 50,
                "runs": {"1": cells([60, 150, 200, 75], [0.8, 0.4, 0.4, 0.41], [0.4] * 3 + [0.8])},
            },
        },
    }
    text = _tables(saved, tmp_path).split("\nhost-matched: ")[1]
    assert text.startswith("cells whose probes ran within 1.3x of the run's fastest (0.400 ms)")
    lines = text.splitlines()
    assert lines[1] == "  in-tree k=3 real        slow 0/1 | 1/3"
    assert lines[2] == "  ours-V2 k=3 real        slow 1/1 | 1/3"
    assert lines[3].split() == ["1.50x", "(1/3)", "|", "-"]
    # A slow pick before one of a cell's later passes makes the cell slow too: in-tree's
    # round 1 now, which leaves no round fast on both sides.
    in_tree = saved["results"]["in-tree k=3 real"]["runs"]["1"]
    in_tree[1]["pass_probe_ms"] = [0.4, 0.8]
    lines = _tables(saved, tmp_path).split("\nhost-matched: ")[1].splitlines()
    assert lines[1] == "  in-tree k=3 real        slow 0/1 | 2/3"
    assert lines[3].split() == ["-", "(0/3)", "|", "-"]
    del in_tree[1]["pass_probe_ms"]
    # Ours' first pass ran fast in the next run: over its fast steady cells' median, 175.
    saved["results"]["ours-V2 k=3 real"]["runs"]["1"][0]["host_probe_ms"] = 0.4
    lines = _tables(saved, tmp_path).split("\nhost-matched: ")[1].splitlines()
    assert lines[3].split() == ["1.50x", "(1/3)", "|", f"{60 / 175:4.2f}"]


def test_engine_turns_reverse_the_order_every_other_round(tmp_path: Path) -> None:
    from engine_turns import EngineTurns

    script = tmp_path / "engine.py"  # ready; each turn appends its index to a shared log
    script.write_text(
        "import sys, pathlib, time\n"
        "a = sys.argv; i = a[a.index('--index') + 1]\n"
        "c = pathlib.Path(a[a.index('--control') + 1])\n"
        "(c / f'{i}.ready').touch()\n"
        "for t in range(4):\n"
        "    while not (c / f'{i}.go{t}').exists(): time.sleep(0.01)\n"
        "    with open(c.parent / 'order.txt', 'a') as f: f.write(i)\n"
        "    (c / f'{i}.done{t}').touch()\n"
        "pathlib.Path(a[a.index('--out') + 1]).write_text('{}')\n"
    )
    turns = EngineTurns(tmp_path / "control")
    for name in ("plain", "in-tree", "ours"):
        turns.start(name, str(script), [], dict(os.environ))
    turns.wait_ready(60)
    turns.take_turns(4, reverse_every=2)  # two rounds of two batch sizes
    turns.results()
    assert (tmp_path / "order.txt").read_text() == "012012210210"


def test_kv_cache_sized_for_the_largest_batch(tmp_path: Path) -> None:
    # 31B's shape: 50 sliding layers of 16 KV heads x 256, 10 full ones of 4 x 512, K and V
    # in bf16; 1 GiB holds ~1190 tokens of it, not 32 requests of 128 + 128 + 4.
    from gemma4_spec.testing.e2b_shaped import _write_config_only
    from gemma4_spec.testing.families import real_shape_configs

    target = _write_config_only(real_shape_configs("31b")[0], tmp_path / "31b")  # as a run does
    per_token = real_work.kv_bytes_per_token(target)
    assert per_token == 50 * 2 * 16 * 256 * 2 + 10 * 2 * 4 * 512 * 2
    assert real_work.kv_cache_bytes(target, 32, 3) == 32 * 260 * per_token * 5 // 4
    assert real_work.kv_cache_bytes(target, 1, 3) == real_work.ENGINE["kv_cache_memory_bytes"]
    # Long prompts: the cache and max_model_len follow them.
    assert real_work.kv_cache_bytes(target, 32, 3, 2048) == 32 * 2180 * per_token * 5 // 4


def test_long_prompts_raise_max_model_len() -> None:
    assert real_work.model_len(3) == {}  # 128 + 128 + 4 fits ENGINE's 1024
    assert real_work.model_len(3, 2048) == {"max_model_len": 2304}  # 2180, in 256s
    prompts = real_work._prompts("e2b", Path("t"), 2, prompt_len=2048)
    assert [len(p["prompt_token_ids"]) for p in prompts] == [2048, 2048]


def test_prompt_len_is_refused_on_the_trained_pair(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["real_work.py", "--pair", "trained", "--prompt-len", "512"])
    with pytest.raises(SystemExit):
        real_work.main()


def test_steady_cells_repeat_their_batch_for_the_minimum_time() -> None:
    calls: list[int] = []

    def run_once() -> int:
        calls.append(len(calls))
        time.sleep(0.01)
        return calls[-1]

    outputs, walls = real_work.timed_passes(run_once, 0.0)  # a first pass: once
    assert outputs == [0] and len(walls) == 1 and walls[0] >= 0.01
    outputs, walls = real_work.timed_passes(run_once, 0.05)
    assert len(outputs) >= 5 and outputs == calls[1:] and len(walls) == len(outputs)
    assert sum(walls) >= 0.05 and sum(walls[:-1]) < 0.05  # stops at the first pass past it
    assert min(walls) >= 0.01
    outputs, walls = real_work.timed_passes(run_once, 0.0, 3)  # the passes after a first
    assert len(outputs) == len(walls) == 3
    # Work between passes (the move to a fast core) runs before every pass but the first,
    # outside the passes' times.
    order: list[str] = []
    outputs, walls = real_work.timed_passes(
        lambda: order.append("pass"),
        0.0,
        3,
        between=lambda: (order.append("pick"), time.sleep(0.05)),
    )
    assert order == ["pass", "pick", "pass", "pick", "pass"]
    assert sum(walls) < 0.05


def test_host_table_shows_cpu_per_wall_and_the_pass_spread(tmp_path: Path) -> None:
    def runs(cpu: list[float], passes: list[list[float]]) -> list[dict]:
        return _cells([100.0] * len(cpu), None, cpu_per_wall=cpu, pass_s=passes)

    saved = {
        "pair": "trained",
        "new_tokens": 128,
        "results": {
            # Steady cells (after the first pass): CPU 0.9 and 1.1 -> median 1.00; spreads
            # 0.3 / 0.2 = 1.5 and 0.2 / 0.2 = 1.0 -> median 1.25.
            "plain": {
                "startup_s": 30,
                "runs": {"1": runs([5.0, 0.9, 1.1], [[0.5], [0.2, 0.3], [0.2, 0.2]])},
            },
        },
    }
    out = _tables(saved, tmp_path)
    host = out.split("steady cells (medians)")[1].splitlines()
    (line,) = [row for row in host if row.startswith("plain")]
    assert "1.00 | 1.25" in line
    # A run saved before the fields existed prints no such table.
    old = {**saved, "results": {"plain": {"startup_s": 30, "runs": {"1": _runs([1, 2], None)}}}}
    assert "steady cells (medians)" not in _tables(old, tmp_path)


def test_pinned_engines_share_the_cores_without_overlap() -> None:
    shares = real_work.core_shares(list(range(16)), 3)
    assert [len(s) for s in shares] == [6, 5, 5]
    assert sorted(c for s in shares for c in s) == list(range(16))
    assert real_work.core_shares([4, 5], 2) == [[4], [5]]
    with pytest.raises(SystemExit, match="3 engines but only 2 cores"):
        real_work.core_shares([0, 1], 3)


def test_a_pinned_run_says_so_in_its_tables(tmp_path: Path) -> None:
    runs = {"1": _runs([50, 100, 100], None)}
    saved = {
        "pair": "trained",
        "new_tokens": 128,
        "results": {"plain": {"startup_s": 30, "runs": runs}},
    }
    assert "each engine on its own CPU cores" not in _tables(saved, tmp_path)
    assert "each engine on its own CPU cores" in _tables({**saved, "pinned_cores": True}, tmp_path)


def test_engines_are_measured_on_the_same_last_cores(tmp_path: Path) -> None:
    assert real_work.measure_cores(list(range(16)), 4) == [12, 13, 14, 15]
    for count in (0, 17):
        with pytest.raises(SystemExit, match="--measure-cores"):
            real_work.measure_cores(list(range(16)), count)
    saved = {
        "pair": "trained",
        "new_tokens": 128,
        "results": {"plain": {"startup_s": 30, "runs": {"1": _runs([50, 100, 100], None)}}},
    }
    assert "timed on the same" not in _tables(saved, tmp_path)
    assert "timed on the same 4 CPU cores" in _tables({**saved, "measure_cores": 4}, tmp_path)


def test_moving_threads_moves_every_thread_of_the_process_tree() -> None:
    import threading

    cores = sorted(os.sched_getaffinity(0))
    stop = threading.Event()
    worker = threading.Thread(target=stop.wait)
    worker.start()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        time.sleep(0.2)  # the child's /proc entry
        assert child.pid in process_tree(os.getpid())
        moved = real_work.move_threads({cores[-1]})
        assert moved >= 3  # this thread, the waiting one, the child's
        assert os.sched_getaffinity(child.pid) == {cores[-1]}
        assert os.sched_getaffinity(worker.native_id) == {cores[-1]}
    finally:
        os.sched_setaffinity(0, set(cores))
        child.kill()
        stop.set()
        worker.join()


def test_scopes_per_engine_step_and_their_table(tmp_path: Path) -> None:
    # Two snapshots 4 steps apart: 4 output updates, 96 slot allocations (24 a step).
    before = {
        real_work.STEP_SCOPE: (10, 0, 0),
        "kv_cache_manager:KVCacheManager.allocate_slots": (0, 0, 0),
    }
    after = {
        real_work.STEP_SCOPE: (14, 4_000_000, 2_000_000),
        "kv_cache_manager:KVCacheManager.allocate_slots": (96, 2_000_000, 1_600_000),
    }
    rows = real_work.scopes_per_step(before, after)
    assert rows["kv_cache_manager:KVCacheManager.allocate_slots"] == [24.0, 0.5, 0.4]
    assert rows[real_work.STEP_SCOPE] == [1.0, 1.0, 0.5]

    def cells(walls: list[float]) -> list[dict]:
        runs = _runs([100.0] * len(walls), None)
        for cell, wall in zip(runs, walls, strict=True):
            cell["scopes"] = {real_work.STEP_SCOPE: [1.0, wall, wall / 2]}
        return runs

    saved = {
        "pair": "trained",
        "new_tokens": 128,
        "results": {"plain": {"startup_s": 30, "runs": {"1": cells([9.0, 0.2, 0.4, 0.3])}}},
    }
    out = _tables(saved, tmp_path)
    table = out.split("plain (steady cells' median): host scopes per decode step")[1]
    table = table.split("first pass minus steady")[0]
    (line,) = [row for row in table.splitlines() if "update_from_output" in row]
    assert "0.300 /  0.150 (1.0)" in line  # the steady cells' median; the first pass left out
    # The first pass (9.0 ms a step) against that median (0.3): 8.7 ms more.
    assert f"B=1: {real_work.STEP_SCOPE} +8.700" in out.split("first pass minus steady")[1]
    saved["results"]["plain"]["runs"]["1"] = _runs([1, 2], None)  # no scopes: no table
    assert "host scopes per decode step" not in _tables(saved, tmp_path)


def test_lazy_work_counts_what_happened_between_two_takes(monkeypatch: pytest.MonkeyPatch) -> None:
    import gc

    import lazy_work
    import torch

    # Triton's hook slot, as ``triton.knobs`` has it (the CPU machines have no Triton), and a
    # capture that does nothing (no CUDA here): what LazyWork wraps.
    knobs = SimpleNamespace(runtime=SimpleNamespace(jit_cache_hook=None))
    began: list[object] = []
    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_begin", lambda g, *a, **k: began.append(g))
    with monkeypatch.context() as installing:  # not while torch.compile runs below
        installing.setitem(sys.modules, "triton", SimpleNamespace(knobs=knobs))
        work = lazy_work.LazyWork()
    knobs.runtime.jit_cache_hook(repr="before[num_warps=4](n: i32)")
    # Only the collection below counts: none started by the allocations of torch.compile's
    # first run (which happen when this test runs alone).
    gc.disable()
    try:
        before = work.take()
        assert knobs.runtime.jit_cache_hook(repr="kernel_a[num_warps=4](n: i32D)") is False
        torch.cuda.CUDAGraph.capture_begin("a graph")
        torch.compile(lambda x: x * 2 + 1, backend="eager")(torch.ones(3))
        gc.collect()
        done = work.since(before)
    finally:
        gc.enable()
    assert began == ["a graph"]
    assert done["triton"] == 1 and done["triton_kernels"] == ["kernel_a[num_warps=4](n: i32D)"]
    assert done["graph_captures"] == 1
    assert done["dynamo_graphs"] == 1
    assert done["device_allocs"] == 0  # no CUDA
    assert done["gc_full"] == 1 and done["gc_s"] > 0
    # And nothing since then.
    assert lazy_work.describe(work.since(work.take())) == "nothing"
    text = lazy_work.describe(lazy_work.total([done, done]))
    assert text.startswith("Triton compiles 2, graph captures 2, Dynamo graphs 2, GC ")
    gc.callbacks.remove(work.pauses._callback)
    # The allocator's counters: what a first pass's allocations reserved, and its retries
    # (the allocator emptying its cache), said beside the count.
    assert set(done) >= set(lazy_work.ALLOCATOR_STATS)
    allocated = {"device_allocs": 1, "device_alloc_bytes": 3 << 20, "alloc_retries": 2}
    assert lazy_work.describe(allocated) == "device allocations 1 (3 MiB), allocator retries 2"
    assert lazy_work.total([allocated, allocated])["device_alloc_bytes"] == 6 << 20
    # Cells saved before these counters existed still describe.
    assert lazy_work.describe({"device_allocs": 2}) == "device allocations 2"


def test_tables_show_a_first_pass_slower_than_every_steady_one_and_what_it_compiled(
    tmp_path: Path,
) -> None:
    def cell(tokens_per_s: float, pass_s: list[float], lazy: dict) -> dict:
        return {
            "tokens_per_s": tokens_per_s,
            "mean_accepted_length": 3.3,
            "pass_s": pass_s,
            "cpu_per_wall": 1.0,
            "lazy": {"gc_s": 0.0, "gc_full": 0, "triton_kernels": [], **lazy},
        }

    compiled = {"triton": 1, "triton_kernels": ["_verify_rows_kernel[num_warps=4](n: i32)"]}
    runs = [
        cell(100, [0.30], compiled),
        cell(200, [0.15, 0.16], {}),
        cell(210, [0.14, 0.15], {"device_allocs": 2}),
    ]
    saved = {
        "pair": "trained",
        "new_tokens": 128,
        "results": {"ours-V2 k=3 real": {"startup_s": 50, "runs": {"16": runs}}},
    }
    out = _tables(saved, tmp_path).split("\nfirst pass, ms")[1]
    line = next(row for row in out.splitlines() if "B=16" in row)
    assert "300.0* (150.0, 160.0)" in line
    assert "first: Triton compiles 1 [_verify_rows_kernel]" in line
    assert line.endswith("steady cells: device allocations 2")
    assert "next:" not in line  # saved before the passes after a first were recorded


def test_a_first_pass_is_shown_against_the_passes_right_after_it(tmp_path: Path) -> None:
    """A first pass slow against the steady median, but as fast as the passes run right after
    it: the host was slow at that moment (the table and the targets line both say so)."""
    runs = [
        {"tokens_per_s": 100, "pass_s": [0.30], "next_pass_s": [0.29, 0.31, 0.33]},
        {"tokens_per_s": 200, "pass_s": [0.15, 0.16]},
        {"tokens_per_s": 210, "pass_s": [0.14, 0.15]},
    ]
    for cell in runs:
        cell.update(mean_accepted_length=3.3, cpu_per_wall=1.0)
    saved = {
        "pair": "trained",
        "new_tokens": 128,
        "results": {"ours-V2 k=3 real": {"startup_s": 50, "runs": {"16": runs}}},
    }
    text = _tables(saved, tmp_path)
    line = next(r for r in text.split("\nfirst pass, ms")[1].splitlines() if "B=16" in r)
    assert "next: 310.0 (first x next 1.03)" in line
    targets = text.split("\ntargets:")[1].splitlines()[1]
    assert "first 0.488 (1.03 x next)" in targets  # 100 of a steady 205


def _request(first_latency: float, first: float, last: float, tokens: int) -> Any:
    metrics = SimpleNamespace(
        first_token_latency=first_latency, first_token_ts=first, last_token_ts=last
    )
    return SimpleNamespace(metrics=metrics, outputs=[SimpleNamespace(token_ids=[0] * tokens)])


def test_request_timing_separates_the_prefill_from_the_decode_steps() -> None:
    # 9 tokens after the first, at 2 accepted a step: 4.5 steps over 45 ms = 10 ms a step.
    outputs = [
        _request(0.020, 100.0, 100.045, 10),
        _request(0.030, 100.0, 100.090, 10),  # 20 ms a step
        _request(0.025, 100.0, 100.054, 10),  # 12 ms a step
        SimpleNamespace(metrics=None, outputs=[SimpleNamespace(token_ids=[1, 2])]),  # no stats
    ]
    timing = real_work.request_timing(outputs, 2.0)
    assert timing["first_token_ms"] == pytest.approx(25.0)
    assert timing["decode_step_ms"] == pytest.approx(12.0)
    assert real_work.request_timing(outputs[3:], 2.0) == {}


def test_tables_show_the_decode_step_apart_from_the_first_token(tmp_path: Path) -> None:
    saved = _saved_run()
    for runs in saved["results"]["ours-V1 k=3 real"]["runs"].values():
        for i, cell in enumerate(runs):
            cell.update(first_token_ms=30.0 + i, decode_step_ms=4.0 + i)
    out = _tables(saved, tmp_path)
    table = out.split("decode steps' ms a step\n")[1].split("\n\n")[0]
    (line,) = [row for row in table.splitlines() if "ours" in row]
    assert "31.5 |  5.500" in line  # rounds 1 and 2: medians of 31, 32 and of 5, 6
