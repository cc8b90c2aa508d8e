"""Load accounting of the disaggregated relay in a real gateway over real workers.

Echo workers take the prefill and decode roles (a prefill answer without ``kv_transfer_params``
is the relay's fallback: the decode worker computes the prompt; the leases are the same), a
raw-socket fake decode worker refuses admission (429 ``kv_admission_full``). Every way a
disaggregated request can end must return each prefill and decode target's in-flight count and
tokens to exactly zero: a leak makes the router avoid a healthy worker for good.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import yaml

from tests.fakes import pd_worker
from tests.procs import PYTHON, Proc, ProcessGroup, free_port, stalled_client, wait_http, wait_until
from tests.support.pd_gateway import PD_POLICY

ADMIN = {"authorization": "Bearer adm"}
TIMEOUT_S = 1.0  # the gateway's request timeout
ROLES = {"p0": "prefill", "p1": "prefill", "d0": "decode", "d1": "decode", "dcrash": "decode", "dfull": "decode"}
DECODERS = ("d0", "d1", "dcrash")  # echo workers; dcrash is made to die two tokens into a stream by the storm


@dataclass
class Cluster:
    http: httpx.Client
    gateway: Proc
    workers: dict[str, Proc]

    def targets(self) -> dict[str, dict[str, int]]:
        out = {}
        for w in self.http.get("/workers", headers=ADMIN).json()["workers"]:
            for t in w["targets"]:
                out[t["id"]] = {k: t[k] for k in ("in_flight", "prefill_tokens", "decode_tokens")}
        return out

    def all_zero(self) -> bool:
        return all(v == {"in_flight": 0, "prefill_tokens": 0, "decode_tokens": 0} for v in self.targets().values())

    def served(self, name: str) -> int:
        return int(httpx.post(self.workers[name].url + "/admin/faults", json={}, timeout=10).json()["served"])


@pytest.fixture(scope="module")
def cluster(module_procs: ProcessGroup) -> Iterator[Cluster]:
    workers: dict[str, Proc] = {}
    for name in ("p0", "p1"):  # a prompt with PFAIL is a prefill 500; the prefill takes 0.05 s
        workers[name] = module_procs.echo_worker(name, "--model", "m", "--fail-on", "PFAIL", "--token-delay-s", "0.05")
    for name in DECODERS:  # a prompt with DFAIL is a decode 500
        workers[name] = module_procs.echo_worker(name, "--model", "m", "--fail-on", "DFAIL", "--token-delay-s", "0.01")
    script = module_procs.log_dir / "pd_worker.py"
    script.write_text(pd_worker.SCRIPT)
    port = free_port()
    workers["dfull"] = module_procs.start([PYTHON, str(script), "dfull", "full", str(port)], name="dfull", port=port)
    wait_http(workers["dfull"].url + "/count", proc=workers["dfull"])
    config = {
        "server": {"admin_key": "adm", "request_timeout_s": TIMEOUT_S},
        "health": {"interval_s": 60},
        "policy": PD_POLICY,
        # "gone" is listed but no worker serves it: the prefill worker answers 404
        "workers": [{"name": n, "url": workers[n].url, "models": ["m", "gone"], "role": r} for n, r in ROLES.items()],
    }
    path = module_procs.log_dir / "pd_load.yaml"
    path.write_text(yaml.safe_dump(config))
    gateway = module_procs.gateway(path, port=free_port(), ready_path="/ready")
    with httpx.Client(base_url=gateway.url, timeout=30) as client:
        yield Cluster(client, gateway, workers)


STALL_TIMEOUT_S = 5.0  # long enough that a stalled request's decode answer is written on a loaded box


@pytest.fixture(scope="module")
def stall_cluster(cluster: Cluster, module_procs: ProcessGroup) -> Iterator[Cluster]:
    """A second gateway in front of p0 and d0 alone, with a request timeout past what the relay
    of a multi-MiB request takes on a busy machine (the first gateway's 1 s can pass first)."""
    config = {"server": {"admin_key": "adm", "request_timeout_s": STALL_TIMEOUT_S}, "health": {"interval_s": 60},
              "policy": PD_POLICY,
              "workers": [{"name": n, "url": cluster.workers[n].url, "models": ["m"], "role": ROLES[n]} for n in ("p0", "d0")]}
    path = module_procs.log_dir / "pd_stall.yaml"
    path.write_text(yaml.safe_dump(config))
    gateway = module_procs.gateway(path, port=free_port(), name="gateway-stall", ready_path="/ready")
    with httpx.Client(base_url=gateway.url, timeout=30) as client:
        yield Cluster(client, gateway, cluster.workers)


def test_a_client_that_stops_reading_holds_no_decode_load_past_the_timeout(stall_cluster: Cluster) -> None:
    # The relay wrote the decode worker's answer to a client that did not read it, with the
    # decode lease (in_flight, every context token) held until it did: forever for a client that
    # keeps its socket open. Several sizes, so that some answers lie past what the sockets and
    # the gateway's buffers absorb; one not streamed.
    c = stall_cluster
    before = c.served("d0")
    sockets = []
    try:
        for mib, stream in [(1.5, True), (2, True), (2.5, True), (3, True), (3.5, True), (3.5, False)]:
            words = int(mib * (1 << 20)) // 8000
            body = {"model": "m", "prompt": " ".join(["x" * 7999] * words), "stream": stream, "max_tokens": words}
            sockets.append(stalled_client(c.gateway.port, body))
        # answers written to clients that do not read them (the case that held the lease)
        wait_until(lambda: c.served("d0") - before >= 1, timeout_s=STALL_TIMEOUT_S,
                   what="a stalled request answered by the decode worker")
        # the gateway builds keys for six 1.5-3.5M-token prompts on one loop: on a slow box the
        # timeouts fire seconds late, so allow that; a lease that never ends still fails here
        wait_until(c.all_zero, timeout_s=STALL_TIMEOUT_S + 45, what="leases ended at the timeout")
    finally:
        for s in sockets:
            s.close()
    assert c.served("d0") - before >= 1


async def _one(client: httpx.AsyncClient, rng: random.Random) -> tuple[str, bytes]:
    """One disaggregated request ending one of many ways: its kind and the end of what the client
    got (the load is checked after)."""
    kind = rng.choice(["ok", "ok", "pfail", "p4xx", "dfail", "d4xx", "leave_prefill", "leave_decode", "timeout"])
    words = " ".join(f"w{rng.randrange(50)}" for _ in range(rng.randrange(4, 30)))
    prompt = {"pfail": f"PFAIL {words}", "dfail": f"DFAIL {words}"}.get(kind, words)
    max_tokens = {"d4xx": 0, "timeout": 400, "leave_decode": 400}.get(kind, 8)  # 400 words: 4 s at 0.01 s
    body: dict[str, Any] = {"model": "gone" if kind == "p4xx" else "m", "prompt": prompt, "stream": kind == "leave_decode" or rng.random() < 0.6,
                            "max_tokens": max_tokens}
    if kind == "timeout":
        prompt = " ".join([words] * 40)
        body["prompt"] = prompt
    headers = {"x-session-id": f"s{rng.randrange(6)}"} if rng.random() < 0.3 else {}
    try:
        if kind.startswith("leave"):  # gone during the prefill (0.05 s) or while the decode streams
            async with asyncio.timeout(rng.uniform(0.0, 0.04) if kind == "leave_prefill" else rng.uniform(0.1, 0.5)):
                async with client.stream("POST", "/v1/completions", json=body, headers=headers) as resp:
                    async for _ in resp.aiter_raw():
                        pass
            return kind, b""
        async with client.stream("POST", "/v1/completions", json=body, headers=headers) as resp:
            return kind, (await resp.aread())[-300:]
    except (TimeoutError, httpx.HTTPError):
        return kind, b""


async def _storm(c: Cluster, n: int, seed: int) -> list[tuple[str, bytes]]:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=c.gateway.url, timeout=30) as client:
        tasks = [asyncio.create_task(_one(client, rng)) for _ in range(n)]
        await asyncio.sleep(0.3)
        # a decode worker drained, and another removed, with requests of theirs in flight
        assert (await client.post("/workers/d0/drain", headers=ADMIN)).status_code == 200
        assert (await client.delete("/workers/d1", headers=ADMIN)).status_code == 200
        await asyncio.sleep(0.3)
        await client.post("/workers/d0/drain", params={"undo": "true"}, headers=ADMIN)
        spec = {"name": "d1", "url": c.workers["d1"].url, "models": ["m"], "role": "decode"}
        assert (await client.post("/workers", json=spec, headers=ADMIN)).status_code == 201
        return await asyncio.gather(*tasks)


def _statuses(c: Cluster) -> set[str]:
    out = set()
    for line in c.http.get("/metrics").text.splitlines():
        if line.startswith("mesh_requests_total{") and float(line.rsplit(" ", 1)[1]):
            out.add(line.split('status="')[1].split('"')[0])
    return out


def test_a_disaggregated_storm_leaves_no_load_on_any_prefill_or_decode_worker(cluster: Cluster) -> None:
    httpx.post(cluster.workers["dcrash"].url + "/admin/faults", json={"crash_after_tokens": 2}, timeout=10)
    sockets = [stalled_client(cluster.gateway.port, {"model": "m", "prompt": "x " * 30000, "stream": True,
                                                      "max_tokens": 30000}) for _ in range(2)]
    try:
        ends = asyncio.run(_storm(cluster, 80, seed=3))
        wait_until(cluster.all_zero, timeout_s=TIMEOUT_S * 10, what=f"load back to zero: {cluster.targets()}")
    finally:
        for s in sockets:
            s.close()
    assert set(cluster.targets()) == set(ROLES)
    # the storm met the endings it is built for (whether the refusing and the dying decode worker
    # were picked is timing's; a decode worker dying is tests/e2e/disagg/test_disagg.py's own test)
    statuses = _statuses(cluster)
    # (a request refused for want of a decode worker ends as the queue's 429, a 503 or, queued past
    # its deadline, a 504, as timing has it: tests/unit/gateway/test_disagg_relay.py checks each)
    assert {"200", "400", "404", "500", "499"} <= statuses, statuses
    assert any(b"request timed out" in tail for kind, tail in ends if kind == "timeout")  # a stream cut at the deadline


@pytest.fixture(scope="module")
def short_ttl(cluster: Cluster, module_procs: ProcessGroup) -> Iterator[httpx.Client]:
    """A second gateway in front of p0 and d0 alone, with a 1 s session idle time."""
    config = {"server": {"admin_key": "adm", "request_timeout_s": 30}, "health": {"interval_s": 60},
              "policy": PD_POLICY, "sessions": {"idle_ttl_s": 1.0},
              "workers": [{"name": n, "url": cluster.workers[n].url, "models": ["m"], "role": ROLES[n]} for n in ("p0", "d0")]}
    path = module_procs.log_dir / "pd_short_ttl.yaml"
    path.write_text(yaml.safe_dump(config))
    gateway = module_procs.gateway(path, port=free_port(), name="gateway-short-ttl", ready_path="/ready")
    with httpx.Client(base_url=gateway.url, timeout=30) as client:
        yield client


@pytest.mark.parametrize("stream", [True, False])
def test_a_session_is_not_idle_while_its_disaggregated_request_runs(short_ttl: httpx.Client, stream: bool) -> None:
    # The decode lease is committed without the session (bound at the first bytes instead); its
    # end still restarts the session's idle time: after a turn longer than idle_ttl_s (150 words
    # at 0.01 s against 1 s) the binding is there, and the next turn goes to the same worker.
    session = f"pd-long-{stream}"
    body = {"model": "m", "prompt": " ".join(f"w{i}" for i in range(150)), "max_tokens": 150, "stream": stream}
    with short_ttl.stream("POST", "/v1/completions", json=body, headers={"x-session-id": session}) as resp:
        assert resp.status_code == 200
        worker = resp.headers["x-mesh-worker"]
        data = resp.read()
    assert data.endswith(b"data: [DONE]\n\n") if stream else json.loads(data)["choices"][0]["text"].startswith("w0 w1")
    route = short_ttl.post("/debug/route", json={"model": "m", "prompt": "next turn"}, headers={"x-session-id": session})
    assert route.json()["session"]["bound_target"] == worker == "d0", route.text


def test_a_decode_worker_at_its_in_flight_limit_takes_no_second_request(cluster: Cluster, module_procs: ProcessGroup) -> None:
    # The gateway's admission limit (max_in_flight) holds for the relay too: a decode worker at
    # its limit counts as one that refused admission, so one with max_in_flight 1 never serves
    # two requests at once; the request waits in the decode queue for headroom.
    config = {"server": {"admin_key": "adm", "request_timeout_s": 30}, "health": {"interval_s": 60}, "policy": PD_POLICY,
              "workers": [{"name": "p0", "url": cluster.workers["p0"].url, "models": ["m"], "role": "prefill"},
                          {"name": "d0", "url": cluster.workers["d0"].url, "models": ["m"], "role": "decode",
                           "max_in_flight": 1}]}
    path = module_procs.log_dir / "pd_limited.yaml"
    path.write_text(yaml.safe_dump(config))
    gateway = module_procs.gateway(path, port=free_port(), name="gateway-limited", ready_path="/ready")
    order: list[Any] = []

    async def run() -> None:
        started = asyncio.Event()
        async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
            async def long() -> None:  # 150 words at 0.01 s
                body = {"model": "m", "prompt": " ".join(f"w{i}" for i in range(150)), "max_tokens": 150, "stream": True}
                async with client.stream("POST", "/v1/completions", json=body) as resp:
                    assert resp.status_code == 200 and resp.headers["x-mesh-worker"] == "d0"
                    started.set()
                    await resp.aread()
                order.append("long")

            async def short() -> None:
                await started.wait()
                resp = await client.post("/v1/completions", json={"model": "m", "prompt": "a b", "max_tokens": 2})
                order.append(("short", resp.status_code, resp.headers.get("x-mesh-worker")))

            await asyncio.gather(long(), short())

    asyncio.run(run())
    assert order == ["long", ("short", 200, "d0")]


def test_a_prefill_worker_at_its_in_flight_limit_takes_no_second_request(cluster: Cluster, module_procs: ProcessGroup) -> None:
    # The pair is decided within the gateway's admission limits: a prefill worker with
    # max_in_flight 1 takes no second request while its first prefill runs; a request every
    # prefill worker of which is full waits in the admission queue and is paired once p0 frees.
    config = {"server": {"admin_key": "adm", "request_timeout_s": 30}, "health": {"interval_s": 60}, "policy": PD_POLICY,
              "workers": [{"name": "p0", "url": cluster.workers["p0"].url, "models": ["m"], "role": "prefill",
                           "max_in_flight": 1},
                          {"name": "d0", "url": cluster.workers["d0"].url, "models": ["m"], "role": "decode"}]}
    path = module_procs.log_dir / "pd_prefill_limited.yaml"
    path.write_text(yaml.safe_dump(config))
    gateway = module_procs.gateway(path, port=free_port(), name="gateway-prefill-limited", ready_path="/ready")
    faults = cluster.workers["p0"].url + "/admin/faults"
    served = cluster.served("p0")
    httpx.post(faults, json={"first_token_delay_s": 3.0}, timeout=10)  # p0's prefills take 3 s
    try:
        async def run() -> tuple[httpx.Response, httpx.Response]:
            async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
                first = asyncio.create_task(client.post("/v1/completions", json={"model": "m", "prompt": "a b", "max_tokens": 2}))
                while cluster.served("p0") == served:  # its prefill runs on p0
                    await asyncio.sleep(0.02)
                second = await client.post("/v1/completions", json={"model": "m", "prompt": "c d", "max_tokens": 2})
                return await first, second

        first, second = asyncio.run(run())
    finally:
        httpx.post(faults, json={"first_token_delay_s": 0.0}, timeout=10)
    assert first.status_code == 200 and first.headers["x-mesh-prefill-worker"] == "p0", first.text
    assert second.status_code == 200 and second.headers["x-mesh-prefill-worker"] == "p0", second.text  # paired, later
    assert cluster.served("p0") == served + 2
    held = [line for line in httpx.get(gateway.url + "/metrics", timeout=10).text.splitlines()
            if line.startswith("mesh_admission_held_total ")]
    assert held == ["mesh_admission_held_total 1.0"]  # the second waited at the gateway
