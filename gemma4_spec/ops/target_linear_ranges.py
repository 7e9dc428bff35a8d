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
keeps it. ``to_matmul`` is the graph rewrite itself, with no vLLM in it.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import fx

from gemma4_spec.log import get_logger
from gemma4_spec.ops.small_linear import TARGET_MAX_ROWS

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


def _pass_class() -> type:
    from vllm.compilation.passes.inductor_pass import InductorPass

    class TargetLinearToMatmul(InductorPass):  # type: ignore[misc]
        """``to_matmul`` on the graphs of compile ranges past ``TARGET_MAX_ROWS``."""

        def __call__(self, graph: fx.Graph) -> None:
            to_matmul(graph)

        def is_applicable_for_range(self, compile_range: Any) -> bool:
            return past_target_rows(compile_range.start)

        def uuid(self) -> str:
            # Inductor caches compiled graphs under this: the rewrite's source is part of it.
            return InductorPass.hash_source(self, to_matmul, past_target_rows)

    return TargetLinearToMatmul


def split_target_ranges(compilation_config: Any) -> bool:
    """Adds the ``TARGET_MAX_ROWS`` endpoint to ``compilation_config``'s compile ranges and
    ``TargetLinearToMatmul`` as its post-grad custom pass, before the target compiles; returns
    whether it did. It does not where vLLM compiles no ranges (no compilation, or every batch
    within ``TARGET_MAX_ROWS`` tokens) or a post-grad custom pass is set already (the op's
    run-time choice then stays in every graph, as without this)."""
    from vllm.platforms import current_platform

    endpoints = list(compilation_config.compile_ranges_endpoints or [])
    key = current_platform.pass_key
    passes = compilation_config.inductor_compile_config
    if not endpoints or max(endpoints) <= TARGET_MAX_ROWS:
        return False
    if key in passes:
        logger.info(
            "gemma4_spec: a post-grad pass is set (%s): the target's matmuls choose their "
            "kernel at run time in every compiled graph.", key,
        )  # fmt: skip
        return False
    compilation_config.compile_ranges_endpoints = sorted({*endpoints, TARGET_MAX_ROWS})
    passes[key] = _pass_class()()
    logger.info(
        "gemma4_spec: the target compiles a graph for 1-%d tokens (its matmuls on our kernel) "
        "and keeps mm in the graphs past it.", TARGET_MAX_ROWS,
    )  # fmt: skip
    return True
