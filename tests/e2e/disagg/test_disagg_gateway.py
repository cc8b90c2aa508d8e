"""``mesh.gateway.disagg_proxy``: the gateway app (``mesh.gateway.app.create_app``, in process; a config with
worker roles builds the disaggregated proxy) serves requests through a (prefill, decode) pair of real worker processes,
answering one ordinary OpenAI response; without prefill/decode profiles it proxies as usual."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mesh.config import parse_config
from mesh.gateway import disagg_proxy
from mesh.gateway.app import create_app
from tests.disagg_cluster import (
    MODEL,
    PD_POLICY,
    Cluster,
    assert_no_leaks,
    completion,
    direct,
    parse_answer,
    prompt_tokens,
    status,
)
from tests.procs import ProcessGroup, free_port, wait_http


@pytest.fixture(scope="module")
def cluster(module_procs: ProcessGroup) -> Cluster:
    c = Cluster(module_procs)
    c.start("p0", "prefill")
    c.start("d0", "decode")
    c.start("m", "mixed")
    c.wait()
    return c


def _config(cluster: Cluster, policy: Any) -> Any:
    workers = [{"name": n, "url": cluster.workers[n].url, "role": cluster.workers[n].role.value} for n in ("p0", "d0")]
    return parse_config({"workers": workers, "policy": policy, "health": {"interval_s": 60}})


@contextlib.asynccontextmanager
async def _gateway(cluster: Cluster, policy: Any) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(_config(cluster, policy))  # workers with roles: the lifespan builds a DisaggProxy
    gateway = app.state.gateway
    async with app.router.lifespan_context(app):
        assert isinstance(gateway.proxy, disagg_proxy.DisaggProxy)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://mesh", timeout=120) as client:
            yield client


async def test_the_gateway_serves_through_a_prefill_decode_pair(cluster: Cluster) -> None:
    m = cluster.workers["m"].url
    before = status(cluster.workers["d0"].url)
    async with _gateway(cluster, PD_POLICY) as client:
        for stream in (False, True):
            body = completion(prompt_tokens(300, seed=50 + stream), 16, stream)
            resp = await client.post("/v1/completions", json=body)
            assert resp.status_code == 200
            assert resp.headers["x-mesh-worker"] == "d0" and resp.headers["x-mesh-prefill-worker"] == "p0"
            assert parse_answer(resp.content, stream, "/v1/completions")[0] == direct(m, body)[0]
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "Why is the sky blue? " * 10}],
                "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stream": True}
        resp = await client.post("/v1/chat/completions", json=chat)
        path = "/v1/chat/completions"
        assert parse_answer(resp.content, True, path)[0] == direct(m, chat, path)[0]
        route = (await client.post("/debug/route", json=completion(prompt_tokens(300, seed=50), 4))).json()
        assert route["decision"]["target"] == "p0" and route["decision"]["decode_target"] == "d0"
    after = status(cluster.workers["d0"].url)
    assert after["decode_requests"] - before["decode_requests"] == 3 and after["decode_blocks_pulled"] > before["decode_blocks_pulled"]
    assert_no_leaks(cluster.alive())


async def test_without_profiles_the_gateway_proxies_as_usual(cluster: Cluster) -> None:
    before = status(cluster.workers["d0"].url)["decode_requests"]
    async with _gateway(cluster, "least_load") as client:
        body = completion(prompt_tokens(100, seed=60), 8)
        resp = await client.post("/v1/completions", json=body)
        assert resp.status_code == 200 and "x-mesh-prefill-worker" not in resp.headers
    assert status(cluster.workers["d0"].url)["decode_requests"] == before
    assert_no_leaks(cluster.alive())


async def test_short_prompts_prefill_on_the_decode_worker_long_ones_take_the_pair(cluster: Cluster) -> None:
    """Conditional disaggregation (``local_prefill_tokens``): a short prompt goes straight to the
    decode worker, which prefills it itself (no relay, no transfer); a long one takes the pair."""
    policy = {**PD_POLICY, "params": {**PD_POLICY["params"], "local_prefill_tokens": 64}}
    m, d0 = cluster.workers["m"].url, cluster.workers["d0"].url
    before = status(d0)["decode_requests"]
    async with _gateway(cluster, policy) as client:
        short = completion(prompt_tokens(40, seed=70), 8)
        resp = await client.post("/v1/completions", json=short)
        assert resp.status_code == 200 and resp.headers["x-mesh-worker"] == "d0"
        assert "x-mesh-prefill-worker" not in resp.headers
        assert parse_answer(resp.content, False, "/v1/completions")[0] == direct(m, short)[0]
        assert status(d0)["decode_requests"] == before  # served as an ordinary request
        long = completion(prompt_tokens(300, seed=71), 8)
        resp = await client.post("/v1/completions", json=long)
        assert resp.status_code == 200 and resp.headers["x-mesh-prefill-worker"] == "p0"
        assert parse_answer(resp.content, False, "/v1/completions")[0] == direct(m, long)[0]
    assert status(d0)["decode_requests"] == before + 1
    assert_no_leaks(cluster.alive())


def test_mesh_up_with_prefill_and_decode_workers_serves_disaggregated(procs: ProcessGroup) -> None:
    """``mesh up --prefill 1 --decode 1``: bundled workers with roles behind the gateway; a
    request is prefilled on one and decoded on the other, the decode side importing the prompt."""
    port = free_port()
    up = procs.start([sys.executable, "-m", "mesh.commands.up", "--prefill", "1", "--decode", "1", "--preset", "tiny",
                      "--port", str(port)],
                     name="up", port=port)
    wait_http(f"http://127.0.0.1:{port}/ready", proc=up, timeout_s=120)
    body = completion(prompt_tokens(200, seed=70), 8)
    resp = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200
    assert resp.headers["x-mesh-prefill-worker"].startswith("prefill-") and resp.headers["x-mesh-worker"].startswith("decode-")
    assert resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 192  # 12 blocks came over


async def test_a_relayed_request_counts_on_the_decode_targets_series(cluster: Cluster) -> None:
    """As the ordinary proxy: TTFT, inter-token gaps, latency and the decode worker's reported
    tokens on the decode target's series; the request id echoed once."""
    labels = frozenset({("model", MODEL), ("target", "d0")})
    async with _gateway(cluster, PD_POLICY) as client:
        usages: list[dict[str, Any]] = []
        for stream in (False, True):
            body = completion(prompt_tokens(200, seed=70 + stream), 12, stream)
            resp = await client.post("/v1/completions", json=body, headers={"x-request-id": f"pd-{stream}"})
            assert resp.status_code == 200, resp.text
            assert resp.headers["x-mesh-worker"] == "d0"
            assert resp.headers.get_list("x-request-id") == [f"pd-{stream}"]
            usage = parse_answer(resp.content, stream, "/v1/completions")[1]
            assert usage is not None
            usages.append(usage)
        text = (await client.get("/metrics")).text
    got = {(s.name, frozenset(s.labels.items())): s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert got[("mesh_time_to_first_token_seconds_count", labels)] == 2
    assert got[("mesh_e2e_request_latency_seconds_count", labels)] == 2
    assert got[("mesh_inter_token_latency_seconds_count", labels)] >= 1  # the stream's 12 tokens came in chunks
    assert got[("mesh_generation_tokens_total", labels)] == sum(u["completion_tokens"] for u in usages) == 24
    assert got[("mesh_prompt_tokens_total", labels)] == sum(u["prompt_tokens"] for u in usages)
    cached = sum((u.get("prompt_tokens_details") or {}).get("cached_tokens", 0) for u in usages)
    assert got[("mesh_cached_prompt_tokens_total", labels)] == cached
