"""A tiny random MiniMax-Text-01 checkpoint (``transformers`` ``MiniMaxForCausalLM``) in a
directory the worker's ``--model DIR`` serves: config.json, model.safetensors and a small
byte-level BPE tokenizer.json; and transformers' greedy generation on it, the oracle."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.support.chat_templates import build_tokenizer

LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention", "linear_attention"]
# Residual factors away from 1 (MiniMax-Text-01 ships alpha 3.56 and beta 1 after attention).
TINY: dict[str, Any] = dict(
    vocab_size=448, hidden_size=64, intermediate_size=32, num_hidden_layers=len(LAYER_TYPES),
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
    num_local_experts=4, num_experts_per_tok=2, layer_types=LAYER_TYPES, block_size=8,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    full_attn_alpha_factor=1.4, full_attn_beta_factor=0.8, linear_attn_alpha_factor=0.9,
    linear_attn_beta_factor=1.3, mlp_alpha_factor=1.2, mlp_beta_factor=0.7,
    tie_word_embeddings=False, eos_token_id=2, bos_token_id=None, pad_token_id=0,
)


def build_minimax(directory: Path, seed: int = 0, **overrides: Any) -> Any:
    """Save a seeded random MiniMaxForCausalLM (float32) and a tokenizer into ``directory``;
    returns the transformers model. Matrices are N(0, 0.08) (transformers' 0.02 leaves the
    logits nearly flat: greedy near-ties), norms U(0.5, 1.5)."""
    from transformers import MiniMaxConfig, MiniMaxForCausalLM

    torch.manual_seed(seed)
    model = MiniMaxForCausalLM(MiniMaxConfig(**(TINY | overrides))).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.08)
    model.save_pretrained(directory, safe_serialization=True)
    build_tokenizer(directory)
    return model


def hf_greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy ``generate``: ``n`` new tokens, EOS not stopping it."""
    from transformers import GenerationConfig

    gen = GenerationConfig(do_sample=False, max_new_tokens=n, min_new_tokens=0, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), generation_config=gen)
    return [int(t) for t in out[0, len(prompt):]]


def hf_logits(model: Any, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()
