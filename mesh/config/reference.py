"""The config reference page (docs/config.md), generated from the pydantic models of ``mesh.config``.

``reference()`` lists every key of ``MeshConfig`` by its YAML path with its type (and bounds), its
default and its text. A key's text is its ``Field(description=...)``, else the comment lines
right above its line in its module (``mesh/config/``) and the comment on the line itself; a section's intro
is its model's docstring. ``python -m mesh.commands.config reference > docs/config.md`` writes the
page; a test keeps the checked-in page equal to the output, so the page follows the models.
"""

from __future__ import annotations

import inspect
import io
import json
import tokenize
import types
import typing
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from mesh.config import MeshConfig
from mesh.yaml_document import model_in as _model_in

HEADER = """# Config reference

Generated from the models in `mesh/config/` by `python -m mesh.commands.config reference`
(do not edit by hand: a test compares this page with that output). One YAML file configures a
gateway; every key is optional. `mesh config validate FILE` checks a file (every error with its
path), `mesh config show --config FILE` prints the effective config with the defaults filled in.

`mesh serve` flags and environment variables override the file: `--worker-urls`, `--policy`,
`--api-key` / `--api-key-file` (`$MESH_API_KEYS` comma-separated, `$MESH_API_KEYS_FILE`),
`--admin-key` / `--admin-key-file` (`$MESH_ADMIN_KEY`, `$MESH_ADMIN_KEY_FILE`), `--host`, `--port`:
a flag wins over its environment variable, which wins over the file. A key file holds one key a
line (blank lines and `#` comments skipped) and is read again at every reload.

The routing policy (`policy:`) is a plugin spec: see [policies.md](policies.md).
"""


def reference() -> str:
    out = [HEADER]
    for name, field in MeshConfig.model_fields.items():
        section = _model_in(field.annotation)
        if section is None:
            out.append(_section(name, None, [(name, field, MeshConfig)]))
        else:
            prefix = f"{name}[]" if typing.get_origin(field.annotation) is list else name
            out.append(_section(prefix, section, list(_fields(section, prefix))))
    return "\n".join(out)


def _fields(model: type[BaseModel], prefix: str) -> typing.Iterator[tuple[str, FieldInfo, type[BaseModel]]]:
    for name, field in model.model_fields.items():
        nested = _model_in(field.annotation)
        if nested is not None and nested is not model:
            yield f"{prefix}.{name}", field, model
            yield from _fields(nested, f"{prefix}.{name}")
        else:
            yield f"{prefix}.{name}", field, model


def _section(title: str, model: type[BaseModel] | None, rows: list[tuple[str, FieldInfo, type[BaseModel]]]) -> str:
    lines = [f"## `{title}`", ""]
    doc = inspect.getdoc(model) if model is not None and model.__doc__ else None
    if doc:
        lines += [_one_line(doc), ""]
    lines += ["| key | type | default | description |", "|---|---|---|---|"]
    for path, field, owner in rows:
        name = path.rsplit(".", 1)[-1]
        text = field.description or _comments(owner).get(name, "")
        lines.append(f"| `{path}` | {_cell(_type(field))} | {_cell(_default(field))} | {_cell(text)} |")
    return "\n".join(lines) + "\n"


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _cell(text: str) -> str:
    return _one_line(text).replace("|", "\\|")


def _type(field: FieldInfo) -> str:
    text = _type_name(field.annotation)
    bounds = []
    for meta in field.metadata:
        for attr, sign in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="), ("max_length", "at most")):
            value = getattr(meta, attr, None)
            if value is not None:
                bounds.append(f"{sign} {value:,}" if isinstance(value, int) else f"{sign} {value}")
    return f"{text} ({', '.join(bounds)})" if bounds else text


def _type_name(annotation: Any) -> str:
    if annotation is None or annotation is type(None):
        return "null"
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Literal:
        return " or ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in args)
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin is list:
        return f"list of {_type_name(args[0])}" if args else "list"
    if origin is dict:
        return f"map of {_type_name(args[0])} to {_type_name(args[1])}" if args else "map"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    if annotation is Any:
        return "any"
    if isinstance(annotation, type) and hasattr(annotation, "__members__"):  # an Enum
        return " or ".join(json.dumps(m.value) for m in annotation)  # type: ignore[attr-defined]
    return getattr(annotation, "__name__", str(annotation))


def _default(field: FieldInfo) -> str:
    if field.default_factory is not None:
        value = field.default_factory()  # type: ignore[call-arg]
        if isinstance(value, BaseModel):
            return "(section)"
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if hasattr(value, "value") and hasattr(type(value), "__members__"):  # an Enum member
        value = value.value
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10_000:
        return f"`{value:,}`".replace(",", "_")
    return f"`{json.dumps(value)}`"


_COMMENTS: dict[type, dict[str, str]] = {}


def _comments(model: type[BaseModel]) -> dict[str, str]:
    """Field name -> the comment block above its line and the comment on it, in the model's source."""
    if model not in _COMMENTS:
        _COMMENTS[model] = _source_comments(inspect.getsource(model), set(model.model_fields))
    return _COMMENTS[model]


def _source_comments(source: str, fields: set[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    above: list[str] = []
    line_field: dict[int, str] = {}
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    for i, tok in enumerate(tokens):
        if tok.type == tokenize.COMMENT:
            text = tok.string.lstrip("#").strip()
            if tok.start[0] in line_field:  # on a field's own line
                name = line_field[tok.start[0]]
                out[name] = f"{out[name]} {text}".strip()
            else:
                above.append(text)
        elif tok.type == tokenize.NAME and tok.start[1] == 4 and tok.string in fields and _is_field(tokens, i):
            line_field[tok.start[0]] = tok.string
            out[tok.string] = " ".join(above)
            above = []
        elif tok.type == tokenize.NAME and tok.start[1] == 4:
            above = []  # a comment above a method or a validator is not a field's
    return out


def _is_field(tokens: list[tokenize.TokenInfo], i: int) -> bool:
    return i + 1 < len(tokens) and tokens[i + 1].string == ":"
