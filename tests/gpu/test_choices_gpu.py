"""OpenAI's ``n`` on the GPU: a ``mesh worker`` process (tiny preset on CUDA: Triton attention,
CUDA graphs, asynchronous decode) serves several choices per prompt, the siblings joining the
running batch at the first child's first token (``workers.server.app.WorkerAPI.children``).

- greedy choices are identical and equal the single-choice answer, streamed and not;
- seeded sampled choices: choice ``i`` equals a single-choice request seeded ``seed + i``;
- several multi-choice requests at once leave the engine idle (no running, waiting or used
  block) and reuse the prompt's blocks (``cached_tokens``).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")

from tests.disagg_cluster import MODEL, Cluster, metrics, prompt_tokens  # noqa: E402
from tests.procs import ProcessGroup  # noqa: E402


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Any:
    group = ProcessGroup(tmp_path_factory.mktemp("choices"))
    try:
        c = Cluster(group)
        c.start("m", "mixed", "--device", "cuda:0", "--gpu-memory-utilization", "0.2", faults=False)
        c.wait()
        yield c.workers["m"].url
    finally:
        group.stop_all()


def _complete(url: str, **body: Any) -> dict[str, Any]:
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "ignore_eos": True, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def _texts(answer: dict[str, Any]) -> list[str]:
    return [c["text"] for c in sorted(answer["choices"], key=lambda c: c["index"])]


def _streamed_texts(url: str, n: int, **body: Any) -> list[str]:
    texts = [""] * n
    with httpx.stream("POST", url + "/v1/completions", timeout=120,
                      json={"model": MODEL, "ignore_eos": True, "stream": True, "n": n, **body}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    texts[choice["index"]] += choice["text"]
    return texts


def test_greedy_choices_equal_the_single_answer_streamed_and_not(url: str) -> None:
    prompt = prompt_tokens(700, seed=3)
    one = _texts(_complete(url, prompt=prompt, max_tokens=24, temperature=0))[0]
    assert _texts(_complete(url, prompt=prompt, max_tokens=24, temperature=0, n=4)) == [one] * 4
    assert _streamed_texts(url, 3, prompt=prompt, max_tokens=24, temperature=0) == [one] * 3


def test_seeded_choice_i_equals_a_single_request_seeded_seed_plus_i(url: str) -> None:
    prompt = prompt_tokens(300, seed=4)
    many = _texts(_complete(url, prompt=prompt, max_tokens=16, temperature=1.0, seed=7, n=3))
    singles = [_texts(_complete(url, prompt=prompt, max_tokens=16, temperature=1.0, seed=7 + i))[0] for i in range(3)]
    assert many == singles and len(set(many)) > 1


def test_concurrent_multi_choice_requests_reuse_the_prompt_and_leave_the_engine_idle(url: str) -> None:
    # 4 prompts x (38 prompt blocks + 5 choices x 2 decode blocks) fit the worker's 256 blocks
    prompts = [prompt_tokens(600, seed=10 + k) for k in range(4)]
    hits_before = metrics(url)["mesh_worker_prefix_cache_hits_total"]
    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(lambda p: _complete(url, prompt=p, max_tokens=20, temperature=0, n=5), prompts))
    for answer in answers:
        texts = _texts(answer)
        assert len(texts) == 5 and len(set(texts)) == 1
        assert answer["usage"]["prompt_tokens"] == 600 and answer["usage"]["completion_tokens"] == 100
    m = metrics(url)
    assert m["mesh_worker_num_requests_running"] == m["mesh_worker_num_requests_waiting"] == 0
    assert m["mesh_worker_kv_blocks_used"] == 0
    # the four siblings of each prompt were admitted on the first child's 37 full prompt blocks
    assert m["mesh_worker_prefix_cache_hits_total"] - hits_before >= len(prompts) * 4 * 37 * 16
