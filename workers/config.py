"""Configuration of the bundled engine: the model's shape (``ModelConfig``) and the engine's
limits (``EngineConfig``). Both are frozen: built once at startup, then only read.

Presets carry deterministic random weights (seeded), so a demo, a load test or a benchmark needs
no download. ``tiny`` runs on two CPU cores; the others have the shapes of common checkpoints.
``demo`` is tiny with a scripted next token (``workers.engine.demo_sampler``): readable answers
through the same engine, ``mesh up``'s default. A checkpoint's config.json becomes a
``ModelConfig`` in ``workers.hf_config``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

LINEAR_ATTENTION_KINDS = ("gated", "lightning")


@dataclass(frozen=True)
class ResidualFactors:
    """MiniMax's residual (``*_alpha_factor``, ``*_beta_factor``): the residual is the *normed*
    input of a block and its output is ``alpha * residual + beta * block(residual)``; one
    (alpha, beta) pair after each kind of mixer and one after the MLP."""

    full_attention: tuple[float, float] = (1.0, 1.0)
    linear_attention: tuple[float, float] = (1.0, 1.0)
    mlp: tuple[float, float] = (1.0, 1.0)


@dataclass(frozen=True)
class ModelConfig:
    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int = 8192
    rope_theta: float = 10000.0
    # HF ``rope_scaling`` of type "llama3" (Llama 3.1+): factor, low/high_freq_factor, original len.
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    rms_norm_eps: float = 1e-6
    qkv_bias: bool = False  # Qwen2
    tie_word_embeddings: bool = False
    dtype: str = "bfloat16"  # float32 | float16 | bfloat16
    init_std: float = 0.02  # random presets only
    tokenizer: str = "byte"  # "byte" or a path load_tokenizer accepts
    eos_token_id: int | None = None  # None: the tokenizer's
    path: str | None = None  # a local HF directory to load weights from; None: random weights
    # Hybrid models: one entry per layer, "full_attention" or "linear_attention" (the recurrent
    # layer of ``workers.model.recurrent``); None: every layer is full attention.
    layer_types: tuple[str, ...] | None = None
    linear_num_heads: int = 0  # recurrent layers' heads, key and value dims (state [heads, d_k, d_v])
    linear_key_dim: int = 0
    linear_value_dim: int = 0
    linear_chunk: int = 64  # tokens per closed-form segment of the prefill scan
    # The layer around the recurrent scan: "gated" (gated linear attention: q, k L2-normed, a
    # learned per-token decay, silu(z) gate) or "lightning" (MiniMax-Text-01: silu on q, k, v,
    # a constant decay per head and layer, sigmoid gate from the layer input).
    linear_attention: str = "gated"
    # Sparse MoE MLP (``workers.model.moe``): num_experts experts of intermediate_size each, the
    # top num_experts_per_tok per token; 0 experts: a dense SwiGLU.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    residual_factors: ResidualFactors | None = None  # None: Llama's pre-norm residual stream
    # Whose weight names ``workers.model.hf_loader`` reads: "llama" (Llama, Qwen2, Mistral) or "minimax".
    hf_architecture: str = "llama"
    # The demo preset: each next token is the next byte of a scripted answer
    # (``workers.engine.demo_sampler``), not a sample of the logits; the forward pass still runs.
    demo_script: bool = False

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.dtype not in ("float32", "float16", "bfloat16"):
            raise ValueError(f"unknown dtype {self.dtype!r}")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers:
                raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
            bad = set(self.layer_types) - {"full_attention", "linear_attention"}
            if bad:
                raise ValueError(f"unknown layer types {sorted(bad)} (full_attention, linear_attention)")
            if self.is_hybrid and min(self.linear_num_heads, self.linear_key_dim, self.linear_value_dim) < 1:
                raise ValueError("a hybrid model needs linear_num_heads, linear_key_dim and linear_value_dim")
        if self.linear_attention not in LINEAR_ATTENTION_KINDS:
            raise ValueError(f"unknown linear_attention {self.linear_attention!r} ({', '.join(LINEAR_ATTENTION_KINDS)})")
        if self.linear_attention == "lightning" and self.linear_key_dim != self.linear_value_dim:
            raise ValueError("lightning attention has one head dim: linear_key_dim must equal linear_value_dim")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok {self.num_experts_per_tok} must lie in [1, {self.num_experts}]")
        if self.hf_architecture not in ("llama", "minimax"):
            raise ValueError(f"unknown hf_architecture {self.hf_architecture!r} (llama, minimax)")

    @property
    def attention_layers(self) -> list[int]:
        """Indices of the full-attention layers (the ones with paged K/V)."""
        types = self.layer_types
        return [i for i in range(self.num_layers) if types is None or types[i] == "full_attention"]

    @property
    def recurrent_layers(self) -> list[int]:
        """Indices of the recurrent (linear-attention) layers, whose per-request state is kept in slots."""
        types = self.layer_types or ()
        return [i for i, t in enumerate(types) if t == "linear_attention"]

    @property
    def is_hybrid(self) -> bool:
        return bool(self.recurrent_layers)

    def state_bytes(self) -> int:
        """Bytes of one request's recurrent state (all recurrent layers, float32)."""
        return len(self.recurrent_layers) * self.linear_num_heads * self.linear_key_dim * self.linear_value_dim * 4

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_params(self) -> int:
        """Parameter count (embedding counted once when tied)."""
        h, i = self.hidden_size, self.intermediate_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        if self.qkv_bias:
            attn += self.q_size + 2 * self.kv_size
        mlp = 3 * h * i + 2 * h
        if self.num_experts:
            mlp = self.num_experts * (3 * h * i + h) + 2 * h  # experts and the router's row each
        hk, hv = self.linear_num_heads * self.linear_key_dim, self.linear_num_heads * self.linear_value_dim
        if self.linear_attention == "lightning":
            linear = h * (2 * hk + hv) + 2 * hv * h + hv  # qkv, output gate and out, norm
        else:
            linear = (h * (2 * hk + 2 * hv + self.linear_num_heads) + hv * h + 2 * self.linear_num_heads
                      + self.linear_value_dim)
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return (len(self.attention_layers) * (attn + mlp) + len(self.recurrent_layers) * (linear + mlp)
                + emb + h)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * len(self.attention_layers) * self.kv_size * dtype_bytes


PRESETS: dict[str, ModelConfig] = {
    # Two CPU cores: a decode step is dominated by Python, not arithmetic. vocab 512 holds the
    # byte tokenizer's 258 ids. A larger init_std makes greedy argmaxes well separated.
    "tiny": ModelConfig(
        name="tiny", vocab_size=512, hidden_size=128, intermediate_size=384, num_layers=4,
        num_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=8192, rope_theta=10000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=True, dtype="float32", init_std=0.1,
    ),
    # tiny, answering readable text: the next token comes from a script (byte tokenizer, EOS 257).
    "demo": ModelConfig(
        name="demo", vocab_size=512, hidden_size=128, intermediate_size=384, num_layers=4,
        num_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=8192, rope_theta=10000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=True, dtype="float32", init_std=0.1,
        eos_token_id=257, demo_script=True,
    ),
    # tiny's shape with every second layer recurrent (gated linear attention, state [4, 32, 32]).
    "tiny-hybrid": ModelConfig(
        name="tiny-hybrid", vocab_size=512, hidden_size=128, intermediate_size=384, num_layers=4,
        num_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=8192, rope_theta=10000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=True, dtype="float32", init_std=0.1,
        layer_types=("linear_attention", "full_attention") * 2,
        linear_num_heads=4, linear_key_dim=32, linear_value_dim=32,
    ),
    # qwen2-0.5b's shape, three recurrent layers to one full-attention layer (Qwen3-Next's ratio).
    "hybrid-0.5b": ModelConfig(
        name="hybrid-0.5b", vocab_size=151936, hidden_size=896, intermediate_size=4864,
        num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64, max_position_embeddings=131072,
        rope_theta=1_000_000.0, qkv_bias=True, tie_word_embeddings=True,
        layer_types=(("linear_attention",) * 3 + ("full_attention",)) * 6,
        linear_num_heads=8, linear_key_dim=128, linear_value_dim=128,
    ),
    "qwen2-0.5b": ModelConfig(
        name="qwen2-0.5b", vocab_size=151936, hidden_size=896, intermediate_size=4864,
        num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64, max_position_embeddings=131072,
        rope_theta=1_000_000.0, qkv_bias=True, tie_word_embeddings=True,
    ),
    "llama3-1b": ModelConfig(
        name="llama3-1b", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
        num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64, max_position_embeddings=131072,
        rope_theta=500_000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
    ),
    "llama3-3b": ModelConfig(
        name="llama3-3b", vocab_size=128256, hidden_size=3072, intermediate_size=8192,
        num_layers=28, num_heads=24, num_kv_heads=8, head_dim=128, max_position_embeddings=131072,
        rope_theta=500_000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
    ),
    "llama3-8b": ModelConfig(
        name="llama3-8b", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=131072,
        rope_theta=500_000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
    ),
}


def get_preset(name: str, **overrides: Any) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r} (known: {', '.join(sorted(PRESETS))})")
    return replace(PRESETS[name], **overrides)


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16
    # KV capacity: an explicit block count, else a share of free GPU memory (CUDA) or a byte
    # budget (CPU).
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_bytes: int = 512 << 20
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192  # token budget of one step (prefill chunks + decodes)
    chunked_prefill_size: int | None = None  # most new tokens of one sequence per step
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    # Hybrid models (``workers.engine.state_checkpoints``): checkpoints of the recurrent state, kept
    # in a pool of their own (LRU) under the key of the last block they cover. One is taken at every
    # multiple of the interval (rounded up to a multiple of block_size; 0: none on an interval)
    # and one at the end of each turn (the last full block of prompt + output); a prefix hit
    # resumes only where attention blocks and a checkpoint both exist. 0 checkpoints: off.
    num_state_checkpoints: int = 256
    state_checkpoint_interval: int = 512
    # Also checkpoint each prompt at its last full block before the last token: where a decode
    # worker resumes a transferred request (on by default on a prefill worker, ``--role prefill``).
    state_checkpoint_prompt_end: bool = False
    # CPU offload tier (``workers.offload.kv_offload``): blocks of host memory (pinned on CUDA) that keep
    # evicted prefix blocks for restore instead of recompute; 0: off.
    cpu_offload_blocks: int = 0
    device: str = "auto"  # auto | cpu | cuda[:N]
    attention_backend: str = "auto"  # auto | torch | triton
    cpu_threads: int | None = None  # None: half the cores (a shared box must not oversubscribe)
    cuda_graphs: bool = True  # decode steps replay captured graphs (CUDA only)
    max_graph_batch_size: int = 256
    seed: int = 0
    served_model_name: str | None = None  # also the namespace of block keys (mesh.core.keys)
    worker_name: str | None = None  # how this worker names itself (the demo preset's answers); None: the model's
    # KV events (vLLM wire format); None: no publisher.
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    kv_events_topic: str = ""
    # the address a wildcard publisher endpoint (tcp://*:P) binds: the HTTP server's host when that
    # is a concrete address (a worker on loopback publishes on loopback); None: every interface
    kv_events_bind_host: str | None = None
    kv_events_buffer_steps: int = 10_000  # batches kept for replay
    kv_events_queue_size: int = 100_000  # batches queued for the publisher thread
    extra: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError("block_size must be positive")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError("num_kv_blocks must be at least 1")
        if self.num_state_checkpoints < 0 or self.state_checkpoint_interval < 0:
            raise ValueError("num_state_checkpoints and state_checkpoint_interval must be >= 0")
        if self.cpu_offload_blocks < 0:
            raise ValueError("cpu_offload_blocks must be >= 0 (0: no CPU offload tier)")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be at least 1")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must lie in (0, 1]")

    @property
    def checkpoint_interval_tokens(self) -> int:
        """The checkpoint interval rounded up to whole blocks (0: none on an interval)."""
        bs = self.block_size
        return -(-self.state_checkpoint_interval // bs) * bs

    @property
    def prefill_chunk(self) -> int:
        return min(self.chunked_prefill_size or self.max_num_batched_tokens, self.max_num_batched_tokens)
