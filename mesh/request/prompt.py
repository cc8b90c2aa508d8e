"""Request body -> ``policies.base.RequestInfo``: validate, render, tokenize, hash.

The body is decoded once (msgspec) and forwarded byte for byte by the proxy; nothing here
re-encodes it. Validation (``mesh.request.validate``) covers what routing reads and what must
never reach a worker; the worker validates the rest.

Tokenizer, block size and chat template content format come from the pool of workers serving
the model (the first worker, in registry order, that serves it). A LoRA adapter (``mesh.cluster.registry.Worker.loras``: a model name
whose worker lists it with a base ``parent``) is keyed in its base model's namespace with the
adapter named, ``namespace_seed(base, adapter, salt)``, as the KV event subscriber keys the
blocks that the engine announces with ``lora_name``; it uses its base model's pool. Sessions reuse a bounded LRU of ``mesh.core.keys.KeyChain`` so that
turn N hashes only the blocks it added; a chain is checked out of the cache while in use, so two
concurrent requests of one session never share one (the second simply starts a fresh chain).
Long prompts are rendered and hashed off the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

from mesh.cluster.registry import WorkerRegistry
from mesh.core.keys import KeyChain, block_keys, namespace_seed
from mesh.errors import MeshError, bad_request
from mesh.request.chat import TEXT_PART_KEYS, continue_final, developer_as_system, normalize_message
from mesh.request.options import DEFAULT_OPTIONS, ChatOptions, ChatTemplateError
from mesh.request.tokenizer import ByteTokenizer, load_tokenizer
from mesh.request.validate import (  # noqa: F401 - MAX_CHOICES, MAX_MODEL_CHARS: part of this module's interface
    MAX_CHOICES,
    MAX_MODEL_CHARS,
    chat_messages,
    completion_prompt,
    decode_body,
    validate_choices,
    validate_common,
)
from policies.base import RequestInfo

MAX_CACHED_SALT_CHARS = 256
TOKENIZER_RETRY_S = 10.0  # a tokenizer that failed to load is not tried again for this long
OFFLOAD_CHARS = 16_384  # prompts longer than this are tokenized and hashed in a thread
# SGLang's prefill/decode pair fields: set by the relay (``disagg.protocol: sglang``), never by a client
BOOTSTRAP_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ParsedRequest:
    kind: str  # "chat" | "completion"
    body: dict[str, Any]
    raw: bytes  # forwarded unchanged
    model: str
    stream: bool
    info: RequestInfo


@dataclass(frozen=True, slots=True)
class Pool:
    tokenizer: str | None
    block_size: int
    content_format: str = "auto"  # the workers' chat_template_content_format (vLLM's flag)
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)  # their --default-chat-template-kwargs


def _pool(config: Any) -> Pool:
    return Pool(config.tokenizer, config.block_size, config.chat_template_content_format,
                config.default_chat_template_kwargs)


@dataclass(frozen=True, slots=True)
class Namespace:
    """Where a requested model name's keys live: its pool, and (base, adapter) for the seed."""

    pool: Pool
    base: str  # the model that seeds the keys: the name itself, or an adapter's base model
    lora: str | None = None  # the adapter, when the name is one


class ChainCache:
    """A bounded LRU of per-session key chains (entries and total cached tokens both bounded)."""

    def __init__(self, max_entries: int = 4096, max_tokens: int = 8_000_000) -> None:
        self.max_entries = max_entries
        self.max_tokens = max_tokens
        self._chains: OrderedDict[tuple[str, int, int], KeyChain] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()  # used from the event loop and from executor threads

    def checkout(self, key: tuple[str, int, int]) -> KeyChain | None:
        with self._lock:
            chain = self._chains.pop(key, None)
            if chain is not None:
                self._tokens -= chain.tokens.size
            return chain

    def checkin(self, key: tuple[str, int, int], chain: KeyChain) -> None:
        size = chain.tokens.size
        if size > self.max_tokens:
            return
        with self._lock:
            old = self._chains.pop(key, None)
            if old is not None:
                self._tokens -= old.tokens.size
            self._chains[key] = chain
            self._tokens += size
            while len(self._chains) > self.max_entries or self._tokens > self.max_tokens:
                _, evicted = self._chains.popitem(last=False)
                self._tokens -= evicted.tokens.size

    def __len__(self) -> int:
        return len(self._chains)

    @property
    def tokens(self) -> int:
        return self._tokens


class PromptProcessor:
    def __init__(self, registry: WorkerRegistry, chain_cache: ChainCache | None = None) -> None:
        self.registry = registry
        self.chains = chain_cache or ChainCache()
        self._tokenizers: dict[str | None, Any] = {}
        self._load_failures: dict[str | None, tuple[float, str]] = {}  # spec -> (when, message)
        self._load_lock = threading.Lock()
        self.clock = time.monotonic
        self._pools: dict[str, Namespace | None] = {}  # per requested model name, for one registry version
        self._pools_version = -1
        self._seeds: dict[tuple[str, str | None, str | None], int] = {}  # (base, adapter, salt), bounded

    # -- entry point --
    async def process(self, raw: bytes, kind: str, session_header: bytes | None) -> ParsedRequest:
        """Validate and prepare one request; raises ``MeshError`` (4xx/503) on bad input."""
        body = decode_body(raw)
        if "kv_transfer_params" in body:  # the gateway's own relay sets these, never a client
            raise bad_request("kv_transfer_params are set by the gateway for disaggregated requests, "
                              "not by clients", "kv_transfer_params")
        if self.registry.config.disagg.protocol == "sglang":  # likewise for SGLang's pairs (the relay's room)
            for key in BOOTSTRAP_FIELDS:
                if key in body:
                    raise bad_request(f"{key} is set by the gateway for disaggregated requests, not by clients", key)
        model, stream, max_tokens = validate_common(body, self.registry.config.server.max_tokens_limit)
        choices = validate_choices(body)
        source = prompt_source(body, kind)
        session_id = self.session_id(body, session_header)
        ns = self.namespace_for(model)
        pool = ns.pool
        salt = body.get("cache_salt")
        seed = self._seed(ns.base, salt if isinstance(salt, str) else None, ns.lora)
        args = (source, pool, seed, session_id)
        if len(raw) > OFFLOAD_CHARS:
            tokens_text, keys, n_tokens, tokens = await asyncio.get_running_loop().run_in_executor(
                None, self._prepare, *args)
        else:
            tokens_text, keys, n_tokens, tokens = self._prepare(*args)
        if n_tokens > self.registry.config.server.max_prompt_tokens:
            raise bad_request(
                f"prompt has {n_tokens} tokens, over the limit of {self.registry.config.server.max_prompt_tokens}",
                "prompt",
                "context_length_exceeded",
            )
        info = RequestInfo(
            model=model,
            block_keys=keys,
            block_size=pool.block_size,
            prompt_tokens=n_tokens,
            max_tokens=max_tokens,
            choices=choices,
            session_id=session_id,
            text=tokens_text,
            lora=ns.lora,
            routing_text=sglang_routing_text(source.content) if kind == "chat" else None,
            tokens=tokens,
            key_seed=seed,
        )
        return ParsedRequest(kind, body, raw, model, stream, info)

    def _seed(self, model: str, salt: str | None, lora: str | None = None) -> int:
        """The key seed of (base ``model``, LoRA adapter, salt); cached, at most ~10k entries.

        A salt is the client's string, as long as the body allows: only short ones are cached
        (distinct megabyte salts kept 10k deep would hold gigabytes)."""
        if salt is not None and len(salt) > MAX_CACHED_SALT_CHARS:
            return namespace_seed(model, lora, salt)
        key = (model, lora, salt)
        seed = self._seeds.get(key)
        if seed is None:
            if len(self._seeds) > 10_000:
                self._seeds.clear()
            seed = self._seeds[key] = namespace_seed(model, lora, salt)
        return seed

    # -- sessions --
    def session_id(self, body: dict[str, Any], header: bytes | None) -> str | None:
        """The session header, else the body field (OpenAI's ``user`` by default); an empty header
        falls back to the body. Any length: only the 128-bit hash is kept (a long ``user`` value
        was a 400 for a request every worker would have served)."""
        raw: bytes | None = header or None
        if raw is None:
            value = body.get(self.registry.config.sessions.body_field)
            if isinstance(value, str) and (value := value.strip(" \t")):  # as HTTP strips a header value
                raw = value.encode("utf-8", "surrogatepass")
        if not raw:
            return None
        return xxhash.xxh3_128_hexdigest(raw)  # never kept or logged raw

    # -- pools --
    def pool_for(self, model: str) -> Pool:
        """Tokenizer and block size of ``model`` (an adapter's are its base model's)."""
        return self.namespace_for(model).pool

    def namespace_for(self, model: str) -> Namespace:
        """Pool and seed namespace of a requested model name; MeshError 503/404 when none serves it."""
        registry = self.registry
        if self._pools_version != registry.version:
            self._pools.clear()
            self._pools_version = registry.version
        if model not in self._pools:
            if len(self._pools) > 10_000:
                self._pools.clear()
            self._pools[model] = self._find_namespace(model)
        ns = self._pools[model]
        if ns is None:
            if not registry.workers:
                raise MeshError(503, "no workers are registered", code="no_workers")
            raise MeshError(404, f"model {model!r} is not served by any worker", param="model", code="model_not_found")
        return ns

    def _find_namespace(self, model: str) -> Namespace | None:
        base = self.registry.lora_base(model)
        if base is None:
            pool = self._find_pool(model)
            return None if pool is None else Namespace(pool, model)
        pool = self._find_pool(base) or self._find_pool(model)  # the base's pool; else the adapter's worker's
        return None if pool is None else Namespace(pool, base, model)

    def _find_pool(self, model: str) -> Pool | None:
        fallback = None
        for w in self.registry.workers.values():
            models = w.models
            if model in models:
                return _pool(w.config)
            if not models and fallback is None:
                fallback = _pool(w.config)  # models not known yet
        return fallback

    def tokenizer(self, spec: str | None) -> Any:
        """The loaded tokenizer of ``spec``; MeshError 503 when it cannot be loaded.

        A failed load is remembered for ``TOKENIZER_RETRY_S``: loading holds the GIL (an 18 MB
        tokenizer.json cut short took 59 ms to refuse), and every request for the model retried
        it, stalling the event loop and every other model's requests once per request. One load
        at a time (requests hashed in executor threads would each parse the same file)."""
        tok = self._tokenizers.get(spec)
        if tok is not None:
            return tok
        with self._load_lock:
            tok = self._tokenizers.get(spec)
            if tok is not None:
                return tok
            now = self.clock()
            failed = self._load_failures.get(spec)
            if failed is not None and now - failed[0] < TOKENIZER_RETRY_S:
                raise MeshError(503, failed[1], code="tokenizer_unavailable")
            try:
                tok = load_tokenizer(spec)
            except Exception as exc:
                # The path and the loader's error go to the log only (once per TOKENIZER_RETRY_S):
                # a client must not learn the server's file layout.
                log.warning("cannot load tokenizer %r: %s", spec, exc)
                message = "the tokenizer configured for this model's workers cannot be loaded (see the gateway's log)"
                self._load_failures[spec] = (now, message)
                raise MeshError(503, message, code="tokenizer_unavailable") from exc
            self._load_failures.pop(spec, None)
            self._tokenizers[spec] = tok
            return tok

    # -- registry listener --
    def on_worker_added(self, worker: Any) -> None:
        """Load the worker's tokenizer as it joins (start-up, reload, admin API), not in the first
        request: parsing a large ``tokenizer.json`` holds the GIL (18 MB: ~2 s), in a thread too.
        One that fails is logged here and answered 503 per request (``tokenizer``)."""
        try:
            self.tokenizer(worker.config.tokenizer)
        except MeshError:
            pass  # logged with its path by ``tokenizer``

    def on_worker_removed(self, worker: Any) -> None:
        return None

    # -- tokens and keys (runs on the loop or in a thread) --
    def _prepare(
        self, source: PromptSource, pool: Pool, seed: int, session_id: str | None
    ) -> tuple[str, list[int], int, np.ndarray]:
        tok = self.tokenizer(pool.tokenizer)
        text, tokens = self._tokens(source, tok, pool.content_format, pool.template_kwargs)
        n_tokens = int(tokens.size)
        if session_id is None:
            return text, block_keys(tokens, pool.block_size, seed), n_tokens, tokens
        cache_key = (session_id, seed, pool.block_size)
        chain = self.chains.checkout(cache_key) or KeyChain(pool.block_size, seed)
        keys = list(chain.extend_to(tokens))
        self.chains.checkin(cache_key, chain)
        return text, keys, n_tokens, tokens

    @staticmethod
    def _tokens(source: PromptSource, tok: Any, content_format: str = "auto",
                default_kwargs: Mapping[str, Any] | None = None) -> tuple[str, np.ndarray]:
        chat = source.kind == "chat"
        if chat:
            try:
                text = _render(source.content, tok, source.options.forced(content_format, default_kwargs))
            except ChatTemplateError as exc:
                text = _render_text_prefix(source.content, tok, exc, content_format)
        elif isinstance(source.content, str):
            text = source.content
        else:  # token ids, already range-checked
            return "", np.asarray(source.content, dtype=np.int64)
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise bad_request("prompt is not valid Unicode text", "messages" if chat else "prompt") from exc
        if isinstance(tok, ByteTokenizer):
            return text, np.frombuffer(data, dtype=np.uint8)
        return text, np.asarray(tok.encode(text, source.add_special_tokens), dtype=np.int64)


@dataclass(frozen=True, slots=True)
class PromptSource:
    """What the engine will tokenize for a request: chat messages with the template options, or
    a completion prompt (text or token ids), and whether the tokenizer adds its special tokens
    (vLLM's ``add_special_tokens``: on for completions, off for chat, where the template has them)."""

    kind: str
    content: Any
    options: ChatOptions = DEFAULT_OPTIONS
    add_special_tokens: bool = False


def prompt_source(body: dict[str, Any], kind: str) -> PromptSource:
    """The request's ``PromptSource``; a 400 on a bad prompt, messages or option."""
    chat = kind == "chat"
    special = body.get("add_special_tokens", not chat)
    if not isinstance(special, bool):
        raise bad_request("'add_special_tokens' must be a boolean", "add_special_tokens")
    if not chat:
        return PromptSource(kind, completion_prompt(body), DEFAULT_OPTIONS, special)
    messages = chat_messages(body)
    try:
        options = ChatOptions.from_body(body)
    except ChatTemplateError as exc:
        raise bad_request(str(exc), "messages", "invalid_chat_options") from exc
    return PromptSource(kind, messages, options, special)


def sglang_routing_text(messages: list[Any]) -> str:
    """The text sglang-router's cache_aware matches a chat request on (its
    ``ChatCompletionRequest::extract_text_for_routing``): per message its content (text parts
    joined by spaces), an assistant's ``content`` and ``reasoning_content`` joined and trimmed (left
    out when both are empty), all joined by spaces; no roles, no template."""
    out = []
    for msg in messages:
        if not isinstance(msg, dict):
            continue
        text = _content_text(msg.get("content"))
        if msg.get("role") == "assistant":
            reasoning = msg.get("reasoning_content")
            text = f"{text} {reasoning if isinstance(reasoning, str) else ''}".strip()
            if not text:
                continue
        out.append(text)
    return " ".join(out)


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(p["text"] for p in content
                        if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str))
    return ""


def _render(messages: list[Any], tok: Any, options: ChatOptions) -> str:
    if type(tok) is ByteTokenizer and options.plain:
        text = render_chatml(messages, options.add_generation_prompt)
        return continue_final(text, [normalize_message(messages[-1])]) if options.continue_final_message else text
    return str(tok.render_chat(messages, options))


def render_chatml(messages: list[Any], add_generation_prompt: bool = True) -> str:
    """``mesh.request.chat.DEFAULT_CHAT_TEMPLATE`` (ChatML, the byte tokenizer's template) without Jinja.

    Jinja costs ~12 us per request, a measurable share of the gateway's per-request budget;
    ``tests/unit/request/test_prompt.py`` checks that this equals the template's output.
    """
    normalized = [normalize_message(m) for m in messages]
    if any(m["role"] == "developer" for m in normalized):  # ChatML names no developer role
        normalized = developer_as_system(normalized)
    parts = [f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in normalized]
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)


def _render_text_prefix(messages: list[Any], tok: Any, error: ChatTemplateError, content_format: str = "auto") -> str:
    """The prompt text routed on when the messages carry a non-text part (an image, audio...).

    The gateway cannot render what the engine makes of an image, but every message before the
    first one with such a part renders (without the generation prompt) to a prefix of the
    engine's prompt: route on that, and forward the request for the worker to accept or refuse
    (a 400 here kept every multimodal request from a vLLM worker that serves images). Messages
    without such a part that do not render are the client's error: the 400, as before.
    """
    first = next((i for i, m in enumerate(messages) if _has_non_text_part(m)), None)
    if first is None:
        raise bad_request(str(error), "messages", "invalid_messages") from error
    head = messages[:first]
    try:
        return _render(head, tok, ChatOptions(add_generation_prompt=False, content_format=content_format))
    except ChatTemplateError:  # e.g. a template that wants a user message last: route on load
        return ""


def _has_non_text_part(message: Any) -> bool:
    content = message.get("content") if isinstance(message, dict) else None
    return isinstance(content, list) and any(
        isinstance(p, dict) and isinstance(p.get("type"), str) and p["type"] not in TEXT_PART_KEYS for p in content
    )
