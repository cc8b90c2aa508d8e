"""The engine serves a MiniMax-Text-01 checkpoint (``transformers`` ``MiniMaxForCausalLM``:
lightning attention beside full attention, sparse MoE, scaled residuals) as transformers computes
it: the logits of a prompt in one prefill, in chunks over cached context and token by token; greedy
generation token for token with state checkpoints on and off and across a second turn resumed
at a checkpoint; the slopes read from the checkpoint; and config values or tensors it cannot
serve are refused by name (float32, CPU)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.support.chunked_logits import assert_logits_close, chunked_logits
from tests.support.minimax import build_minimax, hf_greedy, hf_logits
from workers.config import EngineConfig, ModelConfig
from workers.engine.llm_engine import LLMEngine
from workers.engine.model_runner import ModelRunner
from workers.engine.sequence import SamplingParams
from workers.hf_config import config_from_hf
from workers.model.decoder import CausalLM, build_model
from workers.model.lightning import decay_tables

BS = 4  # KV block size: a 27-token prompt spans partial blocks and several checkpoints
PROMPT = torch.randint(3, 448, (27,), generator=torch.Generator().manual_seed(7)).tolist()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    path = tmp_path_factory.mktemp("minimax")
    return path, build_minimax(path)


@pytest.fixture(scope="module")
def cfg(ckpt: tuple[Path, Any]) -> ModelConfig:
    return config_from_hf(ckpt[0], dtype="float32")


@pytest.fixture(scope="module")
def model(cfg: ModelConfig) -> CausalLM:
    return build_model(cfg, torch.device("cpu"))


def _runner_logits(cfg: ModelConfig, model: CausalLM, tokens: list[int], chunks: list[int]) -> torch.Tensor:
    runner = ModelRunner(cfg, EngineConfig(device="cpu", num_kv_blocks=64, block_size=BS, cpu_threads=1,
                                           max_num_seqs=2, num_state_checkpoints=0), model)
    return chunked_logits(runner, BS, tokens, chunks, recurrent_slots=2)


def test_config_maps_the_hybrid_shape(cfg: ModelConfig) -> None:
    assert cfg.recurrent_layers == [0, 2, 3] and cfg.attention_layers == [1]
    assert (cfg.linear_attention, cfg.linear_num_heads, cfg.linear_key_dim, cfg.linear_value_dim) == ("lightning", 4, 16, 16)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.rope_theta, cfg.rms_norm_eps) == (4, 2, 10000.0, 1e-5)
    assert cfg.residual_factors is not None and cfg.residual_factors.linear_attention == (0.9, 1.3)
    assert cfg.is_hybrid and cfg.state_bytes() == 3 * 4 * 16 * 16 * 4


def test_logits_match_transformers_in_one_prefill_chunks_and_decode(ckpt: tuple[Path, Any], cfg: ModelConfig,
                                                                    model: CausalLM) -> None:
    ref = hf_logits(ckpt[1], PROMPT)  # HF's blocked prefill: blocks of 8 tokens
    assert_logits_close(_runner_logits(cfg, model, PROMPT, [27]), ref)
    # 9 + 6 prefill tokens (the second chunk resumes the state and reads 9 cached K/V), 12 decodes
    assert_logits_close(_runner_logits(cfg, model, PROMPT, [9, 6] + [1] * 12), ref)


def _engine(cfg: ModelConfig, model: CausalLM, **kw: Any) -> LLMEngine:
    config: dict[str, Any] = dict(device="cpu", num_kv_blocks=256, cpu_threads=1, block_size=BS,
                                  state_checkpoint_interval=8)
    config.update(kw)
    return LLMEngine(cfg, EngineConfig(**config), eos_token_id=2, model=model)


def _generate(engine: LLMEngine, rid: str, prompt: list[int], n: int) -> tuple[list[int], int]:
    """Greedy tokens and the prompt tokens served from cache."""
    engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    tokens, cached = [], 0
    while engine.has_unfinished():
        for o in engine.step():
            tokens += o.new_token_ids
            cached = o.num_cached_tokens
        engine.block_manager.check(engine.scheduler.all_seqs())
    return tokens, cached


@pytest.mark.parametrize("checkpoints", ["on", "off"])
def test_greedy_generation_equals_transformers_and_a_second_turn_resumes(
        ckpt: tuple[Path, Any], cfg: ModelConfig, model: CausalLM, checkpoints: str) -> None:
    """Turn 1: 27 prompt tokens, 20 generated. Turn 2: turn 1 + its reply + 5 new tokens. With
    checkpoints turn 2 resumes at turn 1's end-of-turn checkpoint (44 tokens: the last full
    block of prompt + reply) and still generates transformers' tokens; without, nothing resumes."""
    hf = ckpt[1]
    engine = _engine(cfg, model, **({} if checkpoints == "on" else {"num_state_checkpoints": 0}))
    first, _ = _generate(engine, "t1", PROMPT, 20)
    assert first == hf_greedy(hf, PROMPT, 20)
    second_prompt = PROMPT + first + [11, 12, 13, 14, 15]
    second, cached = _generate(engine, "t2", second_prompt, 12)
    assert second == hf_greedy(hf, second_prompt, 12)
    if checkpoints == "on":
        assert cached == 44 and engine.stats()["state_checkpoints_restored"] == 1
    else:
        assert cached == 0 and engine.stats()["prefix_unresumable_tokens"] > 0


def test_batched_sequences_each_generate_transformers_tokens(ckpt: tuple[Path, Any], cfg: ModelConfig,
                                                            model: CausalLM) -> None:
    """Three prompts, the third arriving while the others decode: prefill chunks and decode tokens
    of several sequences share steps (and the experts' routing), each still as transformers alone."""
    prompts = [PROMPT[:13], PROMPT[5:], PROMPT[::-1][:19]]
    engine = _engine(cfg, model, chunked_prefill_size=8)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    out: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts[:2]):
        engine.add_request(f"r{i}", prompt, params)
        out[f"r{i}"] = []
    steps = 0
    while engine.has_unfinished():
        if steps == 3:
            engine.add_request("r2", prompts[2], params)
            out["r2"] = []
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
        steps += 1
    assert [out[f"r{i}"] for i in range(3)] == [hf_greedy(ckpt[1], p, 10) for p in prompts]


def _rewrite(src: Path, dst: Path, edit: Any) -> Path:
    """A copy of the checkpoint in ``src`` whose tensors went through ``edit(dict)``."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_slopes_come_from_the_checkpoint_else_from_the_formula(ckpt: tuple[Path, Any], tmp_path: Path) -> None:
    """Doubled slopes (with their decay tables) in the checkpoint change the logits as they change
    transformers'; a checkpoint without slopes or tables gets MiniMax's own."""
    from transformers import MiniMaxForCausalLM

    def double(t: dict[str, torch.Tensor]) -> None:
        for name in [n for n in t if n.endswith("slope_rate")]:
            t[name] = t[name] * 2
        for name in [n for n in t if n.endswith("_decay")]:
            layer, table = name.rsplit(".", 1)
            block = t[name].shape[-1] if table == "diagonal_decay" else t[name].shape[1]
            t[name] = decay_tables(t[layer + ".slope_rate"].flatten(), block)[table]

    doubled = _rewrite(ckpt[0], tmp_path / "doubled", double)
    ref = hf_logits(MiniMaxForCausalLM.from_pretrained(doubled).eval(), PROMPT)
    ours = _runner_logits(config_from_hf(doubled, dtype="float32"),
                          build_model(config_from_hf(doubled, dtype="float32"), torch.device("cpu")), PROMPT, [27])
    assert_logits_close(ours, ref)
    assert (ref - hf_logits(ckpt[1], PROMPT)).abs().max() > 1e-2  # the slopes matter

    bare = _rewrite(ckpt[0], tmp_path / "bare", lambda t: [t.pop(n) for n in list(t) if "decay" in n or "slope" in n])
    cfg = config_from_hf(bare, dtype="float32")
    assert_logits_close(_runner_logits(cfg, build_model(cfg, torch.device("cpu")), PROMPT, [27]), hf_logits(ckpt[1], PROMPT))


def test_layer_types_absent_take_transformers_default(ckpt: tuple[Path, Any], tmp_path: Path) -> None:
    from transformers import MiniMaxConfig

    shutil.copytree(ckpt[0], tmp_path / "c")
    hf = json.loads((tmp_path / "c" / "config.json").read_text())
    del hf["layer_types"]
    (tmp_path / "c" / "config.json").write_text(json.dumps(hf))
    expected = MiniMaxConfig.from_pretrained(tmp_path / "c").layer_types
    assert list(config_from_hf(tmp_path / "c").layer_types or ()) == expected == [
        "full_attention", "linear_attention", "full_attention", "linear_attention"]


CONFIG_REFUSALS = [
    ({"sliding_window": 16}, "sliding_window"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rotary_dim": 8}, "partial rotary"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}}, "partial rotary"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}}, "rope type 'linear'"),
    ({"layer_types": None, "attn_type_list": [0, 1, 0, 0]}, "attn_type_list"),
    ({"shared_intermediate_size": 64}, "shared_intermediate_size"),
]


@pytest.mark.parametrize(("change", "match"), CONFIG_REFUSALS)
def test_config_values_it_does_not_compute_are_refused(ckpt: tuple[Path, Any], tmp_path: Path,
                                                        change: dict[str, Any], match: str) -> None:
    shutil.copytree(ckpt[0], tmp_path / "c")
    hf = json.loads((tmp_path / "c" / "config.json").read_text())
    hf.update(change)
    (tmp_path / "c" / "config.json").write_text(json.dumps({k: v for k, v in hf.items() if v is not None}))
    with pytest.raises(ValueError, match=match):
        config_from_hf(tmp_path / "c")


TENSOR_REFUSALS = [
    (lambda t: t.pop("model.layers.2.block_sparse_moe.experts.3.w3.weight"), "lacks 1 weights"),
    (lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"), "lacks 1 weights"),
    (lambda t: t.update({"model.layers.0.self_attn.extra.weight": torch.zeros(2)}), "unexpected weight"),
    (lambda t: t.update({"model.layers.0.self_attn.slope_rate": t["model.layers.0.self_attn.slope_rate"] * 3}),
     "disagrees with the checkpoint's slope_rate"),
]


@pytest.mark.parametrize(("edit", "match"), TENSOR_REFUSALS)
def test_a_tensor_missing_unmapped_or_inconsistent_is_refused_by_name(ckpt: tuple[Path, Any], tmp_path: Path,
                                                                      edit: Any, match: str) -> None:
    path = _rewrite(ckpt[0], tmp_path / "t", edit)
    with pytest.raises(ValueError, match=match):
        build_model(config_from_hf(path, dtype="float32"), torch.device("cpu"))
