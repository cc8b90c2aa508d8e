"""``chat_template_content_format`` (vLLM's ``--chat-template-content-format``): forced per worker
pool in the gateway's config and per bundled worker by a flag, over real processes.

A vLLM deployment run with ``--chat-template-content-format string|openai`` renders another
prompt than detection from the template would, so the gateway must force the same format for its
block keys to match that engine's cache: ``auto`` keeps the detection, ``string``/``openai``
force it, in the gateway (``/debug/route``'s prompt_tokens) and in the bundled worker
(``/tokenize``, a served request's usage) alike. The oracle is
transformers' ``apply_chat_template`` given the conversation vLLM builds for that format.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from mesh.config import ConfigError, parse_config
from mesh.request.chat import DEFAULT_CHAT_TEMPLATE
from tests.procs import PYTHON, Proc, ProcessGroup, free_port, wait_http, wait_until
from tests.support.chat_templates import MESSAGES, PARTS, build_tokenizer, hf_render, vllm_conversation

# model -> (tokenizer: PARTS' directory or None for the byte tokenizer, whose template is ChatML; format)
POOLS = {"parts-auto": ("parts", "auto"), "parts-string": ("parts", "string"), "parts-openai": ("parts", "openai"),
         "chatml-auto": (None, "auto"), "chatml-string": (None, "string"), "chatml-openai": (None, "openai")}


@dataclass
class Cluster:
    gateway: Proc
    worker: Proc  # a bundled worker run with --chat-template-content-format openai, model "tiny"
    tok_dir: Path

    def routed_tokens(self, model: str) -> int:
        body = {"model": model, "messages": MESSAGES, "max_tokens": 2}
        resp = httpx.post(self.gateway.url + "/debug/route", json=body, timeout=30)
        assert resp.status_code == 200, resp.text
        return int(resp.json()["request"]["prompt_tokens"])

    def oracle(self, model: str) -> int:
        """Token count of transformers' rendering of vLLM's conversation in the pool's format
        (``auto``: the template's detected one, openai for PARTS and string for ChatML)."""
        tok, fmt = POOLS.get(model, (None, "openai"))
        if fmt == "auto":
            fmt = "openai" if tok else "string"
        template = PARTS if tok else DEFAULT_CHAT_TEMPLATE
        text = hf_render(template, vllm_conversation(MESSAGES, fmt), self.tok_dir, add_generation_prompt=True)
        if tok is None:  # the byte tokenizer: one token per UTF-8 byte
            return len(text.encode())
        from transformers import PreTrainedTokenizerFast

        hf = PreTrainedTokenizerFast(tokenizer_file=str(self.tok_dir / "tokenizer.json"))
        return len(hf.encode(text, add_special_tokens=False))


@pytest.fixture(scope="module")
def cluster(module_procs: ProcessGroup) -> Iterator[Cluster]:
    port = free_port()
    cmd = [PYTHON, "-m", "workers.server.cli", "--preset", "tiny", "--served-model-name", "tiny", "--host", "127.0.0.1",
           "--port", str(port), "--num-kv-blocks", "128", "--cpu-threads", "1", "--max-model-len", "1024",
           "--log-level", "warning", "--chat-template-content-format", "openai"]
    worker = module_procs.start(cmd, name="tiny-openai", port=port)
    tok_dir = build_tokenizer(module_procs.log_dir / "parts", PARTS)
    echo = module_procs.echo_worker("echo", *[a for m in POOLS for a in ("--model", m)])
    wait_http(worker.url + "/health", proc=worker, timeout_s=120)
    workers = [{"name": model, "url": echo.url, "models": [model], "tokenizer": str(tok_dir) if tok else None,
                "chat_template_content_format": fmt} for model, (tok, fmt) in POOLS.items()]
    workers.append({"name": "tiny", "url": worker.url, "models": ["tiny"], "chat_template_content_format": "openai"})
    path = module_procs.log_dir / "mesh.yaml"
    path.write_text(yaml.safe_dump({"workers": workers, "health": {"interval_s": 0.3, "timeout_s": 2},
                                    "server": {"admin_key": "adm"}}))
    gateway = module_procs.gateway(path, port=free_port(), ready_path="/ready")
    wait_until(lambda: all(w["healthy"] for w in httpx.get(gateway.url + "/workers", headers={
        "authorization": "Bearer adm"}, timeout=10).json()["workers"]), what="every worker healthy")
    yield Cluster(gateway, worker, tok_dir)


def test_the_gateway_renders_each_pool_in_its_configured_format(cluster: Cluster) -> None:
    counts = {model: cluster.routed_tokens(model) for model in POOLS}
    for model, count in counts.items():
        assert count == cluster.oracle(model), model
    # forcing the other format than the detected one changes the prompt; forcing the detected one does not
    assert counts["parts-string"] != counts["parts-auto"] == counts["parts-openai"]
    assert counts["chatml-openai"] != counts["chatml-auto"] == counts["chatml-string"]


def test_a_bundled_worker_with_the_flag_renders_as_the_gateway_pool_that_names_it(cluster: Cluster) -> None:
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 2, "temperature": 0}
    with httpx.Client(timeout=60) as http:
        own = http.post(cluster.worker.url + "/tokenize", json={"messages": MESSAGES})
        assert own.status_code == 200, own.text
        expected = cluster.oracle("tiny")
        assert own.json()["count"] == cluster.routed_tokens("tiny") == expected
        assert expected != cluster.oracle("chatml-auto")  # what the worker rendered without the flag
        served = http.post(cluster.gateway.url + "/v1/chat/completions", json=body)
        assert served.status_code == 200, served.text
        assert served.json()["usage"]["prompt_tokens"] == expected
        assert http.get(cluster.worker.url + "/health").json()["chat_template_content_format"] == "openai"


def test_a_bad_value_is_a_config_error_that_names_the_field() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config({"workers": [{"name": "w", "url": "http://127.0.0.1:9", "chat_template_content_format": "strings"}]})
    [line] = caught.value.errors
    assert line.startswith("workers[0].chat_template_content_format:") and "'auto', 'string' or 'openai'" in line, line


def test_a_bad_worker_flag_is_refused_before_loading_anything() -> None:
    from mesh.request.chat import CONTENT_FORMATS
    from workers.server.cli import CONTENT_FORMATS as FLAG_CHOICES

    assert FLAG_CHOICES == CONTENT_FORMATS  # the CLI keeps its own copy (no jinja2 import at --help)
    done = subprocess.run([PYTHON, "-m", "workers.server.cli", "--chat-template-content-format", "jinja"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "--chat-template-content-format" in done.stderr and "invalid choice: 'jinja'" in done.stderr, done.stderr
