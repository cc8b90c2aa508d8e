"""The decoder (Llama/Qwen2, the hybrid presets, MiniMax-Text-01) and its deterministic random
init; ``build_model`` loads a local HF directory through ``workers.model.hf_loader``.

Parameter names follow HF's (``model.layers.N.self_attn...``) except for packed matrices:
``qkv_proj`` = rows of q_proj, k_proj, v_proj, ``gate_up_proj`` = rows of gate_proj, up_proj (an
expert's: w1, w3), and a recurrent layer's mixer is ``linear_attn``; the loader maps the names.
One layer shape serves every model: a mixer (full attention or a recurrent layer) and an MLP
(dense SwiGLU or sparse MoE), each behind an RMSNorm, with a pre-norm or MiniMax's scaled residual.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from workers.config import ModelConfig
from workers.model.attention.base import AttentionBackend
from workers.model.hf_loader import load_hf_weights
from workers.model.layers import Attention, AttentionMetadata, RMSNorm, RotaryEmbedding, SwiGLU
from workers.model.lightning import LightningAttention
from workers.model.moe import SparseMoE
from workers.model.recurrent import GatedLinearAttention

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _mlp(cfg: ModelConfig) -> nn.Module:
    if cfg.num_experts:
        return SparseMoE(cfg.hidden_size, cfg.intermediate_size, cfg.num_experts, cfg.num_experts_per_tok)
    return SwiGLU(cfg.hidden_size, cfg.intermediate_size)


class _Block(nn.Module):
    """A mixer (attention or recurrent) and an MLP, each behind an RMSNorm, and the residual
    around them. A layer returns ``(x, residual)``: the next norm's input is their sum.

    Pre-norm (Llama; ``residual_factors`` None): the residual is the running sum of the layer
    inputs. MiniMax: the residual is the *normed* input of each part, and each part's output is
    ``alpha * residual + beta * part(residual)``."""

    def __init__(self, cfg: ModelConfig, kind: str) -> None:
        super().__init__()
        self.mlp = _mlp(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        f = cfg.residual_factors
        self.factors = None if f is None else (getattr(f, kind), f.mlp)

    def _run(self, x: torch.Tensor, residual: torch.Tensor | None,
             mix: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        if self.factors is None:
            h, residual = self.input_layernorm(x, residual)
            h, residual = self.post_attention_layernorm(mix(h), residual)
            return self.mlp(h), residual
        (attn_alpha, attn_beta), (mlp_alpha, mlp_beta) = self.factors
        h, _ = self.input_layernorm(x, residual)
        h, _ = self.post_attention_layernorm(attn_beta * mix(h), attn_alpha * h)
        return mlp_beta * self.mlp(h), mlp_alpha * h


class DecoderLayer(_Block):
    is_attention = True

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__(cfg, "full_attention")
        self.self_attn = Attention(
            cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.qkv_bias, rotary
        )

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._run(x, residual, lambda h: self.self_attn(positions, h, kv_cache, meta, backend))


class RecurrentDecoderLayer(_Block):
    """A hybrid model's recurrent layer: a linear-attention mixer in place of self-attention
    (HF Qwen3-Next's name ``linear_attn``; MiniMax's ``self_attn`` is renamed at load)."""

    is_attention = False

    def __init__(self, cfg: ModelConfig, layer: int, recurrent_index: int) -> None:
        super().__init__(cfg, "linear_attention")
        self.linear_attn: GatedLinearAttention | LightningAttention
        if cfg.linear_attention == "lightning":
            self.linear_attn = LightningAttention(cfg.hidden_size, cfg.linear_num_heads, cfg.linear_key_dim,
                                                  cfg.linear_chunk, layer, cfg.num_layers, recurrent_index)
        else:
            self.linear_attn = GatedLinearAttention(
                cfg.hidden_size, cfg.linear_num_heads, cfg.linear_key_dim, cfg.linear_value_dim, cfg.linear_chunk,
                cfg.rms_norm_eps, recurrent_index,
            )

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, meta: AttentionMetadata, cu_seqlens: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        recurrent = meta.recurrent
        if recurrent is None:
            raise ValueError("a recurrent layer needs RecurrentMetadata (state slots)")
        return self._run(x, residual, lambda h: self.linear_attn(h, meta.num_prefill_tokens, cu_seqlens, recurrent))


class Model(nn.Module):
    """The decoder stack (HF's ``model.`` prefix)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        scaling = dict(cfg.rope_scaling) if cfg.rope_scaling else None
        # One RoPE table shared by every layer (not a parameter: never saved or loaded).
        rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, scaling)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        recurrent = cfg.recurrent_layers
        self.layers = nn.ModuleList(
            RecurrentDecoderLayer(cfg, i, recurrent.index(i)) if i in recurrent else DecoderLayer(cfg, rotary)
            for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Model(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per full-attention layer (k_cache, v_cache)
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:  # [T, hidden], final-normed
        x = self.model.embed_tokens(input_ids)
        residual = None
        kv_iter = iter(kv_caches)
        cu: list[int] = []
        if meta.recurrent is not None and meta.cu_seqlens_q is not None:
            cu = meta.cu_seqlens_q.tolist()  # host offsets for the per-sequence scans
        for layer in self.model.layers:
            if layer.is_attention:
                x, residual = layer(positions, x, residual, next(kv_iter), meta, backend)
            else:
                x, residual = layer(x, residual, meta, cu)
        x, _ = self.model.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()


def build_model(cfg: ModelConfig, device: torch.device, seed: int = 0) -> CausalLM:
    """The model on ``device``: HF weights when ``cfg.path`` is set, else seeded random weights."""
    dtype = DTYPES[cfg.dtype]
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # parameters are born in the model's dtype (no fp32 copy)
    try:
        with torch.device(device), _without_default_init():
            model = CausalLM(cfg)
    finally:
        torch.set_default_dtype(previous)
    # Rebuilt outside the default dtype: the RoPE table (and the slopes) in fp32.
    scaling = dict(cfg.rope_scaling) if cfg.rope_scaling else None
    rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, scaling).to(device)
    for layer in model.model.layers:
        if layer.is_attention:
            layer.self_attn.rotary = rotary
        elif isinstance(layer.linear_attn, LightningAttention):
            layer.linear_attn.reset_slopes()  # a checkpoint's slope_rate, if any, is loaded over them
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    if cfg.path:
        load_hf_weights(model, cfg.path)
    else:
        random_init(model, seed)
    return model.eval().requires_grad_(False)


# torch.nn's default initializers (nn.Linear's and nn.Embedding's reset_parameters call them)
_DEFAULT_INITS = ("uniform_", "normal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
                  "xavier_normal_", "trunc_normal_", "constant_", "zeros_", "ones_")


@contextmanager
def _without_default_init() -> Iterator[None]:
    """Modules are built with their parameters left as allocated: every one is written after
    (``random_init`` or a checkpoint), so a default init would be a wasted pass over the weights.
    Building on the meta device instead (no allocation) costs torch's lazy import of its compiler
    stack at the first meta op: ~2.5 s of every worker's start."""
    saved = {name: getattr(nn.init, name) for name in _DEFAULT_INITS}
    try:
        for name in saved:
            setattr(nn.init, name, _left_as_allocated)
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def _left_as_allocated(tensor: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    return tensor


@torch.no_grad()
def random_init(model: CausalLM, seed: int) -> None:
    """Normal(0, init_std) matrices and biases, unit norms; same seed + device type = same model."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    std = model.config.init_std
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        if name.endswith("norm.weight") or name.endswith("o_norm"):
            p.fill_(1.0)
        elif name.endswith("A_log"):  # per-token decay exp(-exp(A_log) * softplus(.)) near 0.97: long memory
            p.copy_(torch.empty(p.shape, device=device).uniform_(0.02, 0.1, generator=gen).log())
        else:
            p.copy_(torch.randn(p.shape, generator=gen, device=device, dtype=torch.float32).mul_(std))
