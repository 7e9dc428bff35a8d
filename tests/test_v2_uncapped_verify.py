"""``patch/patch_v2_sample.py`` on stand-ins for Model Runner V2's runner: an all-greedy batch
the greedy path verifies gets its tokens from the logits computed without the soft-cap and the
capped argmax of ``ops/capped_argmax`` (vLLM's own ``LogitsProcessor.forward`` computes the
logits, with its cap turned off for the call and back on after); every other batch runs vLLM's
method. A multimodal target's suppressed tokens are set to ``-inf`` from a device tensor, its
language model computing the logits. The GPU engine test runs the path in an engine
(``greedy_verify_uncapped``)."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch

from gemma4_spec.ops.capped_argmax import capped_argmax_reference
from gemma4_spec.patch import patch_v2_sample as patch
from gemma4_spec.patch.patch_rejection_sampler import GREEDY_VERIFY_ATTR, GreedyVerifyStats
from gemma4_spec.patch.patch_v2_rejection_sampler import VERIFY_GREEDY_TOKENS

CAP = 30.0
VOCAB = 64
HIDDEN = 8


def _processor_class() -> type:
    """vLLM's ``LogitsProcessor`` with the lm_head product as a plain matmul (the cap and the
    rest of ``forward`` are vLLM's)."""
    from vllm.model_executor.layers.logits_processor import LogitsProcessor

    class MatmulLogits(LogitsProcessor):
        def _get_logits(self, hidden: Any, lm_head: Any, *args: Any, **kwargs: Any) -> Any:
            return hidden @ lm_head.t()

    return MatmulLogits


class _Target(torch.nn.Module):
    def __init__(self, soft_cap: float | None, scale: float = 1.0) -> None:
        from vllm.config import VllmConfig, set_current_vllm_config

        super().__init__()
        with set_current_vllm_config(VllmConfig()):
            self.logits_processor = _processor_class()(VOCAB, soft_cap=soft_cap, scale=scale)
        gen = torch.Generator().manual_seed(0)
        # Large weights: many logits saturate the cap, so its ties decide tokens.
        self.register_buffer("lm_head", torch.randn(VOCAB, HIDDEN, generator=gen) * 40)
        self.seen_caps: list[float | None] = []

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        self.seen_caps.append(self.logits_processor.soft_cap)
        return self.logits_processor(self.lm_head, hidden)


class _MultimodalTarget(torch.nn.Module):
    """vLLM 0.26's ``Gemma4ForConditionalGeneration`` as the verification sees it: its language
    model's logits, then the generation config's ``suppress_tokens`` set to ``-inf`` by
    indexing with the list (which a CUDA graph capture refuses)."""

    def __init__(self, suppressed: list[int]) -> None:
        super().__init__()
        self.language_model = _Target(CAP)
        self._suppress_token_ids = suppressed
        self.calls = 0

    def get_language_model(self) -> torch.nn.Module:
        return self.language_model

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        logits = self.language_model.compute_logits(hidden)
        logits[:, self._suppress_token_ids] = float("-inf")
        return logits


class _RejectionSampler:
    def __init__(self) -> None:
        setattr(self, GREEDY_VERIFY_ATTR, GreedyVerifyStats())
        self.sampler = SimpleNamespace(compute_nans=False)
        self.handed: list[torch.Tensor] = []

    def verify(self, best: torch.Tensor, input_batch: Any) -> Any:
        self.handed.append(best)
        return SimpleNamespace(num_sampled="n", num_rejected="r")


setattr(_RejectionSampler, VERIFY_GREEDY_TOKENS, _RejectionSampler.verify)


def _runner_module() -> ModuleType:
    module = ModuleType("stand_in_v2_model_runner")

    class GPUModelRunner:
        def __init__(self, model: torch.nn.Module) -> None:
            self.model = model
            self.device = torch.device("cpu")
            self.rejection_sampler = _RejectionSampler()
            self.speculator = SimpleNamespace(draft_logits=None)

        def sample(self, hidden_states: Any, input_batch: Any, grammar_output: Any) -> Any:
            return "vllm's"

    module.GPUModelRunner = GPUModelRunner  # type: ignore[attr-defined]
    return module


def _batch(num_draft_tokens: int = 6) -> tuple[torch.Tensor, Any]:
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(10, HIDDEN, generator=gen)
    batch = SimpleNamespace(
        logits_indices=torch.tensor([0, 2, 3, 5, 6, 7, 9]), num_draft_tokens=num_draft_tokens
    )
    return hidden, batch


@pytest.fixture
def wrapped(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.delenv(patch.UNCAPPED_VERIFY_ENV, raising=False)  # on by default
    monkeypatch.setattr(patch, "v2_greedy_verify_supported", lambda: True)
    monkeypatch.setattr(patch, "greedy_verify_applies", lambda rs, batch, draft_logits: True)
    module = _runner_module()
    patch.apply(module)
    patch.apply(module)  # idempotent
    return module


def test_greedy_batch_is_verified_from_uncapped_logits(wrapped: ModuleType) -> None:
    target = _Target(CAP)
    runner = wrapped.GPUModelRunner(target)  # type: ignore[attr-defined]
    hidden, batch = _batch()
    out, num_sampled, num_rejected = runner.sample(hidden, batch, None)
    assert (num_sampled, num_rejected) == ("n", "r")
    (best,) = runner.rejection_sampler.handed
    rows = hidden[batch.logits_indices]
    with torch.no_grad():
        capped = target.logits_processor(target.lm_head, rows)  # vLLM's capped logits
    assert torch.equal(best, capped.argmax(dim=-1))
    assert torch.equal(best, capped_argmax_reference(rows @ target.lm_head.t(), CAP))
    assert target.seen_caps == [None] and target.logits_processor.soft_cap == CAP  # restored
    stats = getattr(runner.rejection_sampler, GREEDY_VERIFY_ATTR)
    assert stats.uncapped == 1


def test_a_multimodal_targets_suppressed_tokens_are_never_verified(wrapped: ModuleType) -> None:
    hidden, batch = _batch()
    rows = hidden[batch.logits_indices]
    with torch.no_grad():
        free = _Target(CAP).compute_logits(rows).argmax(dim=-1)  # the same weights, no suppression
    suppressed = sorted(set(free.tolist()))[:2]
    target = _MultimodalTarget(suppressed)
    runner = wrapped.GPUModelRunner(target)  # type: ignore[attr-defined]
    runner.sample(hidden, batch, None)
    (best,) = runner.rejection_sampler.handed
    assert target.calls == 0  # the language model computed the logits, not the list indexing
    with torch.no_grad():
        vllms = target.compute_logits(rows).argmax(dim=-1)  # capped, then suppressed
    assert torch.equal(best, vllms)
    assert not torch.equal(vllms, free) and not set(best.tolist()) & set(suppressed)
    source = patch.logits_source(runner)
    assert source.model is target.language_model and source.suppressed.tolist() == suppressed
    # Ours without the cap (the kernel caps), then the reference's above with it.
    assert target.language_model.seen_caps == [None, CAP]


def test_a_target_without_suppressed_tokens_computes_its_own_logits() -> None:
    target = _Target(CAP)
    assert patch.find_logits_source(target, torch.device("cpu")) == patch.LogitsSource(target, None)
    listless = _MultimodalTarget([])  # a checkpoint without suppress_tokens
    assert patch.find_logits_source(listless, torch.device("cpu")).model is listless


@pytest.mark.parametrize(
    "case", ["grammar", "no drafts", "not greedy", "switched off", "no cap", "scaled", "nans"]
)
def test_every_other_batch_runs_vllms_sample(
    wrapped: ModuleType,
    monkeypatch: pytest.MonkeyPatch,
    set_env: Callable[[str, str | None], None],
    case: str,
) -> None:
    target = _Target(None if case == "no cap" else CAP, scale=0.5 if case == "scaled" else 1.0)
    runner = wrapped.GPUModelRunner(target)  # type: ignore[attr-defined]
    hidden, batch = _batch(num_draft_tokens=0 if case == "no drafts" else 6)
    grammar = object() if case == "grammar" else None
    if case == "not greedy":
        monkeypatch.setattr(patch, "greedy_verify_applies", lambda rs, b, d: False)
    if case == "switched off":
        set_env(patch.UNCAPPED_VERIFY_ENV, "0")
    if case == "nans":
        runner.rejection_sampler.sampler.compute_nans = True
    assert runner.sample(hidden, batch, grammar) == "vllm's"
    assert target.seen_caps == [] and runner.rejection_sampler.handed == []


def test_engines_without_our_greedy_path_run_vllms_sample(wrapped: ModuleType) -> None:
    runner = wrapped.GPUModelRunner(_Target(CAP))  # type: ignore[attr-defined]
    delattr(runner.rejection_sampler, GREEDY_VERIFY_ATTR)  # not a gemma4_mtp engine's sampler
    hidden, batch = _batch()
    assert runner.sample(hidden, batch, None) == "vllm's"
    runner.rejection_sampler = None  # plain decoding
    assert runner.sample(hidden, batch, None) == "vllm's"


def test_cap_is_restored_when_the_logits_fail() -> None:
    head = patch.CappedHead(SimpleNamespace(soft_cap=CAP), CAP)
    with pytest.raises(RuntimeError), patch.uncapped(head):
        assert head.processor.soft_cap is None
        raise RuntimeError("lm_head failed")
    assert head.processor.soft_cap == CAP


def test_the_targets_one_capping_processor_is_found() -> None:
    target = _Target(CAP)
    head = patch.find_capped_head(target)
    assert head is not None and head.processor is target.logits_processor and head.cap == CAP
    target.second = _Target(CAP).logits_processor  # two: which one makes the logits is unknown
    assert patch.find_capped_head(target) is None


@pytest.mark.parametrize("supported", [True, False])
def test_start_up_runs_the_kernel_once_for_the_runners_logits(
    monkeypatch: pytest.MonkeyPatch, supported: bool
) -> None:
    # Called by the V2 warm-up wrapper (patch_v2_warmup.py): the kernel compiles and the
    # exactness check runs there, for the logits' dtype and the target's cap, not in a request.
    import gemma4_spec.ops.capped_argmax as ops

    calls: list[tuple[tuple[int, ...], torch.dtype, float | None]] = []
    monkeypatch.delenv(patch.UNCAPPED_VERIFY_ENV, raising=False)  # on by default
    monkeypatch.setenv(patch.GRAPHED_VERIFY_ENV, "0")  # the graphs have tests of their own
    monkeypatch.setattr(patch, "v2_greedy_verify_supported", lambda: supported)
    monkeypatch.setattr(
        ops, "capped_argmax", lambda x, cap: calls.append((tuple(x.shape), x.dtype, cap))
    )
    runner = SimpleNamespace(
        model=_Target(CAP),
        model_config=SimpleNamespace(get_vocab_size=lambda: VOCAB),
        dtype=torch.float16,
        device=torch.device("cpu"),
    )
    patch.prepare(runner)
    assert calls == ([((1, VOCAB), torch.float16, CAP)] if supported else [])
