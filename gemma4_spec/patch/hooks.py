"""Run a callback once a module has been imported, without importing it ourselves.

vLLM calls plugin ``register()`` in every process, early; importing heavy vLLM modules there
would slow down processes that never need them. A patch of module ``M`` is therefore deferred
until ``M`` is imported (or applied at once if it already is)."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable
from types import ModuleType

Callback = Callable[[ModuleType], None]
_pending: dict[str, list[Callback]] = {}
# Set on the functions our patches put in vLLM's place, so that a second apply sees them.
_OURS = "gemma4_spec"


def ours(fn: Callable[..., object]) -> Callable[..., object]:
    """Mark ``fn`` as a replacement of ours (returns it)."""
    setattr(fn, _OURS, True)
    return fn


def is_ours(fn: object) -> bool:
    """Whether ``fn`` is a replacement an earlier apply put in place."""
    return bool(getattr(fn, _OURS, False))


def when_imported(module_name: str, callback: Callback) -> None:
    module = sys.modules.get(module_name)
    if module is not None:
        callback(module)
        return
    _pending.setdefault(module_name, []).append(callback)
    if not any(isinstance(f, _PostImportFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _PostImportFinder())


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Wraps the loader of a watched module so its callbacks run right after it executes."""

    def find_spec(self, fullname, path, target=None):  # type: ignore[no-untyped-def]
        if fullname not in _pending:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            spec = (
                finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
            )
            if spec is not None and spec.loader is not None:
                spec.loader = _CallbackLoader(spec.loader)
                return spec
        return None


class _CallbackLoader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader) -> None:
        self._inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        for callback in _pending.pop(module.__name__, []):
            callback(module)
