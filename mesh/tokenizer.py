"""Tokenizers and chat templates shared by the gateway and the bundled engine (no torch).

The gateway and the engine must turn the same request into the same token ids, or the router's
block keys will not match the engine's cache. Both load tokenizers through ``load_tokenizer``.

- ``byte``: a byte-level tokenizer that needs no files (ids 0-255 are bytes; 256 BOS, 257 EOS).
- a ``tokenizer.json`` (Hugging Face ``tokenizers``), with the chat template, BOS and EOS from a
  ``tokenizer_config.json`` beside it when present.
"""

from __future__ import annotations

import codecs
import datetime
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox

# ChatML, the template of Qwen2 and of the byte-level default.
DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
GIL_FREE_CHARS = 8192  # texts at least this long are encoded with the GIL released


class ChatTemplateError(ValueError):
    """The messages cannot be rendered (bad shape, or the template raised)."""


class Tokenizer(Protocol):
    vocab_size: int
    eos_token_id: int
    bos_token_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def stream_decoder(self) -> StreamDecoder: ...

    def render_chat(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True) -> str: ...


class StreamDecoder(Protocol):
    def push(self, token_id: int) -> str:
        """Text completed by this token (may be empty while a multi-byte character is open)."""
        ...


class ChatRenderer:
    """Renders OpenAI chat messages with a Jinja chat template in a sandbox.

    The environment is Hugging Face's (``transformers`` ``apply_chat_template``, which vLLM and
    SGLang call): ``loopcontrols``, the ``{% generation %}`` tag, ``strftime_now`` and HF's
    ``tojson`` (no HTML escaping, non-ASCII kept, key order kept). Jinja's own ``tojson``
    rendered tool calls differently from the engine, so a prompt with tool calls never matched
    the engine's cache past them; a template using ``{% break %}`` did not even compile.
    """

    def __init__(self, template: str = DEFAULT_CHAT_TEMPLATE, **special: Any) -> None:
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_template_error
        env.globals["strftime_now"] = _strftime_now
        self._template = env.from_string(template)
        self._special = special

    def render(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        normalized = [normalize_message(m) for m in messages]
        try:
            return self._template.render(
                messages=normalized, add_generation_prompt=add_generation_prompt, **self._special
            )
        except ChatTemplateError:
            raise
        except Exception as exc:  # the template runs on client data: a TypeError ('x' + None) is the client's
            raise ChatTemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from exc


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


def normalize_message(message: Any) -> dict[str, Any]:
    """The message a chat template sees, built as vLLM builds it (``_parse_chat_message_content``
    and ``_postprocess_messages`` in ``vllm/entrypoints/chat_utils``), so that a template renders
    the engine's prompt:

    - content: a string; text parts joined with "\\n"; other parts rejected; null is "";
    - role, content, and only: ``tool_calls`` (assistant, when not null; a JSON-string
      ``arguments`` parsed to an object, a missing/empty one ``{}``, an empty list dropped),
      ``reasoning``/``reasoning_content`` (assistant, from ``reasoning``), ``tool_call_id`` (tool),
      ``name`` (when a string), ``tools`` (developer).
    """
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ChatTemplateError("each message must be an object with a string 'role'")
    role = message["role"]
    content = message.get("content")
    if content is None:
        content = ""
    elif isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ChatTemplateError("only text content parts are supported")
            texts.append(part["text"])
        content = "\n".join(texts)
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
        arguments = function.get("arguments")
        if not arguments:
            arguments = {}
        elif not isinstance(arguments, (dict, list)):
            if not isinstance(arguments, str):
                raise ChatTemplateError("a tool call's 'arguments' must be a JSON string")
            try:
                arguments = json.loads(arguments)
            except ValueError as exc:
                raise ChatTemplateError(f"a tool call's 'arguments' is not valid JSON: {exc}") from exc
        out.append({**item, "function": {**function, "arguments": arguments}})
    return out


def _raise_template_error(message: str) -> None:
    raise ChatTemplateError(message)


class ByteTokenizer:
    """UTF-8 bytes as tokens. Needs no files; the default of the gateway and the tiny preset."""

    BOS = 256
    EOS = 257
    vocab_size = 258
    bos_token_id: int | None = None  # no BOS is prepended, so token ids == bytes of the prompt
    eos_token_id = EOS
    name = "byte"

    def __init__(self) -> None:
        self._chat = ChatRenderer()

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def stream_decoder(self) -> StreamDecoder:
        return _ByteStreamDecoder()

    def render_chat(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        return self._chat.render(messages, add_generation_prompt)


class _ByteStreamDecoder:
    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        return self._utf8.decode(bytes([token_id])) if 0 <= token_id < 256 else ""


class HFTokenizer:
    """A Hugging Face ``tokenizer.json``, with its ``tokenizer_config.json`` when present."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer as _HF

        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise FileNotFoundError(f"no tokenizer.json at {path}")
        self._tok = _HF.from_file(str(file))
        # a tokenizer.json may be saved with truncation/padding on (max_length 512...): transformers,
        # hence vLLM, turns both off per call; left on, every prompt was cut or padded to that length
        self._tok.no_truncation()
        self._tok.no_padding()
        self._encode_batch = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)  # fast: no offsets
        self.name = str(file)
        config = _read_json(file.parent / "tokenizer_config.json")
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_token_id = self._special_id(config.get("eos_token"), fallback=self.vocab_size - 1)
        bos = config.get("bos_token")
        self.bos_token_id = self._special_id(bos, fallback=None) if bos else None
        # transformers (and so vLLM/SGLang) give chat_template.jinja priority over the config's entry;
        # recent model directories ship only the file (without it a Llama model rendered as ChatML)
        template = _read_text(file.parent / "chat_template.jinja") or config.get("chat_template") or DEFAULT_CHAT_TEMPLATE
        if isinstance(template, list):  # [{name, template}, ...]
            template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])
        # as transformers passes them: every special token the config names; an absent or null one
        # stays undefined (rendered "", where a None rendered "None")
        special = {name: _token_text(config.get(name)) for name in SPECIAL_TOKEN_NAMES}
        self._chat = ChatRenderer(template, **{k: v for k, v in special.items() if v is not None})

    def _special_id(self, token: Any, fallback: int | None) -> Any:
        text = _token_text(token)
        found = self._tok.token_to_id(text) if text else None
        return found if found is not None else fallback

    def encode(self, text: str) -> list[int]:
        if len(text) < GIL_FREE_CHARS:
            return self._tok.encode(text, add_special_tokens=False).ids
        # ``Tokenizer.encode`` holds the GIL for the whole text (an 8 MB prompt: ~4 s in which the
        # gateway's event loop, whose executor thread this runs in, answered nothing);
        # the batch call releases it and gives the same ids.
        return self._encode_batch([text], add_special_tokens=False)[0].ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def stream_decoder(self) -> StreamDecoder:
        return _HFStreamDecoder(self)

    def render_chat(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        return self._chat.render(messages, add_generation_prompt)


class _HFStreamDecoder:
    """Incremental detokenization with vLLM's two offsets: each push decodes only the ids from
    ``_prefix`` (the start of the text emitted last, kept as context for decoders that strip or
    merge at a boundary) on, and emits what lies past ``_read`` once it is not a broken character.
    Decoding the whole growing list per token cost O(n^2): 8,000 streamed tokens took 5.4 s.
    """

    def __init__(self, tok: HFTokenizer) -> None:
        self._tok = tok
        self._ids: list[int] = []
        self._prefix = 0  # ids[_prefix:_read] decode to the text emitted last
        self._read = 0  # ids before this have been emitted

    def push(self, token_id: int) -> str:
        ids = self._ids
        ids.append(token_id)
        before = self._tok.decode(ids[self._prefix : self._read]) if self._read > self._prefix else ""
        text = self._tok.decode(ids[self._prefix :])
        if len(text) <= len(before) or text.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(ids)
        return text[len(before) :]


def _token_text(token: Any) -> str | None:
    if isinstance(token, dict):
        return token.get("content")
    return token if isinstance(token, str) else None


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, ValueError):
        return None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def load_tokenizer(spec: str | None = None) -> ByteTokenizer | HFTokenizer:
    """``None`` or ``"byte"``: the byte-level default; else a tokenizer.json or a model directory."""
    if spec in (None, "", "byte"):
        return ByteTokenizer()
    return HFTokenizer(spec)
