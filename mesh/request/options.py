"""The request fields and deployment settings that change a rendered chat prompt (``ChatOptions``),
and the template variables vLLM makes of them (``template_arguments``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

# vLLM's ``--chat-template-content-format``: "string" (text parts joined into one string) or
# "openai" (a list of {"type": "text", "text": ...} parts); "auto" detects it from the template.
ContentFormat = Literal["string", "openai"]
CONTENT_FORMATS = ("auto", "string", "openai")


class ChatTemplateError(ValueError):
    """The messages cannot be rendered (bad shape, or the template raised)."""


# Template variables a request may not set through chat_template_kwargs (they are the call's own).
_RESERVED_KWARGS = frozenset({"messages"})


@dataclass(frozen=True)
class ChatOptions:
    """The request fields that change the rendered prompt (vLLM's defaults), and the deployment's
    forced content format (``content_format``: set by the gateway's pool or the worker's flag with
    ``forced``, never read from a request body; "auto" leaves the renderer's own)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None
    documents: list[Any] | None = None
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    content_format: str = "auto"
    reasoning_effort: str | None = None
    chat_template: str | None = None  # the request's own template (``chat_template``, or in the kwargs)
    default_kwargs: Mapping[str, Any] = field(default_factory=dict)  # the deployment's, never a request's

    @property
    def plain(self) -> bool:
        """Nothing a ChatML template would render differently from the defaults but the flags."""
        return (self.tools is None and self.documents is None and not self.template_kwargs
                and self.content_format != "openai" and self.reasoning_effort is None
                and self.chat_template is None and not self.default_kwargs)

    def forced(self, content_format: str, default_kwargs: Mapping[str, Any] | None = None) -> ChatOptions:
        """These options rendered in ``content_format`` ("auto": unchanged) with the deployment's
        default template kwargs (vLLM's ``--default-chat-template-kwargs``)."""
        if default_kwargs:
            return replace(self, default_kwargs=default_kwargs).forced(content_format)
        if content_format == self.content_format:
            return self
        if content_format not in CONTENT_FORMATS:
            raise ValueError(f"content_format must be one of {CONTENT_FORMATS}, not {content_format!r}")
        return replace(self, content_format=content_format)

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> ChatOptions:
        """Parse a chat request body's options; ChatTemplateError (a 400) on a bad field."""
        if _OPTION_FIELDS.isdisjoint(body):  # the usual request: no option set
            return DEFAULT_OPTIONS
        add_gen = _flag(body, "add_generation_prompt", True)
        cont = _flag(body, "continue_final_message", False)
        if add_gen and cont and "add_generation_prompt" in body:
            raise ChatTemplateError("cannot set both 'continue_final_message' and 'add_generation_prompt' to true")
        if cont:
            add_gen = False  # vLLM: continuing the last message means no new assistant turn
        kwargs = body.get("chat_template_kwargs")
        if kwargs is None:
            kwargs = {}
        elif not isinstance(kwargs, dict) or not all(isinstance(k, str) and k.isidentifier() for k in kwargs):
            raise ChatTemplateError("'chat_template_kwargs' must be an object whose keys are identifiers")
        elif _RESERVED_KWARGS & kwargs.keys():
            raise ChatTemplateError(f"'chat_template_kwargs' may not set {sorted(_RESERVED_KWARGS & kwargs.keys())}")
        documents = body.get("documents")
        if documents is not None and not isinstance(documents, list):
            raise ChatTemplateError("'documents' must be an array")
        effort = _optional_str(body, "reasoning_effort")
        template = _optional_str(body, "chat_template") or _optional_str(kwargs, "chat_template")
        # vLLM takes both as apply_chat_template's own arguments: a template never sees them
        kwargs = {k: v for k, v in kwargs.items() if k not in ("chat_template", "tokenize")}
        return cls(add_gen, cont, template_tools(body.get("tools")), documents, kwargs,
                   reasoning_effort=effort, chat_template=template)


_OPTION_FIELDS = frozenset({"add_generation_prompt", "continue_final_message", "tools", "documents",
                            "chat_template_kwargs", "reasoning_effort", "chat_template"})


def _optional_str(body: Mapping[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise ChatTemplateError(f"'{name}' must be a string")
    return value
DEFAULT_OPTIONS = ChatOptions()


def _flag(body: Mapping[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ChatTemplateError(f"'{name}' must be a boolean")
    return value


def template_tools(tools: Any) -> list[dict[str, Any]] | None:
    """``tools`` as a template sees them from vLLM: each ``ChatCompletionToolsParam.model_dump()``,
    i.e. ``{"type", "function": {"name", "description", "parameters", <extra fields>}, <extras>}``
    with absent optional fields as null (templates ``tojson`` whole tools, so every key counts)."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ChatTemplateError("'tools' must be an array")
    out = []
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ChatTemplateError("each tool must be an object with a 'function' object that has a string 'name'")
        dumped = {"name": function["name"], "description": function.get("description"),
                  "parameters": function.get("parameters")}
        dumped.update((k, v) for k, v in function.items() if k not in dumped)
        entry = {"type": tool.get("type", "function"), "function": dumped}
        entry.update((k, v) for k, v in tool.items() if k not in entry)
        out.append(entry)
    return out


def template_arguments(opts: ChatOptions) -> dict[str, Any]:
    """The variables vLLM passes a template besides the messages and the special tokens, merged
    as its ``build_chat_params`` / ``with_defaults`` / ``preprocess_chat`` merge them (a None or
    "auto" value never overrides): the deployment's default kwargs (``--default-chat-template-kwargs``),
    under ``tools``, under the request's ``chat_template_kwargs``, under the request's explicit fields
    (``add_generation_prompt``, ``continue_final_message``, ``documents``, ``reasoning_effort``, and
    ``enable_thinking`` derived from an effort when the kwargs do not set it)."""
    explicit: dict[str, Any] = {"add_generation_prompt": opts.add_generation_prompt,
                                "continue_final_message": opts.continue_final_message,
                                "documents": opts.documents, "reasoning_effort": opts.reasoning_effort}
    if opts.reasoning_effort is not None and "enable_thinking" not in opts.template_kwargs:
        explicit["enable_thinking"] = opts.reasoning_effort != "none"
    request = merge_kwargs(opts.template_kwargs, explicit)
    merged = merge_kwargs(merge_kwargs(opts.default_kwargs, {"tools": opts.tools}), request)
    # HF's apply_chat_template passes these (None when unset): a template may test ``tools is defined``
    return {"tools": None, "documents": None, **merged}


def merge_kwargs(defaults: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM's ``merge_kwargs``: ``overrides`` over ``defaults``, except its None and "auto" values."""
    return {**defaults, **{k: v for k, v in overrides.items() if v is not None and not _is_auto(v)}}


def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value == "auto"


