"""The near-tie judge of the GPU family test (``gemma4_spec.testing.near_ties``): a recorded
H200 divergence on the tiny E4B pair is a float64 near tie, and divergences that are not ties,
on the same pair and in synthetic logits, are flagged."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gemma4_spec.testing.families import build_family_pair, gpu_family_prompts
from gemma4_spec.testing.near_ties import (
    DEFAULT_TOLERANCE,
    compared_tokens,
    divergences,
    first_divergence,
    judge,
    reference_last_logits,
)

# tests/test_gpu_families.py's prompts (``gpu_family_prompts``): the third one's 32 greedy
# tokens on the H200 (vLLM 0.26, float32, CUDA graphs, V1 runner, k = 3), plain decoding and
# ours, which parted at output token 22.
H200_PLAIN = [
    1527, 1930, 49, 1012, 1112, 1072, 905, 1136, 1457, 1457, 650, 904, 663, 1739, 22, 1228,
    840, 1297, 494, 682, 1808, 697, 1971, 1238, 468, 652, 451, 1418, 985, 684, 1082, 1641,
]  # fmt: skip
H200_OURS = H200_PLAIN[:22] + [
    1414, 1381, 954, 372, 673, 1420, 53, 1260, 1682, 1941,
]  # fmt: skip


def test_first_divergence() -> None:
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2
    assert first_divergence([], []) is None


def test_judge_on_synthetic_logits() -> None:
    logits = torch.tensor([0.5, 1.0, 1.0 - DEFAULT_TOLERANCE / 2, 0.9], dtype=torch.float64)
    assert judge(0, 0, 1, 2, logits, DEFAULT_TOLERANCE).explained
    assert judge(0, 0, 2, 1, logits, DEFAULT_TOLERANCE).explained
    # The control: a pick a tenth below the best is no tie, whichever run made it.
    assert not judge(0, 0, 1, 3, logits, DEFAULT_TOLERANCE).explained
    assert not judge(0, 0, 3, 1, logits, DEFAULT_TOLERANCE).explained
    # The tolerance scales with the size of the best logit.
    big = logits * 100
    assert judge(0, 0, 1, 2, big, DEFAULT_TOLERANCE).explained
    assert not judge(0, 0, 1, 3, big, DEFAULT_TOLERANCE).explained


def test_compared_tokens() -> None:
    assert compared_tokens([[1, 2], [3, 4]], [[1, 2], [3, 4]]) == 1.0
    assert compared_tokens([[1, 2], [3, 5]], [[1, 2], [3, 4]]) == 0.75


@pytest.fixture(scope="module")
def e4b_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    target, _ = build_family_pair("e4b", tmp_path_factory.mktemp("near-ties") / "e4b")
    return target


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return gpu_family_prompts()


def test_recorded_h200_divergence_is_a_near_tie(e4b_target: Path, prompts: list[list[int]]) -> None:
    (found,) = divergences(e4b_target, prompts[2:3], [H200_OURS], [H200_PLAIN])
    assert (found.position, found.ours, found.plain) == (22, 1414, 1971)
    assert found.explained, str(found)


def test_a_divergence_at_a_clear_winner_is_flagged(
    e4b_target: Path, prompts: list[list[int]]
) -> None:
    # The control: the same prompt with ours made to differ at output token 0, where the
    # float64 reference's best token leads the runner-up by a wide margin.
    wrong = [H200_PLAIN[1], *H200_PLAIN[1:]]
    (found,) = divergences(e4b_target, prompts[2:3], [wrong], [H200_PLAIN])
    assert found.position == 0
    assert not found.explained, str(found)


def test_equal_outputs_need_no_reference(prompts: list[list[int]]) -> None:
    # No model is loaded when nothing differs (the path does not exist).
    assert divergences("/nonexistent", prompts, [H200_PLAIN], [H200_PLAIN]) == []


def test_a_moe_target_is_judged_in_float64(
    tmp_path_factory: pytest.TempPathFactory, prompts: list[list[int]]
) -> None:
    # The 26B-A4B family's experts run in float64 too (transformers' grouped matmul refuses
    # it): its reference's best token against its worst is a divergence, and no near tie.
    target, _ = build_family_pair("26b-a4b", tmp_path_factory.mktemp("near-ties") / "moe")
    (row,) = reference_last_logits(target, prompts[:1])
    best, worst = int(row.argmax()), int(row.argmin())
    (found,) = divergences(target, prompts[:1], [[best]], [[worst]])
    assert (found.position, found.gap_ours) == (0, 0.0)
    assert found.gap_plain > 0 and not found.explained, str(found)
