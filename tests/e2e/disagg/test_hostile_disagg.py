"""Hostile ``kv_transfer_params`` and bodies against real prefill and decode workers (tiny preset,
CPU, KV transfer over TCP): a malformed peer address is a 400 in the OpenAI shape (not a bare
500 from deep in the pull), and a body over the relay's 64 MiB read-ahead still arrives whole."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from tests.procs import PYTHON, ProcessGroup, free_port, wait_http


@pytest.fixture(scope="module")
def pair(module_procs: ProcessGroup) -> Iterator[tuple[httpx.Client, httpx.Client]]:
    procs = []
    for role in ("prefill", "decode"):  # both start at once, then each is waited for
        port = free_port()
        cmd = [PYTHON, "-m", "mesh", "worker", "--preset", "tiny", "--host", "127.0.0.1", "--port", str(port),
               "--num-kv-blocks", "64", "--cpu-threads", "1", "--log-level", "warning", "--role", role]
        procs.append(module_procs.start(cmd, name=f"hostile-{role}", port=port))
    for proc in procs:
        wait_http(f"{proc.url}/health", proc=proc, timeout_s=90)
    urls = [proc.url for proc in procs]
    with httpx.Client(base_url=urls[0], timeout=60) as prefill, httpx.Client(base_url=urls[1], timeout=60) as decode:
        yield prefill, decode


def _prefilled(prefill: httpx.Client) -> tuple[str, dict[str, Any]]:
    prompt = uuid.uuid4().hex * 4  # fresh: the decode worker must pull it
    resp = prefill.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1,
                                                 "kv_transfer_params": {"do_remote_decode": True}})
    assert resp.status_code == 200, resp.text
    return prompt, resp.json()["kv_transfer_params"]


def _set(**values: Any) -> Callable[[dict[str, Any]], None]:
    return lambda params: params.update(values)


@pytest.mark.parametrize(
    "tamper",
    [_set(remote_tcp_port="x"), _set(remote_tcp_port=10**9), _set(remote_port="x"), _set(remote_port=True),
     _set(remote_host=5), _set(remote_host=""), _set(transfer_id=["x"]), _set(transfer_id=None)],
)
def test_malformed_peer_address_is_a_400(pair: tuple[httpx.Client, httpx.Client], tamper: Callable[[dict[str, Any]], None]) -> None:
    prefill, decode = pair
    prompt, params = _prefilled(prefill)
    tamper(params)
    resp = decode.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, "kv_transfer_params": params})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == "kv_params_invalid"
    assert decode.get("/health").status_code == 200


def test_the_untampered_transfer_still_decodes(pair: tuple[httpx.Client, httpx.Client]) -> None:
    prefill, decode = pair
    prompt, params = _prefilled(prefill)
    resp = decode.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, "kv_transfer_params": params})
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_unreachable_peer_is_a_5xx_of_server_type(pair: tuple[httpx.Client, httpx.Client]) -> None:
    prefill, decode = pair
    prompt, params = _prefilled(prefill)
    params["remote_tcp_port"] = free_port()  # nothing listens there
    resp = decode.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, "kv_transfer_params": params})
    assert resp.status_code >= 500
    assert resp.json()["error"]["type"] != "invalid_request_error"  # a 502 is not the client's fault


def test_a_body_over_the_read_ahead_arrives_whole(pair: tuple[httpx.Client, httpx.Client]) -> None:
    _, decode = pair
    body = b'{"prompt": "abc", "max_tokens": 1, "pad": "' + b"a" * (65 << 20) + b'"}'  # 65 MiB > 64 MiB
    resp = decode.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert resp.status_code == 200, resp.text[:300]  # not a 400: the replay never cuts the body at 64 MiB


def test_an_invalid_prefill_request_names_its_field(pair: tuple[httpx.Client, httpx.Client]) -> None:
    """The disaggregated prefill path names a bad field (``param``) as the ordinary routes do, not
    ``param: null`` with only the first message."""
    prefill, _ = pair
    resp = prefill.post("/v1/completions", json={"prompt": "x", "max_tokens": "many",
                                                 "kv_transfer_params": {"do_remote_decode": True}})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "max_tokens", resp.text
