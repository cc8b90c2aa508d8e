"""The chat template's content format, decided and rendered as vLLM does (``--chat-template-content-format
auto``): a template that loops over a message's content ("openai") gets the text parts as a list of
``{"type": "text", "text": ...}``; any other ("string") gets them joined with "\\n".

A template looping over ``message['content']`` (Llama 3.x vision, Mistral, Gemma, Qwen3.5
shapes) given strings would iterate characters and render no text at all: the gateway's prompt,
hence every block key, would not be the engine's. Oracle: ``transformers``'
``apply_chat_template`` (what vLLM calls) given the conversation in the form vLLM's
``_parse_chat_message_content`` builds (rebuilt from vLLM's code, not through mesh, in
``tests/support/chat_templates.py``), and a
bundled worker serving a real checkpoint with a content-looping template, over real processes.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import yaml

from mesh.request.chat import ChatOptions, ChatRenderer, detect_content_format
from tests.procs import PYTHON, ProcessGroup, free_port, wait_http
from tests.support.chat_templates import CHATML, GENERATION_TAIL, MESSAGES, PARTS, build_tokenizer, hf_render, vllm_conversation

# Llama-3.2-vision-like: a string test, then a filtered loop over an alias of messages: "openai"
# (so the string branch never runs: vLLM wraps a string content into one part)
MIXED = ("{% set loop_messages = messages[0:] %}{% for message in loop_messages %}<|im_start|>{{ message['role'] }}\n"
         "{% if message['content'] is string %}S:{{ message['content'] }}{% else %}"
         "{% for c in message['content'] | selectattr('type', 'equalto', 'text') %}{{ c['text'] }}{% if not loop.last %}"
         " | {% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}" + GENERATION_TAIL)
# Qwen3.5-like: content handed to a macro that loops over a variable named content: "openai" (vLLM #42660)
MACRO = ("{% macro text(content) %}{% if content is string %}{{ content }}{% else %}{% for item in content %}"
         "{{ item.text }};{% endfor %}{% endif %}{% endmacro %}"
         "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ text(m.content) }}<|im_end|>\n{% endfor %}" + GENERATION_TAIL)
# the same loop through an alias not named content: vLLM's name-based scan misses it, "string"
# (the template then takes its string branch, on the "\n"-joined text)
ALIASED = ("{% for m in messages %}{% set c = m.content %}<|im_start|>{{ m.role }}\n{% if c is string %}{{ c }}"
           "{% else %}{% for p in c %}{{ p.text }};{% endfor %}{% endif %}<|im_end|>\n{% endfor %}" + GENERATION_TAIL)
TEMPLATES = {"parts": (PARTS, "openai"), "mixed": (MIXED, "openai"), "macro": (MACRO, "openai"),
             "chatml": (CHATML, "string"), "aliased": (ALIASED, "string")}


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer(tmp_path_factory.mktemp("cf-tok"))


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_each_template_renders_what_transformers_renders_from_vllms_conversation(tok_dir: Path, name: str) -> None:
    template, expected_format = TEMPLATES[name]
    assert detect_content_format(template) == expected_format
    renderer = ChatRenderer(template)
    assert renderer.content_format == expected_format
    ours = renderer.render(MESSAGES)
    assert ours == hf_render(template, vllm_conversation(MESSAGES, expected_format), tok_dir, add_generation_prompt=True)
    # the format matters for every one of these templates: the other one renders another prompt
    other = "string" if expected_format == "openai" else "openai"
    assert ours != ChatRenderer(template, content_format=other).render(MESSAGES)
    assert "brown fox" in ours


@pytest.mark.parametrize("name", ["parts", "mixed", "macro"])
def test_continue_final_message_in_openai_format_cuts_where_transformers_cuts(tok_dir: Path, name: str) -> None:
    template, _ = TEMPLATES[name]
    messages = [*MESSAGES[:2], {"role": "assistant", "content": [{"type": "text", "text": "a"},
                                                                 {"type": "text", "text": "the lazy dog"}]}]
    ours = ChatRenderer(template).render(messages, ChatOptions(add_generation_prompt=False, continue_final_message=True))
    expected = hf_render(template, vllm_conversation(messages, "openai"), tok_dir, continue_final_message=True)
    assert ours == expected and ours.endswith("the lazy dog")


@pytest.mark.parametrize(("template", "expected"), [
    ("{% for m in messages[1:] %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endfor %}", "openai"),
    ("{% for m in messages | reverse %}{% for p in m.content if p.type == 'text' %}{% endfor %}{% endfor %}", "openai"),
    ("{% set ms = messages %}{% set ms2 = ms %}{% for m in ms2 %}{% for p in m['content'][:1] %}{% endfor %}{% endfor %}", "openai"),
    ("{% for m in messages %}{{ m.content }}{% endfor %}{% for p in content %}{% endfor %}", "openai"),
    ("{% for m in messages %}{{ m.content | length }}{% endfor %}", "string"),
    ("{% for p in other.content %}{% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}", "string"),
    ("{% for m in messages %}{% for k, v in m.content %}{% endfor %}{% endfor %}", "string"),  # vLLM's scan gives up
    ("{% set a, b = messages %}{% for p in content %}{% endfor %}", "string"),  # likewise, before any loop
    ("{% for m in messages %}{% for p in m.content %}", "string"),  # does not parse: vLLM's default
])
def test_detection_follows_vllms_scan(template: str, expected: str) -> None:
    assert detect_content_format(template) == expected


def test_a_forced_format_is_used_and_a_bad_one_refused() -> None:
    assert ChatRenderer(CHATML, content_format="openai").content_format == "openai"
    assert ChatRenderer(PARTS, content_format="string").render(MESSAGES[:1]).startswith("<|im_start|>system\n[]")
    with pytest.raises(ValueError):
        ChatRenderer(CHATML, content_format="auto-ish")


def _tiny_checkpoint(directory: Path, template: str) -> Path:
    """A random-weight Qwen2 checkpoint over ``build_tokenizer``'s 420-token vocabulary."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    build_tokenizer(directory, template)
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=420, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=True, eos_token_id=2)
    Qwen2ForCausalLM(config).save_pretrained(directory, safe_serialization=True)
    return directory


def test_gateway_and_a_worker_count_a_content_looping_templates_prompt_alike(procs: ProcessGroup, tmp_path: Path) -> None:
    """A bundled worker serving a checkpoint whose template loops over content, and a gateway with
    the same tokenizer directory: /debug/route's prompt_tokens equal the worker's /tokenize count
    and transformers' count of vLLM's conversation; the request is served through the gateway."""
    from transformers import AutoTokenizer

    model = _tiny_checkpoint(tmp_path / "model", PARTS)
    port = free_port()
    cmd = [PYTHON, "-m", "workers.server.cli", "--model", str(model), "--served-model-name", "m", "--host", "127.0.0.1",
           "--port", str(port), "--device", "cpu", "--dtype", "float32", "--block-size", "16", "--num-kv-blocks", "256",
           "--cpu-threads", "1", "--max-model-len", "2048", "--log-level", "warning"]
    worker = procs.start(cmd, name="cf-worker", port=port)
    wait_http(worker.url + "/health", proc=worker, timeout_s=180)
    config = tmp_path / "mesh.yaml"
    config.write_text(yaml.safe_dump({"workers": [{"name": "w", "url": worker.url, "models": ["m"], "block_size": 16,
                                                   "tokenizer": str(model)}],
                                      "health": {"interval_s": 0.3, "timeout_s": 1}}))
    gateway = procs.gateway(config, port=free_port())
    hf = AutoTokenizer.from_pretrained(str(model))
    expected = len(hf.encode(hf_render(PARTS, vllm_conversation(MESSAGES, "openai"), model, add_generation_prompt=True),
                             add_special_tokens=False))
    as_strings = len(hf.encode(hf_render(PARTS, vllm_conversation(MESSAGES, "string"), model, add_generation_prompt=True),
                               add_special_tokens=False))
    assert expected != as_strings  # rendering strings counts another prompt
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 2, "temperature": 0}
    with httpx.Client(timeout=60) as http:
        routed = http.post(gateway.url + "/debug/route", json=body)
        assert routed.status_code == 200, routed.text
        own = http.post(worker.url + "/tokenize", json={"messages": MESSAGES})
        assert own.status_code == 200, own.text
        assert routed.json()["request"]["prompt_tokens"] == own.json()["count"] == expected
        served = http.post(gateway.url + "/v1/chat/completions", json=body)
        assert served.status_code == 200, served.text
        assert served.json()["usage"]["prompt_tokens"] == expected
