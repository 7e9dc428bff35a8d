"""Host time of the scheduler's ``allocate_slots``: ours' decode-step short cut
(``patch/patch_allocate_slots.py``) beside vLLM's method, in one engine, side by side.

One engine of the shipped tiny pair (greedy, k=3, vLLM's single-process mode, so the scheduler
runs here) generates the same batch in rounds that alternate between the short cut and vLLM's
method (the scheduler's manager with and without ours' ``allocate_slots``). Each round times
every ``allocate_slots`` call and counts the scheduler's steps; printed per batch size: us a call,
ms a step, and vLLM's over ours'. Tokens must be the same in every round. CPU or GPU, any vLLM
the plugin installs the short cut on.

    python benchmarks/allocate_slots.py [--batch 16,32,64] [--rounds 4] [--new-tokens 200]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")


class _Timer:
    """Times the calls of whatever ``allocate_slots`` the manager has when it is made."""

    def __init__(self, call: Any) -> None:
        self.call, self.calls, self.seconds = call, 0, 0.0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return self.call(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start
            self.calls += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", default="16,32,64")
    parser.add_argument("--rounds", type=int, default=4, help="rounds of each, alternating")
    parser.add_argument("--new-tokens", type=int, default=200)
    parser.add_argument("--k", type=int, default=3)
    args = parser.parse_args()

    from vllm import LLM, SamplingParams

    from gemma4_spec.assets import tiny_gsm8k_pair
    from gemma4_spec.patch.patch_allocate_slots import FastAllocateSlots
    from gemma4_spec.testing.engine_run import RunConfig, engine_kwargs, gpu_attention

    target, assistant = (str(p) for p in tiny_gsm8k_pair())
    config = RunConfig(
        target=target,
        prompts=[],
        assistant=assistant,
        num_speculative_tokens=args.k,
        max_model_len=1024,
        extra_engine_kwargs={"enable_prefix_caching": False, **gpu_attention()},
    )
    llm = LLM(**engine_kwargs(config, single_process=True))
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    manager = scheduler.kv_cache_manager
    fast = manager.__dict__.get("allocate_slots")
    if not isinstance(fast, FastAllocateSlots):
        raise SystemExit("the short cut is not installed on this engine (vLLM version, switch?)")
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    original_schedule = scheduler.schedule
    steps = [0]

    def schedule(*a: Any, **k: Any) -> Any:
        steps[0] += 1
        return original_schedule(*a, **k)

    scheduler.schedule = schedule
    print(f"tiny pair, k={args.k}, {args.new_tokens} new tokens a request, greedy")
    print(
        f"{'B':>4} {'ours us/call':>13} {'vLLM us/call':>13} {'ours ms/step':>13} "
        f"{'vLLM ms/step':>13} {'vLLM / ours':>12}"
    )
    for batch in (int(b) for b in args.batch.split(",")):
        prompts = [
            {"prompt_token_ids": [2] + [100 + (i * 7 + j) % 200 for j in range(20 + i % 29)]}
            for i in range(batch)
        ]
        llm.generate(prompts, params, use_tqdm=False)  # warm
        per_call: dict[str, list[float]] = {"ours": [], "vLLM": []}
        per_step: dict[str, list[float]] = {"ours": [], "vLLM": []}
        tokens: list[list[int]] | None = None
        for _ in range(args.rounds):
            for name in ("ours", "vLLM"):
                timer = _Timer(fast if name == "ours" else fast.general)
                manager.allocate_slots = timer
                steps[0] = 0
                outputs = llm.generate(prompts, params, use_tqdm=False)
                got = [list(o.outputs[0].token_ids) for o in outputs]
                if tokens is not None and got != tokens:
                    raise SystemExit(f"B={batch}: {name}'s tokens differ from the first round's")
                tokens = got
                per_call[name].append(timer.seconds / timer.calls * 1e6)
                per_step[name].append(timer.seconds / steps[0] * 1e3)
        manager.allocate_slots = fast
        med = {
            name: (statistics.median(per_call[name]), statistics.median(per_step[name]))
            for name in per_step
        }
        print(
            f"{batch:>4} {med['ours'][0]:>13.1f} {med['vLLM'][0]:>13.1f} {med['ours'][1]:>13.3f} "
            f"{med['vLLM'][1]:>13.3f} {med['vLLM'][1] / med['ours'][1]:>11.2f}x"
        )
    print(f"short cuts {fast.short_cuts}, vLLM's method {fast.general_calls} (ours' rounds)")


if __name__ == "__main__":
    main()
