"""Hostile requests against a real bundled worker (``mesh worker --preset tiny``): a bad value is a
400 in the OpenAI shape, and the engine loop survives it (it goes on serving every request)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.procs import PYTHON, ProcessGroup, free_port


@pytest.fixture(scope="module")
def worker(module_procs: ProcessGroup) -> Iterator[httpx.Client]:
    port = free_port()
    cmd = [PYTHON, "-m", "mesh", "worker", "--preset", "tiny", "--host", "127.0.0.1", "--port", str(port),
           "--num-kv-blocks", "64", "--cpu-threads", "1", "--log-level", "warning"]
    module_procs.start_http(cmd, name="hostile-tiny", port=port, timeout_s=90)
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
        yield client


def _assert_400(resp: httpx.Response, param: str) -> None:
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, err


def _assert_alive(client: httpx.Client) -> None:
    assert client.get("/health").status_code == 200
    resp = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2, "temperature": 0.7, "seed": 3})
    assert resp.status_code == 200, resp.text


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (b'"seed": 1180591620717411303424', "seed"),  # 2**70: torch's manual_seed overflowed in the loop
        (b'"seed": -9223372036854775809', "seed"),
        (b'"top_k": 1000000000000000000000', "top_k"),  # torch.tensor of ks overflowed in the loop
        (b'"temperature": NaN', "temperature"),  # Python's JSON takes NaN: sampled garbage
        (b'"temperature": Infinity', "temperature"),
    ],
)
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_sampling_values_the_engine_cannot_take_are_400(worker: httpx.Client, route: str, raw: bytes, param: str) -> None:
    prompt = b'"prompt": "abc"' if route == "/v1/completions" else b'"messages": [{"role": "user", "content": "abc"}]'
    body = b'{' + prompt + b', "max_tokens": 2, "temperature": 0.8, ' + raw + b'}'
    if b"temperature" in raw:
        body = body.replace(b'"temperature": 0.8, ', b"")
    _assert_400(worker.post(route, content=body, headers={"content-type": "application/json"}), param)
    _assert_alive(worker)


def test_extreme_but_valid_seed_and_top_k_still_serve(worker: httpx.Client) -> None:
    for extra in ({"seed": 2**64 - 1}, {"seed": -(2**63)}, {"top_k": 10**6}):
        resp = worker.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2, "temperature": 0.5, **extra})
        assert resp.status_code == 200, (extra, resp.text)


@pytest.mark.parametrize(
    ("path", "raw", "param"),
    [
        ("/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udc00"}], "max_tokens": 2}', "messages"),
        ("/tokenize", b'{"prompt": "\\ud800"}', "prompt"),
        ("/tokenize", b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages"),
    ],
)
def test_lone_surrogates_are_400_not_500(worker: httpx.Client, path: str, raw: bytes, param: str) -> None:
    _assert_400(worker.post(path, content=raw, headers={"content-type": "application/json"}), param)
    _assert_alive(worker)


def test_a_cache_salt_over_1024_characters_is_400(worker: httpx.Client) -> None:
    # the engine keeps a key seed per distinct salt (4096 deep): megabyte salts held gigabytes
    _assert_400(worker.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2, "cache_salt": "s" * 1025}), "cache_salt")
    resp = worker.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2, "cache_salt": "s" * 1024})
    assert resp.status_code == 200, resp.text


@pytest.mark.parametrize("stream", [False, True])
def test_more_than_1024_stop_sequences_is_400(worker: httpx.Client, stream: bool) -> None:
    # capped at 1024: stops are searched at every token, and 10k of them would hold the event loop ~9 s
    body = {"prompt": "abc", "max_tokens": 2, "stream": stream, "stop": [f"s{i}" for i in range(1025)]}
    _assert_400(worker.post("/v1/completions", json=body), "stop")
    body["stop"] = body["stop"][:1024]
    assert worker.post("/v1/completions", json=body).status_code == 200


@pytest.mark.parametrize("tokens", [[-1], [2**70], [104, 512]])
def test_detokenize_out_of_vocabulary_is_400(worker: httpx.Client, tokens: list[int]) -> None:
    _assert_400(worker.post("/detokenize", json={"tokens": tokens}), "tokens")
    assert worker.post("/detokenize", json={"tokens": [104, 105]}).json() == {"prompt": "hi"}


def test_a_vanishing_temperature_is_greedy(worker: httpx.Client) -> None:
    def text(temperature: float) -> str:
        body = {"prompt": "the same prompt", "max_tokens": 8, "ignore_eos": True, "temperature": temperature}
        resp = worker.post("/v1/completions", json=body)
        assert resp.status_code == 200, resp.text
        return str(resp.json()["choices"][0]["text"])

    greedy = text(0.0)
    assert text(1e-300) == greedy and text(1e-6) == greedy  # greedy, not "\x00" * 8 from NaN probabilities
