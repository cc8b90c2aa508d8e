"""Tokenizers and chat templates shared by the gateway and the bundled engine (no torch).

The gateway and the engine must turn the same request into the same token ids, or the router's
block keys will not match the engine's cache. Both load tokenizers through ``load_tokenizer``.

- ``byte``: a byte-level tokenizer that needs no files (ids 0-255 are bytes; 256 BOS, 257 EOS).
- a ``tokenizer.json`` (Hugging Face ``tokenizers``), with the chat template, BOS and EOS from a
  ``tokenizer_config.json`` beside it when present.

Chat templates are rendered by ``mesh.request.chat``; ``encode`` adds the tokenizer's special tokens (a
Llama BOS) only when asked, as vLLM does per request (completions: on by default, chat: off).
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from mesh.request.chat import DEFAULT_CHAT_TEMPLATE, SPECIAL_TOKEN_NAMES, ChatRenderer
from mesh.request.options import ChatOptions

GIL_FREE_CHARS = 8192  # texts at least this long are encoded with the GIL released


class Tokenizer(Protocol):
    vocab_size: int
    eos_token_id: int
    bos_token_id: int | None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def stream_decoder(self) -> StreamDecoder: ...

    def render_chat(self, messages: Sequence[dict[str, Any]], options: ChatOptions | None = None) -> str: ...


class StreamDecoder(Protocol):
    def push(self, token_id: int) -> str:
        """Text completed by this token (may be empty while a multi-byte character is open)."""
        ...


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

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))  # no special token is ever added: ids == the text's bytes

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def stream_decoder(self) -> StreamDecoder:
        return _ByteStreamDecoder()

    def render_chat(self, messages: Sequence[dict[str, Any]], options: ChatOptions | None = None) -> str:
        return self._chat.render(messages, options)


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

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if len(text) < GIL_FREE_CHARS:
            return self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        # ``Tokenizer.encode`` holds the GIL for the whole text (an 8 MB prompt: ~4 s in which the
        # gateway's event loop, whose executor thread this runs in, answered nothing);
        # the batch call releases it and gives the same ids.
        return self._encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def stream_decoder(self) -> StreamDecoder:
        return _HFStreamDecoder(self)

    def render_chat(self, messages: Sequence[dict[str, Any]], options: ChatOptions | None = None) -> str:
        return self._chat.render(messages, options)


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
