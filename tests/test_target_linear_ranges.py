"""The compiled graphs past TARGET_MAX_ROWS tokens put ``mm`` back where ``target_linear`` was
(``ops/target_linear_ranges.py``): the rewrite keeps the product, touches only the op, and is
installed as vLLM's post-grad pass with a compile range ending at TARGET_MAX_ROWS, from the
engine arguments when the opt-in is on."""

from __future__ import annotations

import pickle
import shutil
from types import SimpleNamespace

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from vllm.compilation.passes.inductor_pass import InductorPass

from gemma4_spec.ops.small_linear import SMALL_LINEAR_ENV, TARGET_LINEAR_ENV, TARGET_MAX_ROWS
from gemma4_spec.ops.target_linear_ranges import (
    TARGET_LINEAR,
    TargetLinearToMatmul,
    past_target_rows,
    prepare_target_ranges,
    split_target_ranges,
    to_matmul,
)


def _targets(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    return [n for n in graph.nodes if n.target is TARGET_LINEAR]


def _traced(x: torch.Tensor, w: torch.Tensor, w2: torch.Tensor) -> torch.fx.GraphModule:
    def forward(x: torch.Tensor, w: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(torch.ops.gemma4_spec.target_linear(x, w))
        return torch.ops.gemma4_spec.target_linear(hidden, w2) + x

    return make_fx(forward, tracing_mode="fake")(x, w, w2)


def test_to_matmul_replaces_every_2d_target_linear_with_the_same_product() -> None:
    torch.manual_seed(0)
    x, w, w2 = torch.randn(40, 24), torch.randn(56, 24), torch.randn(24, 56)
    module = _traced(x, w, w2)
    assert len(_targets(module.graph)) == 2
    expected = module(x, w, w2)

    assert to_matmul(module.graph) == 2
    module.recompile()
    assert _targets(module.graph) == []
    products = [n for n in module.graph.nodes if n.target is torch.ops.aten.mm.default]
    assert [tuple(n.meta["val"].shape) for n in products] == [(40, 56), (40, 24)]
    assert torch.equal(module(x, w, w2), expected)
    reference = torch.relu(x @ w.t()) @ w2.t() + x
    torch.testing.assert_close(module(x, w, w2), reference)


def test_to_matmul_leaves_other_ranks_and_other_ops() -> None:
    def forward(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.ops.gemma4_spec.target_linear(x, w) + torch.nn.functional.linear(x, w)

    x, w = torch.randn(2, 5, 8), torch.randn(4, 8)
    module = make_fx(forward, tracing_mode="fake")(x, w)
    before = [n.target for n in module.graph.nodes]
    assert to_matmul(module.graph) == 0
    assert [n.target for n in module.graph.nodes] == before


@pytest.mark.skipif(shutil.which("g++") is None, reason="Inductor's CPU code needs a C++ compiler")
def test_the_rewrite_runs_in_inductors_post_grad_pipeline() -> None:
    """As vLLM installs it, the rewrite runs on Inductor's post-grad graph of a dynamic-shape
    compile: the generated code calls no ``target_linear`` and gives the op's values."""
    from torch._inductor.custom_graph_pass import CustomGraphPass
    from torch._inductor.utils import run_and_get_code

    class Rewrite(CustomGraphPass):  # type: ignore[misc]
        def __call__(self, graph: torch.fx.Graph) -> None:
            self.replaced = to_matmul(graph)

        def uuid(self) -> str:
            return "test_target_linear_ranges.Rewrite"

    def forward(x: torch.Tensor, w: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(torch.ops.gemma4_spec.target_linear(x, w))
        return torch.ops.gemma4_spec.target_linear(hidden, w2) + x

    torch._dynamo.reset()
    rewrite = Rewrite()
    compiled = torch.compile(forward, dynamic=True, options={"post_grad_custom_post_pass": rewrite})
    x, w, w2 = torch.randn(40, 24), torch.randn(56, 24), torch.randn(24, 56)
    with torch._inductor.config.patch(fx_graph_cache=False):  # the pass must run, not a hit
        out, code = run_and_get_code(compiled, x, w, w2)
    assert rewrite.replaced == 2
    assert "target_linear" not in "".join(code)
    torch.testing.assert_close(out, forward(x, w, w2))
    torch._dynamo.reset()


@pytest.mark.parametrize(("start", "past"), [(1, False), (TARGET_MAX_ROWS, False), (17, True)])
def test_only_ranges_wholly_past_the_cap_are_rewritten(start: int, past: bool) -> None:
    assert TARGET_MAX_ROWS == 16
    assert past_target_rows(start) is past


def test_split_target_ranges_installs_the_endpoint_and_the_pass() -> None:
    """The endpoint goes into the config vLLM builds the engine's from (which adds its own at
    max_num_batched_tokens); the pass applies past it, pickles (it travels to the engine and
    worker processes) and hashes the rewrite."""
    from vllm.config import CompilationConfig, VllmConfig
    from vllm.platforms import current_platform

    config = CompilationConfig()
    assert split_target_ranges(config)
    assert config.compile_ranges_endpoints == [TARGET_MAX_ROWS]
    engine = VllmConfig(compilation_config=config)
    tokens = engine.scheduler_config.max_num_batched_tokens
    ranges = engine.compilation_config.get_compile_ranges()
    assert [(r.start, r.end) for r in ranges] == [(1, TARGET_MAX_ROWS), (17, tokens)]
    installed = engine.compilation_config.inductor_compile_config[current_platform.pass_key]
    assert isinstance(installed, TargetLinearToMatmul)
    assert [installed.is_applicable_for_range(r) for r in ranges] == [False, True]
    travelled = pickle.loads(pickle.dumps(installed))
    assert travelled.uuid() == installed.uuid()
    assert installed.uuid() != InductorPass.hash_source(installed)  # it covers the rewrite

    x, w, w2 = torch.randn(20, 8), torch.randn(12, 8), torch.randn(8, 12)
    module = _traced(x, w, w2)
    travelled(module.graph)
    assert _targets(module.graph) == []


def test_split_target_ranges_stands_aside_for_another_pass() -> None:
    from vllm.config import CompilationConfig
    from vllm.platforms import current_platform

    theirs = CompilationConfig(compile_ranges_endpoints=[2048])
    marker = object()
    theirs.inductor_compile_config[current_platform.pass_key] = marker
    assert not split_target_ranges(theirs)
    assert theirs.compile_ranges_endpoints == [2048]
    assert theirs.inductor_compile_config[current_platform.pass_key] is marker


def test_engine_arguments_get_the_split_only_with_the_opt_in_on_cuda(
    set_env, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    """``prepare_target_ranges`` gives the engine arguments a split copy of their compilation
    config with ``GEMMA4_SPEC_TARGET_LINEAR=1`` on CUDA, and leaves them alone otherwise."""
    from vllm.config import CompilationConfig
    from vllm.platforms import current_platform

    original = CompilationConfig()
    engine_args = SimpleNamespace(compilation_config=original)
    monkeypatch.setattr(current_platform, "is_cuda", lambda: True)
    set_env(TARGET_LINEAR_ENV, None)
    assert not prepare_target_ranges(engine_args)
    set_env(TARGET_LINEAR_ENV, "1")
    set_env(SMALL_LINEAR_ENV, "0")
    assert not prepare_target_ranges(engine_args)
    assert engine_args.compilation_config is original
    set_env(SMALL_LINEAR_ENV, None)
    assert prepare_target_ranges(engine_args)
    assert engine_args.compilation_config.compile_ranges_endpoints == [TARGET_MAX_ROWS]
    assert original.compile_ranges_endpoints is None  # the caller's config is not changed
    unparsed = SimpleNamespace(compilation_config={"mode": 3})
    assert not prepare_target_ranges(unparsed)
    assert unparsed.compilation_config == {"mode": 3}
    monkeypatch.setattr(current_platform, "is_cuda", lambda: False)
    engine_args.compilation_config = original
    assert not prepare_target_ranges(engine_args)
