"""The ``gemma4_spec`` operator namespace: how the plugin's kernels become ``torch.ops``.

torch.compile sees each custom op as one opaque node, so a kernel's choice between its Triton
path and the fallback (a row count, a dtype) is made when the op runs, not when the graph is
traced. Inside a CUDA graph that is once, at capture; outside one (prefill batches larger than
the captured sizes, eager mode) it is every call, from the compiled graph's Python code.

``torch.library.custom_op`` wraps each call in several Python layers, a few times the host
cost of ``F.linear`` itself; with one op per matmul of the target's forward (212 on E2B) that
adds up to milliseconds per uncaptured step (figures in ``benchmarks/results/h100``,
thirty-fifth session). These ops are defined on a ``torch.library.Library`` fragment instead,
with one implementation for every backend: the dispatcher calls the Python function directly,
about half the overhead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

NAMESPACE = "gemma4_spec"
_LIBRARY = torch.library.Library(NAMESPACE, "FRAGMENT")

Fn = TypeVar("Fn", bound=Callable[..., torch.Tensor])


def custom_op(name: str, fake: Callable[..., torch.Tensor]) -> Callable[[Fn], Fn]:
    """Defines ``torch.ops.gemma4_spec.<name>`` from the decorated function (schema from its
    annotations, no argument mutated), with ``fake`` giving its output's shape and dtype to
    torch.compile. Returns the function itself, for eager callers."""

    def register(fn: Fn) -> Fn:
        schema = torch.library.infer_schema(fn, mutates_args=())
        _LIBRARY.define(name + schema)
        _LIBRARY.impl(name, fn, "CompositeExplicitAutograd")
        torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=_LIBRARY)
        return fn

    return register
