"""vLLM's split-key attention kernel gives a verification batch the same attention at any
number of softmax segments (``GEMMA4_SPEC_VERIFY_SEGMENTS``), its scratch viewed as
``patch/patch_triton_attn.py`` views it, as vLLM's one-pass kernel gives it. On CPU through
Triton's interpreter, in a child process (``testing/triton_attention.interpreted_kernel``
must run before vLLM's kernel module is imported); on CUDA directly, at E2B's sizes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")
pytest.importorskip("vllm.triton_utils")

from gemma4_spec.testing.triton_attention import split_errors  # noqa: E402

# Small shapes for the interpreter: 8 query heads on one KV head (E2B's grouping), 5 requests
# of 4 query tokens (k = 3); the scratch holds 8 rows at 16 segments, so 20 query tokens
# need 4 segments or fewer: the extra rows are real.
SMALL = dict(batch=5, q_len=4, head_dim=32, longest=120, scratch_rows=8)
SMALL_SEGMENTS = [4, 2, 1]
TOLERANCE = 1e-5  # float32; the interpreter's dots are exact float32


def _interpreted(cases: list[dict]) -> list[dict[str, float]]:
    script = (
        "import json, sys\n"
        "from gemma4_spec.testing.triton_attention import interpreted_kernel, split_errors\n"
        "interpreted_kernel()\n"
        "cases = json.loads(sys.argv[1])\n"
        "print(json.dumps([split_errors(c.pop('segments'), **c) for c in cases]))\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-c", script, json.dumps(cases)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA test below runs the kernel")
def test_fewer_segments_give_the_same_attention_interpreted() -> None:
    full, sliding, control = _interpreted(
        [
            {**SMALL, "segments": SMALL_SEGMENTS},
            {**SMALL, "segments": SMALL_SEGMENTS, "window": 24, "seed": 1},
            # Control: the split runs one key short; the comparison must see it.
            {**SMALL, "segments": [4], "shorten_split": 1},
        ]
    )
    for errors in (full, sliding):
        assert set(errors) == {str(n) for n in SMALL_SEGMENTS}
        assert max(errors.values()) < TOLERANCE, errors
    assert control["4"] > 100 * TOLERANCE


def test_segments_that_overflow_the_scratch_are_refused() -> None:
    with pytest.raises(ValueError, match="overflow the scratch at 8 segments"):
        split_errors([8], **SMALL)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("head_dim", "window"), [(256, 0), (256, 512), (512, 0)])
@pytest.mark.parametrize(("batch", "q_len"), [(1, 4), (16, 4), (32, 4), (64, 3)])
def test_fewer_segments_give_the_same_attention_cuda(
    batch: int, q_len: int, head_dim: int, window: int
) -> None:
    counts = [n for n in (16, 8, 4, 2, 1) if batch * q_len <= 128 * 16 // n]
    errors = split_errors(
        counts, batch=batch, q_len=q_len, head_dim=head_dim, window=window, longest=1200,
        device="cuda",
    )  # fmt: skip
    # vLLM's kernel multiplies float32 in TF32 and the two kernels tile the keys differently.
    assert max(errors.values()) < 1e-3, errors
    control = split_errors(
        counts[-1:], batch=batch, q_len=q_len, head_dim=head_dim, window=window, longest=1200,
        shorten_split=1, device="cuda",
    )  # fmt: skip
    assert max(control.values()) > 1e-2
