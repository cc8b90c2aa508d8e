"""The gateway's chat prompt against vLLM's own chat code (the pinned wheel, ``tests/fakes/vllm_chat.py``)
and ``transformers``' ``apply_chat_template``: for each request of the corpus, the prompt Mesh routes
on (``PromptProcessor._tokens``, the gateway's path) equals what vLLM renders, byte for byte, and a
request vLLM refuses is refused by Mesh too.

Templates: Qwen3's (``tests/support/qwen3_template.jinja``: reasoning in the tool loop, tool calls,
the ``enable_thinking`` switch), ChatML with tool calls, one that loops over content parts (vLLM's
"openai" format) and one that prints ``reasoning_effort`` / ``enable_thinking``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from mesh.errors import MeshError
from mesh.request.prompt import PromptProcessor, prompt_source
from mesh.request.tokenizer import load_tokenizer
from tests.support.chat_templates import CHATML, PARTS, build_tokenizer
from tests.support.upstream import Upstream

REPO = Path(__file__).resolve().parents[3]
QWEN3 = (REPO / "tests/support/qwen3_template.jinja").read_text()
# prints what vLLM derives from reasoning_effort, and a kwarg a deployment may default
EFFORT = CHATML.replace("{% if add_generation_prompt %}", "{% if add_generation_prompt %}[effort={{ reasoning_effort }}]"
                        "[thinking={{ enable_thinking }}][style={{ style }}]")
TEMPLATES = {"qwen3": QWEN3, "chatml": CHATML, "parts": PARTS, "effort": EFFORT}

BILL = "x-anthropic-billing-header: cc_version=2.1; cch=91c2e;"
CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def _call(arguments: Any) -> dict[str, Any]:
    return {**CALL, "function": {"name": "get_weather", **({} if arguments is ... else {"arguments": arguments})}}


USER = {"role": "user", "content": "weather in Paris?"}
TOOL_LOOP = [
    {"role": "system", "content": "You are helpful."},
    USER,
    {"role": "assistant", "content": "", "reasoning_content": "I should call the tool.", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "sunny"}, {"type": "text", "text": "21C"}]},
    {"role": "assistant", "content": "It is sunny.", "reasoning": "Tool said sunny."},
    {"role": "user", "content": "and tomorrow?"},
]
PARTS_USER = {"role": "user", "content": [{"type": "text", "text": "the quick"}, {"type": "text", "text": "brown fox", "x": 1}]}

# (id, template, request fields besides model, the deployment's default_chat_template_kwargs)
CASES: list[tuple[str, str, dict[str, Any], dict[str, Any]]] = [
    ("plain", "qwen3", {"messages": [{"role": "system", "content": "Be brief."}, USER]}, {}),
    ("multi-part", "qwen3", {"messages": [PARTS_USER]}, {}),
    ("multi-part-openai", "parts", {"messages": [{"role": "system", "content": "sys"}, PARTS_USER]}, {}),
    ("string-part", "chatml", {"messages": [{"role": "user", "content": ["plain string part", {"type": "text", "text": "b"}]}]}, {}),
    ("text-part-kinds", "chatml", {"messages": [{"role": "user", "content": [
        {"type": "input_text", "text": "a"}, {"type": "refusal", "refusal": "b"}, {"type": "text", "text": "c"}]}]}, {}),
    ("tool-loop-reasoning", "qwen3", {"messages": TOOL_LOOP}, {}),
    ("tool-loop-reasoning-chatml", "chatml", {"messages": TOOL_LOOP}, {}),
    *[(f"tool-args-{name}", "qwen3", {"messages": [USER, {"role": "assistant", "content": None, "tool_calls": [_call(args)]},
                                                  {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}, {})
      for name, args in [("invalid-json", "{city: Paris"), ("array", "[1, 2]"), ("number", "42"), ("empty", ""),
                         ("missing", ...), ("null", None), ("object", {"city": "Rome"})]],
    ("tool-calls-empty", "qwen3", {"messages": [USER, {"role": "assistant", "content": "hi", "tool_calls": []}, USER]}, {}),
    ("billing-string", "qwen3", {"messages": [{"role": "system", "content": f"{BILL}\nYou are Claude Code."}, USER]}, {}),
    ("billing-parts", "qwen3", {"messages": [{"role": "system", "content": [
        {"type": "text", "text": f"{BILL}\nFirst."}, {"type": "text", "text": "Second."}]}, USER]}, {}),
    ("billing-only-part", "qwen3", {"messages": [{"role": "system", "content": [
        {"type": "text", "text": BILL}, {"type": "text", "text": "You are Claude Code."}]}, USER]}, {}),
    ("billing-user-kept", "qwen3", {"messages": [{"role": "user", "content": f"{BILL}\nhi"}]}, {}),
    ("no-thinking", "qwen3", {"messages": [USER], "chat_template_kwargs": {"enable_thinking": False}}, {}),
    ("kwargs-under-fields", "qwen3", {"messages": [USER], "chat_template_kwargs": {"add_generation_prompt": False}}, {}),
    ("kwargs-none-ignored", "effort", {"messages": [USER], "chat_template_kwargs": {"style": None}}, {"style": "terse"}),
    ("effort-high", "effort", {"messages": [USER], "reasoning_effort": "high"}, {}),
    ("effort-none", "effort", {"messages": [USER], "reasoning_effort": "none"}, {}),
    ("effort-none-qwen3", "qwen3", {"messages": [USER], "reasoning_effort": "none"}, {}),
    ("effort-kwargs-win", "effort", {"messages": [USER], "reasoning_effort": "none",
                                     "chat_template_kwargs": {"enable_thinking": True}}, {}),
    ("default-kwargs", "qwen3", {"messages": [USER]}, {"enable_thinking": False}),
    ("default-kwargs-overridden", "qwen3", {"messages": [USER], "chat_template_kwargs": {"enable_thinking": True}},
     {"enable_thinking": False}),
    ("default-kwargs-effort", "effort", {"messages": [USER], "reasoning_effort": "low"}, {"enable_thinking": False, "style": "x"}),
    ("request-template", "chatml", {"messages": [USER], "chat_template": "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"}, {}),
    ("request-template-parts", "chatml", {"messages": [PARTS_USER], "chat_template": PARTS}, {}),
    ("request-template-in-kwargs", "chatml", {"messages": [USER], "chat_template_kwargs": {"chat_template": "<<{{ messages[0].content }}>>"}}, {}),
    ("continue-final", "chatml", {"messages": [USER, {"role": "assistant", "content": "It is"}],
                                  "continue_final_message": True, "add_generation_prompt": False}, {}),
    ("kwargs-tokenize", "chatml", {"messages": [USER], "chat_template_kwargs": {"tokenize": True}}, {}),
    ("developer", "qwen3", {"messages": [{"role": "system", "content": "s"}, {"role": "developer", "content": "d"}, USER]}, {}),
]


REFUSED: list[tuple[str, dict[str, Any]]] = [
    ("tool-call-not-function", {"messages": [USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "custom", "function": {"name": "f", "arguments": "{}"}}]}]}),
]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("chat-templates")
    return {name: build_tokenizer(base / name, template) for name, template in TEMPLATES.items()}


@pytest.fixture(scope="module")
def vllm_prompts(vllm_wheel: Upstream, tokenizers: dict[str, Path]) -> dict[str, dict[str, Any]]:
    """Every case rendered by vLLM's code, in one driver process (its imports take seconds)."""
    every = [*CASES, *((case, "chatml", body, {}) for case, body in REFUSED)]
    cases = [{"tokenizer": str(tokenizers[t]), "body": body, "default_kwargs": defaults} for _, t, body, defaults in every]
    done = subprocess.run([sys.executable, "-m", "tests.fakes.vllm_chat", str(vllm_wheel.root)], cwd=REPO,
                          input=json.dumps(cases), capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(REPO), "VLLM_CONFIGURE_LOGGING": "0", "PATH": "/usr/bin:/bin",
                               "HOME": str(Path.home())})
    assert done.returncode == 0, done.stderr[-4000:]
    return dict(zip([c[0] for c in every], json.loads(done.stdout), strict=True))


def _mesh(tok_dir: Path, body: dict[str, Any], defaults: dict[str, Any]) -> tuple[str, list[int]]:
    """The prompt text and token ids the gateway routes ``body`` on."""
    source = prompt_source({"model": "m", **body}, "chat")
    text, tokens = PromptProcessor._tokens(source, load_tokenizer(str(tok_dir)), "auto", defaults)
    return text, tokens.tolist()


@pytest.mark.parametrize(("case", "template", "body", "defaults"), CASES, ids=[c[0] for c in CASES])
def test_prompt_is_vllms(case: str, template: str, body: dict[str, Any], defaults: dict[str, Any],
                         tokenizers: dict[str, Path], vllm_prompts: dict[str, dict[str, Any]]) -> None:
    expected = vllm_prompts[case]
    assert "error" not in expected, f"vLLM refused {case}: {expected['error']}"
    text, tokens = _mesh(tokenizers[template], body, defaults)
    if isinstance(expected["prompt"], list):  # the request asked vLLM for token ids (chat_template_kwargs tokenize)
        assert tokens == expected["prompt"]
    else:
        assert text == expected["prompt"]


@pytest.mark.parametrize(("case", "body"), REFUSED, ids=[c[0] for c in REFUSED])
def test_refused_as_vllm(case: str, body: dict[str, Any], tokenizers: dict[str, Path],
                         vllm_prompts: dict[str, dict[str, Any]]) -> None:
    assert "error" in vllm_prompts[case], f"vLLM rendered {case}"
    with pytest.raises(MeshError) as err:
        _mesh(tokenizers["chatml"], body, {})
    assert err.value.status == 400
