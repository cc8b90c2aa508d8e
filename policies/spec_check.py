"""Every problem of a policy spec, each on its own line with its YAML path (``mesh config validate``).

``spec_problems(spec)`` walks the spec as ``policies.registry.create`` and the composite
policies read it (a ``pipeline``'s filters, scorers, picker and profiles; ``session_sticky``'s
``inner``) and reports, instead of stopping at the first:

- a plugin name that resolves to nothing (with the nearest built-in name);
- a parameter the plugin's constructor does not take (with the nearest parameter name);
- a bad shape (a scorer entry with unknown keys, profiles that are not prefill/decode maps);
- whatever a constructor raises for values (a negative temperature), at the plugin's path: a
  node is built only when nothing inside it was reported, through ``create`` (which checks the
  class has its kind's method before calling it), so an error is never reported twice.

``named_roles(spec)`` lists the worker roles the spec routes to (P/D profiles, ``role`` filters),
for the check that some worker has them. Pure: no I/O, nothing kept.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Iterator, Mapping
from typing import Any

from policies.base import Role
from policies.registry import PluginError, create, names, resolve, split_spec

SCORER_KEYS = ("name", "weight", "params")
PROFILE_KEYS = ("filters", "scorers", "picker")
PROFILES = ("prefill", "decode")


def spec_problems(spec: Any, path: str = "policy") -> list[str]:
    """``path: message`` lines, one per problem of the policy ``spec``; empty when it builds."""
    return _node("policy", spec, path)


def nearest(word: str, choices: Any) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``choices``, else an empty string."""
    close = difflib.get_close_matches(word, [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _node(kind: str, spec: Any, path: str) -> list[str]:
    try:
        name, params = split_spec(kind, spec)
    except PluginError as exc:
        return [f"{path}: {exc}"]
    where = f"{path}.name" if isinstance(spec, dict) else path
    try:
        cls = resolve(kind, name)
    except PluginError as exc:
        return [f"{where}: {exc}{nearest(name, names(kind)) if ':' not in name else ''}"]
    problems = _unknown_params(kind, name, cls, params, f"{path}.params")
    for child_kind, child, child_path in _children(cls, params, f"{path}.params"):
        problems += _node(child_kind, child, child_path) if child_kind else [f"{child_path}: {child}"]
    if problems:
        return problems
    try:
        create(kind, spec)
    except PluginError as exc:
        return [f"{path}: {exc}"]
    except Exception as exc:  # noqa: BLE001  (a plugin's own bug: named, not a traceback)
        return [f"{path}: {kind} {name!r} raised {type(exc).__name__}: {exc}"]
    return []


def _unknown_params(kind: str, name: str, cls: type, params: Mapping[str, Any], path: str) -> list[str]:
    try:
        sig = inspect.signature(cls)
    except (TypeError, ValueError):  # no signature to read: the constructor itself will say
        return []
    if any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
        return []
    known = [p for p in sig.parameters if sig.parameters[p].kind is not inspect.Parameter.VAR_POSITIONAL]
    return [f"{path}.{key}: {kind} {name!r} has no parameter {key!r}{nearest(str(key), known)} "
            f"(its parameters: {', '.join(known) or 'none'})"
            for key in params if key not in known]


def _children(cls: type, params: Mapping[str, Any], path: str) -> Iterator[tuple[str, Any, str]]:
    """``(kind, spec, path)`` of each nested plugin spec; kind ``""`` carries a shape problem."""
    from policies.pipeline import Pipeline
    from policies.session_sticky import SessionSticky

    if cls is SessionSticky and params.get("inner") is not None:
        yield "policy", params["inner"], f"{path}.inner"
    if cls is not Pipeline:
        return
    yield from _profile(params, path)
    profiles = params.get("profiles")
    if profiles is None:
        return
    if not isinstance(profiles, Mapping):
        yield "", f"must be a map with 'prefill' and 'decode', got {profiles!r}", f"{path}.profiles"
        return
    for label in profiles:
        if label not in PROFILES:
            yield "", f"unknown profile{nearest(str(label), PROFILES)} (profiles are prefill and decode)", f"{path}.profiles.{label}"
    for label in PROFILES:
        body = profiles.get(label)
        if not isinstance(body, Mapping):
            yield "", "missing" if body is None else f"must be a map of {', '.join(PROFILE_KEYS)}", f"{path}.profiles.{label}"
            continue
        for key in body:
            if key not in PROFILE_KEYS:
                yield "", f"unknown key{nearest(str(key), PROFILE_KEYS)} (a profile takes {', '.join(PROFILE_KEYS)})", \
                    f"{path}.profiles.{label}.{key}"
        yield from _profile(body, f"{path}.profiles.{label}")


def _profile(body: Mapping[str, Any], path: str) -> Iterator[tuple[str, Any, str]]:
    """A pipeline's (or a profile's) filters, scorers and picker."""
    for key, kind in (("filters", "filter"), ("scorers", "scorer")):
        items = body.get(key)
        if items is None:
            continue
        if not isinstance(items, list):
            yield "", f"must be a list, got {type(items).__name__}", f"{path}.{key}"
            continue
        for i, item in enumerate(items):
            if kind == "scorer" and isinstance(item, dict):
                yield from _scorer_entry(item, f"{path}.{key}[{i}]")
            else:
                yield kind, item, f"{path}.{key}[{i}]"
    if body.get("picker") is not None:
        yield "picker", body["picker"], f"{path}.picker"


def _scorer_entry(entry: dict[str, Any], path: str) -> Iterator[tuple[str, Any, str]]:
    for key in entry:
        if key not in SCORER_KEYS:
            yield "", f"unknown key{nearest(str(key), SCORER_KEYS)} (a scorer entry takes {', '.join(SCORER_KEYS)})", f"{path}.{key}"
    weight = entry.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 <= weight < float("inf"):
        yield "", f"must be a finite number >= 0, got {weight!r}", f"{path}.weight"
    yield "scorer", {k: v for k, v in entry.items() if k in ("name", "params")}, path


def named_roles(spec: Any, path: str = "policy") -> list[tuple[str, frozenset[Role]]]:
    """``(path, roles)`` for each part of ``spec`` that routes only to workers of ``roles``: a
    pipeline's P/D profiles (each profile its role) and each ``role`` filter. Best effort on a
    spec that does not build (its problems are ``spec_problems``')."""
    out: list[tuple[str, frozenset[Role]]] = []
    try:
        name, params = split_spec("policy", spec)
        cls = resolve("policy", name)
    except PluginError:
        return out
    profiles = params.get("profiles")
    if isinstance(profiles, Mapping):
        out += [(f"{path}.params.profiles.{label}", frozenset({Role(label)})) for label in PROFILES if label in profiles]
    for kind, child, child_path in _children(cls, params, f"{path}.params"):
        if kind == "policy":
            out += named_roles(child, child_path)
        elif kind == "filter":
            out += _role_filter(child, child_path)
    return out


def local_prefills(spec: Any, path: str = "policy") -> list[tuple[str, int]]:
    """``(path, tokens)`` for each pipeline of ``spec`` that serves short prompts on the decode
    worker alone (``local_prefill_tokens`` > 0). Best effort, as ``named_roles``."""
    try:
        name, params = split_spec("policy", spec)
        cls = resolve("policy", name)
    except PluginError:
        return []
    tokens = params.get("local_prefill_tokens")
    out = [(f"{path}.params.local_prefill_tokens", tokens)] if isinstance(tokens, int) and tokens > 0 else []
    for kind, child, child_path in _children(cls, params, f"{path}.params"):
        if kind == "policy":
            out += local_prefills(child, child_path)
    return out


def _role_filter(spec: Any, path: str) -> list[tuple[str, frozenset[Role]]]:
    try:
        name, params = split_spec("filter", spec)
        roles = frozenset(Role(r) for r in params.get("roles", ("mixed",)))
    except (PluginError, ValueError, TypeError):
        return []
    return [(path, roles)] if name == "role" else []
