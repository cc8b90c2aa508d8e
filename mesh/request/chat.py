"""Chat rendering shared by the gateway and the bundled engine: OpenAI chat messages and the
request's template options -> the prompt text an engine would tokenize.

Mesh routes on the engine's prompt, so it renders exactly as vLLM and SGLang do through Hugging
Face's ``apply_chat_template``: messages rebuilt as vLLM's ``chat_utils`` builds them
(``normalize_message``), tools as vLLM dumps its ``ChatCompletionToolsParam`` (``template_tools``),
the request's ``add_generation_prompt``, ``continue_final_message``, ``documents`` and
``chat_template_kwargs`` (``ChatOptions``: Qwen3's ``enable_thinking`` lives there), and HF's
Jinja environment (``ChatRenderer``), and the template's content format (``detect_content_format``:
a template that loops over a message's content gets the text parts as a list, as vLLM gives them).
A difference anywhere shifts every block key after it, and the router never matches the engine's cache.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox

from mesh.request.options import (
    CONTENT_FORMATS,
    DEFAULT_OPTIONS,
    ChatOptions,
    ChatTemplateError,
    ContentFormat,
    template_arguments,
)

# ChatML, the template of Qwen2 and of the byte-level default.
DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)



SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


REQUEST_TEMPLATES = 8  # per-request chat templates kept compiled, per renderer





class ChatRenderer:
    """Renders OpenAI chat messages with a Jinja chat template in a sandbox.

    The environment is Hugging Face's (``transformers`` ``apply_chat_template``, which vLLM and
    SGLang call): ``loopcontrols``, the ``{% generation %}`` tag, ``strftime_now`` and HF's
    ``tojson`` (no HTML escaping, non-ASCII kept, key order kept). Jinja's own ``tojson``
    rendered tool calls differently from the engine, so a prompt with tool calls never matched
    the engine's cache past them; a template using ``{% break %}`` did not even compile.

    ``content_format`` is vLLM's ``--chat-template-content-format`` ("auto": detected from the
    template once, here); a template looping over message content got strings and rendered none
    of their text. A deployment's forced format (``ChatOptions.content_format``: the gateway
    pool's ``chat_template_content_format``, the worker's flag) overrides it per render.
    """

    def __init__(self, template: str = DEFAULT_CHAT_TEMPLATE, content_format: str = "auto", **special: Any) -> None:
        if content_format not in CONTENT_FORMATS:
            raise ValueError(f"content_format must be one of {CONTENT_FORMATS}, not {content_format!r}")
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_template_error
        env.globals["strftime_now"] = _strftime_now
        self._template = env.from_string(template)
        self.source = template
        self._special = special
        self._content_format_option = content_format
        self._request_templates: dict[str, ChatRenderer] = {}
        # vLLM's _detect_developer_role_support: a template that never names the role gets
        # developer messages as system ones
        self.knows_developer = '"developer"' in template or "'developer'" in template
        # decided once per template (vLLM caches it per template text too); never per request
        self.content_format: ContentFormat = (
            _detect_in_source(env, template) if content_format == "auto" else content_format  # type: ignore[assignment]
        )

    def render(self, messages: Sequence[dict[str, Any]], options: ChatOptions | None = None) -> str:
        """As HF's ``apply_chat_template(tokenize=False)`` with vLLM's arguments (``template_arguments``);
        a request's own ``chat_template`` is rendered by a renderer of its own (same special tokens)."""
        opts = options or DEFAULT_OPTIONS
        if opts.chat_template is not None and opts.chat_template != self.source:
            return self._for_template(opts.chat_template).render(messages, replace(opts, chat_template=None))
        content_format = self.content_format if opts.content_format == "auto" else opts.content_format
        if content_format == "string":
            normalized = [normalize_message(m) for m in messages]
        else:
            normalized = [normalize_message(m, "openai") for m in messages]
        if not self.knows_developer and any(m["role"] == "developer" for m in normalized):
            normalized = developer_as_system(normalized)
        try:
            text = self._template.render(messages=normalized, **{**self._special, **template_arguments(opts)})
        except ChatTemplateError:
            raise
        except Exception as exc:  # the template runs on client data: a TypeError ('x' + None) is the client's
            raise ChatTemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from exc
        return continue_final(text, normalized) if opts.continue_final_message else text

    def _for_template(self, template: str) -> ChatRenderer:
        """The renderer of a request's ``chat_template`` (vLLM ``--trust-request-chat-template``);
        kept per template text, the last ``REQUEST_TEMPLATES`` of them."""
        renderer = self._request_templates.pop(template, None)
        if renderer is None:
            try:
                renderer = ChatRenderer(template, self._content_format_option, **self._special)
            except jinja2.TemplateError as exc:
                raise ChatTemplateError(f"'chat_template' does not compile: {exc}") from exc
        self._request_templates[template] = renderer
        while len(self._request_templates) > REQUEST_TEMPLATES:
            self._request_templates.pop(next(iter(self._request_templates)))
        return renderer


def developer_as_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """vLLM (``renderers/hf.py``) for a template without a developer role: each developer message
    becomes a system one without its ``tools``; then, if a system message is not first or there
    are several, all system texts are merged into one first message ("\n\n" between them, list
    content joined with "\n", empty ones dropped)."""
    converted = [{k: v for k, v in m.items() if k != "tools"} | {"role": "system"} if m["role"] == "developer" else m
                 for m in messages]
    texts: list[str] = []
    rest: list[dict[str, Any]] = []
    merge = False
    for i, m in enumerate(converted):
        if m["role"] != "system":
            rest.append(m)
            continue
        merge = merge or i > 0 or bool(texts)
        content = m.get("content", "")
        if isinstance(content, list):
            content = "\n".join(p["text"] if isinstance(p, dict) else p for p in content
                                if (isinstance(p, dict) and "text" in p) or isinstance(p, str))
        if content:
            texts.append(content)
    return [{"role": "system", "content": "\n\n".join(texts)}, *rest] if merge else converted


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    """Hugging Face's ``tojson`` filter (Jinja's escapes <>&' and sorts keys)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (HF marks assistant spans with it): renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


# -- content format: does the template loop over a message's content? --
# vLLM's detection (``_detect_content_format`` and the ``_iter_nodes_*`` helpers, in
# ``vllm/entrypoints/chat_utils.py``, moved to ``vllm/renderers/hf.py``; with the ``for x in
# content`` loop of vLLM PR #42660), rewritten over the same Jinja AST. It is a name-based scan,
# not a data-flow analysis: a template counts as "openai" when some ``for`` loop iterates
# ``<message>.content`` / ``<message>['content']`` (through filters, tests or slices), where
# <message> is the target of a loop over ``messages`` or over a name assigned from it, or when a
# loop iterates a variable named ``content``. Everything else, a template that does not parse
# included, is "string" (vLLM's default). A shape vLLM's scan refuses (a tuple target) makes it
# give up with "string" too: ``_Undecided``.
class _Undecided(Exception):
    """The scan met a node vLLM's scan asserts against: the format falls back to "string"."""


def detect_content_format(template: str) -> ContentFormat:
    """vLLM's ``auto`` content format for ``template`` ("string" or "openai")."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    return _detect_in_source(env, template)


def _detect_in_source(env: jinja2.Environment, template: str) -> ContentFormat:
    try:
        root = env.parse(template)
    except jinja2.TemplateError:
        return "string"
    try:
        return "openai" if _first_content_loop(root) else "string"
    except _Undecided:
        return "string"


def _loads(node: jinja2.nodes.Node, name: str) -> bool:
    return isinstance(node, jinja2.nodes.Name) and node.ctx == "load" and node.name == name


def _reads(node: jinja2.nodes.Node, name: str, key: str | None = None) -> bool:
    """``node`` is ``name`` (or ``name.key`` / ``name['key']``), possibly filtered, tested or sliced."""
    while True:
        if isinstance(node, (jinja2.nodes.Filter, jinja2.nodes.Test)):
            if node.node is None:  # a filter block ({% filter %}): reads nothing
                return False
            node = node.node
        elif isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
            node = node.node
        else:
            break
    if key is None:
        return _loads(node, name)
    if isinstance(node, jinja2.nodes.Getitem):
        return _loads(node.node, name) and isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == key
    if isinstance(node, jinja2.nodes.Getattr):
        return _loads(node.node, name) and node.attr == key
    return False


def _target_name(node: jinja2.nodes.Node) -> str:
    if not isinstance(node, jinja2.nodes.Name):
        raise _Undecided
    return node.name


def _aliases(root: jinja2.nodes.Template, name: str) -> list[str]:
    """``name`` and every variable ``{% set %}`` (transitively) from it or its slices/filters."""
    found, queue = [name], [name]
    while queue:
        current = queue.pop(0)
        for assign in root.find_all(jinja2.nodes.Assign):
            if _reads(assign.node, current):
                alias = _target_name(assign.target)
                if alias not in found:
                    found.append(alias)
                    queue.append(alias)
    return found


def _message_names(root: jinja2.nodes.Template) -> list[str]:
    """Targets of the loops over ``messages`` (or over its aliases)."""
    lists = _aliases(root, "messages")
    return [_target_name(loop.target) for loop in root.find_all(jinja2.nodes.For)
            if any(_reads(loop.iter, name) for name in lists)]


def _first_content_loop(root: jinja2.nodes.Template) -> bool:
    messages = _message_names(root)
    for loop in root.find_all(jinja2.nodes.For):
        if any(_reads(loop.iter, name, "content") for name in messages) or (
                isinstance(loop.iter, jinja2.nodes.Name) and loop.iter.name == "content"):
            _target_name(loop.target)
            return True
    return False


def normalize_message(message: Any, content_format: ContentFormat = "string") -> dict[str, Any]:
    """The message a chat template sees, built as vLLM builds it (``_parse_chat_message_content``
    and ``_postprocess_messages`` in ``vllm/entrypoints/chat_utils``), so that a template renders
    the engine's prompt:

    - a system text part starting with Claude Code's ``x-anthropic-billing-header`` line: without it;
    - content, "string" format: a string; text parts joined with "\\n"; other parts rejected; null is "";
    - content, "openai" format: a list of ``{"type": "text", "text": ...}`` (only those two keys),
      a string being one such part and null an empty list; a tool message's content is still
      its texts joined with "\\n" (vLLM flattens a text-only tool result for every template);
    - role, content, and only: ``tool_calls`` (assistant, when not null; a JSON-string
      ``arguments`` parsed to an object, a missing/empty/invalid/non-object one ``{}``, an empty list dropped),
      ``reasoning``/``reasoning_content`` (assistant, from ``reasoning``, else ``reasoning_content``),
      ``tool_call_id`` (tool),
      ``name`` (when a string), ``tools`` (developer).
    """
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ChatTemplateError("each message must be an object with a string 'role'")
    role = message["role"]
    content = message.get("content")
    if role == "system" and isinstance(content, (str, list)):
        content = _without_billing_lines([content] if isinstance(content, str) else content)
    if content_format == "openai" and role != "tool":
        content = _openai_content(content)
    elif content is None:
        content = ""
    elif isinstance(content, list):
        content = "\n".join(_part_texts(content))
    elif not isinstance(content, str):
        raise ChatTemplateError("message 'content' must be a string or a list of text parts")
    out: dict[str, Any] = {"role": role, "content": content}
    if len(message) == 2:  # the common case: role and content only
        return out
    if role == "assistant":
        tool_calls = message.get("tool_calls")
        if tool_calls is not None:
            tool_calls = _template_tool_calls(tool_calls)
            if tool_calls is not None:
                out["tool_calls"] = tool_calls
        reasoning = message.get("reasoning")
        if reasoning is None:  # vLLM takes the older name too (renamed to "reasoning")
            reasoning = message.get("reasoning_content")
        if reasoning is not None:
            out["reasoning"] = out["reasoning_content"] = reasoning
    elif role == "tool" and "tool_call_id" in message:
        out["tool_call_id"] = message["tool_call_id"]
    name = message.get("name")
    if isinstance(name, str):
        out["name"] = name
    if role == "developer":
        out["tools"] = message.get("tools")
    return out


BILLING_LINE = "x-anthropic-billing-header"  # Claude Code's per-request attribution line


def _without_billing_lines(parts: list[Any]) -> list[Any]:
    """A system message's parts as vLLM renders them (``_strip_claude_code_billing_header``; a string
    content is one part): a text part that starts with Claude Code's ``x-anthropic-billing-header``
    line loses that line, and is dropped when nothing is left (its value changes with every
    request: kept, no two requests of a conversation would share their prefix)."""
    out = []
    for part in parts:
        text = part if isinstance(part, str) else part.get("text") if isinstance(part, dict) and part.get("type") == "text" else None
        if not (isinstance(text, str) and text.startswith(BILLING_LINE)):
            out.append(part)
            continue
        rest = text.partition("\n")[2]
        if rest:
            out.append(rest if isinstance(part, str) else {**part, "text": rest})
    return out


# vLLM's text part types (``TEXT_PART_TYPES``) and the key that holds each one's text
TEXT_PART_KEYS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal", "thinking": "thinking"}


def _part_texts(parts: list[Any]) -> list[str]:
    """The texts of a content list as vLLM parses them: a string is a text; a text-kind part
    gives its text (a part of type text or refusal without one is skipped); any other part is not
    rendered here (ChatTemplateError: the caller routes on the text before it)."""
    texts = []
    for part in parts:
        if isinstance(part, str):
            texts.append(part)
            continue
        kind = part.get("type") if isinstance(part, dict) and "uuid" not in part else None
        key = TEXT_PART_KEYS.get(kind) if isinstance(kind, str) else None
        if key is None:
            raise ChatTemplateError("only text content parts are supported")
        text = part.get(key)
        if text is None and part["type"] in ("text", "refusal"):
            continue
        if not isinstance(text, str):
            raise ChatTemplateError(f"a '{part['type']}' content part needs a string '{key}'")
        texts.append(text)
    return texts


def _openai_content(content: Any) -> list[dict[str, str]]:
    """vLLM's "openai" content: a string is one text part, null no part, and each text part is
    rebuilt as ``{"type": "text", "text": ...}`` (a client's extra keys are not passed on)."""
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if isinstance(content, list):
        return [{"type": "text", "text": text} for text in _part_texts(content)]
    raise ChatTemplateError("message 'content' must be a string or a list of text parts")


def _template_tool_calls(tool_calls: Any) -> Any:
    """vLLM's tool-call rewrite (templates expect ``arguments`` as an object); the client's
    objects are copied, never changed. None when the list is empty (the plain assistant path)."""
    if not isinstance(tool_calls, list):
        return tool_calls
    if not tool_calls:
        return None
    out = []
    for item in tool_calls:
        function = item.get("function") if isinstance(item, dict) else None
        if not isinstance(function, dict):
            raise ChatTemplateError("each tool call must be an object with a 'function' object")
        if item.get("type", "function") != "function":  # vLLM: chat completions take function calls only
            raise ChatTemplateError("chat completions only support assistant tool_calls of type 'function'")
        out.append({**item, "function": {**function, "arguments": _tool_arguments(function.get("arguments"))}})
    return out


def _tool_arguments(raw: Any) -> dict[str, Any]:
    """A tool call's ``arguments`` as the template sees them, as vLLM renders them: an object as
    is, a JSON string parsed, and anything else (missing, empty, not valid JSON, JSON that is no
    object: a model's malformed call kept in the history) ``{}``, so the conversation goes on."""
    if isinstance(raw, dict):
        return raw
    if isinstance(raw, str) and raw:
        try:
            parsed = json.loads(raw)
        except ValueError:
            return {}
        return parsed if isinstance(parsed, dict) else {}
    return {}


def _raise_template_error(message: str) -> None:
    raise ChatTemplateError(message)


def continue_final(rendered: str, messages: Sequence[dict[str, Any]]) -> str:
    """HF's ``continue_final_message``: cut the rendering right after the final message's text
    (its stripped content, last occurrence; of a list of parts, HF's pick: the last part with a
    text), so that the engine continues that message."""
    content = messages[-1].get("content", "") if messages else ""
    if isinstance(content, list):
        content = next((p["text"] for p in reversed(content) if isinstance(p, dict) and "text" in p), "")
    final = str(content).strip()
    end = rendered.rfind(final)
    if not final or end < 0:
        raise ChatTemplateError("continue_final_message is set but the final message does not appear "
                                "in the rendered chat")
    return rendered[: end + len(final)]
