"""What both ends of a KV transfer must agree on, and how a transfer fails.

- ``Layout``: the fingerprint both sides must share (model, dtype, layers, KV heads, head_dim,
  block size, page layout). A mismatch is a clean refusal, never a silent garbage import. Page
  layout of one block: ``[num_layers, 2 (K, V), block_size, num_kv_heads, head_dim]`` in the
  model dtype, C order; exactly ``Layout.block_bytes`` bytes.
- ``TransferError``: a transfer that cannot go on, with its HTTP status, code and whether another
  attempt may succeed.

No torch import: the engine is only duck-typed here (``layout_of``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

KV_LAYOUT = "layer,kv,slot,head,dim/v1"


@dataclass(frozen=True)
class Layout:
    model: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    kv_layout: str = KV_LAYOUT

    @property
    def itemsize(self) -> int:
        return {"float32": 4, "float16": 2, "bfloat16": 2}[self.dtype]

    @property
    def block_bytes(self) -> int:
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * self.itemsize

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> Layout:
        if not isinstance(d, dict):
            raise TransferError(400, "kv_layout_invalid", f"layout must be an object, got {d!r}")
        try:
            return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})
        except TypeError as exc:
            raise TransferError(400, "kv_layout_invalid", f"incomplete layout {d!r}: {exc}") from exc

    def mismatch(self, other: Layout) -> str | None:
        """None when compatible, else which fields differ (for the refusal message)."""
        diffs = [f"{k}: {a!r} here vs {b!r} there" for k, a, b in
                 ((k, getattr(self, k), getattr(other, k)) for k in self.__dataclass_fields__) if a != b]
        return "; ".join(diffs) or None


def layout_of(engine: Any) -> Layout:
    mc = engine.model_config
    return Layout(engine.model_name, mc.dtype, len(mc.attention_layers), mc.num_kv_heads, mc.head_dim, engine.config.block_size)


class TransferError(Exception):
    """A transfer that cannot go on: ``status``/``code`` for the HTTP answer, ``retryable``
    when another attempt (on the same or another pair) may succeed."""

    def __init__(self, status: int, code: str, message: str, retryable: bool = False) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.retryable = status, code, message, retryable
