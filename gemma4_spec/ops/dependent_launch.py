"""Programmatic dependent launch (PDL) for the draft's own kernels.

A draft step is a chain of ~50 small kernels, each waiting on the one before it; on the H100 a
kernel of the chain costs ~3 us, most of it the launch and the first loads, not the work. With
PDL (Hopper and later) a kernel launched with the ``launch_pdl`` attribute may start while the
kernel before it is still running: its programs do what needs no earlier output (index
arithmetic, loads of weights), then ``gdc_wait`` holds them until every earlier kernel has
finished and its writes are visible. A kernel calls ``gdc_launch_dependents`` once its own
dependent work is issued, so that the next kernel's launch overlaps its tail.

The rule every kernel here keeps: before ``gdc_wait`` it loads only what no kernel writes
(weights, norm gains), and stores nothing (its output buffer may be one an earlier kernel still
reads). A kernel that triggers its dependents before its own wait lets the chain start more
than one kernel ahead, so "written two kernels ago" is not safe to read early either. The wait
covers every earlier kernel of the stream, so the order of the chain is kept.

``GEMMA4_SPEC_PDL=1`` turns it on (off by default until the engine benchmark has measured it);
it needs a CUDA device of compute capability 9 or more and a Triton with ``gdc_wait``; under
Triton's CPU interpreter it is always off (the interpreter has no grid dependencies).
Inductor's own kernels take the same attribute with ``TORCHINDUCTOR_ENABLE_PDL=1``.
"""

from __future__ import annotations

import functools

import torch

from gemma4_spec.ops.centroid_argmax_triton import HAS_TRITON, _interpreting
from gemma4_spec.switches import turned_on

PDL_ENV = "GEMMA4_SPEC_PDL"


@functools.cache
def _triton_has_gdc() -> bool:
    if not HAS_TRITON:
        return False
    import triton.language as tl

    cuda = getattr(tl.extra, "cuda", None)
    return hasattr(cuda, "gdc_wait") and hasattr(cuda, "gdc_launch_dependents")


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def dependent_launch(device: torch.device) -> bool:
    """Whether our kernels on ``device`` launch with PDL (module docstring)."""
    if not turned_on(PDL_ENV) or device.type != "cuda" or _interpreting():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _triton_has_gdc() and _capable(index)
