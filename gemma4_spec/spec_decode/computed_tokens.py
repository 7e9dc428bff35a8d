"""vLLM's async-scheduling correction of the computed-token counts, replayed from CUDA graphs.

With async scheduling and drafts, the host schedules a step before it knows how many of the
previous step's drafts were kept, so it assumes all were; at the start of the next step the V1
runner corrects each request's computed-token count on the GPU from the previous step's kept
counts (``vllm.v1.spec_decode.utils.update_num_computed_tokens_for_batch_change``). That is a
dozen small torch ops, each a kernel launch with its Python dispatch on the host (0.1 ms and
more a step on the H200 machine, where the host bounds the step at small batches), over
tensors that mostly sit at fixed addresses in the runner.

``GraphedCorrection`` wraps vLLM's function (``patch/patch_gpu_model_runner.py`` rebinds the
runner module's name): for runners whose drafter is ours (registered by the proposer), the call
runs through ``ops/graphed_launch.py``, keyed by the address, length and stride of every
argument, so a call over tensors seen before replays the same ops from a graph. Other runners,
and any call where graphs cannot run, call vLLM's function as it is.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from gemma4_spec.ops.graphed_launch import GraphedLaunches

CORRECTION_NAME = "update_num_computed_tokens_for_batch_change"


class GraphedCorrection:
    def __init__(self, vllms: Callable[..., None]) -> None:
        self.vllms = vllms
        self.launches = GraphedLaunches("computed-token correction", max_graphs=8)
        # ``num_computed_tokens`` addresses of the runners whose drafter is ours.
        self._runners: set[int] = set()

    def register(self, num_computed_tokens: torch.Tensor) -> None:
        self._runners.add(num_computed_tokens.data_ptr())

    def __call__(self, *args: torch.Tensor, **kwargs: object) -> None:
        if kwargs or not args or args[0].data_ptr() not in self._runners:
            self.vllms(*args, **kwargs)
            return
        key = tuple((t.data_ptr(), t.shape[0], t.stride(0), t.dtype) for t in args)
        self.launches.run(key, lambda: self.vllms(*args), args[0].device)


def register_runner(runner: object) -> None:
    """Let ``runner`` (a V1 GPU model runner whose drafter is ours) take the graphed
    correction, if the plugin installed it."""
    import vllm.v1.worker.gpu_model_runner as runner_module

    correction = getattr(runner_module, CORRECTION_NAME, None)
    computed = getattr(runner, "num_computed_tokens", None)
    if isinstance(correction, GraphedCorrection) and isinstance(computed, torch.Tensor):
        correction.register(computed)


def install(runner_module: object) -> None:
    """Wrap the runner module's correction function (once; absent in some versions)."""
    vllms = getattr(runner_module, CORRECTION_NAME, None)
    if vllms is not None and not isinstance(vllms, GraphedCorrection):
        setattr(runner_module, CORRECTION_NAME, GraphedCorrection(vllms))
