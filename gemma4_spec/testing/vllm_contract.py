"""Checks of what gemma4_spec relies on in vLLM, read from the installed vLLM's code.

Each contract kind names vLLM objects by dotted path (``"package.module:Qualified.name"``) and
says what must be true of them; ``problems()`` returns what is not (empty: the contract holds).
Facts come from the objects themselves: ``inspect.signature``, dataclass fields, ``hasattr``,
and, for attributes that only instances get, the ``self.<name> = ...`` assignments in the
sources of the class and its bases. ``tests/test_vllm_contract.py`` holds the table of
contracts and runs them under whatever vLLM is installed.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import textwrap
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import cache
from typing import Any

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


class Missing(LookupError):
    """A dotted path that does not resolve in the installed vLLM."""


def resolve(path: str) -> Any:
    """The object at ``"module:Qualified.name"`` (or a bare module path)."""
    module_name, _, qualname = path.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise Missing(f"module {module_name} is missing ({exc})") from exc
    for i, part in enumerate(qualname.split(".") if qualname else ()):
        owner = obj
        # Class attributes as written (a property, not what it returns; a function, not a
        # bound method), found along the MRO.
        for klass in owner.__mro__ if isinstance(owner, type) else ():
            if part in vars(klass):
                obj = vars(klass)[part]
                break
        else:
            if not hasattr(owner, part):
                done = ".".join(qualname.split(".")[:i]) or module_name
                raise Missing(f"{done} has no {part!r}")
            obj = getattr(owner, part)
    return obj


def _function_of(obj: Any) -> Callable[..., Any]:
    """The plain function behind a staticmethod, classmethod or property getter."""
    if isinstance(obj, (staticmethod, classmethod)):
        return obj.__func__
    if isinstance(obj, property):
        assert obj.fget is not None
        return obj.fget
    return obj


def parameters(obj: Any) -> list[inspect.Parameter]:
    """The parameters of a function, method or class (its ``__init__``), ``self`` included
    for functions defined in classes."""
    return list(inspect.signature(_function_of(obj)).parameters.values())


def signature_problems(theirs: Any, ours: Any) -> list[str]:
    """Where a callable of ours cannot stand in for vLLM's: a caller that calls vLLM's the
    way its signature allows (arguments by position, by name, or left to their defaults) must
    be able to call ours the same way."""
    found: list[str] = []
    t_params = parameters(theirs)
    o_params = parameters(ours)
    o_kinds = {p.kind for p in o_params}
    o_var_pos = inspect.Parameter.VAR_POSITIONAL in o_kinds
    o_var_kw = inspect.Parameter.VAR_KEYWORD in o_kinds
    t_pos = [p for p in t_params if p.kind in _POSITIONAL]
    o_pos = [p for p in o_params if p.kind in _POSITIONAL]
    o_by_name = {p.name: p for p in o_params if p.kind is not inspect.Parameter.POSITIONAL_ONLY}
    matched: set[str] = set()
    for i, t in enumerate(t_pos):
        if i < len(o_pos):
            o = o_pos[i]
            matched.add(o.name)
            if o.name != t.name and t.kind is not inspect.Parameter.POSITIONAL_ONLY:
                found.append(f"parameter {i} is {o.name!r} here, {t.name!r} in vLLM")
            if t.default is not inspect.Parameter.empty and o.default is inspect.Parameter.empty:
                found.append(f"{o.name!r} needs a value here, vLLM's has a default")
        elif not o_var_pos:
            found.append(f"no parameter {i} ({t.name!r}) here")
    for t in t_params:
        if t.kind is inspect.Parameter.KEYWORD_ONLY:
            o = o_by_name.get(t.name)
            if o is None and not o_var_kw:
                found.append(f"no keyword parameter {t.name!r} here")
            elif o is not None:
                matched.add(o.name)
                if (
                    t.default is not inspect.Parameter.empty
                    and o.default is inspect.Parameter.empty
                ):
                    found.append(f"{o.name!r} needs a value here, vLLM's has a default")
        elif t.kind is inspect.Parameter.VAR_KEYWORD and not o_var_kw:
            found.append(f"vLLM's takes **{t.name}, this does not")
        elif t.kind is inspect.Parameter.VAR_POSITIONAL and not o_var_pos:
            found.append(f"vLLM's takes *{t.name}, this does not")
    for o in o_params:
        if (
            o.name not in matched
            and o.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
            and o.default is inspect.Parameter.empty
        ):
            found.append(f"{o.name!r} is required here, vLLM's callers do not pass it")
    return found


@cache
def _self_assignments(klass: type) -> frozenset[str]:
    """Names assigned as ``self.<name>`` anywhere in ``klass``'s own source."""
    try:
        source = textwrap.dedent(inspect.getsource(klass))
    except (OSError, TypeError):
        return frozenset()
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
        ):
            names.add(node.attr)
    return frozenset(names)


@cache
def _module_assignments(module_name: str) -> frozenset[str]:
    """Names a module's helpers set on objects they are given: ``<obj>.<name> = ...`` and
    ``<obj>.register_buffer("<name>", ...)`` anywhere in its source."""
    try:
        source = inspect.getsource(importlib.import_module(module_name))
    except (OSError, TypeError):
        return frozenset()
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("register_buffer", "register_parameter")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            names.add(node.args[0].value)
    return frozenset(names)


def attributes_of(klass: type, helpers: bool = False) -> set[str]:
    """Every attribute an instance of ``klass`` can have: class attributes (methods and enum
    members included), dataclass and annotated fields, and the ``self.<name>`` assignments in
    the sources of its MRO; with ``helpers``, also what functions of the class's module set
    on the objects they are given (``_module_assignments``)."""
    names = set(dir(klass))
    if dataclasses.is_dataclass(klass):
        names |= {f.name for f in dataclasses.fields(klass)}
    for base in klass.__mro__:
        names |= set(vars(base))
        names |= set(getattr(base, "__annotations__", {}))
        names |= _self_assignments(base)
    if helpers:
        names |= _module_assignments(klass.__module__)
    return names


def calls_on(klass: type, receiver: str) -> set[str]:
    """Methods called as ``<receiver>.<name>(...)`` (e.g. ``self.drafter``) in the sources of
    ``klass`` and its bases."""
    names: set[str] = set()
    for base in klass.__mro__:
        try:
            source = textwrap.dedent(inspect.getsource(base))
        except (OSError, TypeError):
            continue
        for node in ast.walk(ast.parse(source)):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and ast.unparse(node.func.value) == receiver
            ):
                names.add(node.func.attr)
    return names


@dataclass(frozen=True)
class Exists:
    """``path`` resolves, and is of ``kind``: "class", "callable", "property", "module", or
    "any"."""

    path: str
    kind: str = "any"
    why: str = ""

    def problems(self) -> list[str]:
        try:
            obj = resolve(self.path)
        except Missing as exc:
            return [str(exc)]
        ok = {
            "any": True,
            "class": isinstance(obj, type),
            "callable": callable(_function_of(obj)),
            "property": isinstance(obj, property) and obj.fget is not None,
            "module": inspect.ismodule(obj),
        }[self.kind]
        return [] if ok else [f"{self.path} is a {type(obj).__name__}, not a {self.kind}"]


@dataclass(frozen=True)
class Params:
    """The callable at ``path`` takes ``positional`` as its first parameters, in that order
    (after ``self`` for methods), and names each of ``keywords`` as a parameter; it needs no
    parameter besides those (we would not pass it)."""

    path: str
    positional: tuple[str, ...] = ()
    keywords: tuple[str, ...] = ()
    why: str = ""

    def problems(self) -> list[str]:
        try:
            obj = resolve(self.path)
        except Missing as exc:
            return [str(exc)]
        params = parameters(obj)
        in_class = "." in self.path.partition(":")[2]
        if in_class and not isinstance(obj, (type, staticmethod)):
            params = params[1:]  # self (or cls)
        found = []
        names = [p.name for p in params if p.kind in _POSITIONAL]
        if tuple(names[: len(self.positional)]) != self.positional:
            found.append(
                f"positional parameters {names}, expected to start {list(self.positional)}"
            )
        # Named parameters only: a keyword that vLLM renamed would otherwise vanish into its
        # **kwargs unnoticed.
        by_name = {
            p.name
            for p in params
            if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        }
        found += [f"no parameter {k!r}" for k in self.keywords if k not in by_name]
        # A parameter vLLM added without a default would be missing from every call we make.
        passed = set(self.positional) | set(self.keywords)
        found += [
            f"new required parameter {p.name!r}"
            for p in params
            if p.name not in passed
            and p.default is inspect.Parameter.empty
            and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
            and (self.positional or self.keywords)
        ]
        return found


@dataclass(frozen=True)
class Attributes:
    """Instances of the class at ``path`` have each of ``names`` (see ``attributes_of``;
    ``helpers``: some are set by functions of the class's module)."""

    path: str
    names: tuple[str, ...]
    helpers: bool = False
    why: str = ""

    def problems(self) -> list[str]:
        try:
            klass = resolve(self.path)
        except Missing as exc:
            return [str(exc)]
        have = attributes_of(klass, self.helpers)
        return [f"{self.path} has no attribute {n!r}" for n in self.names if n not in have]


@dataclass(frozen=True)
class Overrides:
    """Our class ``ours`` subclasses vLLM's ``base``: each method ours defines either
    overrides one of the base (with a compatible signature) or is in ``own`` (ours alone).
    An override whose base method vanished would silently never be called."""

    ours: str
    base: str
    own: tuple[str, ...] = ()
    why: str = ""

    def problems(self) -> list[str]:
        try:
            ours, base = resolve(self.ours), resolve(self.base)
        except Missing as exc:
            return [str(exc)]
        found = []
        if not issubclass(ours, base):
            found.append(f"{self.ours} no longer subclasses {self.base}")
        for name, obj in vars(ours).items():
            # Constructors differ by design (``StandsIn`` checks ours against vLLM's).
            if name == "__init__" or not callable(_function_of(obj)):
                continue
            theirs = inspect.getattr_static(base, name, None)
            if theirs is None:
                if name not in self.own:
                    found.append(f"{name} overrides nothing in {self.base}")
                continue
            if name in self.own:
                found.append(f"{name} is declared ours alone, but {self.base} has it")
            found += [f"{name}: {p}" for p in signature_problems(theirs, obj)]
        return found


@dataclass(frozen=True)
class StandsIn:
    """Our class ``ours`` takes the place of vLLM's ``theirs`` (a module global we rebind):
    it is built the same way, and every method ``caller``'s source calls on ``receiver`` that
    vLLM's class has, ours has with a compatible signature."""

    ours: str
    theirs: str
    caller: str
    receiver: str
    why: str = ""

    def problems(self) -> list[str]:
        try:
            ours, theirs, caller = resolve(self.ours), resolve(self.theirs), resolve(self.caller)
        except Missing as exc:
            return [str(exc)]
        found = [f"__init__: {p}" for p in signature_problems(theirs.__init__, ours.__init__)]
        for name in sorted(calls_on(caller, self.receiver)):
            t = inspect.getattr_static(theirs, name, None)
            if t is None or not callable(_function_of(t)):
                continue  # another drafter's method
            o = inspect.getattr_static(ours, name, None)
            if o is None:
                found.append(f"{self.caller} calls {self.receiver}.{name}, which ours lacks")
            else:
                found += [f"{name}: {p}" for p in signature_problems(t, o)]
        return found


@dataclass(frozen=True)
class ModelCalls:
    """Every method vLLM's ``caller`` (a class) calls on ``receiver`` (its draft model), our
    model class ``model`` has, except those in ``not_needed`` (with the reason in ``why``);
    ``forward_keywords``: what it passes our ``forward`` by name."""

    caller: str
    receiver: str
    model: str
    forward_keywords: tuple[str, ...] = ()
    not_needed: tuple[str, ...] = ()
    why: str = ""

    def problems(self) -> list[str]:
        try:
            caller, model = resolve(self.caller), resolve(self.model)
        except Missing as exc:
            return [str(exc)]
        found = [
            f"{self.caller} calls {self.receiver}.{name}, which {model.__name__} lacks"
            for name in sorted(calls_on(caller, self.receiver) - set(self.not_needed))
            if not hasattr(model, name)
        ]
        accepted = {p.name for p in parameters(model.forward)}
        found += [f"forward takes no {k!r}" for k in self.forward_keywords if k not in accepted]
        return found


@dataclass(frozen=True)
class Check:
    """A fact no declarative kind above states: ``test`` returns the problems."""

    name: str
    test: Callable[[], Iterable[str]] = field(compare=False)
    why: str = ""

    def problems(self) -> list[str]:
        try:
            return list(self.test())
        except Missing as exc:
            return [str(exc)]


Contract = Exists | Params | Attributes | Overrides | StandsIn | ModelCalls | Check


def contract_id(contract: Contract) -> str:
    """A short test id for a contract."""
    subject = getattr(contract, "path", None) or getattr(contract, "ours", None)
    subject = subject or getattr(contract, "caller", None) or getattr(contract, "name", "")
    return f"{type(contract).__name__}:{subject.rsplit(':', 1)[-1]}"
