"""Plugin registry: built-in names, ``module:Class`` paths and the ``mesh.policies`` entry points.

A spec is what the YAML file holds under ``policy``: a bare name (``round_robin``), or a map
``{name: NAME_OR_PATH, params: {...}}``. Every plugin kind (policy, filter, scorer, picker) has
its own namespace; ``create(kind, spec)`` builds one and raises ``PluginError`` with a message
that names the plugin and what is wrong.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any, TypeVar

KINDS = ("policy", "filter", "scorer", "picker")
ENTRY_POINT_GROUP = "mesh.policies"
_KIND_METHODS = {"policy": "decide", "filter": "filter", "scorer": "score", "picker": "pick"}

_REGISTRY: dict[str, dict[str, type]] = {kind: {} for kind in KINDS}
T = TypeVar("T", bound=type)


class PluginError(ValueError):
    """A plugin spec that cannot be built: unknown name, failed import, wrong shape or params."""


def register(kind: str, name: str) -> Callable[[T], T]:
    if kind not in _REGISTRY:
        raise PluginError(f"unknown plugin kind {kind!r}; expected one of {KINDS}")

    def deco(cls: T) -> T:
        _REGISTRY[kind][name] = cls
        cls.name = name  # type: ignore[attr-defined]
        return cls

    return deco


def names(kind: str) -> list[str]:
    _load_builtins()
    return sorted(_REGISTRY[kind])


def resolve(kind: str, name: str) -> type:
    """The class for ``name``: built-in, ``module:Class``, or a ``mesh.policies`` entry point."""
    _load_builtins()
    if name in _REGISTRY[kind]:
        return _REGISTRY[kind][name]
    if ":" in name:
        return _import_path(kind, name)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == name:
            try:
                loaded: type = ep.load()
                return loaded
            except (Exception, SystemExit) as exc:  # a broken third-party plugin must not crash the gateway
                raise PluginError(f"{kind} {name!r}: entry point failed to load: {exc}") from exc
    known = ", ".join(sorted(_REGISTRY[kind])) or "none"
    raise PluginError(f"unknown {kind} {name!r} (built-in: {known}; or use module:Class)")


def create(kind: str, spec: str | dict[str, Any], **context: Any) -> Any:
    """Build a plugin from its spec; ``context`` (keyword arguments) is passed where accepted."""
    name, params = split_spec(kind, spec)
    cls = resolve(kind, name)
    if kind == "policy" and not callable(getattr(cls, "decide", None)):
        raise PluginError(f"policy {name!r} has no decide(request, cluster) method")
    # Checked on the class, BEFORE it is called: ``module:Class`` can name any importable class,
    # and calling one with YAML params is running code (``subprocess:Popen`` as a scorer ran a
    # command at ``mesh config validate``). Only a class with its kind's method is ever built.
    method = _KIND_METHODS[kind]
    if kind != "policy" and not callable(getattr(cls, method, None)):
        raise PluginError(f"{kind} {name!r} has no {method}() method (subclass policies.pipeline.{kind.title()})")
    sig = inspect.signature(cls)
    accepts_any = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
    extra = {k: v for k, v in context.items() if accepts_any or k in sig.parameters}
    try:
        obj = cls(**{**extra, **params})
    except PluginError:  # a nested plugin's error already names itself and what is wrong
        raise
    except (TypeError, ValueError) as exc:
        raise PluginError(f"{kind} {name!r}: bad parameters {params}: {exc}") from exc
    except SystemExit as exc:  # not an Exception: it would end the gateway (a reload) or the CLI silently
        raise PluginError(f"{kind} {name!r}: its constructor exited (code {exc.code!r})") from None
    except Exception as exc:  # a plugin's own bug (RuntimeError, KeyError...): an error naming it, not a traceback
        raise PluginError(f"{kind} {name!r}: its constructor raised {type(exc).__name__}: {exc}") from exc
    return obj


_SPEC_KEYS = frozenset({"name", "params"})


def split_spec(kind: str, spec: str | dict[str, Any]) -> tuple[str, dict[str, Any]]:
    if isinstance(spec, str):
        return spec, {}
    if isinstance(spec, dict) and isinstance(spec.get("name"), str):
        unknown = set(spec) - _SPEC_KEYS
        if unknown:  # a typo (``parms``, ``param``) dropped the parameters without a word
            raise PluginError(f"{kind} {spec['name']!r}: unknown keys {sorted(map(str, unknown))} "
                              "(a plugin spec takes name and params)")
        params = spec.get("params", {})
        if not isinstance(params, dict):
            raise PluginError(f"{kind} {spec['name']!r}: params must be a mapping")
        return spec["name"], dict(params)
    raise PluginError(f"{kind} spec must be a name or a map with 'name' (and 'params'), got {spec!r}")


def _import_hint(module_name: str, exc: ModuleNotFoundError) -> str:
    """What to do when the plugin's own module (not one it imports) is not found."""
    missing = exc.name or ""
    if missing and module_name != missing and not module_name.startswith(missing + "."):
        return f" (the plugin module was found; a module it imports is missing: install {missing!r})"
    top = module_name.partition(".")[0]
    return (f" (a plugin module is imported by name, not by file: run with the directory that holds "
            f"{top!r} on PYTHONPATH, e.g. PYTHONPATH=examples/plugins for examples/plugins/{top}.py, "
            f"or install it as a package)")


def _import_path(kind: str, path: str) -> type:
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except SystemExit as exc:  # not an Exception: a script's sys.exit/argparse ended `mesh config validate` silently
        raise PluginError(f"{kind} {path!r}: {module_name!r} exited at import (code {exc.code!r}): not a plugin module") from None
    except ModuleNotFoundError as exc:
        raise PluginError(f"{kind} {path!r}: cannot import {module_name!r}: {exc}{_import_hint(module_name, exc)}") from exc
    except Exception as exc:
        raise PluginError(f"{kind} {path!r}: cannot import {module_name!r}: {exc}") from exc
    obj = getattr(module, attr, None)
    if obj is None or not inspect.isclass(obj):
        raise PluginError(f"{kind} {path!r}: {module_name!r} has no class {attr!r}")
    return obj


_builtins_loaded = False


def _load_builtins() -> None:
    global _builtins_loaded
    if _builtins_loaded:
        return
    _builtins_loaded = True
    import policies.builtin  # noqa: F401  (registers every built-in plugin)
