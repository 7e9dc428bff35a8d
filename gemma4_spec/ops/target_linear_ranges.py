"""The target's matmuls back on plain ``mm`` in the compiled graphs above ``TARGET_MAX_ROWS``.

``target_linear`` (``ops/small_linear.py``) chooses between our kernel and ``F.linear`` when it
runs, because torch.compile traces the target once for every token count. Inside a CUDA graph
that choice costs nothing; outside one (prefill batches past the largest captured size) the
compiled graph calls the op from Python once per matmul, 212 times an E2B forward, and a
request's first token came slower than on ``mm`` (``benchmarks/results/h100``, thirty-fifth
session).

vLLM compiles a graph per compile range (``CompilationConfig.compile_ranges_endpoints``) and
runs each post-grad pass only on the ranges it says it applies to. ``split_target_ranges``
adds an endpoint at ``TARGET_MAX_ROWS`` and installs ``TargetLinearToMatmul`` as the
post-grad custom pass (vLLM's hook for one, ``current_platform.pass_key``): in the graphs of
ranges whose every size is past ``TARGET_MAX_ROWS`` it puts ``aten.mm`` where ``target_linear``
was, so those graphs run as they would without the op; the graph of ``[1, TARGET_MAX_ROWS]``
keeps it. vLLM copies the pass into a model's compiler when it builds the model, before any
plugin code sees the model, so ``prepare_target_ranges`` applies it to the engine arguments
(``patch/patch_engine_args.py``, when the opt-in is on). ``to_matmul`` is the graph rewrite
itself.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch
from torch import fx
from vllm.compilation.passes.inductor_pass import InductorPass

from gemma4_spec.log import get_logger
from gemma4_spec.ops.small_linear import TARGET_MAX_ROWS, target_rows_wanted

logger = get_logger(__name__)

TARGET_LINEAR = torch.ops.gemma4_spec.target_linear.default


def to_matmul(graph: fx.Graph) -> int:
    """Replaces each ``target_linear(x, weight)`` of ``graph`` whose ``x`` is 2-D (vLLM's
    ``[tokens, hidden]``) with ``aten.mm(x, weight.permute(1, 0))``, the product ``F.linear``
    computes there; returns how many it replaced. Nodes keep a ``val`` meta (the fake tensors
    Inductor's lowering reads) where the replaced node had one."""
    replaced = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not TARGET_LINEAR:
            continue
        x, weight = node.args
        x_val = x.meta.get("val") if isinstance(x, fx.Node) else None
        if x_val is None or x_val.dim() != 2:
            continue  # the op's own fallback keeps it right
        with graph.inserting_before(node):
            transposed = graph.call_function(torch.ops.aten.permute.default, (weight, [1, 0]))
            product = graph.call_function(torch.ops.aten.mm.default, (x, transposed))
        weight_val = weight.meta.get("val")
        if weight_val is not None:
            mode = getattr(x_val, "fake_mode", None)
            with mode if mode is not None else contextlib.nullcontext():
                transposed.meta["val"] = weight_val.permute(1, 0)
                product.meta["val"] = torch.mm(x_val, transposed.meta["val"])
        node.replace_all_uses_with(product)
        graph.erase_node(node)
        replaced += 1
    return replaced


def past_target_rows(start: int) -> bool:
    """Whether a compile range starting at ``start`` tokens lies wholly past ``TARGET_MAX_ROWS``
    (its graph takes ``to_matmul``)."""
    return start > TARGET_MAX_ROWS


class TargetLinearToMatmul(InductorPass):  # type: ignore[misc]
    """``to_matmul`` on the graphs of compile ranges past ``TARGET_MAX_ROWS``. Module-level so
    that it pickles with the engine's config into the engine and worker processes."""

    def __call__(self, graph: fx.Graph) -> None:
        to_matmul(graph)

    def is_applicable_for_range(self, compile_range: Any) -> bool:
        return past_target_rows(compile_range.start)

    def uuid(self) -> str:
        # Inductor caches compiled graphs under this: the rewrite's source is part of it.
        return InductorPass.hash_source(self, to_matmul, past_target_rows)


def split_target_ranges(compilation_config: Any) -> bool:
    """Adds the ``TARGET_MAX_ROWS`` endpoint to ``compilation_config``'s compile ranges and
    ``TargetLinearToMatmul`` as its post-grad custom pass; returns whether it did. For the
    config an engine is built from: vLLM adds its own endpoint (``max_num_batched_tokens``)
    and drops ours when batches never pass it, and copies the pass into each model's compiler
    when the model is built, so this must come before. It stands aside where a post-grad pass
    is set already (the op's run-time choice then stays in every graph, as without this)."""
    from vllm.platforms import current_platform

    key = current_platform.pass_key
    passes = compilation_config.inductor_compile_config
    if key in passes:
        logger.info(
            "gemma4_spec: a post-grad pass is set (%s): the target's matmuls choose their "
            "kernel at run time in every compiled graph.", key,
        )  # fmt: skip
        return False
    endpoints = compilation_config.compile_ranges_endpoints or []
    compilation_config.compile_ranges_endpoints = sorted({*endpoints, TARGET_MAX_ROWS})
    passes[key] = TargetLinearToMatmul()
    logger.info(
        "gemma4_spec: the target compiles a graph for 1-%d tokens (its matmuls on our kernel) "
        "and keeps mm in the graphs past it.", TARGET_MAX_ROWS,
    )  # fmt: skip
    return True


def prepare_target_ranges(engine_args: Any) -> bool:
    """Where the target's matmuls will run on our kernel (``target_rows_wanted``, on CUDA),
    gives ``engine_args`` a copy of its compilation config with ``split_target_ranges``
    applied, before vLLM builds the engine's config from it; returns whether it did."""
    from vllm.platforms import current_platform

    given = getattr(engine_args, "compilation_config", None)
    if not (target_rows_wanted() and current_platform.is_cuda()) or not hasattr(
        given, "inductor_compile_config"
    ):
        return False  # (a config vLLM has not parsed yet is left to vLLM as it is)
    config = copy.deepcopy(given)
    if not split_target_ranges(config):
        return False
    engine_args.compilation_config = config
    return True
