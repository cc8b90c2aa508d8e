"""vLLM's own chat rendering, run on the extracted wheel (``python -m tests.fakes.vllm_chat ROOT``).

Reads a JSON list of cases on stdin and writes, per case, the prompt vLLM's chat completions path
renders, or the error it raises: the request's message normalization
(``ChatCompletionRequest._normalize_messages_before``), ``build_chat_params`` with the server's
``--default-chat-template-kwargs`` merged as ``preprocess_chat`` merges them, the content format
(``resolve_chat_template_content_format``), ``parse_chat_messages`` and ``safe_apply_chat_template``
with ``transformers``' real tokenizer and ``apply_chat_template``. A case is
``{"tokenizer": <dir>, "body": <request body>, "default_kwargs": {...}}``.

Stand-ins (``tests.fakes.upstream_loader``): vLLM's package ``__init__``s, its config, inputs and
multimodal packages (text-only requests never reach them; ``merge_media_io_kwargs`` is given its
result for no media kwargs, the tracker's media budgets an empty class), and dependencies not installed here.
The two methods of ``ChatCompletionRequest`` are compiled from the wheel's source on a plain
object: the pydantic model itself needs ``openai_harmony`` types that are not installed.
"""

from __future__ import annotations

import ast
import copy
import importlib
import json
import sys
import types
from pathlib import Path
from typing import Any

from tests.fakes.upstream_loader import install

HOLLOW = ["vllm", "vllm.renderers", "vllm.entrypoints", "vllm.entrypoints.openai",
          "vllm.entrypoints.openai.chat_completion"]
ABSENT = ["vllm.config", "vllm.inputs", "vllm.multimodal", "openai_harmony", "psutil", "cbor2", "cachetools",
          "pybase64", "urllib3", "requests", "cloudpickle", "cpuinfo"]
# ChatCompletionRequest's defaults for the fields build_chat_params reads
REQUEST_DEFAULTS = {"reasoning_effort": None, "add_generation_prompt": True, "continue_final_message": False,
                    "documents": None, "chat_template": None, "chat_template_kwargs": None,
                    "media_io_kwargs": None, "tool_choice": None, "tools": None, "response_format": None}


def _methods(root: str, names: tuple[str, ...], namespace: dict[str, Any]) -> dict[str, Any]:
    """``ChatCompletionRequest``'s methods ``names``, compiled from the wheel without decorators."""
    path = Path(root, "vllm/entrypoints/openai/chat_completion/protocol.py")
    tree = ast.parse(path.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ChatCompletionRequest")
    found = {}
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and node.name in names:
            node.decorator_list = []
            node.returns = None
            module = ast.Module([node], type_ignores=[])
            exec(compile(module, str(path), "exec"), namespace)
            found[node.name] = namespace[node.name]
    assert set(found) == set(names), f"ChatCompletionRequest lacks {set(names) - set(found)}"
    return found


class _Unspent:
    """A media budget of a request without media: built by the item tracker, never drawn on."""


def _no_media(defaults: Any, overrides: Any) -> None:
    """``merge_media_io_kwargs`` for requests without media kwargs (its result then: None)."""
    if defaults or overrides:
        raise RuntimeError("stand-in merge_media_io_kwargs was given media kwargs")


def main(root: str) -> None:
    install(root, HOLLOW, ABSENT)
    params = importlib.import_module("vllm.renderers.params")
    hf = importlib.import_module("vllm.renderers.hf")
    chat_message = importlib.import_module("vllm.renderers.chat_utils.chat_message")
    params.merge_media_io_kwargs = _no_media  # its module decodes media (aiohttp, torch): absent here
    tracker = importlib.import_module("vllm.renderers.chat_utils.item_tracker")
    tracker.MediaDecodedBudget = tracker.MediaRequestDownloadBudget = _Unspent  # built per request, spent by media only
    from transformers import PreTrainedTokenizerFast

    namespace: dict[str, Any] = {"Any": Any, "map_reasoning_effort": params.map_reasoning_effort,
                                 "merge_kwargs": params.merge_kwargs, "ChatParams": params.ChatParams}
    methods = _methods(root, ("_normalize_messages_before", "build_chat_params"), namespace)
    model_config = types.SimpleNamespace(
        multimodal_config=None, enable_prompt_embeds=False, is_multimodal_model=False, model="m", tokenizer="m",
        revision=None, code_revision=None, tokenizer_revision=None, trust_remote_code=False,
        hf_config=types.SimpleNamespace(model_type="qwen3"), allowed_local_media_path="", allowed_media_domains=None)
    tokenizers: dict[str, Any] = {}
    out = []
    for case in json.load(sys.stdin):
        body = copy.deepcopy(case["body"])
        try:
            tok = tokenizers.get(case["tokenizer"])
            if tok is None:
                tok = tokenizers[case["tokenizer"]] = PreTrainedTokenizerFast.from_pretrained(case["tokenizer"])
            methods["_normalize_messages_before"](None, body)
            request = types.SimpleNamespace(**{**REQUEST_DEFAULTS, **body})
            # preprocess_chat: the server's defaults, under tools (ChatCompletionToolsParam dumps) and tokenize
            defaults = params.merge_kwargs(case.get("default_kwargs"), {"tools": body.get("tools"), "tokenize": False})
            chat_params = methods["build_chat_params"](request, None, "auto", None).with_defaults(defaults)
            content_format = hf.resolve_chat_template_content_format(
                chat_template=chat_params.chat_template, tools=chat_params.chat_template_kwargs.get("tools"),
                given_format=chat_params.chat_template_content_format, tokenizer=tok, model_config=model_config)
            conversation, _, _ = chat_message.parse_chat_messages(body["messages"], model_config, content_format)
            prompt = hf.safe_apply_chat_template(model_config, tok, conversation,
                                                 **chat_params.get_apply_chat_template_kwargs())
            out.append({"prompt": prompt, "content_format": content_format})
        except Exception as exc:
            out.append({"error": f"{type(exc).__name__}: {exc}"})
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main(sys.argv[1])
