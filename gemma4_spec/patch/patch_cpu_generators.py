"""Rewind a seeded request's CPU generator after a step whose sampled token is discarded.

vLLM samples a token for every request in the batch, also for one whose prompt is only partly
prefilled (a chunked prefill); that token is discarded. So that a seeded request draws the same
random numbers however its prompt was chunked, the runner then winds the request's generator
back with ``gen.set_offset(gen.get_offset() - 4)``: right for CUDA's Philox generators, but a
CPU generator (Mersenne Twister) has no offset and raises ``RuntimeError: CPU Generator does not
use offset``, which kills the engine as soon as a seeded sampled request is chunked.

Wraps, for CPU generators only (CUDA ones keep vLLM's rewind):
* ``GPUModelRunner._sample``: saves the state of each CPU generator of a request whose token
  will be discarded, before sampling, and puts it back right after: the same rewind, exactly.
* ``GPUModelRunner._bookkeeping_sync``: hides those generators from vLLM's offset rewind
  while it runs (they are already wound back), and hands them back after.
The CPU runner inherits both methods. vLLM versions: ``compat.CPU_GENERATOR_REWIND_VLLM``
(0.32, where the rewind and the discard mask were read); elsewhere vLLM's methods run as is.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

import numpy as np
import torch

from gemma4_spec.compat import cpu_generator_rewind_needed
from gemma4_spec.patch.hooks import is_ours, ours

RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"


def discarded_cpu_generators(runner: Any) -> dict[int, torch.Generator]:
    """The CPU generators (by batch index) of the requests whose token this step discards."""
    num_reqs = runner.input_batch.num_reqs
    generators = runner.input_batch.generators
    if not generators or num_reqs == 0:
        return {}
    discarded = np.flatnonzero(runner.discard_request_mask.np[:num_reqs])
    found = {int(i): generators.get(int(i)) for i in discarded}
    return {i: g for i, g in found.items() if g is not None and g.device.type == "cpu"}


def apply(runner_module: ModuleType) -> None:
    runner = runner_module.GPUModelRunner
    vllms_sample = runner._sample
    vllms_bookkeeping = runner._bookkeeping_sync
    if is_ours(vllms_sample) or not cpu_generator_rewind_needed():
        return

    @functools.wraps(vllms_sample)
    def _sample(self: Any, *args: Any, **kwargs: Any) -> Any:
        saved = {i: g.get_state() for i, g in discarded_cpu_generators(self).items()}
        try:
            return vllms_sample(self, *args, **kwargs)
        finally:
            generators = self.input_batch.generators
            for i, state in saved.items():
                generators[i].set_state(state)

    @functools.wraps(vllms_bookkeeping)
    def _bookkeeping_sync(self: Any, *args: Any, **kwargs: Any) -> Any:
        hidden = discarded_cpu_generators(self)
        generators = self.input_batch.generators
        for i in hidden:
            del generators[i]
        try:
            return vllms_bookkeeping(self, *args, **kwargs)
        finally:
            generators.update(hidden)

    runner._sample = ours(_sample)
    runner._bookkeeping_sync = ours(_bookkeeping_sync)
