"""A ``ModelConfig`` from a Hugging Face directory's ``config.json``: Llama, Qwen2, Mistral, and
MiniMax-Text-01 (``MiniMaxForCausalLM``: lightning attention beside full attention, sparse MoE).

A config.json value the engine does not compute as ``transformers`` does is refused with its
name (a ``ValueError``), never ignored. A field absent from config.json takes the default of the
architecture's ``transformers`` config class.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from workers.config import ModelConfig, ResidualFactors

LLAMA_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
# transformers 5.24 ``MiniMaxConfig``'s defaults, for fields a config.json leaves out
MINIMAX_DEFAULTS: dict[str, Any] = {
    "num_key_value_heads": 8, "hidden_act": "silu", "max_position_embeddings": 4096 * 32, "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False, "sliding_window": None, "num_experts_per_tok": 2, "num_local_experts": 8,
}
MINIMAX_ROPE_THETA = 1_000_000.0  # MiniMaxConfig.default_theta
# Fields of MiniMax-Text-01's original (remote-code) config that transformers' model does not read;
# a value other than these would mean a model transformers does not compute.
MINIMAX_FIXED: dict[str, tuple[Any, ...]] = {
    "hidden_act": ("silu",),
    "sliding_window": (None,),
    "shared_intermediate_size": (None, 0),
    "postnorm": (None, True),
}


def config_from_hf(path: str | Path, dtype: str | None = None) -> ModelConfig:
    """The engine's config for the checkpoint in ``path`` (``dtype`` overrides the saved one)."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"no config.json in {path}")
    hf = json.loads(cfg_file.read_text())
    arch = (hf.get("architectures") or [""])[0]
    model_type = hf.get("model_type", "")
    common = _common(hf, path, dtype)
    if arch == "MiniMaxForCausalLM" or model_type == "minimax":
        return ModelConfig(**common, **_minimax(hf))
    if model_type in ("llama", "qwen2", "mistral") or arch in LLAMA_ARCHITECTURES:
        return ModelConfig(**common, **_llama(hf, model_type))
    raise ValueError(f"unsupported architecture {arch or model_type!r} (Llama, Qwen2, Mistral, MiniMax)")


def _common(hf: dict[str, Any], path: Path, dtype: str | None) -> dict[str, Any]:
    torch_dtype = dtype or hf.get("torch_dtype") or hf.get("dtype") or "bfloat16"
    eos = hf.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    return {
        "name": path.name,
        "vocab_size": hf["vocab_size"],
        "hidden_size": hf["hidden_size"],
        "intermediate_size": hf["intermediate_size"],
        "num_layers": hf["num_hidden_layers"],
        "dtype": str(torch_dtype).removeprefix("torch."),
        "tokenizer": str(path) if (path / "tokenizer.json").is_file() else "byte",
        "eos_token_id": eos,
        "path": str(path),
    }


def _rope(hf: dict[str, Any], default_theta: float) -> tuple[float, dict[str, Any] | None]:
    """(theta, the scaling parameters beyond theta, or None for plain RoPE)."""
    scaling = hf.get("rope_scaling") or hf.get("rope_parameters")
    theta = hf.get("rope_theta") or (scaling or {}).get("rope_theta") or default_theta
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type")
    if kind in (None, "default"):
        return float(theta), None
    return float(theta), {k: v for k, v in (scaling or {}).items() if k not in ("rope_type", "type", "rope_theta")} | {
        "rope_type": kind}


def _llama(hf: dict[str, Any], model_type: str) -> dict[str, Any]:
    if hf.get("mlp_bias"):
        raise ValueError("mlp_bias=true is not supported")
    heads = hf["num_attention_heads"]
    theta, scaling = _rope(hf, 10000.0)
    rope_scaling = None
    if scaling is not None:
        if scaling["rope_type"] != "llama3":
            raise ValueError(f"unsupported rope_scaling type {scaling['rope_type']!r}")
        rope_scaling = tuple(sorted((k, v) for k, v in scaling.items() if k != "rope_type"))
    return {
        "num_heads": heads,
        "num_kv_heads": hf.get("num_key_value_heads") or heads,
        "head_dim": hf.get("head_dim") or hf["hidden_size"] // heads,
        "max_position_embeddings": hf.get("max_position_embeddings", 8192),
        "rope_theta": theta,
        "rope_scaling": rope_scaling,
        "rms_norm_eps": hf.get("rms_norm_eps", 1e-6),
        "qkv_bias": bool(hf.get("attention_bias", model_type == "qwen2")),
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)),
    }


def _minimax(hf: dict[str, Any]) -> dict[str, Any]:
    """MiniMaxForCausalLM (transformers 5.24 ``modeling_minimax``): every layer a sparse MoE;
    its lightning layers' state is [heads, head_dim, head_dim] (``linear_attention="lightning"``)."""
    hf = MINIMAX_DEFAULTS | hf
    for key, allowed in MINIMAX_FIXED.items():
        if hf.get(key) not in allowed:
            raise ValueError(f"config.json {key}={hf.get(key)!r} is not supported (supported: {allowed})")
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    theta, scaling = _rope(hf, MINIMAX_ROPE_THETA)
    if scaling is not None:
        raise ValueError(f"rope type {scaling['rope_type']!r} is not supported for MiniMax (default RoPE only)")
    # transformers' MiniMax rotates the whole head; a checkpoint asking for partial rotary (the
    # original MiniMax-Text-01 rotates half of it) would be computed as transformers does not.
    partial = (hf.get("rope_parameters") or {}).get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if hf.get("rotary_dim", head_dim) != head_dim or partial != 1.0:
        raise ValueError(f"partial rotary (rotary_dim={hf.get('rotary_dim')}, partial_rotary_factor={partial}) "
                         f"is not supported: MiniMaxForCausalLM rotates the whole head of {head_dim}")
    return {
        "num_heads": heads,
        "num_kv_heads": hf["num_key_value_heads"] or heads,
        "head_dim": head_dim,
        "max_position_embeddings": hf["max_position_embeddings"],
        "rope_theta": theta,
        "rms_norm_eps": hf["rms_norm_eps"],
        "tie_word_embeddings": bool(hf["tie_word_embeddings"]),
        "layer_types": _minimax_layer_types(hf),
        "linear_num_heads": heads,
        "linear_key_dim": head_dim,
        "linear_value_dim": head_dim,
        "linear_attention": "lightning",
        "num_experts": hf["num_local_experts"],
        "num_experts_per_tok": hf["num_experts_per_tok"],
        "residual_factors": ResidualFactors(
            full_attention=(_factor(hf, "full_attn_alpha_factor"), _factor(hf, "full_attn_beta_factor")),
            linear_attention=(_factor(hf, "linear_attn_alpha_factor"), _factor(hf, "linear_attn_beta_factor")),
            mlp=(_factor(hf, "mlp_alpha_factor"), _factor(hf, "mlp_beta_factor")),
        ),
        "hf_architecture": "minimax",
    }


def _minimax_layer_types(hf: dict[str, Any]) -> tuple[str, ...]:
    types = hf.get("layer_types")
    if types is None:
        if hf.get("attn_type_list") is not None:  # the original config's list; transformers does not read it
            raise ValueError("config.json has attn_type_list but no layer_types: MiniMaxForCausalLM reads layer_types "
                             "(transformers' converted checkpoints carry it)")
        # transformers' default: full attention at even layers, lightning at odd ones
        types = ["full_attention" if (i + 1) % 2 else "linear_attention" for i in range(hf["num_hidden_layers"])]
    return tuple(types)


def _factor(hf: dict[str, Any], key: str) -> float:
    return float(hf.get(key, 1.0))
