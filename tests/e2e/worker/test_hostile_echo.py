"""Hostile requests against the echo worker (``mesh up --engine echo``), directly and through a
gateway: bad values are 400s in the OpenAI shape, never a plain-text 500 (which the gateway counts
as a worker fault: five of them would open the circuit and take the worker out for everyone)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.procs import ProcessGroup, free_port


@pytest.fixture(scope="module")
def cluster(module_procs: ProcessGroup) -> Iterator[tuple[httpx.Client, httpx.Client]]:
    worker = module_procs.echo_worker("hostile-echo")
    config = module_procs.log_dir / "mesh.yaml"
    config.write_text(yaml.safe_dump({
        "circuit_breaker": {"failure_threshold": 3, "open_s": 600},
        "workers": [{"name": "echo", "url": worker.url}],
    }))
    gw = module_procs.gateway(config, port=free_port(), ready_path="/ready")
    with httpx.Client(base_url=worker.url, timeout=30) as w, httpx.Client(base_url=gw.url, timeout=30) as g:
        yield w, g


def _is_400(resp: httpx.Response) -> None:
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "extra",
    [{"max_tokens": "abc"}, {"max_tokens": [1]}, {"max_tokens": -1}, {"max_completion_tokens": True},
     {"stream": True, "stream_options": "x"}, {"stream": True, "stream_options": [1]},
     {"prompt": [1, "a"]}, {"prompt": [[1], 2]}, {"prompt": [{"a": 1}]}],
)
def test_bad_values_are_400_on_the_worker(cluster: tuple[httpx.Client, httpx.Client], extra: dict[str, Any]) -> None:
    worker, _ = cluster
    _is_400(worker.post("/v1/completions", json={"model": "echo", "prompt": "a b", **extra}))


@pytest.mark.parametrize("raw", [b"x", b"[1]", b'{"fail_rate": "x"}'])
def test_bad_fault_settings_are_400(cluster: tuple[httpx.Client, httpx.Client], raw: bytes) -> None:
    worker, _ = cluster
    _is_400(worker.post("/admin/faults", content=raw))


def test_valid_requests_still_echo(cluster: tuple[httpx.Client, httpx.Client]) -> None:
    worker, _ = cluster
    resp = worker.post("/v1/completions", json={"model": "echo", "prompt": [[104, 105], [1]], "max_tokens": 3})
    assert resp.json()["choices"][0]["text"] == "hi"
    lines = worker.post("/v1/completions", json={"model": "echo", "prompt": "a b c", "max_tokens": 2, "stream": True,
                                                  "stream_options": {"include_usage": True}}).text
    assert '"usage"' in lines and lines.endswith("data: [DONE]\n\n")


def test_a_client_cannot_open_the_circuit_with_bad_requests(cluster: tuple[httpx.Client, httpx.Client]) -> None:
    _, gateway = cluster
    body = {"model": "echo", "prompt": "a b", "stream": True, "stream_options": "x"}
    for _ in range(6):  # twice the breaker's threshold
        _is_400(gateway.post("/v1/completions", json=body))
    resp = gateway.post("/v1/completions", json={"model": "echo", "prompt": "a b"})
    assert resp.status_code == 200, resp.text


def _rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(status.split("VmRSS:")[1].split()[0]) / 1024


def test_distinct_long_cache_salts_are_not_kept(cluster: tuple[httpx.Client, httpx.Client], module_procs: ProcessGroup) -> None:
    _, gateway = cluster
    pid = next(p.pid for p in module_procs.procs if p.name == "gateway")
    for i in range(3):  # warm up: buffers, the executor, allocator arenas
        gateway.post("/v1/completions", json={"model": "echo", "prompt": "x", "cache_salt": f"{i}" + "w" * (1 << 20)})
    before = _rss_mib(pid)
    for i in range(40):  # each salt held ~1 MiB for the gateway's life (10k deep: ~10 GiB)
        resp = gateway.post("/v1/completions", json={"model": "echo", "prompt": "x", "cache_salt": f"{i}" + "s" * (1 << 20)})
        assert resp.status_code == 200
    assert _rss_mib(pid) - before < 20, "the gateway kept the salts"
