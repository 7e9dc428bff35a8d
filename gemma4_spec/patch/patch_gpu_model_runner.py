"""Make vLLM's V1 GPU model runner (and the CPU runner, its subclass) draft with our proposer.

Replaces: ``vllm.v1.worker.gpu_model_runner.Gemma4Proposer``, the name the runner instantiates
for the gemma4_mtp method and checks with ``isinstance`` (per-group block tables, metadata).
Rebinding that one module global swaps the class everywhere the runner uses it.

Wraps, when the runner's drafter is ours (otherwise vLLM's methods run as they are):
* ``GPUModelRunner._calc_spec_decode_metadata``: the drafter's ``verify_metadata`` builder
  answers (``spec_decode/verify_metadata.py``: the same arrays in one transfer);
* ``GPUModelRunner._prepare_input_ids``: where async scheduling carries tokens over on the GPU,
  the drafter's ``verify_input_ids`` writes them (``spec_decode/verify_input_ids.py``: the same
  scatters from one transfer). vLLM's method runs for everything else: no carried tokens,
  prompt embeddings, or a pipeline-parallel receive to wait for (0.32 added that wait).

Replaces the runner module's ``update_num_computed_tokens_for_batch_change`` (async scheduling's
correction of computed-token counts) with ``spec_decode/computed_tokens.py``'s graphed wrapper,
which calls vLLM's function as it is for runners whose drafter is not ours.
vLLM versions: 0.26 - 0.33 (the names, the methods' signatures and the runner state they read
are the same in all of them).
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

import numpy as np
import torch

from gemma4_spec.patch.hooks import is_ours, ours

RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"


def apply(runner_module: ModuleType) -> None:
    from gemma4_spec.spec_decode import computed_tokens
    from gemma4_spec.spec_decode.proposer import Gemma4Proposer
    from gemma4_spec.spec_decode.verify_input_ids import carried_tokens, uniform_drafts

    if not hasattr(runner_module, "Gemma4Proposer"):
        raise RuntimeError(
            f"{RUNNER_MODULE} has no Gemma4Proposer: this vLLM is not one gemma4-spec supports."
        )
    runner_module.Gemma4Proposer = Gemma4Proposer
    computed_tokens.install(runner_module)

    runner = runner_module.GPUModelRunner
    vllms = runner._calc_spec_decode_metadata
    if is_ours(vllms):
        return  # already wrapped

    @functools.wraps(vllms)
    def _calc_spec_decode_metadata(
        self: Any, num_draft_tokens: Any, cu_num_scheduled_tokens: Any
    ) -> Any:
        builder = getattr(getattr(self, "drafter", None), "verify_metadata", None)
        if builder is None:
            return vllms(self, num_draft_tokens, cu_num_scheduled_tokens)
        return builder.build(num_draft_tokens, cu_num_scheduled_tokens, self.input_ids.gpu)

    runner._calc_spec_decode_metadata = ours(_calc_spec_decode_metadata)

    vllms_input_ids = runner._prepare_input_ids

    @functools.wraps(vllms_input_ids)
    def _prepare_input_ids(
        self: Any,
        scheduler_output: Any,
        num_reqs: int,
        total_num_scheduled_tokens: int,
        cu_num_tokens: Any,
    ) -> None:
        writer = getattr(getattr(self, "drafter", None), "verify_input_ids", None)
        if (
            writer is None
            or self.input_batch.prev_sampled_token_ids is None
            or self.enable_prompt_embeds
            or getattr(self, "_pp_recv_work", None) is not None
        ):
            return vllms_input_ids(
                self, scheduler_output, num_reqs, total_num_scheduled_tokens, cu_num_tokens
            )
        scheduled = scheduler_output.scheduled_spec_decode_tokens
        req_ids = self.input_batch.req_ids[:num_reqs]
        prev_positions = self.prev_positions.np[:num_reqs]
        prev_sampled = self.input_batch.prev_sampled_token_ids
        prev_drafts = self._draft_token_ids
        if not isinstance(prev_drafts, torch.Tensor):
            prev_drafts = None
        d = uniform_drafts(
            prev_positions,
            req_ids,
            scheduled,
            total_num_scheduled_tokens,
            self.prev_num_spec_tokens,
        )
        if d is not None and writer.write_uniform(
            self.input_ids, num_reqs, d, prev_sampled, prev_drafts
        ):
            return
        draft_lens = np.fromiter(
            (len(scheduled.get(r, ())) for r in req_ids), dtype=np.int64, count=num_reqs
        )
        carried = carried_tokens(
            prev_positions, draft_lens, cu_num_tokens, self.prev_num_spec_tokens
        )
        writer.write(self.input_ids, carried, prev_sampled, prev_drafts, total_num_scheduled_tokens)

    runner._prepare_input_ids = ours(_prepare_input_ids)
