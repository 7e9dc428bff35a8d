"""Tiny random Gemma 4 checkpoints: load in transformers, deterministic, behave as built."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    Gemma4AssistantForCausalLM,
    Gemma4ForCausalLM,
)

from gemma4_spec.testing.tiny import (
    FULL,
    SLIDING,
    build_tiny_assistant,
    build_tiny_pair,
    build_tiny_target,
    hf_draft_step,
)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny")


@pytest.fixture(scope="module")
def pair(root: Path) -> tuple[Path, Path]:
    return build_tiny_pair(root / "default")


@pytest.fixture(scope="module")
def plain_copy(pair: tuple[Path, Path], root: Path) -> Path:
    return build_tiny_assistant(root / "plain-copy", pair[0], centroids=False)


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


def _load_target(path: Path) -> Gemma4ForCausalLM:
    return Gemma4ForCausalLM.from_pretrained(path, attn_implementation="eager").eval()


def _load_assistant(path: Path) -> Gemma4AssistantForCausalLM:
    return Gemma4AssistantForCausalLM.from_pretrained(path, attn_implementation="eager").eval()


def test_checkpoints_load_with_auto_classes(pair: tuple[Path, Path]) -> None:
    target_dir, assistant_dir = pair
    assert AutoConfig.from_pretrained(target_dir).model_type == "gemma4_text"
    assert AutoConfig.from_pretrained(assistant_dir).model_type == "gemma4_assistant"
    for path, cls in ((target_dir, Gemma4ForCausalLM), (assistant_dir, Gemma4AssistantForCausalLM)):
        model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
        assert isinstance(model, cls)
        assert not info["missing_keys"] and not info["unexpected_keys"]
        # lm_head stays tied to the embedding, as in the real checkpoints.
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert not (target_dir / "tokenizer.json").exists()


def test_token_ordering_is_a_permutation(pair: tuple[Path, Path], root: Path) -> None:
    random_dir = build_tiny_assistant(root / "random", pair[0], style="random")
    for path in (pair[1], random_dir):
        config = AutoConfig.from_pretrained(path)
        vocab = config.get_text_config().vocab_size
        assert vocab % config.num_centroids == 0
        ordering = _tensors(path)["masked_embedding.token_ordering"]
        assert ordering.dtype == torch.int64
        assert torch.equal(ordering.sort().values, torch.arange(vocab))
        # ...and survives transformers' loading (which would zero-init it otherwise).
        loaded = _load_assistant(path).masked_embedding
        assert loaded is not None and torch.equal(loaded.token_ordering, ordering)


def test_same_seed_same_bytes_other_seed_differs(root: Path) -> None:
    a_t, a_a = build_tiny_pair(root / "seed-a", seed=3)
    b_t, b_a = build_tiny_pair(root / "seed-b", seed=3)
    c_t, c_a = build_tiny_pair(root / "seed-c", seed=4)
    for a, b, c in ((a_t, b_t, c_t), (a_a, b_a, c_a)):
        assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
        ta, tc = _tensors(a), _tensors(c)
        assert ta.keys() == tc.keys()
        assert not torch.equal(ta["model.embed_tokens.weight"], tc["model.embed_tokens.weight"])


def test_dtype_is_respected(root: Path) -> None:
    target, assistant = build_tiny_pair(root / "bf16", dtype=torch.bfloat16)
    assert _tensors(target)["model.embed_tokens.weight"].dtype == torch.bfloat16
    tensors = _tensors(assistant)
    assert tensors["pre_projection.weight"].dtype == torch.bfloat16
    assert tensors["masked_embedding.token_ordering"].dtype == torch.int64


def _assistant_final_hidden(
    target: Gemma4ForCausalLM, assistant: Gemma4AssistantForCausalLM, tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run one draft step for every token in ``tokens`` (as a batch) after a random prompt.

    Returns the assistant's final-normed hidden [n, 64] (what the lm_head consumes) and its logits.
    """
    prompt = torch.randint(
        0, target.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(1)
    )
    n = tokens.shape[0]
    with torch.no_grad():
        out = target(
            input_ids=prompt,
            use_cache=False,
            output_hidden_states=True,
            return_shared_kv_states=True,
        )
        hidden = out.hidden_states[-1][:, -1:].expand(n, 1, -1)
        shared = {
            k: (v[0].expand(n, -1, -1, -1), v[1].expand(n, -1, -1, -1))
            for k, v in out.shared_kv_states.items()
        }
        embeds = torch.cat([target.get_input_embeddings()(tokens[:, None]), hidden], dim=-1)
        draft = assistant(
            inputs_embeds=embeds,
            position_ids=torch.full((n, 1), prompt.shape[1]),
            shared_kv_states=shared,
            output_hidden_states=True,
        )
    return draft.hidden_states[-1][:, 0], draft.logits[:, 0]


@pytest.mark.parametrize("centroids", [True, False])
def test_copy_assistant_drafts_its_input_token(
    pair: tuple[Path, Path], plain_copy: Path, centroids: bool
) -> None:
    target = _load_target(pair[0])
    assistant = _load_assistant(pair[1] if centroids else plain_copy)
    vocab = target.config.vocab_size
    tokens = torch.arange(vocab)
    final, hf_logits = _assistant_final_hidden(target, assistant, tokens)
    embed = assistant.model.embed_tokens.weight  # == lm_head

    full_argmax = (final @ embed.T).argmax(-1)
    assert (full_argmax == tokens).float().mean() > 0.9

    masked = assistant.masked_embedding
    if not centroids:
        assert masked is None
        assert torch.equal(hf_logits.argmax(-1), full_argmax)
        return
    assert masked is not None
    # Centroid path in plain torch: top-k centroids -> their tokens -> argmax among those.
    top = (
        (final @ masked.centroids.weight.T)
        .topk(assistant.config.centroid_intermediate_top_k)
        .indices
    )
    clusters = masked.token_ordering.view(assistant.config.num_centroids, -1)
    candidates = clusters[top].flatten(1)  # [vocab, top_k * tokens_per_centroid]
    scores = (final[:, None, :] * embed[candidates]).sum(-1)
    centroid_argmax = candidates.gather(1, scores.argmax(-1, keepdim=True))[:, 0]
    assert (centroid_argmax == tokens).float().mean() > 0.9
    assert torch.equal(hf_logits.argmax(-1), centroid_argmax)


def test_hf_draft_step_shapes(pair: tuple[Path, Path]) -> None:
    prompt = torch.randint(0, 2048, (24,), generator=torch.Generator().manual_seed(2)).tolist()
    step = hf_draft_step(pair[0], pair[1], prompt)
    assert step.inputs_embeds.shape == (1, 1, 256)
    assert step.position_ids.tolist() == [[len(prompt)]]
    assert step.logits.shape == (1, 1, 2048)
    assert step.projected_hidden.shape == (1, 1, 128)
    assert step.target_hidden.shape == (1, 1, 128)
    assert set(step.shared_kv_states) == {SLIDING, FULL}
    for name, head_dim in ((SLIDING, 32), (FULL, 64)):
        k, v = step.shared_kv_states[name]
        assert k.shape == v.shape == (1, 2, len(prompt), head_dim)
    # Token half of inputs_embeds is the target's scaled embedding of its greedy token.
    embed = _tensors(pair[0])["model.embed_tokens.weight"][step.token_id]
    torch.testing.assert_close(step.inputs_embeds[0, 0, :128], embed * 128**0.5)
    torch.testing.assert_close(step.inputs_embeds[0, 0, 128:], step.target_hidden[0, 0])
    # The copy assistant drafts the token it was given.
    assert int(step.logits.argmax()) == step.token_id


def test_target_greedy_generation_is_not_degenerate(pair: tuple[Path, Path]) -> None:
    target = _load_target(pair[0])
    prompt = torch.randint(0, 2048, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = target.generate(prompt, max_new_tokens=20, do_sample=False, eos_token_id=None)
    new = out[0, 8:].tolist()
    assert len(new) == 20 and len(set(new)) > 1


def test_kv_shared_target_pair(root: Path) -> None:
    target_dir, assistant_dir = build_tiny_pair(
        root / "shared", num_hidden_layers=6, num_kv_shared_layers=2
    )
    config = AutoConfig.from_pretrained(target_dir)
    assert config.num_kv_shared_layers == 2
    assert config.layer_types == [SLIDING, SLIDING, SLIDING, FULL, SLIDING, FULL]
    names = _tensors(target_dir).keys()
    assert "model.layers.3.self_attn.k_proj.weight" in names
    assert "model.layers.4.self_attn.k_proj.weight" not in names
    step = hf_draft_step(target_dir, assistant_dir, list(range(10, 30)))
    assert step.shared_kv_states[FULL][0].shape == (1, 2, 20, 64)


def test_bad_target_layouts_are_rejected(root: Path) -> None:
    with pytest.raises(ValueError, match="last Gemma 4 layer must be full attention"):
        build_tiny_target(root / "bad", layer_types=[SLIDING, FULL, SLIDING, SLIDING])
    # Shared layers would have no full-attention layer to read.
    with pytest.raises(ValueError, match="must include a sliding and a full layer"):
        build_tiny_target(root / "bad", num_kv_shared_layers=1)
