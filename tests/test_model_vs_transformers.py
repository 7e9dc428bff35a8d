"""Our vLLM assistant module against transformers' ``Gemma4AssistantForCausalLM``.

Both run one draft step on the same weights, the same input and the same shared K/V (the
target's own, from transformers). vLLM's paged attention needs a running engine, so here each
Q-only layer's ``attn`` is replaced by plain attention over those K/V; everything else (weight
loading, projections, q-norm, RoPE, MLPs, norms, layer scalars, lm_head, centroid masking) is our
code as vLLM runs it. The engine-level attention path is covered by the end-to-end tests.

Tolerance: float32 throughout; vLLM's and transformers' RoPE and norm kernels round differently,
so values agree to ~1e-5 relative, asserted at 1e-4.
"""

import glob
import json

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from gemma4_spec.testing.families import build_family_pair
from gemma4_spec.testing.tiny import build_tiny_pair, hf_draft_step

PROMPT = [17, 301, 5, 999, 42, 1500, 7, 64, 128, 256, 3]  # shorter than the sliding window
TOL = dict(rtol=1e-4, atol=1e-4)


class SharedKVAttention(nn.Module):
    """Stand-in for vLLM's ``Attention`` in a KV-shared layer: the query attends, with scale
    1.0 and grouped KV heads, to fixed K/V ``[1, kv_heads, L, d]`` of the target."""

    def __init__(self, key: torch.Tensor, value: torch.Tensor, num_heads: int) -> None:
        super().__init__()
        self.key, self.value, self.num_heads = key[0], value[0], num_heads

    def forward(self, q: torch.Tensor, k: None, v: None) -> torch.Tensor:
        kv_heads, _, dim = self.key.shape
        group = self.num_heads // kv_heads
        q = q.view(-1, self.num_heads, dim).transpose(0, 1)  # [H, T, d]
        key = self.key.repeat_interleave(group, dim=0)
        value = self.value.repeat_interleave(group, dim=0)
        weights = torch.softmax(q @ key.transpose(1, 2), dim=-1)
        return (weights @ value).transpose(0, 1).reshape(q.shape[1], -1)


def _assistant_module(target_dir, assistant_dir, tmp_path):  # type: ignore[no-untyped-def]
    """Build our model (and vLLM's target, whose layers it reads) in a single-rank vLLM."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import (
        cleanup_dist_env_and_memory,
        init_distributed_environment,
        initialize_model_parallel,
    )
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.models.gemma4 import Gemma4ForCausalLM

    from gemma4_spec.models.gemma4_mtp import Gemma4AssistantForDrafting

    config = EngineArgs(
        model=str(target_dir),
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=256,
        enforce_eager=True,
        speculative_config={
            "method": "gemma4_mtp",
            "model": str(assistant_dir),
            "num_speculative_tokens": 1,
        },
    ).create_engine_config()
    with set_current_vllm_config(config):
        init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            distributed_init_method=f"file://{tmp_path}/dist",
            backend="gloo",
        )
        initialize_model_parallel(1, 1)
        try:
            target = Gemma4ForCausalLM(vllm_config=config)
            draft = Gemma4AssistantForDrafting(vllm_config=config)
            target.load_weights(_tensors(target_dir).items())
            draft.load_weights(_tensors(assistant_dir).items())
            # What vLLM's loader does next (on CPU it prepares the linear kernels).
            for model in (target, draft):
                process_weights_after_loading(model, config.model_config, torch.device("cpu"))
        finally:
            cleanup_dist_env_and_memory()
    draft.model.embed_tokens = target.model.embed_tokens
    return target, draft


def _attend_to_reference_kv(draft, ref) -> None:  # type: ignore[no-untyped-def]
    """Make each Q-only layer attend to the target K/V that transformers gave the assistant."""
    for layer, layer_type in zip(draft.model.layers, draft.text_config.layer_types, strict=True):
        key, value = ref.shared_kv_states[layer_type]
        layer.self_attn.attn = SharedKVAttention(key, value, layer.self_attn.num_heads)


def _tensors(directory) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(glob.glob(f"{directory}/*.safetensors")):
        tensors.update(load_file(path))
    return tensors


@pytest.mark.parametrize("centroids", [True, False], ids=["centroids", "full-vocab"])
def test_one_draft_step_matches_transformers(tmp_path, centroids: bool) -> None:
    target_dir, assistant_dir = build_tiny_pair(tmp_path / "pair", centroids=centroids)
    _check_one_draft_step(target_dir, assistant_dir, tmp_path, centroids)


@pytest.mark.parametrize(
    ("family", "sources"), [("e4b", [4, 5]), ("26b-a4b", [10, 11]), ("31b", [10, 11])]
)
def test_one_draft_step_matches_transformers_on_other_families(
    tmp_path, family: str, sources: list[int]
) -> None:
    """E4B (KV-shared target layers, half as many draft query heads), 26B-A4B (MoE, k_eq_v
    full layers with 1 KV head against 4) and 31B (k_eq_v): each draft layer reads the cache of
    the target's last layer of its type that owns one, and computes what transformers does."""
    target_dir, assistant_dir = build_family_pair(family, tmp_path / "pair")
    draft = _check_one_draft_step(target_dir, assistant_dir, tmp_path, family == "e4b")
    names = [layer.self_attn.attn.kv_sharing_target_layer_name for layer in draft.model.layers]
    assert names == [f"model.layers.{i}.self_attn.attn" for i in sources]


def _check_one_draft_step(target_dir, assistant_dir, tmp_path, centroids: bool):  # type: ignore[no-untyped-def]
    """One draft step of our model against transformers'; returns our model (its attention
    layers as vLLM built them, before they are replaced by the reference attention)."""
    ref = hf_draft_step(target_dir, assistant_dir, PROMPT)
    _, draft = _assistant_module(target_dir, assistant_dir, tmp_path)
    vllm_attention = [layer.self_attn.attn for layer in draft.model.layers]

    _attend_to_reference_kv(draft, ref)

    backbone = draft.config.backbone_hidden_size
    positions = ref.position_ids.view(-1)
    with torch.no_grad():
        # Our embedding path (the target's embedding, scaled) must give transformers' input.
        embeds = draft.embed_input_ids(torch.tensor([ref.token_id]))
        torch.testing.assert_close(embeds, ref.inputs_embeds[0, :, :backbone], **TOL)
        draft_hidden, next_hidden = draft(
            input_ids=torch.tensor([ref.token_id]),
            positions=positions,
            hidden_states=ref.target_hidden[0],
        )
        logits = draft.compute_logits(draft_hidden)
        top = draft.get_top_tokens(draft_hidden)

    torch.testing.assert_close(next_hidden, ref.projected_hidden[0], **TOL)
    want = ref.logits[0]
    if centroids:
        # transformers fills unselected tokens with (min selected logit - 1); we use -inf.
        selected = torch.isfinite(logits)
        assert selected.sum().item() == 8 * (2048 // 64)
        assert torch.equal(selected, want > want.min())
        torch.testing.assert_close(logits[selected], want[selected], **TOL)
    else:
        torch.testing.assert_close(logits, want, **TOL)
    assert torch.equal(top, want.argmax(dim=-1))
    for layer, attention in zip(draft.model.layers, vllm_attention, strict=True):
        layer.self_attn.attn = attention
    return draft


@pytest.mark.parametrize("centroids", [True, False], ids=["centroids", "full-vocab"])
def test_suppress_tokens_of_the_generation_config_are_never_drafted(
    tmp_path, centroids: bool
) -> None:
    target_dir, assistant_dir = build_tiny_pair(tmp_path / "pair", centroids=centroids)
    ref = hf_draft_step(target_dir, assistant_dir, PROMPT)
    favourite = int(ref.logits[0].argmax())
    config_path = assistant_dir / "generation_config.json"
    generation = json.loads(config_path.read_text())
    generation["suppress_tokens"] = [favourite]
    config_path.write_text(json.dumps(generation))

    _, draft = _assistant_module(target_dir, assistant_dir, tmp_path)
    _attend_to_reference_kv(draft, ref)
    with torch.no_grad():
        draft_hidden, _ = draft(
            input_ids=torch.tensor([ref.token_id]),
            positions=ref.position_ids.view(-1),
            hidden_states=ref.target_hidden[0],
        )
        logits = draft.compute_logits(draft_hidden)
        top = draft.get_top_tokens(draft_hidden)

    assert logits[0, favourite] == float("-inf")
    expected = ref.logits[0].clone()
    expected[0, favourite] = float("-inf")
    assert top.item() != favourite
    assert top.item() == int(expected.argmax())
