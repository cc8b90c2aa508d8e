"""The engine's model computes what Hugging Face ``transformers`` computes, on the same
random-weight checkpoint saved as safetensors: in one prefill, in chunks over cached context, and
token by token through the paged decode path (float32, CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from tests.support.chunked_logits import assert_logits_close, chunked_logits
from workers.config import EngineConfig
from workers.engine.model_runner import ModelRunner
from workers.hf_config import config_from_hf

SMALL = dict(
    vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
)
BLOCK = 4


def _save(model_cls, config, path: Path, seed: int):  # type: ignore[no-untyped-def]
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():  # non-trivial weights everywhere, biases and norms included
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.08)
    model.save_pretrained(path, safe_serialization=True)
    return model


def _hf_logits(model, tokens: list[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


def _engine_logits(path: Path, tokens: list[int], chunks: list[int]) -> torch.Tensor:
    cfg = config_from_hf(path, dtype="float32")
    runner = ModelRunner(cfg, EngineConfig(device="cpu", num_kv_blocks=64, block_size=BLOCK, cpu_threads=1))
    return chunked_logits(runner, BLOCK, tokens, chunks)


CASES = {
    "llama": (LlamaForCausalLM, lambda: LlamaConfig(**SMALL, rope_theta=5000.0, tie_word_embeddings=False)),
    "llama3-rope-scaling": (
        LlamaForCausalLM,
        lambda: LlamaConfig(
            **SMALL, rope_theta=500000.0,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
        ),
    ),
    "qwen2-tied-bias": (Qwen2ForCausalLM, lambda: Qwen2Config(**SMALL, rope_theta=10000.0, tie_word_embeddings=True)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_hf_in_one_prefill_chunks_and_decode(case: str, tmp_path: Path) -> None:
    model_cls, make_config = CASES[case]
    hf = _save(model_cls, make_config(), tmp_path, seed=len(case))
    tokens = torch.randint(0, SMALL["vocab_size"], (27,), generator=torch.Generator().manual_seed(7)).tolist()
    ref = _hf_logits(hf, tokens)
    assert_logits_close(_engine_logits(tmp_path, tokens, [27]), ref)
    # 9 + 6 tokens of prefill (the second chunk reads 9 cached tokens, across a partial
    # block), then 12 decode steps.
    assert_logits_close(_engine_logits(tmp_path, tokens, [9, 6] + [1] * 12), ref)


def test_loader_maps_every_tensor_and_reads_config(tmp_path: Path) -> None:
    _save(Qwen2ForCausalLM, Qwen2Config(**SMALL, tie_word_embeddings=True), tmp_path, seed=1)
    cfg = config_from_hf(tmp_path, dtype="float32")
    assert (cfg.qkv_bias, cfg.tie_word_embeddings, cfg.num_kv_heads, cfg.head_dim) == (True, True, 2, 16)
    # A checkpoint missing a tensor is refused with its name.
    from safetensors.torch import load_file, save_file

    file = next(tmp_path.glob("*.safetensors"))
    tensors = load_file(str(file))
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="lacks 1 weights"):
        ModelRunner(cfg, EngineConfig(device="cpu", num_kv_blocks=8, block_size=BLOCK))
