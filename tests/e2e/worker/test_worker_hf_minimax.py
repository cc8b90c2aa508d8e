"""``mesh worker --model DIR`` on a tiny MiniMax-Text-01 checkpoint (transformers'
``MiniMaxForCausalLM``, saved with a BPE tokenizer.json) as a real process: /health says it is
hybrid, and a greedy completion over HTTP is the text of transformers' greedy tokens."""

from __future__ import annotations

from pathlib import Path

import httpx

from mesh.request.tokenizer import load_tokenizer
from tests.procs import PYTHON, ProcessGroup, free_port, wait_http
from tests.support.minimax import build_minimax, hf_greedy


def test_a_worker_serves_a_minimax_checkpoint_as_transformers_generates(procs: ProcessGroup, tmp_path: Path) -> None:
    ckpt = tmp_path / "minimax-tiny"
    hf = build_minimax(ckpt)
    port = free_port()
    proc = procs.start([PYTHON, "-m", "workers.server.cli", "--model", str(ckpt), "--device", "cpu", "--served-model-name", "minimax-tiny",
                        "--host", "127.0.0.1", "--port", str(port), "--block-size", "16", "--num-kv-blocks", "128",
                        "--cpu-threads", "1", "--log-level", "warning"], name="worker", port=port)
    wait_http(proc.url + "/health", proc=proc, timeout_s=120)
    health = httpx.get(proc.url + "/health").json()
    assert health["hybrid"] is True and health["tokenizer"] == str(ckpt)

    text = "the quick brown fox jumps over the lazy dog"
    tok = load_tokenizer(str(ckpt))  # the worker's tokenizer, and its streaming decode of the reply
    ids = tok.encode(text)
    expected = hf_greedy(hf, ids, 16)
    decoder = tok.stream_decoder()
    body = {"model": "minimax-tiny", "prompt": text, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    resp = httpx.post(proc.url + "/v1/completions", json=body, timeout=60).json()
    assert (resp["usage"]["prompt_tokens"], resp["usage"]["completion_tokens"]) == (len(ids), 16)
    assert resp["choices"][0]["text"] == "".join(decoder.push(t) for t in expected)
