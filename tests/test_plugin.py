"""Unit tests for the plugin entry point, the vLLM version range and the deferred-import hooks.

Fast: no engine, no checkpoints. Anything that must see a process where vLLM's GPU model runner
has not been imported yet runs in a fresh subprocess; in-process tests put every global they
touch (``_registered``, vLLM's ModelRegistry entry, the hooks' pending table) back afterwards.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import json
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from packaging.version import Version

import gemma4_spec.compat as compat
from gemma4_spec import plugin
from gemma4_spec.compat import SUPPORTED_VLLM, UnsupportedVLLMVersionError, check_vllm_version
from gemma4_spec.patch import (
    hooks,
    patch_allocate_slots,
    patch_cpu_expand,
    patch_cpu_generators,
    patch_engine_args,
    patch_gpu_model_runner,
    patch_input_processor,
    patch_rejection_sampler,
    patch_request_params,
    patch_top_k_only,
    patch_triton_attn,
    patch_v2_rejection_sampler,
    patch_v2_sample,
    patch_v2_speculator,
    patch_v2_warmup,
    patch_vllm_config,
)
from gemma4_spec.testing.engine_run import PLUGIN_PROPOSER

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def fresh_plugin(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[Any]]:
    """``register()`` as if never called; records what it registers instead of doing it.

    ``when_imported`` is replaced by a recorder (so no hook is installed and no patch applied),
    ``ModelRegistry.register_model`` is recorded and called through, and the registry entry,
    ``_registered`` and the hooks' pending table are restored on teardown.
    """
    from vllm import ModelRegistry

    calls: dict[str, list[Any]] = {"when_imported": [], "register_model": []}
    monkeypatch.setattr(plugin, "_registered", False)
    monkeypatch.setattr(hooks, "_pending", {k: list(v) for k, v in hooks._pending.items()})
    monkeypatch.setitem(
        ModelRegistry.models,
        plugin.ASSISTANT_ARCHITECTURE,
        ModelRegistry.models[plugin.ASSISTANT_ARCHITECTURE],
    )
    monkeypatch.setattr(
        plugin,
        "when_imported",
        lambda name, callback: calls["when_imported"].append((name, callback)),
    )
    register_model = ModelRegistry.register_model

    def record_register_model(arch: str, cls: Any) -> None:
        calls["register_model"].append((arch, cls))
        register_model(arch, cls)

    monkeypatch.setattr(ModelRegistry, "register_model", record_register_model)
    return calls


def run_python(code: str) -> Any:
    """Run ``code`` in a fresh interpreter; it prints one ``RESULT:<json>`` line."""
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT:")]
    assert len(lines) == 1, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads(lines[0].removeprefix("RESULT:"))


# --- register() ------------------------------------------------------------------------------


def test_register_is_idempotent(fresh_plugin: dict[str, list[Any]]) -> None:
    from vllm import ModelRegistry

    plugin.register()
    plugin.register()

    assert fresh_plugin["register_model"] == [(plugin.ASSISTANT_ARCHITECTURE, plugin.MODEL_CLASS)]
    assert [name for name, _ in fresh_plugin["when_imported"]] == [
        patch_engine_args.ARG_UTILS_MODULE,
        patch_gpu_model_runner.RUNNER_MODULE,
        patch_vllm_config.CONFIG_MODULE,
        patch_triton_attn.TRITON_ATTN_MODULE,
        patch_rejection_sampler.REJECTION_SAMPLER_MODULE,
        patch_cpu_expand.REJECTION_SAMPLER_MODULE,
        patch_top_k_only.TOPK_TOPP_MODULE,
        patch_cpu_generators.RUNNER_MODULE,
        patch_v2_warmup.WORKER_MODULE,
        patch_input_processor.INPUT_PROCESSOR_MODULE,
        patch_input_processor.INPUT_PROCESSOR_MODULE,
        patch_v2_speculator.SPECULATOR_MODULE,
        patch_v2_rejection_sampler.V2_REJECTION_SAMPLER_MODULE,
        patch_v2_sample.V2_RUNNER_MODULE,
        patch_allocate_slots.SCHEDULER_MODULE,
    ]
    assert [cb for _, cb in fresh_plugin["when_imported"]] == [
        patch_engine_args.apply,
        patch_gpu_model_runner.apply,
        patch_vllm_config.apply,
        patch_triton_attn.apply,
        patch_rejection_sampler.apply,
        patch_cpu_expand.apply,
        patch_top_k_only.apply,
        patch_cpu_generators.apply,
        patch_v2_warmup.apply,
        patch_input_processor.apply,
        patch_request_params.apply,
        patch_v2_speculator.apply,
        patch_v2_rejection_sampler.apply,
        patch_v2_sample.apply,
        patch_allocate_slots.apply,
    ]
    entry = ModelRegistry.models[plugin.ASSISTANT_ARCHITECTURE]
    assert f"{entry.module_name}:{entry.class_name}" == plugin.MODEL_CLASS


def test_register_on_unsupported_vllm_only_installs_the_check(
    fresh_plugin: dict[str, list[Any]],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    from vllm import ModelRegistry

    before = ModelRegistry.models[plugin.ASSISTANT_ARCHITECTURE]
    monkeypatch.setattr(plugin, "vllm_is_supported", lambda: False)
    # Our loggers live under vLLM's "vllm" logger, which does not propagate to pytest's handler.
    monkeypatch.setattr(plugin.logger, "handlers", [caplog.handler])
    with caplog.at_level("WARNING", logger=plugin.logger.name):
        plugin.register()

    assert fresh_plugin["register_model"] == []
    assert ModelRegistry.models[plugin.ASSISTANT_ARCHITECTURE] is before
    assert fresh_plugin["when_imported"] == [
        (patch_engine_args.ARG_UTILS_MODULE, patch_engine_args.apply)
    ]
    assert f"supports vLLM {SUPPORTED_VLLM}" in caplog.text


def test_register_defers_the_runner_patch_to_its_import() -> None:
    result = run_python(
        "import json, sys\n"
        "from gemma4_spec.plugin import register\n"
        "register()\n"
        "imported = 'vllm.v1.worker.gpu_model_runner' in sys.modules\n"
        "import vllm.v1.worker.gpu_model_runner as runner\n"
        "cls = runner.Gemma4Proposer\n"
        "print('RESULT:' + json.dumps([imported, f'{cls.__module__}.{cls.__qualname__}']))\n"
    )
    assert result == [False, PLUGIN_PROPOSER]


def test_entry_point_is_declared() -> None:
    plugins = importlib.metadata.entry_points(group="vllm.general_plugins")
    ours = [ep for ep in plugins if ep.name == "gemma4_spec"]
    assert len(ours) == 1
    assert ours[0].value == "gemma4_spec.plugin:register"


# --- supported vLLM versions -----------------------------------------------------------------


@pytest.mark.parametrize("found", ["0.20.0", "0.40.0", "0.34.0", "0.25.9"])
def test_unsupported_vllm_version(found: str) -> None:
    with pytest.raises(UnsupportedVLLMVersionError) as info:
        check_vllm_version(Version(found))
    message = str(info.value)
    assert f"vLLM {found} is installed" in message
    assert str(SUPPORTED_VLLM) in message
    assert "pip install" in message and "VLLM_PLUGINS" in message


@pytest.mark.parametrize(
    "found", ["0.26.0", "0.29.1", "0.32.0", "0.33.1", "0.32.0+cpu", "0.33.0.post1"]
)
def test_supported_vllm_version(found: str) -> None:
    check_vllm_version(Version(found))
    assert compat.vllm_is_supported(Version(found))


def test_no_vllm_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compat, "installed_vllm_version", lambda: None)
    assert not compat.vllm_is_supported()
    with pytest.raises(UnsupportedVLLMVersionError) as info:
        check_vllm_version()
    message = str(info.value)
    assert "no vLLM is installed" in message
    assert str(SUPPORTED_VLLM) in message and "pip install" in message


def test_installed_vllm_is_supported() -> None:
    assert compat.installed_vllm_version() is not None
    check_vllm_version()


# --- hooks.when_imported ---------------------------------------------------------------------


def test_when_imported_runs_at_once_for_an_imported_module() -> None:
    seen: list[ModuleType] = []
    hooks.when_imported("json", seen.append)
    assert seen == [json]
    assert "json" not in hooks._pending


@pytest.fixture
def probe_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The name of a not-yet-imported throwaway module on sys.path (forgotten afterwards)."""
    name = f"gemma4_spec_hook_probe_{uuid.uuid4().hex}"
    (tmp_path / f"{name}.py").write_text("VALUE = 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    yield name
    sys.modules.pop(name, None)
    hooks._pending.pop(name, None)


def test_when_imported_runs_once_right_after_import(probe_module: str) -> None:
    seen: list[tuple[str, ModuleType, int]] = []
    hooks.when_imported(probe_module, lambda m: seen.append(("first", m, m.VALUE)))
    hooks.when_imported(probe_module, lambda m: seen.append(("second", m, m.VALUE)))
    assert seen == []
    assert probe_module not in sys.modules

    module = importlib.import_module(probe_module)
    # Both callbacks, in order, with the fully executed module.
    assert seen == [("first", module, 42), ("second", module, 42)]
    assert probe_module not in hooks._pending

    importlib.import_module(probe_module)
    assert len(seen) == 2


def test_pipeline_parallelism_is_rejected_before_loading() -> None:
    from types import SimpleNamespace

    from gemma4_spec.checks import UnsupportedConfigurationError, check_gemma4_mtp_request

    spec_config = SimpleNamespace(
        target_parallel_config=SimpleNamespace(pipeline_parallel_size=2),
        draft_model_config=None,
        target_model_config=None,
    )
    with pytest.raises(UnsupportedConfigurationError, match="pipeline_parallel_size=2"):
        check_gemma4_mtp_request(spec_config)


# --- model runner selection ------------------------------------------------------------------


class _FakeSpec:
    """Like vLLM's SpeculativeConfig, which turns method "gemma4_mtp" into "mtp" + a draft
    model_type, and answers ``use_gemma4_mtp()``."""

    def __init__(self, method: str) -> None:
        self.method = "mtp" if method == "gemma4_mtp" else method
        self._gemma4 = method == "gemma4_mtp"

    def use_gemma4_mtp(self) -> bool:
        return self._gemma4


class _FakeConfig:
    """Stands in for VllmConfig: like vLLM's, its choice is the environment variable when set."""

    def __init__(self, method: str | None, default: bool) -> None:
        self.speculative_config = None if method is None else _FakeSpec(method)
        self._default = default

    @property
    def use_v2_model_runner(self) -> bool:
        explicit = patch_vllm_config.explicit_runner_choice()
        return self._default if explicit is None else explicit


def _patched_config_module() -> ModuleType:
    module = ModuleType("fake_vllm_config")
    own = {"use_v2_model_runner": _FakeConfig.__dict__["use_v2_model_runner"]}
    module.VllmConfig = type("VllmConfig", (_FakeConfig,), own)  # type: ignore[attr-defined]
    patch_vllm_config.apply(module)
    once = module.VllmConfig.__dict__["use_v2_model_runner"]
    patch_vllm_config.apply(module)  # idempotent: a second apply must not wrap the wrapper
    assert module.VllmConfig.__dict__["use_v2_model_runner"] is once
    return module


@pytest.mark.parametrize(
    ("method", "env", "default", "with_v2", "with_v1"),
    [
        # DEFAULT_RUNNER "V2": vLLM's choice stands; "V1": gemma4_mtp moves off V2 unless told.
        ("gemma4_mtp", None, True, True, False),
        ("gemma4_mtp", "0", True, False, False),
        ("gemma4_mtp", "1", True, True, True),  # an explicit choice stands: both are supported
        ("eagle", None, True, True, True),  # other methods keep vLLM's choice
        (None, None, True, True, True),
        (None, None, False, False, False),
        ("gemma4_mtp", "1", False, True, True),
        ("gemma4_mtp", "0", False, False, False),
    ],
)
@pytest.mark.parametrize("default_runner", ["V2", "V1"])
def test_gemma4_mtp_runner_choice(
    set_env: Callable[[str, str | None], None],
    monkeypatch: pytest.MonkeyPatch,
    default_runner: str,
    method: str | None,
    env: str | None,
    default: bool,
    with_v2: bool,
    with_v1: bool,
) -> None:
    set_env("VLLM_USE_V2_MODEL_RUNNER", env)
    monkeypatch.setattr(patch_vllm_config, "DEFAULT_RUNNER", default_runner)
    module = _patched_config_module()
    expected = with_v2 if default_runner == "V2" else with_v1
    assert module.VllmConfig(method, default).use_v2_model_runner is expected


def test_real_vllm_config_is_patched_in_engine_processes() -> None:
    result = run_python(
        "import json\n"
        "from gemma4_spec.patch.hooks import is_ours\n"
        "from gemma4_spec.plugin import register\n"
        "register()\n"
        "from vllm.config.vllm import VllmConfig\n"
        "fget = VllmConfig.__dict__['use_v2_model_runner'].fget\n"
        "print('RESULT:' + json.dumps(is_ours(fget)))\n"
    )
    assert result is True


@pytest.mark.parametrize("default", ["V1", "V2"])
def test_the_default_runner_applies_only_where_vllm_would_pick_v2(
    monkeypatch: pytest.MonkeyPatch, default: str
) -> None:
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    monkeypatch.setattr(patch_vllm_config, "DEFAULT_RUNNER", default)
    module = _patched_config_module()
    assert module.VllmConfig("gemma4_mtp", True).use_v2_model_runner is (default == "V2")
    # Where vLLM picks V1 (the CPU runner, older models) gemma4_mtp stays there.
    assert module.VllmConfig("gemma4_mtp", False).use_v2_model_runner is False
    # A feature that runs on V2 only keeps vLLM's choice.
    watermarked = module.VllmConfig("gemma4_mtp", True)
    watermarked.watermark_config = object()
    assert watermarked.use_v2_model_runner is True


@pytest.mark.parametrize(
    ("method", "has_field", "expected"),
    [("greedy", True, True), ("probabilistic", True, False), ("greedy", False, None)],
)
def test_greedy_drafting_on_v2_goes_through_our_argmax(
    method: str, has_field: bool, expected: bool | None
) -> None:
    from types import SimpleNamespace

    from gemma4_spec.patch.patch_engine_args import draft_with_our_argmax

    spec = SimpleNamespace(draft_sample_method=method)
    if has_field:
        spec.use_local_argmax_reduction = False
    draft_with_our_argmax(spec)
    assert getattr(spec, "use_local_argmax_reduction", None) is expected


# --- the start-up warm-up of small prefill batches (Model Runner V2) ----------------------------


def _patched_worker_module(seen: list[int]) -> ModuleType:
    """A worker module whose warm-up records the request cap it ran under (vLLM's sizes its
    batch by ``scheduler_config.max_num_seqs``) and fails on a cap of 2 when asked to."""

    def warmup_kernels(model_runner: Any, execute_model: Any, sample_tokens: Any) -> None:
        assert (execute_model, sample_tokens) == ("execute", "sample")
        cap = model_runner.scheduler_config.max_num_seqs
        seen.append(cap)
        if cap == 2 and model_runner.fail_at_two:
            raise RuntimeError("warm-up failed")

    module = ModuleType("fake_vllm_gpu_worker")
    module.warmup_kernels = warmup_kernels  # type: ignore[attr-defined]
    patch_v2_warmup.apply(module)
    once = module.warmup_kernels  # type: ignore[attr-defined]
    patch_v2_warmup.apply(module)  # idempotent
    assert module.warmup_kernels is once  # type: ignore[attr-defined]
    return module


def _runner(method: str | None, max_num_seqs: int, fail_at_two: bool = False) -> Any:
    from types import SimpleNamespace

    config = _FakeConfig(method, default=True)
    return SimpleNamespace(
        vllm_config=config,
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs),
        fail_at_two=fail_at_two,
    )


@pytest.mark.parametrize(
    ("method", "max_num_seqs", "env", "expected"),
    [
        ("gemma4_mtp", 256, None, [256, 1, 2, 16]),  # then one batch of each integer class
        ("gemma4_mtp", 8, None, [8, 1, 2]),  # no batch of 16 requests can happen
        ("gemma4_mtp", 1, None, [1]),  # vLLM's own warm-up is the one-request batch
        ("gemma4_mtp", 256, "0", [256]),  # GEMMA4_SPEC_PREFILL_WARMUP=0
        ("eagle", 256, None, [256]),  # other speculative methods: vLLM's warm-up alone
        (None, 256, None, [256]),  # no speculation
    ],
)
def test_small_prefill_batches_are_warmed_for_gemma4_mtp(
    set_env: Callable[[str, str | None], None],
    method: str | None,
    max_num_seqs: int,
    env: str | None,
    expected: list[int],
) -> None:
    set_env(patch_v2_warmup.PREFILL_WARMUP_ENV, env)
    seen: list[int] = []
    runner = _runner(method, max_num_seqs)
    _patched_worker_module(seen).warmup_kernels(runner, "execute", "sample")
    assert seen == expected
    assert runner.scheduler_config.max_num_seqs == max_num_seqs


@pytest.mark.parametrize(("method", "uploads"), [("gemma4_mtp", 1), ("eagle", 0), (None, 0)])
def test_graphs_are_uploaded_after_the_warm_up_for_gemma4_mtp(
    monkeypatch: pytest.MonkeyPatch, method: str | None, uploads: int
) -> None:
    from gemma4_spec.spec_decode import graph_upload

    seen: list[int] = []
    uploaded: list[int] = []
    # Records how many warm-up rounds had run when the upload was called: one upload, after all.
    monkeypatch.setattr(
        graph_upload, "upload_runner_graphs", lambda runner: uploaded.append(len(seen)) or 0
    )
    runner = _runner(method, 256)
    _patched_worker_module(seen).warmup_kernels(runner, "execute", "sample")
    assert uploaded == [len(seen)] * uploads


def test_the_request_cap_is_restored_when_a_warm_up_round_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(patch_v2_warmup.PREFILL_WARMUP_ENV, raising=False)
    seen: list[int] = []
    runner = _runner("gemma4_mtp", 64, fail_at_two=True)
    with pytest.raises(RuntimeError, match="warm-up failed"):
        _patched_worker_module(seen).warmup_kernels(runner, "execute", "sample")
    assert seen == [64, 1, 2]
    assert runner.scheduler_config.max_num_seqs == 64


def test_real_gpu_worker_warm_up_is_patched_in_engine_processes() -> None:
    result = run_python(
        "import json\n"
        "from gemma4_spec.patch.hooks import is_ours\n"
        "from gemma4_spec.plugin import register\n"
        "register()\n"
        "import vllm.v1.worker.gpu_worker as worker\n"
        "print('RESULT:' + json.dumps(is_ours(worker.warmup_kernels)))\n"
    )
    assert result is True


# --- compat: the one API difference between vLLM 0.26 and 0.32 that we meet -----------------


def test_drafting_metadata_on_either_vllm() -> None:
    calls: list[tuple[str, Any, int]] = []

    class Builder:  # vLLM 0.26: the group's metadata builder builds drafting metadata
        def build_for_drafting(self, common_attn_metadata: Any, draft_index: int) -> str:
            calls.append(("builder", common_attn_metadata, draft_index))
            return "from-builder"

    class Group026:
        def get_metadata_builder(self) -> Builder:
            return Builder()

    class Group032(Group026):  # vLLM >= 0.32: the group itself does (and maps block tables)
        def build_metadata_for_drafting(self, common_attn_metadata: Any, draft_index: int) -> str:
            calls.append(("group", common_attn_metadata, draft_index))
            return "from-group"

    assert compat.build_drafting_metadata(Group026(), "meta", 0) == "from-builder"
    assert compat.build_drafting_metadata(Group032(), "meta", 2) == "from-group"
    assert calls == [("builder", "meta", 0), ("group", "meta", 2)]


# --- patch_v2_speculator ---------------------------------------------------------------------


def _speculator_module() -> ModuleType:
    """A stand-in for vLLM's gemma4 speculator module, holding vLLM's real class."""
    from vllm.v1.worker.gpu.spec_decode.gemma4 import speculator

    module = ModuleType("fake_gemma4_speculator")
    module.Gemma4Speculator = speculator.Gemma4Speculator  # type: ignore[attr-defined]
    return module


@pytest.mark.parametrize(
    ("supported", "env", "ours"),
    [(True, None, True), (True, "0", False), (False, None, False)],
)
def test_v2_draft_loop_replaces_vllms_speculator_where_supported(
    monkeypatch: pytest.MonkeyPatch,
    set_env: Callable[[str, str | None], None],
    supported: bool,
    env: str | None,
    ours: bool,
) -> None:
    from gemma4_spec.spec_decode.runner_v2 import Gemma4LoopSpeculator

    set_env(patch_v2_speculator.V2_DRAFT_LOOP_ENV, env)
    monkeypatch.setattr(patch_v2_speculator, "v2_draft_loop_supported", lambda: supported)
    module = _speculator_module()
    vllms = module.Gemma4Speculator  # type: ignore[attr-defined]
    patch_v2_speculator.apply(module)
    patch_v2_speculator.apply(module)  # idempotent
    installed = module.Gemma4Speculator  # type: ignore[attr-defined]
    assert (installed is Gemma4LoopSpeculator) == ours
    assert issubclass(installed, vllms)
    if not ours:
        assert installed is vllms


def test_v2_draft_loop_is_gated_to_the_vllm_it_was_read_in() -> None:
    from gemma4_spec.compat import v2_draft_loop_supported

    assert v2_draft_loop_supported(Version("0.26.0"))
    assert not v2_draft_loop_supported(Version("0.32.0"))
    assert not v2_draft_loop_supported(Version("0.33.0"))


# --- request parameters refused before they run (patch_request_params) -------------------------


def _checking_processor_module() -> ModuleType:
    """A module with an InputProcessor whose check refuses what vLLM's does (``logit_bias``
    with speculative decoding), patched twice."""

    class InputProcessor:
        def __init__(self, vllm_config: Any) -> None:
            self.vllm_config = vllm_config
            self.checked: list[Any] = []

        def _validate_params(self, params: Any, supported_tasks: Any) -> None:
            self.checked.append(params)
            if self.vllm_config.speculative_config is not None and (
                params.logit_bias or params.min_p > 0
            ):  # vLLM's words
                raise ValueError(
                    "The min_p and logit_bias sampling parameters are not yet supported with "
                    "speculative decoding."
                )
            if params.logit_bias == {"bad": 1}:
                raise ValueError("some other error")

    return _processor_module_patched_twice(
        InputProcessor, patch_request_params.apply, "_validate_params"
    )


def _processor_module_patched_twice(
    processor: type, apply: Callable[[ModuleType], None], method: str
) -> ModuleType:
    """A module holding ``processor`` as vLLM's input processor module holds its class, with
    ``apply`` applied twice (the second must leave ``method`` as the first put it)."""
    module = ModuleType("fake_vllm_input_processor")
    module.InputProcessor = processor  # type: ignore[attr-defined]
    apply(module)
    once = getattr(processor, method)
    apply(module)  # idempotent
    assert getattr(processor, method) is once
    return module


@pytest.mark.parametrize(
    ("method", "v2", "ids", "refused"),
    [
        ("gemma4_mtp", False, [5, 17], True),  # V1: no logprobs, or the engine fails
        ("gemma4_mtp", False, None, False),
        ("gemma4_mtp", True, [5, 17], True),  # V2: the top logprobs instead of these
        ("eagle", False, [5, 17], False),  # other engines as vLLM has them
        (None, False, [5, 17], False),
    ],
)
def test_logprob_token_ids_are_refused_on_gemma4_mtp_engines(
    method: str | None, v2: bool, ids: list[int] | None, refused: bool
) -> None:
    from types import SimpleNamespace

    config = SimpleNamespace(
        speculative_config=None if method is None else _FakeSpec(method),
        use_v2_model_runner=v2,
    )
    processor = _checking_processor_module().InputProcessor(config)  # type: ignore[attr-defined]
    params = SimpleNamespace(logprob_token_ids=ids, logit_bias=None, min_p=0.0)
    error = type(patch_request_params.validation_error("", "x"))  # vLLM's class for a 400
    if refused:
        with pytest.raises(error, match="logprob_token_ids .* is not supported") as info:
            processor._validate_params(params, ("generate",))
        assert getattr(info.value, "parameter", None) == "logprob_token_ids"
    else:
        processor._validate_params(params, ("generate",))
    assert processor.checked == [params]  # vLLM's own check ran first, either way


@pytest.mark.parametrize(
    ("method", "changes", "named"),
    [
        ("gemma4_mtp", {"logit_bias": {1: 1.0}}, "logit_bias"),
        ("gemma4_mtp", {"min_p": 0.5}, "min_p"),
        ("eagle", {"min_p": 0.5}, None),  # other engines: vLLM's words as they are
    ],
)
def test_vllms_speculative_refusals_name_the_parameter(
    method: str, changes: dict[str, Any], named: str | None
) -> None:
    from types import SimpleNamespace

    config = SimpleNamespace(speculative_config=_FakeSpec(method), use_v2_model_runner=False)
    processor = _checking_processor_module().InputProcessor(config)  # type: ignore[attr-defined]
    params = SimpleNamespace(
        **{"logprob_token_ids": None, "logit_bias": None, "min_p": 0.0, **changes}
    )
    with pytest.raises(Exception) as info:
        processor._validate_params(params, ("generate",))
    message = str(info.value)
    if named is None:
        assert message.startswith("The min_p and logit_bias")
        return
    assert getattr(info.value, "parameter", None) == named
    assert f"remove {named} from the request" in message and "--speculative-config" in message
    assert "not yet supported with speculative decoding" in str(info.value.__cause__)
    other = SimpleNamespace(logprob_token_ids=None, logit_bias={"bad": 1}, min_p=0.0)
    config.speculative_config = None  # not vLLM's speculative refusal: left as it is
    with pytest.raises(ValueError, match="some other error"):
        processor._validate_params(other, ("generate",))


# --- the logits-processor plugins loaded when the front end starts (patch_input_processor) ------


def _input_processor_module(eager_v2: bool) -> ModuleType:
    """A module with an InputProcessor like vLLM's (``eager_v2``: with the constructor-time
    checker of vLLM 0.32+ Model Runner V2), patched twice."""

    class InputProcessor:
        def __init__(self, vllm_config: Any, renderer: Any = None, *, mm_registry: Any = None):
            self.vllm_config = vllm_config

    if eager_v2:
        setattr(InputProcessor, patch_input_processor.EAGER_V2_CHECKER, lambda self: None)
    return _processor_module_patched_twice(InputProcessor, patch_input_processor.apply, "__init__")


@pytest.mark.parametrize(
    ("method", "v2", "eager_v2", "env", "loads"),
    [
        ("gemma4_mtp", False, False, None, True),  # vLLM 0.26, V1
        ("gemma4_mtp", True, False, None, True),  # vLLM 0.26, V2: lazy as well
        ("gemma4_mtp", False, True, None, True),  # 0.32+ on V1: still lazy
        ("gemma4_mtp", True, True, None, False),  # 0.32+ on V2: vLLM loads them at start-up
        ("gemma4_mtp", False, False, "0", False),  # GEMMA4_SPEC_EARLY_LOGITSPROCS=0
        ("eagle", False, False, None, False),  # other engines keep vLLM's timing
        (None, False, False, None, False),
    ],
)
def test_logits_processor_plugins_load_when_the_front_end_starts(
    monkeypatch: pytest.MonkeyPatch,
    set_env: Callable[[str, str | None], None],
    method: str | None,
    v2: bool,
    eager_v2: bool,
    env: str | None,
    loads: bool,
) -> None:
    from types import SimpleNamespace

    set_env(patch_input_processor.EARLY_LOGITSPROCS_ENV, env)
    loaded: list[Any] = []
    monkeypatch.setattr(patch_input_processor, "load_logitsprocs_now", loaded.append)
    model_config = SimpleNamespace(logits_processors=None)
    config = SimpleNamespace(
        speculative_config=None if method is None else _FakeSpec(method),
        use_v2_model_runner=v2,
        model_config=model_config,
    )
    processor = _input_processor_module(eager_v2).InputProcessor(config, renderer="r")  # type: ignore[attr-defined]
    assert processor.vllm_config is config  # vLLM's constructor ran, with its arguments
    assert loaded == ([model_config] if loads else [])


@pytest.mark.parametrize("configured", [None, ["my_pkg.MyProcessor"]])
def test_the_early_load_fills_the_cache_vllms_request_check_reads(
    monkeypatch: pytest.MonkeyPatch, configured: list[str] | None
) -> None:
    # Against the installed vLLM: after the early load, vLLM's own check of a request finds
    # the classes in its cache (a hit, no new load), under the key it derives itself.
    from types import SimpleNamespace

    from vllm import SamplingParams
    from vllm.v1.sample import logits_processor

    loads: list[Any] = []
    # The cache wraps vLLM's loader; a stand-in for the loader keeps the test off the
    # installed distributions and any named class.
    fake = functools.lru_cache(lambda key: loads.append(key) or [])
    monkeypatch.setattr(logits_processor, "cached_load_custom_logitsprocs", fake)
    patch_input_processor.load_logitsprocs_now(SimpleNamespace(logits_processors=configured))
    assert len(loads) == 1
    logits_processor.validate_logits_processors_parameters(configured, SamplingParams())
    assert len(loads) == 1, "vLLM's request check loaded again: the key differs"
    assert fake.cache_info().hits == 1
