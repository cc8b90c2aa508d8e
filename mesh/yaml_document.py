"""Checks on a decoded YAML document, shared by the config loader (``mesh.config``) and the
``--policy`` file reader (``mesh.commands.policy_arg``).

``document_problem`` bounds a document before anything walks it: anchors and aliases can make a
small file a huge structure (billion laughs) that an error message would repr in full, or a
recursive one. ``format_errors`` writes pydantic's errors as ``path: message`` lines, the path
as in the YAML. Both are pure functions: no I/O, no state.
"""

from __future__ import annotations

import difflib
import types
import typing
from typing import Any

from pydantic import BaseModel, ValidationError

# Bounds on a decoded YAML document, aliases expanded; nesting deeper than this is no config (the
# YAML parser itself recurses once per level).
MAX_DOC_VALUES = 250_000
MAX_DOC_DEPTH = 64


def format_errors(exc: ValidationError, model: type[BaseModel] | None = None) -> list[str]:
    """One ``path: message`` line per pydantic error, the path written as in the YAML. With the
    validated ``model``, an unknown key names the keys its section takes (the nearest first)."""
    lines = []
    for err in exc.errors():
        path = ""
        for part in err["loc"]:
            path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden" and model is not None:
            msg = unknown_key_message(model, err["loc"])
        lines.append(f"{path or '(top level)'}: {msg}")
    return lines


def unknown_key_message(model: type[BaseModel], loc: tuple[int | str, ...]) -> str:
    """``unknown key (did you mean 'x'?)`` for the last part of ``loc``, from the fields of the
    section the rest of ``loc`` leads to in ``model``."""
    section: type[BaseModel] | None = model
    for part in loc[:-1]:
        if isinstance(part, int) or section is None:
            continue
        field = section.model_fields.get(part)
        section = model_in(field.annotation) if field is not None else None
    if section is None:
        return "unknown key"
    keys = list(section.model_fields)
    close = difflib.get_close_matches(str(loc[-1]), keys, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"unknown key ({hint}this section takes: {', '.join(keys)})"


def model_in(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model inside an annotation (``list[WorkerConfig]``, ``X | None``), if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if isinstance(annotation, (types.UnionType, types.GenericAlias)) or typing.get_origin(annotation) is not None:
        for arg in typing.get_args(annotation):
            found = model_in(arg)
            if found is not None:
                return found
    return None


def document_problem(data: Any) -> str | None:
    """Why a decoded document is no config (too many values once aliases are expanded, too deep,
    or recursive through an alias); None when it is fine. Iterative, and each shared container
    is visited once, so a billion-laughs document costs its size on disk, not its expansion."""
    sizes: dict[int, int] = {}  # id -> expanded values, containers finished
    open_ids: set[int] = set()  # containers on the current path (a recursive alias loops back)
    stack: list[tuple[Any, bool]] = [(data, False)]
    while stack:
        node, done = stack.pop()
        if not isinstance(node, (dict, list)):
            continue
        key = id(node)
        children = [*node.keys(), *node.values()] if isinstance(node, dict) else node
        if done:
            open_ids.discard(key)
            sizes[key] = 1 + sum(sizes.get(id(c), 1) for c in children)
            if sizes[key] > MAX_DOC_VALUES:
                return f"the document expands to more than {MAX_DOC_VALUES} values (YAML anchors and aliases count once per use)"
            continue
        if key in sizes:
            continue
        if key in open_ids:
            return "a YAML alias refers to a value that contains it (recursive structure)"
        if len(open_ids) >= MAX_DOC_DEPTH:
            return f"values nested more than {MAX_DOC_DEPTH} levels deep"
        open_ids.add(key)
        stack.append((node, True))
        stack.extend((c, False) for c in children if isinstance(c, (dict, list)) and id(c) not in sizes)
    return None
