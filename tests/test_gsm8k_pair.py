"""The shipped GSM8k-trained tiny pair (``gemma4_spec.assets.tiny_gsm8k_pair``) and its builder.

Loads in transformers with its tokenizer and chat template, passes our validation, has a real
clustered ``token_ordering``, decodes losslessly through vLLM; the builder runs end to end on a
tiny budget.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoTokenizer,
    Gemma4AssistantForCausalLM,
    Gemma4ForCausalLM,
)

from gemma4_spec.assets import tiny_gsm8k_pair
from gemma4_spec.cli import main as cli_main
from gemma4_spec.data import gsm8k
from gemma4_spec.testing.engine_run import RunConfig, generate_in_subprocess
from gemma4_spec.training.corpus import prompt_ids
from gemma4_spec.training.tokenizer import END_OF_TURN, START_OF_TURN
from gemma4_spec.validation import read_token_ordering, validate_pair, validate_token_ordering


@pytest.fixture(scope="module")
def pair() -> tuple[Path, Path]:
    return tiny_gsm8k_pair()


def _check_loadable(target: Path, assistant: Path) -> None:
    validate_pair(AutoConfig.from_pretrained(target), AutoConfig.from_pretrained(assistant))
    Gemma4ForCausalLM.from_pretrained(target, dtype=torch.float32)
    Gemma4AssistantForCausalLM.from_pretrained(assistant, dtype=torch.float32)
    AutoTokenizer.from_pretrained(target)


def test_tokenizer_round_trip_and_chat_template(pair: tuple[Path, Path]) -> None:
    tokenizer = AutoTokenizer.from_pretrained(pair[0])
    config = AutoConfig.from_pretrained(pair[0])
    assert len(tokenizer) == config.vocab_size
    problem = gsm8k.load("test", limit=1)[0]
    ids = tokenizer(problem.question, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == problem.question
    assert len(ids) < len(problem.question) / 2  # BPE merges, not bytes
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+3?"}], tokenize=False, add_generation_prompt=True
    )
    assert rendered == (
        f"<bos>{START_OF_TURN}user\nWhat is 2+3?{END_OF_TURN}\n{START_OF_TURN}model\n"
    )
    chat_ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert chat_ids[0] == tokenizer.bos_token_id == config.bos_token_id
    assert tokenizer.convert_tokens_to_ids(END_OF_TURN) in config.eos_token_id


def test_models_load_and_validate(pair: tuple[Path, Path]) -> None:
    _check_loadable(*pair)


def test_token_ordering_is_a_clustering(pair: tuple[Path, Path]) -> None:
    """A permutation that groups similar lm_head rows: clusters far tighter than random ones."""
    target, assistant_dir = pair
    assistant = Gemma4AssistantForCausalLM.from_pretrained(assistant_dir, dtype=torch.float32)
    head = assistant.masked_embedding
    assert head is not None
    ordering = read_token_ordering(assistant_dir)
    assert ordering is not None
    vocab = assistant.config.get_text_config().vocab_size
    validate_token_ordering(ordering, vocab, head.num_centroids)
    assert not torch.equal(ordering, torch.arange(vocab))

    # Rows share a large common direction (no effect on any argmax): compare what is left.
    weight = assistant.lm_head.weight.detach()
    rows = torch.nn.functional.normalize(weight - weight.mean(0), dim=-1)

    def tightness(order: torch.Tensor) -> float:
        """Mean cosine of each (centred) row to its cluster's mean direction."""
        clusters = rows[order].view(head.num_centroids, -1, rows.shape[1])
        centres = torch.nn.functional.normalize(clusters.mean(1, keepdim=True), dim=-1)
        return float((clusters * centres).sum(-1).mean())

    random_order = torch.randperm(vocab, generator=torch.Generator().manual_seed(0))
    assert tightness(ordering) > 1.3 * tightness(random_order)


def test_builder_runs_end_to_end_and_is_deterministic(
    tmp_path: Path, pair: tuple[Path, Path]
) -> None:
    budget = ["--target-steps", "2", "--distill-prompts", "8", "--assistant-steps", "2"]
    outs = [tmp_path / "first", tmp_path / "second"]
    for out in outs:
        code = cli_main(["build-gsm8k-pair", "--out", str(out), *budget, "--centroid-steps", "2"])
        assert code == 0
    first = outs[0]
    _check_loadable(first / "target", first / "assistant")
    ordering = read_token_ordering(first / "assistant")
    assert ordering is not None and not torch.equal(ordering, torch.arange(ordering.numel()))
    for name in ("target/model.safetensors", "assistant/model.safetensors"):
        assert (outs[0] / name).read_bytes() == (outs[1] / name).read_bytes(), name
    # The tokenizer depends on the data only, the configs on the recipe's shapes only (not the
    # budget): the shipped ones are the ones the builder makes, configs in the flat form that
    # every supported transformers reads (gemma4_spec.testing.config_format).
    for shipped in pair:
        for name in ("tokenizer.json", "config.json", "generation_config.json"):
            built = (first / shipped.name / name).read_bytes()
            assert built == (shipped / name).read_bytes(), f"{shipped.name}/{name}"


def test_builder_reports_missing_gsm8k(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An explicit folder without GSM8k (or without its train split) is an error, not a
    fallback to the shipped copy: one line, status 2, nothing built."""
    out = tmp_path / "pair"
    assert cli_main(["build-gsm8k-pair", "--out", str(out), "--gsm8k", str(tmp_path)]) == 2
    assert "GSM8k not found" in capsys.readouterr().err
    (tmp_path / "test.jsonl").write_text("")
    assert cli_main(["build-gsm8k-pair", "--out", str(out), "--gsm8k", str(tmp_path)]) == 2
    assert "no train split" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.engine
def test_speculative_equals_plain_through_vllm(pair: tuple[Path, Path]) -> None:
    """Greedy float32: identical tokens with and without speculation (vLLM loads the tokenizer
    too, to detokenize)."""
    target, assistant = pair
    tokenizer = AutoTokenizer.from_pretrained(target)
    prompts = [prompt_ids(tokenizer, p.question) for p in gsm8k.load("test", limit=4)]
    common = dict(
        target=str(target),
        prompts=prompts,
        max_tokens=48,
        extra_engine_kwargs={"skip_tokenizer_init": False},
    )
    plain, spec = generate_in_subprocess(
        [RunConfig(**common), RunConfig(**common, assistant=str(assistant))]
    )
    assert spec.proposer_class == "gemma4_spec.spec_decode.proposer.Gemma4Proposer"
    assert spec.token_ids == plain.token_ids
    assert spec.acceptance_rate > 0.3  # a trained assistant: most drafts are right
