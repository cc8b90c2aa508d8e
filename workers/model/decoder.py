"""A Llama/Qwen2-style decoder, its deterministic random init, and a loader for a local HF
directory (``config.json`` + ``*.safetensors``).

Parameter names follow HF's (``model.layers.N.self_attn...``) except for two packed matrices:
``qkv_proj`` = rows of q_proj, k_proj, v_proj and ``gate_up_proj`` = rows of gate_proj, up_proj;
``load_hf_weights`` copies each HF shard into its rows.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from workers.config import ModelConfig
from workers.model.attention.base import AttentionBackend
from workers.model.layers import Attention, AttentionMetadata, RMSNorm, RotaryEmbedding, SwiGLU
from workers.model.recurrent import GatedLinearAttention

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class DecoderLayer(nn.Module):
    is_attention = True

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = Attention(
            cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.qkv_bias, rotary
        )
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(positions, h, kv_cache, meta, backend)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class RecurrentDecoderLayer(nn.Module):
    """A hybrid model's recurrent layer: gated linear attention in place of self-attention
    (HF Qwen3-Next's name ``linear_attn``), the same MLP and norms."""

    is_attention = False

    def __init__(self, cfg: ModelConfig, recurrent_index: int) -> None:
        super().__init__()
        self.linear_attn = GatedLinearAttention(
            cfg.hidden_size, cfg.linear_num_heads, cfg.linear_key_dim, cfg.linear_value_dim, cfg.linear_chunk,
            cfg.rms_norm_eps, recurrent_index,
        )
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, meta: AttentionMetadata, cu_seqlens: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if meta.recurrent is None:
            raise ValueError("a recurrent layer needs RecurrentMetadata (state slots)")
        h, residual = self.input_layernorm(x, residual)
        h = self.linear_attn(h, meta.num_prefill_tokens, cu_seqlens, meta.recurrent)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


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
            RecurrentDecoderLayer(cfg, recurrent.index(i)) if i in recurrent else DecoderLayer(cfg, rotary)
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
        with torch.device("meta"):
            model = CausalLM(cfg)
    finally:
        torch.set_default_dtype(previous)
    model = model.to_empty(device=device)
    # Buffers are not materialized by to_empty: rebuild the RoPE table on the device in fp32.
    scaling = dict(cfg.rope_scaling) if cfg.rope_scaling else None
    rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, scaling).to(device)
    for layer in model.model.layers:
        if layer.is_attention:
            layer.self_attn.rotary = rotary
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    if cfg.path:
        load_hf_weights(model, cfg.path)
    else:
        random_init(model, seed)
    return model.eval().requires_grad_(False)


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


# HF name suffix -> (our name suffix, shard index) for the packed matrices.
_PACKED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


@torch.no_grad()
def load_hf_weights(model: CausalLM, path: str | Path) -> None:
    """Copy every tensor of ``path/*.safetensors`` into ``model``; raise on a missing one."""
    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    params = dict(model.named_parameters(remove_duplicate=False))
    cfg = model.config
    shard_rows = {
        "self_attn.qkv_proj": [cfg.q_size, cfg.kv_size, cfg.kv_size],
        "mlp.gate_up_proj": [cfg.intermediate_size, cfg.intermediate_size],
    }
    loaded: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for hf_name in f.keys():
                if "rotary_emb" in hf_name:
                    continue
                tensor = f.get_tensor(hf_name)
                target, rows = _target(hf_name, shard_rows)
                if target not in params:
                    raise ValueError(f"unexpected weight {hf_name!r} in {file.name}")
                dst = params[target]
                if rows is not None:
                    dst = dst.narrow(0, rows[0], rows[1])
                    loaded.add(f"{target}#{rows[0]}")
                else:
                    loaded.add(target)
                if dst.shape != tensor.shape:
                    raise ValueError(f"{hf_name}: shape {tuple(tensor.shape)} != expected {tuple(dst.shape)}")
                dst.copy_(tensor.to(dst.dtype))
    _check_loaded(params, loaded, shard_rows, cfg.tie_word_embeddings)


def _target(hf_name: str, shard_rows: dict[str, list[int]]) -> tuple[str, tuple[int, int] | None]:
    """Our parameter name for an HF tensor, and (row offset, rows) when it is a packed shard."""
    for hf_part, (ours, shard) in _PACKED.items():
        if f".{hf_part}." in hf_name:
            sizes = shard_rows[ours]
            return hf_name.replace(hf_part, ours), (sum(sizes[:shard]), sizes[shard])
    return hf_name, None


def _check_loaded(
    params: dict[str, nn.Parameter], loaded: set[str], shard_rows: dict[str, list[int]], tied: bool
) -> None:
    missing = []
    for name in params:
        if name == "lm_head.weight" and tied:
            continue
        packed = next((p for p in shard_rows if name.endswith(p + ".weight") or name.endswith(p + ".bias")), None)
        if packed is None:
            if name not in loaded:
                missing.append(name)
            continue
        sizes = shard_rows[packed]
        # qkv bias has all three shards; gate_up has no bias.
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        missing += [f"{name}#{o}" for o in offsets if f"{name}#{o}" not in loaded]
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} weights, e.g. {missing[:3]}")
