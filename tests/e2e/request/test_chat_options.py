"""The request fields that change an engine's prompt, rendered as vLLM renders them: ``tools``,
``documents``, ``chat_template_kwargs`` (Qwen3's ``enable_thinking``), ``add_generation_prompt``,
``continue_final_message``, and ``add_special_tokens`` (a Llama BOS on completions).

A gateway ignoring them would hash an agent's request with tools (the tool block opens the
prompt) or a completion through a BOS-adding tokenizer to keys that match no engine's cache from
block 0. Oracle: ``transformers`` (what vLLM calls), with tools dumped by pydantic
models shaped like vLLM's ``ChatCompletionToolsParam``; and the bundled worker's ``/tokenize``
against the gateway's ``/debug/route`` over real processes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import BaseModel, ConfigDict

from mesh.cluster.registry import WorkerRegistry
from mesh.config import WorkerConfig, parse_config
from mesh.request.chat import ChatOptions, ChatRenderer, ChatTemplateError
from mesh.request.prompt import PromptProcessor
from mesh.request.tokenizer import HFTokenizer
from tests.e2e_bundled import start_workers, write_config
from tests.procs import ProcessGroup, free_port, wait_until
from tests.support.chat_templates import build_tokenizer

# Qwen2.5/Qwen3-shaped: tools as JSON lines in the system turn, documents, a thinking switch.
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n"
    "</tools><|im_end|>\n{%- endif %}"
    "{%- if documents %}<|im_start|>system\n{% for d in documents %}[{{ d.title }}] {{ d.text }}\n{% endfor %}"
    "<|im_end|>\n{%- endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{%- endif %}{%- endif %}"
)
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "now", "strict": True}},  # no description/parameters, an extra
]
MESSAGES = [{"role": "user", "content": "hello world"}, {"role": "assistant", "content": "the quick brown"}]


class _Function(BaseModel):  # vLLM's FunctionDefinition (OpenAIBaseModel: extra="allow")
    model_config = ConfigDict(extra="allow")
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class _Tool(BaseModel):  # vLLM's ChatCompletionToolsParam
    model_config = ConfigDict(extra="allow")
    type: str = "function"
    function: _Function


def _vllm_render(tok_dir: Path, body: dict[str, Any]) -> str:
    """What vLLM hands to the tokenizer for ``body`` (serving_chat + apply_hf_chat_template)."""
    from transformers import AutoTokenizer

    kwargs: dict[str, Any] = {
        "add_generation_prompt": body.get("add_generation_prompt", True),
        "continue_final_message": body.get("continue_final_message", False),
        "tools": None if body.get("tools") is None else [_Tool(**t).model_dump() for t in body["tools"]],
        "documents": body.get("documents"),
    }
    kwargs.update(body.get("chat_template_kwargs") or {})
    return str(AutoTokenizer.from_pretrained(str(tok_dir)).apply_chat_template(body["messages"], tokenize=False, **kwargs))


@pytest.fixture(scope="module")
def tools_tok(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer(tmp_path_factory.mktemp("tools-tok"), TOOLS_TEMPLATE)


@pytest.mark.parametrize("extra", [
    {},
    {"tools": TOOLS},
    {"tools": TOOLS, "documents": [{"title": "a", "text": "the lazy dog"}]},
    {"chat_template_kwargs": {"enable_thinking": False}},
    {"tools": TOOLS, "chat_template_kwargs": {"enable_thinking": False}},
    {"add_generation_prompt": False},
    {"add_generation_prompt": False, "continue_final_message": True},
], ids=["plain", "tools", "tools+documents", "no-thinking", "tools+no-thinking", "no-generation-prompt",
        "continue-final"])
def test_the_rendered_prompt_equals_what_vllm_renders(tools_tok: Path, extra: dict[str, Any]) -> None:
    body = {"model": "m", "messages": MESSAGES, **extra}
    ours = HFTokenizer(tools_tok).render_chat(MESSAGES, ChatOptions.from_body(body))
    assert ours == _vllm_render(tools_tok, body)


def test_tools_are_dumped_with_every_key_vllm_gives_the_template() -> None:
    body = {"messages": MESSAGES, "tools": TOOLS}
    assert ChatOptions.from_body(body).tools == [_Tool(**t).model_dump() for t in TOOLS]
    assert ChatRenderer("{{ tools | tojson }}").render(MESSAGES, ChatOptions.from_body(body)) == json.dumps(
        [_Tool(**t).model_dump() for t in TOOLS])


@pytest.mark.parametrize("body", [
    {"tools": "all of them"}, {"tools": [{"type": "function"}]}, {"tools": [{"function": {"name": 3}}]},
    {"documents": {"a": 1}}, {"chat_template_kwargs": ["x"]}, {"chat_template_kwargs": {"1bad": 1}},
    {"chat_template_kwargs": {"messages": []}}, {"add_generation_prompt": "yes"},
    {"add_generation_prompt": True, "continue_final_message": True},
])
def test_bad_options_are_a_clear_error(body: dict[str, Any]) -> None:
    with pytest.raises(ChatTemplateError):
        ChatOptions.from_body({"messages": MESSAGES, **body})


def test_continue_final_message_needs_the_final_text_in_the_rendering() -> None:
    renderer = ChatRenderer("{% for m in messages %}{{ m.role }}{% endfor %}")  # never renders content
    with pytest.raises(ChatTemplateError):
        renderer.render(MESSAGES, ChatOptions(add_generation_prompt=False, continue_final_message=True))


def test_completions_add_the_tokenizers_special_tokens_as_vllm_does(tmp_path: Path) -> None:
    """A Llama-style tokenizer.json prepends BOS; vLLM's completions encode with special tokens
    (chat does not: the template has them). The gateway encoded every prompt without."""
    from tokenizers import Tokenizer as HFTok
    from tokenizers import processors
    from transformers import AutoTokenizer

    directory = build_tokenizer(tmp_path / "bos")
    raw = HFTok.from_file(str(directory / "tokenizer.json"))
    bos = raw.token_to_id("<|endoftext|>")
    raw.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", bos)])
    raw.save(str(directory / "tokenizer.json"))
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "bos_token": "<|endoftext|>"}))
    text = "hello world the quick brown fox"
    hf = AutoTokenizer.from_pretrained(str(directory))
    reg = WorkerRegistry(parse_config({}))
    reg.add(WorkerConfig(name="w", url="http://h:1", models=["m"], block_size=2, tokenizer=str(directory)))
    processor = PromptProcessor(reg)

    def routed(body: dict[str, Any], kind: str) -> int:
        import asyncio

        return asyncio.run(processor.process(json.dumps(body).encode(), kind, None)).info.prompt_tokens

    assert routed({"model": "m", "prompt": text}, "completion") == len(hf(text).input_ids)
    assert hf(text).input_ids[0] == bos
    assert routed({"model": "m", "prompt": text, "add_special_tokens": False}, "completion") == len(
        hf(text, add_special_tokens=False).input_ids)
    chat = {"model": "m", "messages": [{"role": "user", "content": text}]}
    assert routed(chat, "chat") == len(hf.apply_chat_template(chat["messages"], tokenize=True, add_generation_prompt=True,
                                                              return_dict=False))


def test_gateway_and_bundled_worker_render_every_option_alike(procs: ProcessGroup, tmp_path: Path) -> None:
    """Over real processes: the gateway's routed token count equals the worker's own /tokenize
    for each option (and the options did change the prompt), and the worker serves the body."""
    workers = start_workers(procs, ["w0"])
    config = write_config(tmp_path / "mesh.yaml", list(workers.values()))
    gateway = procs.gateway(config, port=free_port())
    worker = workers["w0"].proc.url
    with httpx.Client(timeout=60) as http:
        wait_until(lambda: http.get(gateway.url + "/health").status_code == 200, what="gateway up")
        counts = set()
        for extra in ({}, {"add_generation_prompt": False}, {"add_generation_prompt": False, "continue_final_message": True},
                      # tool_choice none: the tools reach the template, and the bundled worker, which
                      # calls no tools, answers in text (without it, 'auto': a 400 naming tools)
                      {"tools": TOOLS, "tool_choice": "none", "chat_template_kwargs": {"enable_thinking": False}}):
            body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 2, **extra}
            routed = http.post(gateway.url + "/debug/route", json=body)
            assert routed.status_code == 200, routed.text
            own = http.post(worker + "/tokenize", json=body)
            assert own.status_code == 200, own.text
            assert routed.json()["request"]["prompt_tokens"] == own.json()["count"], extra
            counts.add(own.json()["count"])
            served = http.post(gateway.url + "/v1/chat/completions", json=body)
            assert served.status_code == 200, served.text
        assert len(counts) == 3  # plain, no generation prompt, continued (ChatML ignores tools)
        bad = http.post(gateway.url + "/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "tools": "x"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"


def _vllm_developer_as_system(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """vLLM's renderers/hf.py rule, written out for the oracle: developer -> system (tools
    dropped), then the system messages merged first when one is not first or there are several."""
    converted = [{**{k: v for k, v in m.items() if k != "tools"}, "role": "system"} if m["role"] == "developer" else m
                 for m in conversation]
    systems = [(i, m) for i, m in enumerate(converted) if m["role"] == "system"]
    if not any(i > 0 for i, _ in systems) and len(systems) < 2:
        return converted
    merged = "\n\n".join(m["content"] for _, m in systems if m["content"])
    return [{"role": "system", "content": merged}, *(m for m in converted if m["role"] != "system")]


@pytest.mark.parametrize("template", [TOOLS_TEMPLATE, TOOLS_TEMPLATE + "{# developer is 'developer' here #}"],
                         ids=["no-developer-role", "names-developer"])
def test_developer_messages_render_as_vllm_renders_them(tmp_path: Path, template: str) -> None:
    """A template that never names the developer role gets developer messages as one merged
    system message (OpenAI agent SDKs send 'developer'); one that names it gets them as they are."""
    from transformers import AutoTokenizer

    directory = build_tokenizer(tmp_path / "tok", template)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"},
                {"role": "developer", "content": "the quick brown fox"}]
    conversation = messages if "'developer'" in template else _vllm_developer_as_system(messages)
    expected = AutoTokenizer.from_pretrained(str(directory)).apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=True)
    assert HFTokenizer(directory).render_chat(messages) == expected
    assert ("<|im_start|>developer" in expected) == ("'developer'" in template)
