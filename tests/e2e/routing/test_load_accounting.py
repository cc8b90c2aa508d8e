"""Load accounting and session bindings of a real gateway over real workers.

Load: every way a request can end (success, a worker's 4xx/5xx, retry then success, a stream
broken mid-way, a connect error, a client leaving before or while streaming, the request timeout,
a slow reader, a 429 from admission, a worker removed, re-added or drained with requests in
flight) must return each target's in-flight count and prefill/decode tokens to exactly zero: a
leak makes the router avoid a healthy worker for good.

Sessions: where a session's turns actually went (``x-mesh-worker``) agrees with the binding
``/debug/route`` reports.
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

from tests.fakes import pd_worker, streaming_worker
from tests.procs import PYTHON, Proc, ProcessGroup, free_port, stalled_client, wait_http, wait_until
from tests.support.pd_gateway import PD_POLICY

ADMIN = {"authorization": "Bearer adm"}
TIMEOUT_S = 1.5  # the gateway's request timeout
# every worker serves "m"; a kind of request that must meet one worker asks for its own model
MODELS = {"fake": ["m", "f"], "ok": ["m", "m-boom"], "flaky": ["m", "m-boom"], "slow": ["m", "m-slow"],
          "doomed": ["m"], "crashy": ["m", "m-crash"]}


@dataclass
class Cluster:
    http: httpx.Client
    gateway: Proc
    procs: ProcessGroup
    workers: dict[str, Proc]
    config: Any

    def targets(self) -> dict[str, dict[str, Any]]:
        out = {}
        for w in self.http.get("/workers", headers=ADMIN).json()["workers"]:
            for t in w["targets"]:
                out[t["id"]] = {k: t[k] for k in ("in_flight", "prefill_tokens", "decode_tokens")}
        return out

    def metric_values(self, name: str) -> dict[str, float]:
        out = {}
        for line in self.http.get("/metrics").text.splitlines():
            if line.startswith(name + "{"):
                out[line.split("{", 1)[1].split("}", 1)[0]] = float(line.rsplit(" ", 1)[1])
        return out


def _echo(procs: ProcessGroup, name: str, *extra: str) -> Proc:
    port = free_port()
    return procs.start([PYTHON, "-m", "mesh.echo_worker", "--port", str(port), "--name", name, "--model", "m", *extra],
                       name=name, port=port)


@pytest.fixture(scope="module")
def cluster(module_procs: ProcessGroup) -> Iterator[Cluster]:
    script = module_procs.log_dir / "fake_worker.py"
    script.write_text(streaming_worker.SCRIPT)
    fport = free_port()
    workers = {
        "fake": module_procs.start([PYTHON, str(script), str(fport)], name="fake", port=fport),
        "ok": _echo(module_procs, "ok", "--token-delay-s", "0.01", "--model", "m-boom"),
        "flaky": _echo(module_procs, "flaky", "--fail-on", "BOOM", "--token-delay-s", "0.02", "--model", "m-boom"),
        "slow": _echo(module_procs, "slow", "--token-delay-s", "0.3", "--model", "m-slow"),
        "doomed": _echo(module_procs, "doomed", "--token-delay-s", "0.05"),
        # dies two tokens into its first stream: a broken stream, then connect errors
        "crashy": _echo(module_procs, "crashy", "--crash-after-tokens", "2", "--token-delay-s", "0.05", "--model", "m-crash"),
    }
    for proc in workers.values():
        wait_http(proc.url + ("/count" if proc.name == "fake" else "/health"), proc=proc, timeout_s=60)
    config = {
        "server": {"admin_key": "adm", "request_timeout_s": TIMEOUT_S},
        "health": {"interval_s": 0.5, "timeout_s": 1},
        "circuit_breaker": {"failure_threshold": 100_000, "open_s": 1},
        "retries": {"max_attempts": 3, "backoff_base_s": 0.01, "backoff_max_s": 0.02},
        "policy": "session_sticky",
        "sessions": {"idle_ttl_s": 600},
        "workers": [{"name": n, "url": p.url, "models": MODELS[n], "max_in_flight": 6} for n, p in workers.items()],
    }
    path = module_procs.log_dir / "mesh.yaml"
    path.write_text(yaml.safe_dump(config))
    gateway = module_procs.gateway(path, port=free_port(), ready_path="/ready")
    with httpx.Client(base_url=gateway.url, timeout=30) as client:
        c = Cluster(client, gateway, module_procs, workers, config)
        wait_until(lambda: all(w["healthy"] for w in client.get("/workers", headers=ADMIN).json()["workers"]),
                   what="every worker healthy")
        yield c


def _all_zero(c: Cluster) -> bool:
    return all(v == {"in_flight": 0, "prefill_tokens": 0, "decode_tokens": 0} for v in c.targets().values())


async def _one(client: httpx.AsyncClient, rng: random.Random, i: int) -> None:
    """One request ending one of many ways; its outcome is not checked, only the load after."""
    kind = rng.choice(["ok", "ok", "boom", "partial", "err500", "leave", "leave_stream", "slow", "session", "crash"])
    stream = kind == "crash" or (kind != "slow" and rng.random() < 0.6)
    model = {"boom": "m-boom", "partial": "f", "err500": "f", "slow": "m-slow", "crash": "m-crash"}.get(kind, "m")
    words = " ".join(f"w{rng.randrange(50)}" for _ in range(rng.randrange(4, 40)))
    prompt = {"boom": f"BOOM {words}", "partial": "partial x", "err500": "err500 x", "slow": words}.get(kind, words)
    body: dict[str, Any] = {"model": model, "prompt": prompt, "stream": stream, "max_tokens": 16}
    headers = {"x-session-id": f"s{rng.randrange(8)}"} if kind == "session" or rng.random() < 0.3 else {}
    try:
        if kind.startswith("leave"):  # the client goes away before or while the answer streams
            body["stream"] = kind == "leave_stream"
            async with asyncio.timeout(rng.uniform(0.0, 0.3)):
                async with client.stream("POST", "/v1/completions", json=body, headers=headers) as resp:
                    async for _ in resp.aiter_raw():
                        await asyncio.sleep(0.05)
            return
        async with client.stream("POST", "/v1/completions", json=body, headers=headers) as resp:
            async for _ in resp.aiter_raw():
                pass
    except (TimeoutError, httpx.HTTPError):
        pass


async def _storm(c: Cluster, n: int, seed: int, admin: bool) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=c.gateway.url, timeout=30) as client:
        tasks = [asyncio.create_task(_one(client, rng, i)) for i in range(n)]
        if admin:
            await asyncio.sleep(0.2)
            # drained, removed and re-added with requests of theirs in flight
            await client.post("/workers/ok/drain", headers=ADMIN)
            removed = (await client.delete("/workers/doomed", headers=ADMIN)).status_code
            assert removed == 200
            await asyncio.sleep(0.2)
            await client.post("/workers/ok/drain", params={"undo": "true"}, headers=ADMIN)
            spec = {"name": "doomed", "url": c.workers["doomed"].url, "models": ["m"], "max_in_flight": 6}
            assert (await client.post("/workers", json=spec, headers=ADMIN)).status_code == 201
        await asyncio.gather(*tasks)


def test_a_mixed_storm_leaves_no_load_anywhere(cluster: Cluster) -> None:
    sockets = [stalled_client(cluster.gateway.port, {"model": "m", "prompt": " ".join(["word"] * 3000), "stream": True, "max_tokens": 3000}) for _ in range(2)]
    try:
        asyncio.run(_storm(cluster, 120, seed=1, admin=True))
        wait_until(lambda: _all_zero(cluster), timeout_s=TIMEOUT_S * 10, what=f"load back to zero: {cluster.targets()}")
    finally:
        for s in sockets:
            s.close()
    assert set(cluster.targets()) == {"fake", "ok", "flaky", "slow", "doomed", "crashy"}
    for name in ("mesh_worker_in_flight", "mesh_worker_prefill_tokens", "mesh_worker_decode_tokens"):
        assert set(cluster.metric_values(name).values()) == {0.0}, name
    # the storm met the endings it is built for (each kind asks for a model only its worker serves)
    statuses = {k.split('status="')[1].rstrip('"') for k, v in cluster.metric_values("mesh_requests_total").items() if v}
    assert {"200", "504"} <= statuses, statuses  # 504: the slow worker's request timeout
    errors = cluster.metric_values("mesh_upstream_errors_total")
    assert errors.get('kind="timeout",worker="slow"') and errors.get('kind="status_500",worker="fake"'), errors
    assert not cluster.workers["crashy"].alive()  # it broke a stream by dying


@pytest.fixture(scope="module")
def short_ttl(cluster: Cluster) -> Iterator[httpx.Client]:
    """A second gateway in front of the slow worker alone, with a 1 s idle time."""
    config = {**cluster.config, "sessions": {"idle_ttl_s": 1.0}, "server": {"admin_key": "adm", "request_timeout_s": 30},
              "workers": [{"name": "slow", "url": cluster.workers["slow"].url, "models": ["m"]}]}
    path = cluster.procs.log_dir / "short_ttl.yaml"
    path.write_text(yaml.safe_dump(config))
    gateway = cluster.procs.gateway(path, port=free_port(), name="gateway-short-ttl", ready_path="/ready")
    with httpx.Client(base_url=gateway.url, timeout=30) as client:
        yield client


def _bound(client: httpx.Client, session: str) -> str | None:
    route = client.post("/debug/route", json={"model": "m", "prompt": "next turn"}, headers={"x-session-id": session})
    assert route.status_code == 200, route.text
    return route.json()["session"]["bound_target"]


@pytest.mark.parametrize("stream", [True, False])
def test_a_session_is_not_idle_while_its_request_runs(short_ttl: httpx.Client, stream: bool) -> None:
    # The idle time runs from the end of a turn, not its start: after a turn longer than
    # idle_ttl_s (here 8 tokens at 0.3 s against 1 s) the binding is there for the next turn.
    session = f"long-{stream}"
    body = {"model": "m", "prompt": "a b c d e f g h", "max_tokens": 8, "stream": stream}
    with short_ttl.stream("POST", "/v1/completions", json=body, headers={"x-session-id": session}) as resp:
        assert resp.status_code == 200
        worker = resp.headers["x-mesh-worker"]
        data = resp.read()
    assert data.endswith(b"data: [DONE]\n\n") if stream else json.loads(data)["choices"][0]["text"] == "a b c d e f g h"
    assert _bound(short_ttl, session) == worker == "slow"


def test_a_decode_worker_removed_during_the_prefill_hands_the_decode_to_another(procs: ProcessGroup) -> None:
    # The pair is chosen before the prefill; the decode worker is removed while the prefill runs:
    # the decode goes to another decode worker, not a KeyError at commit and a 500 to the client.
    script = procs.log_dir / "pd_worker.py"
    script.write_text(pd_worker.SCRIPT)
    fakes = {}
    for name, role in (("p0", "prefill"), ("d0", "decode"), ("d1", "decode")):
        port = free_port()
        fakes[name] = procs.start([PYTHON, str(script), name, role, str(port)], name=name, port=port)
        wait_http(fakes[name].url + "/count", proc=fakes[name])
    config = {"server": {"admin_key": "adm"}, "policy": PD_POLICY, "health": {"interval_s": 60},
              "workers": [{"name": n, "url": fakes[n].url, "models": ["m"], "role": r} for n, r in (("p0", "prefill"), ("d0", "decode"))]}
    path = procs.log_dir / "pd.yaml"
    path.write_text(yaml.safe_dump(config))
    gateway = procs.gateway(path, port=free_port(), ready_path="/ready")

    async def run() -> httpx.Response:
        async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
            call = asyncio.create_task(client.post("/v1/completions", json={"model": "m", "prompt": "hello " * 40}))
            while (await client.get(fakes["p0"].url + "/count")).json()["posts"] == 0:
                await asyncio.sleep(0.02)
            assert (await client.delete("/workers/d0", headers=ADMIN)).status_code == 200
            spec = {"name": "d1", "url": fakes["d1"].url, "models": ["m"], "role": "decode"}
            assert (await client.post("/workers", json=spec, headers=ADMIN)).status_code == 201
            await client.get(fakes["p0"].url + "/release")
            return await call

    resp = asyncio.run(run())
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-mesh-worker"] == "d1" and resp.json()["choices"][0]["text"] == "from d1"
    with httpx.Client(base_url=gateway.url, timeout=30) as client:
        targets = [t for w in client.get("/workers", headers=ADMIN).json()["workers"] for t in w["targets"]]
    assert [(t["id"], t["in_flight"], t["prefill_tokens"], t["decode_tokens"]) for t in targets] == [
        ("p0", 0, 0, 0), ("d1", 0, 0, 0)]


async def _session_turns(client: httpx.AsyncClient, session: str, rng: random.Random, seen: dict[str, str]) -> None:
    for turn in range(6):
        prompt = rng.choice(["BOOM", "partial", "plain", "plain"]) + f" {session} turn {turn}"
        body = {"model": "m", "prompt": prompt, "stream": rng.random() < 0.5, "max_tokens": 4}
        async with client.stream("POST", "/v1/completions", json=body, headers={"x-session-id": session}) as resp:
            await resp.aread()
            if "x-mesh-worker" in resp.headers:
                seen[session] = resp.headers["x-mesh-worker"]


def test_debug_route_binding_agrees_with_where_each_sessions_last_turn_went(cluster: Cluster) -> None:
    # Retries (a 500 from 'flaky'), broken streams ('fake') and a drain in the middle: the binding
    # /debug/route reports is the worker that answered the session's last turn (x-mesh-worker).
    seen: dict[str, str] = {}
    rng = random.Random(7)

    async def run() -> None:
        async with httpx.AsyncClient(base_url=cluster.gateway.url, timeout=30) as client:
            first = [asyncio.create_task(_session_turns(client, f"agree-{i}", rng, seen)) for i in range(6)]
            await asyncio.sleep(0.1)
            await client.post("/workers/flaky/drain", headers=ADMIN)
            await asyncio.gather(*first)
            await client.post("/workers/flaky/drain", params={"undo": "true"}, headers=ADMIN)

    asyncio.run(run())
    assert len(seen) == 6
    for session, worker in seen.items():
        route = cluster.http.post("/debug/route", json={"model": "m", "prompt": "x"}, headers={"x-session-id": session})
        assert route.json()["session"]["bound_target"] == worker, session
    wait_until(lambda: _all_zero(cluster), what="load back to zero")


def test_a_client_that_stops_reading_a_finished_answer_holds_no_load_past_the_timeout(procs: ProcessGroup) -> None:
    # A non-streamed answer, read whole from the worker, is written to a client that does not
    # read it: the lease ends at the request timeout, not when the client reads (forever for a hung
    # client). The worker sends its whole stream (the gateway holds its last MiB at most) while the
    # client has stopped reading: no upstream timeout fires for a finished answer, so without the
    # request timeout the lease (in_flight, every context token as decode load) would be held for as
    # long as the client kept its socket open. Several sizes, so that some answer lies between
    # what the client's socket absorbs and that plus the gateway's read buffer (past it the
    # gateway stops reading the worker).
    worker = procs.echo_worker("fast", "--model", "m")
    config = {"server": {"admin_key": "adm", "request_timeout_s": 1.0},
              "workers": [{"name": "fast", "url": worker.url, "models": ["m"]}]}
    path = procs.log_dir / "fast.yaml"
    path.write_text(yaml.safe_dump(config))
    gateway = procs.gateway(path, port=free_port(), ready_path="/ready")
    sockets = []
    try:
        sizes = [(mib, True) for mib in (1.5, 2, 2.25, 2.5, 2.75, 3, 3.25, 3.5)] + [(3.5, False)]
        for mib, stream in sizes:  # prompts under max_prompt_tokens
            words = int(mib * (1 << 20)) // 8000
            body = {"model": "m", "prompt": " ".join(["x" * 7999] * words), "stream": stream, "max_tokens": words}
            sockets.append(stalled_client(gateway.port, body))
        with httpx.Client(base_url=gateway.url, timeout=30) as client:
            def load() -> dict[str, Any]:
                return client.get("/workers", headers=ADMIN).json()["workers"][0]["targets"][0]
            def served() -> int:
                return int(httpx.post(worker.url + "/admin/faults", json={}, timeout=10).json()["served"])
            wait_until(lambda: served() == len(sockets), what="every stalled request answered by the worker")
            wait_until(lambda: load()["in_flight"] == 0, timeout_s=15, what=f"leases ended at the timeout: {load()}")
            assert load()["decode_tokens"] == load()["prefill_tokens"] == 0
    finally:
        for s in sockets:
            s.close()


def test_a_request_every_worker_fails_leaves_its_session_where_it_was(procs: ProcessGroup) -> None:
    # A request that makes every worker answer 500 (its own fault: README, retries) is retried
    # on each worker in turn without re-binding its session: the session's next turn goes to its
    # bound worker and its cache, not to the last worker tried, and no move is counted.
    workers = [procs.echo_worker(f"p{i}", "--model", "m", "--fail-on", "POISON") for i in range(3)]
    config = {"server": {"admin_key": "adm"}, "policy": "session_sticky",
              "circuit_breaker": {"failure_threshold": 100, "open_s": 1},
              "retries": {"max_attempts": 3, "backoff_base_s": 0.01, "backoff_max_s": 0.02},
              "workers": [{"name": w.name, "url": w.url, "models": ["m"]} for w in workers]}
    path = procs.log_dir / "poison.yaml"
    path.write_text(yaml.safe_dump(config))
    gateway = procs.gateway(path, port=free_port(), ready_path="/ready")
    session = {"x-session-id": "poisoned"}
    with httpx.Client(base_url=gateway.url, timeout=30) as client:
        home = client.post("/v1/completions", json={"model": "m", "prompt": "fine"}, headers=session)
        assert home.status_code == 200
        bad = client.post("/v1/completions", json={"model": "m", "prompt": "POISON"}, headers=session)
        assert bad.status_code == 500
        assert _bound(client, "poisoned") == home.headers["x-mesh-worker"]
        after = client.post("/v1/completions", json={"model": "m", "prompt": "fine again"}, headers=session)
        assert after.headers["x-mesh-worker"] == home.headers["x-mesh-worker"]
        moves = [line for line in client.get("/metrics").text.splitlines() if line.startswith("mesh_session_moves_total ")]
        assert moves == ["mesh_session_moves_total 0.0"]


def test_a_decode_worker_refusing_admission_does_not_move_the_session(procs: ProcessGroup) -> None:
    # Each decode attempt committed the request's session: one refused (429) by its decode worker
    # bound the session there, then the next attempt moved it, counting a move per refusal.
    script = procs.log_dir / "pd_worker.py"
    script.write_text(pd_worker.SCRIPT)
    roles = {"p0": "prefill-now", "d0": "full", "d1": "decode"}
    fakes = {}
    for name, role in roles.items():
        port = free_port()
        fakes[name] = procs.start([PYTHON, str(script), name, role, str(port)], name=name, port=port)
        wait_http(fakes[name].url + "/count", proc=fakes[name])
    # seeded: the decode ties are drawn from the router's RNG, and unseeded all six could go to d1
    config = {"server": {"admin_key": "adm"}, "policy": PD_POLICY, "health": {"interval_s": 60}, "seed": 7,
              "workers": [{"name": n, "url": fakes[n].url, "models": ["m"], "role": "prefill" if n == "p0" else "decode"}
                          for n in roles]}
    path = procs.log_dir / "pd_full.yaml"
    path.write_text(yaml.safe_dump(config))
    gateway = procs.gateway(path, port=free_port(), ready_path="/ready")
    with httpx.Client(base_url=gateway.url, timeout=30) as client:
        for i in range(6):
            resp = client.post("/v1/completions", json={"model": "m", "prompt": f"turn {i}"}, headers={"x-session-id": f"pd-{i}"})
            assert resp.status_code == 200 and resp.headers["x-mesh-worker"] == "d1", resp.text
            assert _bound(client, f"pd-{i}") == "d1"
        assert httpx.get(fakes["d0"].url + "/count").json()["posts"] > 0  # some first choices were refused
        moves = [line for line in client.get("/metrics").text.splitlines() if line.startswith("mesh_session_moves_total ")]
        assert moves == ["mesh_session_moves_total 0.0"]
