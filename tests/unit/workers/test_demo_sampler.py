"""The demo preset through the real engine (CPU): its answer is readable text chosen token by token,
and max_tokens, EOS, ignore_eos, stop token ids and the prefix cache behave as for any preset."""

from __future__ import annotations

import pytest
import torch

from workers.config import EngineConfig, get_preset
from workers.engine.demo_sampler import DemoSampler, demo_answer
from workers.engine.llm_engine import LLMEngine
from workers.engine.sampler import Sampler
from workers.engine.sequence import SamplingParams
from workers.model.decoder import build_model

DEMO = get_preset("demo")
EOS = 257
PROMPT = list(b"You are a helpful assistant. Tell me about the Mesh router, please.")  # 4 full blocks


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return build_model(DEMO, torch.device("cpu"), seed=0)


def _engine(model: torch.nn.Module) -> LLMEngine:
    config = EngineConfig(device="cpu", num_kv_blocks=256, cpu_threads=1, worker_name="worker-7")
    return LLMEngine(DEMO, config, model=model)


def _text(ids: list[int]) -> str:
    return bytes(t for t in ids if t < 256).decode()


def test_the_answer_is_readable_names_the_worker_and_ends_with_eos(model: torch.nn.Module) -> None:
    engine = _engine(model)
    [out] = engine.generate([PROMPT], SamplingParams(max_tokens=1000))
    text = _text(out)
    assert out[-1] == EOS and len(out) == len(text) + 1
    assert text == demo_answer("worker-7", len(PROMPT), 0)
    assert text.isprintable() and "Hello from worker-7" in text and f"prompt was {len(PROMPT)} tokens" in text
    assert len(text.split()) > 20
    # every token came out of a forward pass: the prompt was prefilled, each output token decoded
    assert engine.stats()["decode_computed_tokens"] == len(out) - 1


def test_a_repeated_prompt_hits_the_prefix_cache_and_the_answer_says_how_much(model: torch.nn.Module) -> None:
    engine = _engine(model)
    engine.generate([PROMPT], SamplingParams(max_tokens=1000))
    engine.add_request("again", PROMPT, SamplingParams(max_tokens=1000))
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    cached = outputs[-1].num_cached_tokens
    assert cached == 64  # the 4 full blocks of the 67-token prompt
    text = _text([t for o in outputs for t in o.new_token_ids])
    assert text == demo_answer("worker-7", len(PROMPT), cached)
    assert f"{cached} came from my prefix cache" in text and f"computed only {len(PROMPT) - cached}" in text


def test_max_tokens_cuts_the_answer_and_ignore_eos_repeats_it(model: torch.nn.Module) -> None:
    engine = _engine(model)
    answer = demo_answer("worker-7", len(PROMPT), 0)
    [short] = engine.generate([PROMPT], SamplingParams(max_tokens=10))
    assert _text(short) == answer[:10] == "Hello from"
    [long] = _engine(model).generate([PROMPT], SamplingParams(max_tokens=len(answer) + 12, ignore_eos=True))
    assert _text(long) == answer + " " + answer[:11]


def test_a_stop_token_id_ends_the_answer_where_it_occurs(model: torch.nn.Module) -> None:
    [out] = _engine(model).generate([PROMPT], SamplingParams(max_tokens=1000, stop_token_ids=(ord(","),)))
    assert _text(out) == "Hello from worker-7,"


def test_a_sequence_gets_the_same_answer_alone_or_batched_with_others(model: torch.nn.Module) -> None:
    other = list(b"A different and much shorter prompt")
    alone = _engine(model).generate([PROMPT], SamplingParams(max_tokens=1000, temperature=0.8))[0]
    batched = _engine(model).generate([other, PROMPT], SamplingParams(max_tokens=1000))
    assert batched[1] == alone
    assert _text(batched[0]) == demo_answer("worker-7", len(other), 0)


def test_only_the_demo_preset_is_scripted(model: torch.nn.Module) -> None:
    assert isinstance(_engine(model).runner.sampler, DemoSampler)
    tiny = LLMEngine(get_preset("tiny"), EngineConfig(device="cpu", num_kv_blocks=64, cpu_threads=1), model=model)
    assert isinstance(tiny.runner.sampler, Sampler)
