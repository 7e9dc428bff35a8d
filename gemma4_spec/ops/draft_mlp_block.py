"""The assistant's work between two attentions, from the attention's output to the next layer's
normed input, defined in plain torch: what ``ops/draft_mlp_block_triton.py`` computes in one
launch.

For a draft layer with attention output ``o [T, Q]`` and residual stream ``h [T, H]``:

    a  = o @ Wo^T                                  # the output projection, [T, H]
    h1 = h + rms(a) * post_attention_norm
    x  = rms(h1) * pre_feedforward_norm
    m  = gelu_tanh(x @ Wg^T) * (x @ Wu^T)          # Wgu = [Wg; Wu], [2I, H]
    d  = m @ Wd^T                                  # [T, H]
    h2 = (h1 + rms(d) * post_feedforward_norm) * layer_scalar
    x' = rms(h2) * next_norm                       # the next layer's input norm, or the final one

with ``rms(v) = v / sqrt(mean(v^2) + eps)`` over the last dimension. It returns ``(h2, x')``.

Why one launch: at a draft step's few rows each of these matmuls reads 0.5-2 MB of weights, a
microsecond of the GPU's bandwidth, and each of the five launches they take now (output
projection, its residual norm, gate/up with the activation, down projection, its residual norm)
costs 3-4 us in a CUDA graph, mostly the wait between dependent kernels
(``benchmarks/draft_chain.py``). The kernel runs the five as stages of one persistent launch
with grid barriers between them (``ops/draft_mlp_block_triton.py``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn


class MlpBlockWeights(NamedTuple):
    """One draft layer's weights from its output projection on, and the next norm's gain."""

    o_proj: torch.Tensor  # [H, Q]
    gate_up: torch.Tensor  # [2I, H]: the gate's rows, then the up projection's
    down: torch.Tensor  # [H, I]
    post_attention_norm: torch.Tensor  # [H]
    pre_feedforward_norm: torch.Tensor  # [H]
    post_feedforward_norm: torch.Tensor  # [H]
    next_norm: torch.Tensor  # [H]
    layer_scalar: torch.Tensor  # [1]


def _rms(v: torch.Tensor, gain: torch.Tensor, eps: float) -> torch.Tensor:
    return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps) * gain.float()


def draft_mlp_block_reference(
    attn: torch.Tensor, h: torch.Tensor, w: MlpBlockWeights, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h2, x')`` of the module docstring in float32 maths, each in ``h``'s dtype."""
    a = attn.float() @ w.o_proj.float().t()
    h1 = h.float() + _rms(a, w.post_attention_norm, eps)
    x = _rms(h1, w.pre_feedforward_norm, eps)
    gate, up = (x @ w.gate_up.float().t()).chunk(2, dim=-1)
    m = nn.functional.gelu(gate, approximate="tanh") * up
    d = m @ w.down.float().t()
    h2 = (h1 + _rms(d, w.post_feedforward_norm, eps)) * w.layer_scalar.float()
    x_next = _rms(h2, w.next_norm, eps)
    return h2.to(h.dtype), x_next.to(h.dtype)
