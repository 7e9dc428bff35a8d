"""End to end on vLLM's CPU backend: greedy requests whose ``SamplingParams`` change or read the
logits (penalties, bad words, allowed tokens, min_tokens with a stop token, stop tokens and
strings, logprobs, min_p, structured outputs) give with our speculation (k = 3; the centroid
assistant, with and without chunked prefill, and the full-vocabulary one) exactly the tokens
plain decoding gives, request by request, in one batch that mixes them with plain greedy
requests; vLLM's in-tree gemma4_mtp runs the same batch (full-vocabulary assistant), to tell a
vLLM difference from ours.

The plugin verifies greedy batches without vLLM's rejection sampler only when nothing changes
their logits (``patch/patch_rejection_sampler.py``, ``greedy_verify_applies``): any such request
must send its batch to vLLM's path. The unit tests check the gate with stand-ins; here the
engine runs it. The plain requests generate longer than the others, so the last steps' batches
are plain greedy only and the plugin's own verification runs too, after the mixed steps.

Each parameter must change the tokens plain decoding gives (the equality would prove nothing
otherwise): the parameters are chosen from the tokens the prompts give without them (computed
with transformers before any engine starts: the stop tokens, stop string and bad words are in
those continuations), and a test checks that every one bites on the plain engine. Mild
penalties sit on prompts whose continuations repeat tokens, and penalties below zero (below one)
make them repeat, so the copy assistant's drafts are accepted in the penalised requests too (a
test checks it per request): verification must then count the accepted drafts among the earlier
tokens. min_p cannot bite: vLLM resets it to 0 for greedy requests (and refuses min_p > 0 with
speculative decoding, so a greedy request with one must still be taken). logprobs do not change
tokens; their values are compared instead.

What vLLM 0.32 itself does not answer with speculative decoding: it refuses logit_bias
(``SamplingParams`` validation), for ours and the in-tree gemma4_mtp; its V1 rejection sampler
returns no logprobs for ``logprob_token_ids``, and a batch with one request for them and another
for ``logprobs`` fails the whole engine. Ours refuses ``logprob_token_ids`` with a clear error
(``patch/patch_request_params.py``); the in-tree gemma4_mtp shows why (when vLLM answers them,
the refusal can go).

The tiny random pair of the other engine tests carries no tokenizer; bad words, stop strings and
structured outputs need one, so the target gets the tokenizer of the shipped GSM8k pair (the
same 2048-token vocabulary) and the engines run with it. float32 throughout.
"""

from __future__ import annotations

import math
import random
import re
import shutil
from collections.abc import Callable
from typing import Any

import pytest
from transformers import AutoTokenizer

from gemma4_spec.assets import tiny_gsm8k_pair
from gemma4_spec.testing.engine_run import (
    IN_TREE_PROPOSER,
    PLUGIN_PROPOSER,
    RunConfig,
    RunResult,
    generate_in_subprocess,
)
from gemma4_spec.testing.tiny import build_tiny_assistant, build_tiny_pair, hf_greedy_tokens

pytestmark = pytest.mark.engine

# One request per case, in this order, each on its own prompt (lengths: some beyond the
# sliding window of 16). The mild penalties sit on prompts whose plain continuations repeat
# tokens, so the copy assistant's drafts are accepted before the penalty changes a token.
CASES = (
    "repetition_penalty",
    "min_p",
    "presence_penalty",
    "structured_outputs",
    "frequency_penalty",
    "bad_words",
    "allowed_token_ids",
    "min_tokens",
    "plain-2",
    "stop_token_ids",
    "bad_words-two-tokens",
    "logprobs",
    "plain",
    "presence_penalty-negative",
    "frequency_penalty-negative",
    "repetition_penalty-below-one",
    "stop",
)
PROMPT_LENGTHS = (3, 9, 21, 40, 5, 12, 30, 7, 17, 26, 4, 33, 11, 19, 8, 14, 23)
MAX_TOKENS = 24
# The plain requests go on after the others have finished: all-greedy batches at the end.
PLAIN_MAX_TOKENS = 32
NUM_LOGPROBS = 5
# Tokens whose logprobs the logprob_token_ids request asks for.
LOGPROB_TOKEN_IDS = [5, 17, 1000]
MIN_TOKENS = 10
# Cases whose requests need not have a draft accepted: the no-op, a plain request, the
# structured one (the grammar cuts the copy assistant's drafts), and the stop string (vLLM
# keeps no per-request counts for a request its front end stops).
NO_ACCEPTANCE_NEEDED = ("min_p", "plain-2", "structured_outputs", "stop")
# Tokens a request with allowed_token_ids may generate: a quarter of the vocabulary.
ALLOWED = list(range(1, 2048, 4))
STRUCTURED_REGEX = r"[a-z]{1,6}( [a-z]{1,6}){3}"
LOGPROB_TOLERANCE = 1e-4
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# The engines run with the tokenizer (bad words and structured outputs need it); speculative
# ones count each request's accepted drafts too.
WITH_TOKENIZER = {"skip_tokenizer_init": False}
SPECULATIVE_ENGINE = {**WITH_TOKENIZER, "per_request_spec_decode_metrics": "summary"}
LOGIT_BIAS_CASE = "plain"  # the prompt whose first token a logit_bias forbids
# The prompts of the logprob_token_ids request and of the request beside it.
LOGPROB_IDS_CASES = ("logprobs", "plain")
# vLLM 0.32's error when one request of a speculative batch asks for logprob_token_ids and
# another for logprobs (rejection_sampler.py, RejectionSampler._get_logprobs_tensors).
LOGPROB_IDS_CRASH = "cannot be broadcast to indexing result of shape"
SPECULATIVE = ("centroids", "full-vocab", "centroids-chunked", "in-tree-full-vocab")
K = 3


def _first_occurrences(tokens: list[int]) -> list[int]:
    """Positions whose token does not occur earlier."""
    return [p for p, t in enumerate(tokens) if t not in tokens[:p]]


def _token_word(tokenizer: Any, tokens: list[int]) -> str | None:
    """The text of ``tokens`` if it is a bad word vLLM turns back into exactly these tokens
    (no leading space: vLLM strips it), else None."""
    text = tokenizer.decode(tokens)
    if not text or text != text.lstrip() or not text.isprintable():
        return None
    return text if tokenizer.encode(text, add_special_tokens=False) == tokens else None


def _bad_word(tokenizer: Any, reference: list[int], length: int) -> str:
    """A bad word of ``length`` tokens that the continuation ``reference`` holds from its third
    token on, first there (so banning it changes the continuation where it stands)."""
    for p in range(2, len(reference) - length + 1):
        tokens = reference[p : p + length]
        earlier = [reference[q : q + length] for q in range(p)]
        word = _token_word(tokenizer, tokens)
        if word is not None and tokens not in earlier:
            return word
    raise AssertionError(f"no {length}-token bad word in {reference}")


def _stop_token(reference: list[int], first: int, last: int) -> int:
    """A token that first occurs in ``reference`` at a position in [first, last]."""
    for p in _first_occurrences(reference):
        if first <= p <= last:
            return reference[p]
    raise AssertionError(f"no token first occurs at {first}..{last} in {reference}")


def _stop_string(tokenizer: Any, reference: list[int], first: int, last: int) -> str:
    """The text of a token at a position in [first, last] of ``reference`` that the text before
    it does not hold: a stop string that ends the continuation there."""
    for p in range(first, last + 1):
        text = tokenizer.decode(reference[p : p + 1]).strip()
        if len(text) > 1 and text.isprintable() and text not in tokenizer.decode(reference[:p]):
            return text
    raise AssertionError(f"no stop string at {first}..{last} in {reference}")


def _sampling(reference: list[list[int]], tokenizer: Any) -> list[dict[str, Any]]:
    """Each case's ``SamplingParams`` arguments, chosen from its prompt's plain continuation."""
    ref = dict(zip(CASES, reference, strict=True))
    params: dict[str, dict[str, Any]] = {
        "repetition_penalty": {"repetition_penalty": 1.05},
        "min_p": {"min_p": 0.5},
        "presence_penalty": {"presence_penalty": 0.1},
        # Ends with the end-of-sequence token once the text is complete.
        "structured_outputs": {
            "structured_outputs": {"regex": STRUCTURED_REGEX},
            "ignore_eos": False,
        },
        "frequency_penalty": {"frequency_penalty": 0.1},
        "bad_words": {"bad_words": [_bad_word(tokenizer, ref["bad_words"], 1)]},
        "allowed_token_ids": {"allowed_token_ids": ALLOWED},
        # A stop token among the first few tokens: without min_tokens it would end the request.
        "min_tokens": {
            "min_tokens": MIN_TOKENS,
            "stop_token_ids": [_stop_token(ref["min_tokens"], 1, 4)],
        },
        "plain-2": {"max_tokens": PLAIN_MAX_TOKENS},
        "stop_token_ids": {"stop_token_ids": [_stop_token(ref["stop_token_ids"], 8, 16)]},
        "bad_words-two-tokens": {
            "bad_words": [_bad_word(tokenizer, ref["bad_words-two-tokens"], 2)]
        },
        "logprobs": {"logprobs": NUM_LOGPROBS},
        "plain": {"max_tokens": PLAIN_MAX_TOKENS},
        # Penalties below zero (below one) favour repeating: most drafts are accepted.
        "presence_penalty-negative": {"presence_penalty": -1.0},
        "frequency_penalty-negative": {"frequency_penalty": -0.5},
        "repetition_penalty-below-one": {"repetition_penalty": 0.8},
        "stop": {"stop": [_stop_string(tokenizer, ref["stop"], 8, 16)]},
    }
    assert tuple(params) == CASES
    return list(params.values())


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Checkpoints (the target with a tokenizer), prompts and the cases' sampling arguments."""
    root = tmp_path_factory.mktemp("tiny")
    target, centroids = build_tiny_pair(root, centroids=True, style="copy")
    full_vocab = build_tiny_assistant(root / "assistant-full-vocab", target, centroids=False)
    gsm8k_target, _ = tiny_gsm8k_pair()
    for name in TOKENIZER_FILES:
        shutil.copy(gsm8k_target / name, target / name)
    tokenizer = AutoTokenizer.from_pretrained(target)
    rng = random.Random(1234)
    prompts = [[rng.randrange(3, 2048) for _ in range(n)] for n in PROMPT_LENGTHS]
    reference = hf_greedy_tokens(target, prompts, MAX_TOKENS)
    return {
        "target": str(target),
        "centroids": str(centroids),
        "full-vocab": str(full_vocab),
        "tokenizer": tokenizer,
        "prompts": prompts,
        "reference": reference,
        "sampling": _sampling(reference, tokenizer),
    }


@pytest.fixture(scope="module")
def runs(setup: dict[str, Any]) -> dict[str, RunResult]:
    """In one process: the batch without its parameters (``unset``), and with them plainly and
    with our speculation; the logit_bias request alone and the logprob_token_ids batches, the
    same ways. Then vLLM's in-tree gemma4_mtp on the speculative ones (full-vocab assistant)."""
    base: dict[str, Any] = dict(
        target=setup["target"],
        prompts=setup["prompts"],
        max_tokens=MAX_TOKENS,
        extra_engine_kwargs=WITH_TOKENIZER,
    )
    batch = dict(base, sampling=setup["sampling"])
    index = CASES.index(LOGIT_BIAS_CASE)
    # The logit_bias request: its prompt alone, the first token of its continuation forbidden.
    biased = dict(
        base,
        prompts=[setup["prompts"][index]],
        sampling=[{"logit_bias": {setup["reference"][index][0]: -100.0}}],
        record_refusal=True,
    )
    speculative = dict(num_speculative_tokens=K, extra_engine_kwargs=SPECULATIVE_ENGINE)
    centroids = dict(speculative, assistant=setup["centroids"])
    full_vocab = dict(speculative, assistant=setup["full-vocab"])
    ids = _logprob_ids_batch(setup, beside={})
    named = {
        "unset": RunConfig(**base),
        "plain": RunConfig(**batch),
        "centroids": RunConfig(**{**batch, **centroids}),
        "full-vocab": RunConfig(**{**batch, **full_vocab}),
        # Prefill in chunks of 32 tokens: requests start decoding at different steps, so the
        # batch's mix of parameters changes from step to step.
        "centroids-chunked": RunConfig(**{**batch, **centroids}, max_num_batched_tokens=32),
        "plain-logit-bias": RunConfig(**biased),
        "centroids-logit-bias": RunConfig(**{**biased, **centroids}),
        "plain-logprob-ids": RunConfig(**ids),
        "centroids-logprob-ids": RunConfig(**{**ids, **centroids}, record_refusal=True),
        "centroids-logprob-ids-beside-logprobs": RunConfig(
            **{**_logprob_ids_batch(setup), **centroids}, record_refusal=True
        ),
    }
    results = dict(zip(named, generate_in_subprocess(list(named.values())), strict=True))
    in_tree = {
        "in-tree-full-vocab": RunConfig(**{**batch, **full_vocab}),
        "in-tree-logit-bias": RunConfig(**{**biased, **full_vocab}),
        "in-tree-logprob-ids": RunConfig(**{**ids, **full_vocab}),
    }
    in_tree_results = generate_in_subprocess(list(in_tree.values()), plugins="none")
    results.update(zip(in_tree, in_tree_results, strict=True))
    return results


def _logprob_ids_batch(
    setup: dict[str, Any], beside: dict[str, Any] | None = None
) -> dict[str, Any]:
    """RunConfig fields of a batch of two: a request for logprob_token_ids, and one with
    ``beside`` (by default a request for logprobs: vLLM's speculative path fails on the mix)."""
    indices = [CASES.index(case) for case in LOGPROB_IDS_CASES]
    return dict(
        target=setup["target"],
        prompts=[setup["prompts"][i] for i in indices],
        max_tokens=MAX_TOKENS,
        extra_engine_kwargs=WITH_TOKENIZER,
        sampling=[
            {"logprob_token_ids": LOGPROB_TOKEN_IDS},
            {"logprobs": NUM_LOGPROBS} if beside is None else beside,
        ],
    )


def _first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two token lists differ (one ending early counts), or None."""
    for p, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return p
    return None if len(a) == len(b) else min(len(a), len(b))


@pytest.mark.parametrize("variant", SPECULATIVE)
@pytest.mark.parametrize("case", CASES)
def test_same_tokens_as_plain(runs: dict[str, RunResult], variant: str, case: str) -> None:
    i = CASES.index(case)
    plain, spec = runs["plain"].token_ids[i], runs[variant].token_ids[i]
    assert spec == plain, (
        f"{case} with {variant}: first difference at position "
        f"{_first_difference(plain, spec)}\nplain: {plain}\nspec:  {spec}"
    )


def _changed(unset: list[int], plain: list[int], params: dict[str, Any], tokenizer: Any) -> None:
    assert plain != unset


def _unchanged(unset: list[int], plain: list[int], params: dict[str, Any], tokenizer: Any) -> None:
    assert plain == unset


def _plain_longer(
    unset: list[int], plain: list[int], params: dict[str, Any], tokenizer: Any
) -> None:
    # The same continuation, on to PLAIN_MAX_TOKENS.
    assert len(plain) == PLAIN_MAX_TOKENS and plain[:MAX_TOKENS] == unset


def _bad_word_gone(
    unset: list[int], plain: list[int], params: dict[str, Any], tokenizer: Any
) -> None:
    (word,) = params["bad_words"]
    tokens = tokenizer.encode(word, add_special_tokens=False)
    windows = [plain[p : p + len(tokens)] for p in range(len(plain))]
    assert tokens in [unset[p : p + len(tokens)] for p in range(len(unset))]
    assert tokens not in windows and plain != unset


def _only_allowed(
    unset: list[int], plain: list[int], params: dict[str, Any], tokenizer: Any
) -> None:
    assert set(plain) <= set(ALLOWED) and not set(unset) <= set(ALLOWED)


def _stops_late(unset: list[int], plain: list[int], params: dict[str, Any], tokenizer: Any) -> None:
    # Without min_tokens the stop token would have ended the request before MIN_TOKENS tokens.
    (stop,) = params["stop_token_ids"]
    assert unset.index(stop) < MIN_TOKENS - 1
    assert stop not in plain[:MIN_TOKENS] and len(plain) > MIN_TOKENS
    assert plain != unset[: len(plain)]


def _stops_early(
    unset: list[int], plain: list[int], params: dict[str, Any], tokenizer: Any
) -> None:
    # Ends at (and with) its stop token, well before MAX_TOKENS.
    (stop,) = params["stop_token_ids"]
    assert plain == unset[: unset.index(stop) + 1] and len(plain) < MAX_TOKENS


def _stops_early_on_text(
    unset: list[int], plain: list[int], params: dict[str, Any], tokenizer: Any
) -> None:
    # Ends with the token that completes its stop string, well before MAX_TOKENS.
    (stop,) = params["stop"]
    assert plain == unset[: len(plain)] and len(plain) < MAX_TOKENS
    assert stop in tokenizer.decode(plain) and stop not in tokenizer.decode(plain[:-1])


def _structured(unset: list[int], plain: list[int], params: dict[str, Any], tokenizer: Any) -> None:
    # The text matches the regex, and the request ended with end-of-sequence once it did.
    text = tokenizer.decode(plain, skip_special_tokens=True)
    assert re.fullmatch(STRUCTURED_REGEX, text), text
    assert plain[-1] == tokenizer.eos_token_id and len(plain) < MAX_TOKENS


# How each case shows that its parameter took effect on the plain engine: the continuation
# without it (``unset``) against the one with it.
BITES: dict[str, Callable[[list[int], list[int], dict[str, Any], Any], None]] = {
    "plain": _plain_longer,
    "logprobs": _unchanged,  # the values are checked in test_logprobs_equal_plain_ones
    "presence_penalty": _changed,
    "frequency_penalty": _changed,
    "repetition_penalty": _changed,
    "bad_words": _bad_word_gone,
    "allowed_token_ids": _only_allowed,
    "min_tokens": _stops_late,
    "plain-2": _plain_longer,
    "stop_token_ids": _stops_early,
    "bad_words-two-tokens": _bad_word_gone,
    "min_p": _unchanged,  # vLLM resets min_p to 0 for greedy requests: nothing to bite
    "structured_outputs": _structured,
    "presence_penalty-negative": _changed,
    "frequency_penalty-negative": _changed,
    "repetition_penalty-below-one": _changed,
    "stop": _stops_early_on_text,
}


@pytest.mark.parametrize("case", CASES)
def test_each_parameter_takes_effect(
    setup: dict[str, Any], runs: dict[str, RunResult], case: str
) -> None:
    i = CASES.index(case)
    unset, plain = runs["unset"].token_ids[i], runs["plain"].token_ids[i]
    # The engine's plain continuations are the ones the parameters were chosen from.
    assert unset == setup["reference"][i]
    BITES[case](unset, plain, setup["sampling"][i], setup["tokenizer"])


@pytest.mark.parametrize("variant", SPECULATIVE)
def test_logprobs_equal_plain_ones(runs: dict[str, RunResult], variant: str) -> None:
    i = CASES.index("logprobs")
    plain = runs["plain"]
    assert len(plain.logprobs[i]) == MAX_TOKENS
    for token, position in zip(plain.token_ids[i], plain.logprobs[i], strict=True):
        assert token in dict(position) and len(position) >= NUM_LOGPROBS
    _assert_close(plain.logprobs[i], runs[variant].logprobs[i])


def _assert_close(want: list[list[tuple[int, float]]], got: list[list[tuple[int, float]]]) -> None:
    """Equal logprobs: the same tokens at each position, values within LOGPROB_TOLERANCE."""
    assert len(got) == len(want)
    for p, (want_pairs, got_pairs) in enumerate(zip(want, got, strict=True)):
        want_map, got_map = dict(map(tuple, want_pairs)), dict(map(tuple, got_pairs))
        assert want_map.keys() == got_map.keys(), p
        for token, value in want_map.items():
            assert math.isclose(got_map[token], value, abs_tol=LOGPROB_TOLERANCE), (p, token)


def test_plain_decoding_answers_logprob_token_ids(runs: dict[str, RunResult]) -> None:
    # The chosen token's logprob and those of the tokens asked for, at every position.
    plain = runs["plain-logprob-ids"]
    for token, position in zip(plain.token_ids[0], plain.logprobs[0], strict=True):
        assert dict(position).keys() == {token, *LOGPROB_TOKEN_IDS}


@pytest.mark.parametrize(
    "variant", ["centroids-logprob-ids", "centroids-logprob-ids-beside-logprobs"]
)
def test_ours_refuses_logprob_token_ids(runs: dict[str, RunResult], variant: str) -> None:
    # Refused before any step, naming the parameter and what to ask for instead; alone or
    # beside a request for logprobs (which failed the engine before the refusal).
    refusal = runs[variant].refusal
    assert refusal is not None and "logprob_token_ids" in refusal and "logprobs=N" in refusal
    assert runs[variant].token_ids == []


def test_why_ours_refuses_logprob_token_ids(
    setup: dict[str, Any], runs: dict[str, RunResult]
) -> None:
    # vLLM's in-tree gemma4_mtp on the V1 runner: the same tokens as plain decoding but no
    # logprobs for them, and the engine fails when a request for logprobs shares the batch.
    # Where this no longer holds, vLLM answers them and patch_request_params's refusal can go.
    in_tree = runs["in-tree-logprob-ids"]
    assert in_tree.token_ids == runs["plain-logprob-ids"].token_ids
    assert in_tree.logprobs[0] == []
    speculative = dict(num_speculative_tokens=K, extra_engine_kwargs=SPECULATIVE_ENGINE)
    beside = RunConfig(
        **{**_logprob_ids_batch(setup), **speculative}, assistant=setup["full-vocab"]
    )
    with pytest.raises(RuntimeError, match=LOGPROB_IDS_CRASH):
        generate_in_subprocess([beside], plugins="none")


@pytest.mark.parametrize("variant", SPECULATIVE)
@pytest.mark.parametrize("case", [c for c in CASES if c not in NO_ACCEPTANCE_NEEDED])
def test_drafts_were_accepted(runs: dict[str, RunResult], variant: str, case: str) -> None:
    # Verification with the parameter went on past accepted drafts, where it must count them
    # (among the earlier tokens a penalty or a bad word's prefix looks at, in min_tokens' count).
    assert runs[variant].accepted_drafts[CASES.index(case)] > 0


@pytest.mark.parametrize("variant", ["centroids", "full-vocab", "centroids-chunked"])
def test_both_verification_paths_ran(runs: dict[str, RunResult], variant: str) -> None:
    # Steps with a parameterised request went through vLLM's rejection sampler, the all-plain
    # steps at the end through the plugin's greedy verification; drafts were accepted.
    run = runs[variant]
    assert run.proposer_class == PLUGIN_PROPOSER
    assert 0 < run.greedy_verify_batches < run.verify_metadata_builds
    assert run.spec_metrics["vllm:spec_decode_num_accepted_tokens"] > 0


def test_in_tree_ran_vllms_proposer(runs: dict[str, RunResult]) -> None:
    run = runs["in-tree-full-vocab"]
    assert run.proposer_class == IN_TREE_PROPOSER
    assert run.spec_metrics["vllm:spec_decode_num_accepted_tokens"] > 0


@pytest.mark.parametrize("variant", ["centroids-logit-bias", "in-tree-logit-bias"])
def test_logit_bias_is_refused_with_speculation(runs: dict[str, RunResult], variant: str) -> None:
    # Plain decoding takes it, and it changes the first token; every speculative engine refuses
    # it (vLLM's SamplingParams validation), so no user gets a speculative answer to compare.
    unset = runs["unset"].token_ids[CASES.index(LOGIT_BIAS_CASE)]
    biased = runs["plain-logit-bias"]
    assert biased.refusal is None and biased.token_ids[0][0] != unset[0]
    assert runs[variant].refusal is not None and "logit_bias" in runs[variant].refusal
    assert runs[variant].token_ids == []
    # Ours gives vLLM's refusal again with the parameter named and what to do
    # (patch/patch_request_params.py); vLLM's own names neither.
    named = "remove logit_bias from the request" in runs[variant].refusal
    assert named is (variant == "centroids-logit-bias")
