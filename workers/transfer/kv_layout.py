"""What both ends of a KV transfer must agree on, and how a transfer fails.

- ``Layout``: the fingerprint both sides must share, one entry per pool a transfer moves. A
  mismatch is a clean refusal, never a silent garbage import.
  - attention KV pages (model, dtype, layers, KV heads, head_dim, block size, page layout): one
    block is ``[num_layers, 2 (K, V), block_size, num_kv_heads, head_dim]`` in the model dtype,
    C order; exactly ``Layout.block_bytes`` bytes;
  - ``state`` (hybrid models; None otherwise): the recurrent state of a request at the end of
    the transfer's last block, ``StateLayout``: ``[num_layers, num_heads, key_dim, value_dim]``
    float32 (the recurrent layers only), C order; exactly ``StateLayout.nbytes`` bytes. A hybrid
    worker and an attention-only one never agree (``state`` differs), nor do two state shapes.
- ``TransferError``: a transfer that cannot go on, with its HTTP status, code and whether another
  attempt may succeed.

No torch import: the engine is only duck-typed here (``layout_of``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

KV_LAYOUT = "layer,kv,slot,head,dim/v1"
STATE_LAYOUT = "layer,head,key,value/v1"
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class StateLayout:
    """The recurrent-state pool of a hybrid model: one state per transfer, every recurrent layer."""

    dtype: str
    num_layers: int
    num_heads: int
    key_dim: int
    value_dim: int
    state_layout: str = STATE_LAYOUT

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return self.num_layers, self.num_heads, self.key_dim, self.value_dim

    @property
    def nbytes(self) -> int:
        return self.num_layers * self.num_heads * self.key_dim * self.value_dim * _ITEMSIZE[self.dtype]

    @classmethod
    def from_dict(cls, d: Any) -> StateLayout | None:
        if d is None:
            return None
        if not isinstance(d, dict):
            raise TransferError(400, "kv_layout_invalid", f"state layout must be an object or null, got {d!r}")
        try:
            out = cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})
        except TypeError as exc:
            raise TransferError(400, "kv_layout_invalid", f"incomplete state layout {d!r}: {exc}") from exc
        if out.dtype not in _ITEMSIZE:
            raise TransferError(400, "kv_layout_invalid", f"unknown state dtype {out.dtype!r}")
        return out


@dataclass(frozen=True)
class Layout:
    model: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    kv_layout: str = KV_LAYOUT
    state: StateLayout | None = None  # hybrid models: the recurrent-state pool

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self.dtype]

    @property
    def block_bytes(self) -> int:
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def state_bytes(self) -> int:
        """Bytes of the one recurrent state a transfer carries (0: an attention-only model)."""
        return 0 if self.state is None else self.state.nbytes

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> Layout:
        if not isinstance(d, dict):
            raise TransferError(400, "kv_layout_invalid", f"layout must be an object, got {d!r}")
        fields = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        fields["state"] = StateLayout.from_dict(d.get("state"))
        try:
            out = cls(**fields)
        except TypeError as exc:
            raise TransferError(400, "kv_layout_invalid", f"incomplete layout {d!r}: {exc}") from exc
        if out.dtype not in _ITEMSIZE:
            raise TransferError(400, "kv_layout_invalid", f"unknown KV dtype {out.dtype!r}")
        return out

    def mismatch(self, other: Layout) -> str | None:
        """None when compatible, else which fields differ (for the refusal message)."""
        diffs = [f"{k}: {_show(a)} here vs {_show(b)} there" for k, a, b in
                 ((k, getattr(self, k), getattr(other, k)) for k in self.__dataclass_fields__) if a != b]
        return "; ".join(diffs) or None


def _show(value: Any) -> str:
    if isinstance(value, StateLayout):
        return f"recurrent state {value.dtype} {list(value.shape)} ({value.state_layout})"
    return "no recurrent state (an attention-only model)" if value is None else repr(value)


def layout_of(engine: Any) -> Layout:
    mc = engine.model_config
    state = StateLayout("float32", len(mc.recurrent_layers), mc.linear_num_heads, mc.linear_key_dim,
                        mc.linear_value_dim) if mc.is_hybrid else None
    return Layout(engine.model_name, mc.dtype, len(mc.attention_layers), mc.num_kv_heads, mc.head_dim,
                  engine.config.block_size, state=state)


class TransferError(Exception):
    """A transfer that cannot go on: ``status``/``code`` for the HTTP answer, ``retryable``
    when another attempt (on the same or another pair) may succeed."""

    def __init__(self, status: int, code: str, message: str, retryable: bool = False) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.retryable = status, code, message, retryable
