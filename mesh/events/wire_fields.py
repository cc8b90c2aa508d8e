"""One field of a KV event, normalized (``mesh.events.wire``'s parts): block hashes to u64 ints,
token lists (SGLang's bigram pages included), copy counts, block sizes, the storage medium, the
LoRA name and the cache salt. Each returns the normalized value or raises ``BadField``, which the
decoder turns into a counted malformed event: nothing here trusts the wire."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

U64 = (1 << 64) - 1


class BadField(Exception):
    """A malformed event or field (internal to the decoder: it becomes a count, never escapes)."""


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def norm_hash(h: Any) -> int:
    if type(h) is int:
        return h & U64
    if isinstance(h, (bytes, bytearray, memoryview)):
        if not len(h):
            raise BadField("empty bytes block hash")
        return int.from_bytes(h, "big") & U64
    raise BadField(f"block hash of type {type(h).__name__}")


def hashes(raw: Any) -> list[int]:
    if not isinstance(raw, (list, tuple)):
        raise BadField("block_hashes is not an array")
    if all(type(h) is int for h in raw):
        return [h & U64 for h in raw]
    return [norm_hash(h) for h in raw]


BAD_FIELD: Any = object()  # an optional field present but malformed (the event still applies)


def copy_counts(raw: Any, n: int) -> tuple[int, ...] | None:
    """``remaining_copy_counts``: None when absent or nil, else a tuple of ``n`` non-negative ints
    (one per block hash); ``BAD_FIELD`` for anything else. A bad field never drops the removal:
    the caller applies it as if the field were absent and counts it."""
    if raw is None:
        return None
    if not isinstance(raw, (list, tuple)) or len(raw) != n:
        return BAD_FIELD
    for c in raw:
        if type(c) is not int or c < 0:
            return BAD_FIELD
    return tuple(raw)


def opt_hash(raw: Any) -> int | None:
    return None if raw is None else norm_hash(raw)


def tokens(raw: Any) -> list[int] | None:
    if raw is None:
        return None
    if not isinstance(raw, (list, tuple)):
        raise BadField("token_ids is not an array")
    if raw and isinstance(raw[0], (list, tuple)):
        return bigram_tokens(raw)
    return raw if isinstance(raw, list) else list(raw)  # ids are checked when keyed


def bigram_tokens(raw: Sequence[Any]) -> list[int]:
    """SGLang under EAGLE keys its radix tree (and fills a BlockStored's token_ids) with bigrams
    ``[t_i, t_i+1]``, one per position: position i holds token i's KV, so the tokens are the first
    of each pair. SGLang reuses a page only when the token after it matches too: ``lookahead``
    reads that token (a lookahead of one, ``mesh.core.lookahead``)."""
    out = []
    for pair in raw:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise BadField("token_ids mixes ids and pairs")
        out.append(pair[0])
    return out


def block_size(raw: Any) -> int:
    """0 when absent, or 0 as vLLM's offloading connector sends it in a placeholder store (the
    chunk's last block hash, no tokens: a tier update of a block known by hash)."""
    if raw is None:
        return 0
    if not is_int(raw) or raw < 0:
        raise BadField(f"bad block_size {raw!r}")
    return raw


def medium(raw: Any) -> str:
    if raw is None:
        return "GPU"
    if not isinstance(raw, str):
        raise BadField("medium is not a string")
    return raw.upper()


def opt_int(raw: Any) -> int | None:
    return raw if is_int(raw) else None


def opt_str(raw: Any) -> str | None:
    return raw if isinstance(raw, str) else None


def lora(name: Any, lora_id: Any) -> str | None:
    """The LoRA namespace of a store: ``lora_name``; else, when only ``lora_id`` names the adapter
    (vLLM before ``lora_name``, 0.9/0.10), a namespace of that id that no request is keyed in (the
    gateway knows adapters by name only), so an adapter's blocks never count for the base model.
    vLLM's adapter ids start at 1; 0 or nil is the base model."""
    if isinstance(name, str):
        return name
    if is_int(lora_id) and lora_id > 0:
        return f"\0lora_id\0{lora_id}"
    return None


def salt(field: Any, extra_keys: Any, lora_name: Any) -> str | None:
    """The key namespace of a stored chain's first block beyond (model, LoRA): an explicit
    ``cache_salt`` field (Dynamo's and SGLang's wire), else vLLM's ``extra_keys`` of that block,
    which list the LoRA name, multimodal identifiers, the cache salt and prompt-embedding digests
    as they apply. The LoRA name (first, when present) is the LoRA namespace already; a single
    remaining string is the salt (the bundled engine's and vLLM's text-only case); anything else
    becomes an opaque namespace that no router query uses, so such blocks never give false hits."""
    if isinstance(field, str) and field:
        return field
    if not isinstance(extra_keys, (list, tuple)) or not extra_keys:
        return None
    first = extra_keys[0]
    if not isinstance(first, (list, tuple)):
        return None
    entries = list(first)
    if entries and isinstance(lora_name, str) and entries[0] == lora_name:
        entries = entries[1:]
    if not entries:
        return None
    if len(entries) == 1 and isinstance(entries[0], str) and entries[0]:
        return entries[0]
    return "\0opaque\0" + "\0".join(e.hex() if isinstance(e, bytes) else str(e) for e in entries)


def lookahead(raw: Any, raw_tokens: Any, bs: int) -> list[list[int]] | None:
    """Per block, the tokens after it that its hash covers: vLLM's ``lookahead_token_ids`` (one
    equal-length list per block hash), else, for SGLang's bigram pages, the second token of each
    page's last pair; None when the store has no lookahead (the common case)."""
    if raw is not None:
        if not isinstance(raw, (list, tuple)) or not raw:
            raise BadField("lookahead_token_ids is not a list of token lists")
        out = [list(a) for a in raw if isinstance(a, (list, tuple))]
        if len(out) != len(raw) or not out[0] or any(len(a) != len(out[0]) or not all(map(is_int, a)) for a in out):
            raise BadField("lookahead_token_ids: blocks of unequal or empty lookahead")
        return out
    if not raw_tokens or not isinstance(raw_tokens, (list, tuple)) or not isinstance(raw_tokens[0], (list, tuple)):
        return None
    if bs <= 0 or len(raw_tokens) % bs:
        raise BadField("bigram token_ids are not whole pages")
    return [[raw_tokens[end - 1][1]] for end in range(bs, len(raw_tokens) + 1, bs)]
