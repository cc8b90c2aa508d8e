"""session-sticky routing over kv_aware (the default policy) on real gateway processes,
real echo workers and real KV event streams (a ZMQ publisher per worker rank, owned by the test,
that says which worker holds which prefix; the gateway keys the blocks itself from the tokens).

Workers: ``w0``, ``w1`` and ``dp`` (``dp_size: 2``: targets ``dp@0`` and ``dp@1``, one event
stream per rank on port + rank). Gateways: ``main`` (idle time 600 s, a tight load ceiling, new
sessions placed by prefix: ``spread_new: false``), ``short`` (1 s idle time, in front of
``w0``/``w1``) and ``small`` (``max_sessions: 3``).
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import msgspec
import pytest
import yaml

from tests.fakes.kv_publisher import Publisher
from tests.procs import PYTHON, Proc, ProcessGroup, free_port, wait_http, wait_until

ADMIN = {"authorization": "Bearer adm"}
MODEL = "m"
BS = 4  # block size of every worker: a 4-byte block of the completion prompt (byte tokenizer)


def _two_free_ports() -> int:
    """A port P with P + 1 free as well (rank r of a worker publishes on port + r)."""
    for _ in range(200):
        p = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p + 1))
            except OSError:
                continue
        return p
    raise RuntimeError("no two consecutive free ports")


@dataclass
class Gw:
    proc: Proc
    http: httpx.Client

    def complete(self, prompt: str, session: str | None = None, **body: Any) -> httpx.Response:
        headers = {"x-session-id": session} if session is not None else {}
        resp = self.http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2, **body},
                              headers=headers)
        assert resp.status_code == 200, resp.text
        return resp

    def route(self, prompt: str, session: str | None = None, **body: Any) -> dict[str, Any]:
        headers = {"x-session-id": session} if session is not None else {}
        resp = self.http.post("/debug/route", json={"model": MODEL, "prompt": prompt, **body}, headers=headers)
        assert resp.status_code == 200, resp.text
        return resp.json()

    def bound(self, session: str) -> str | None:
        return self.route("probe", session)["session"]["bound_target"]  # type: ignore[no-any-return]

    def metric(self, name: str) -> float:
        for line in self.http.get("/metrics").text.splitlines():
            if line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"{name} not exposed")

    def metrics(self) -> dict[str, float]:
        return {n: self.metric(f"mesh_session_{n}_total") for n in ("created", "moves", "expired", "evicted")} | {
            "live": self.metric("mesh_sessions_live")}


@dataclass
class Cluster:
    procs: ProcessGroup
    workers: dict[str, Proc]
    configs: dict[str, dict[str, Any]]
    pubs: dict[str, Publisher]  # target id -> its rank's publisher
    main: Gw
    short: Gw
    small: Gw
    hashes: int = 1_000

    def hold(self, target: str, prompt: str, blocks: int | None = None) -> None:
        """``target`` announces the first ``blocks`` full blocks of ``prompt`` (all by default)."""
        tokens = list(prompt.encode())
        n = len(tokens) // BS if blocks is None else blocks
        hashes = list(range(self.hashes, self.hashes + n))
        self.hashes += n
        rank = int(target.partition("@")[2] or 0)
        ev = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None,
              "token_ids": tokens[: n * BS], "block_size": BS, "lora_id": None, "medium": "GPU"}
        self.pubs[target].publish(msgspec.msgpack.encode([time.time(), [ev], rank]))

    def wait_held(self, gw: Gw, prompt: str, expect: dict[str, int]) -> None:
        """Until the gateway's index credits each target with exactly ``expect`` blocks of ``prompt``."""
        def seen() -> bool:
            cands = gw.route(prompt)["decision"]["candidates"]
            got = {t: c["overlap"]["gpu_blocks"] for t, c in cands.items() if c["overlap"]["gpu_blocks"]}
            return got == expect
        wait_until(seen, what=f"index holds {expect}")


def _echo(procs: ProcessGroup, name: str) -> Proc:
    port = free_port()
    proc = procs.start([PYTHON, "-m", "mesh.echo_worker", "--port", str(port), "--name", name, "--model", MODEL],
                       name=name, port=port)
    return proc


def _config(workers: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {
        "server": {"admin_key": "adm", "request_timeout_s": 30},
        "health": {"interval_s": 0.2, "timeout_s": 1, "unhealthy_threshold": 1, "healthy_threshold": 1},
        "retries": {"max_attempts": 2, "backoff_base_s": 0.01, "backoff_max_s": 0.02},
        "workers": workers,
        **extra,
    }


def _gateway(procs: ProcessGroup, name: str, config: dict[str, Any]) -> Proc:
    path = procs.log_dir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    port = free_port()
    cmd = [PYTHON, "-m", "mesh.commands.serve", "--config", str(path), "--port", str(port), "--log-level", "warning"]
    return procs.start(cmd, name=name, port=port)


@pytest.fixture(scope="module")
def cluster(module_procs: ProcessGroup) -> Iterator[Cluster]:
    procs = module_procs
    workers = {n: _echo(procs, n) for n in ("w0", "w1", "dp")}
    pubs: dict[str, Publisher] = {}
    cfgs = []
    for name, proc in workers.items():
        dp = 2 if name == "dp" else 1
        port = _two_free_ports() if dp > 1 else free_port()
        for rank in range(dp):
            tid = f"{name}@{rank}" if dp > 1 else name
            pubs[tid] = Publisher(pub_port=port + rank)
        cfgs.append({"name": name, "url": proc.url, "models": [MODEL], "dp_size": dp, "block_size": BS,
                     "kv_events": {"endpoint": f"tcp://127.0.0.1:{port}"}})
    limited = [dict(cfg, max_in_flight=1) if cfg["name"] == "w1" else cfg for cfg in cfgs]
    gws = {
        # a tight configured ceiling (in_flight <= mean + 1) over the default inner policy; new
        # sessions placed by prefix (no spread by live sessions), so that a test can put a new
        # session on the prefix holder it sets up, whatever other tests left bound
        "main": _gateway(procs, "gw-main", _config(limited, policy={"name": "session_sticky", "params": {
            "load_factor": 1.0, "load_slack": 1.0, "spread_new": False}})),
        "short": _gateway(procs, "gw-short", _config(cfgs[:2], sessions={"idle_ttl_s": 1.0})),
        "small": _gateway(procs, "gw-small", _config(cfgs, sessions={"max_sessions": 3})),
    }
    for proc in [*workers.values(), *gws.values()]:
        wait_http(proc.url + "/health", proc=proc, timeout_s=60)
    clients = {n: httpx.Client(base_url=p.url, timeout=30) for n, p in gws.items()}
    c = Cluster(procs, workers, {cfg["name"]: cfg for cfg in cfgs}, pubs, *(Gw(gws[n], clients[n]) for n in ("main", "short", "small")))
    try:
        # every stream trusted: the gateway credits a rank's blocks only after a frame from it
        for tid in pubs:
            c.hold(tid, "init")
        for gw in (c.main, c.short, c.small):
            wait_until(lambda gw=gw: all(w["healthy"] for w in gw.http.get("/workers", headers=ADMIN).json()["workers"]),
                       what="every worker healthy")
            wait_until(lambda gw=gw: all(c["scores"]["index_healthy"] == 1.0
                                         for c in gw.route("probe")["decision"]["candidates"].values()),
                       what="every event stream live")
        yield c
    finally:
        for client in clients.values():
            client.close()
        for pub in pubs.values():
            pub.close()


def _prompt(tag: str, blocks: int = 12) -> str:
    """Exactly ``blocks`` full blocks of words (the echo worker answers word by word)."""
    return (tag + " " + " ".join("abcdefghijklmnopqrstuvwxyz") * 8)[: blocks * BS]


def _faults(c: Cluster, worker: str, **faults: Any) -> None:
    assert httpx.post(c.workers[worker].url + "/admin/faults", json=faults).status_code == 200


# -- a long turn and concurrent turns keep the binding alive --------------------------------------

def test_a_long_streaming_turn_does_not_expire_its_own_binding(cluster: Cluster) -> None:
    """The idle time runs from the END of the session's last request: while a 2 s stream runs
    under a 1 s idle time, the binding stays (visible, never expired, no new binding after)."""
    gw, prompt = cluster.short, _prompt("long", 20)
    before = gw.metrics()
    _faults(cluster, "w0", token_delay_s=0.1)
    _faults(cluster, "w1", token_delay_s=0.1)
    try:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 20, "stream": True}
        with gw.http.stream("POST", "/v1/completions", json=body, headers={"x-session-id": "long-1"}) as resp:
            assert resp.status_code == 200
            home = resp.headers["x-mesh-worker"]
            chunks = 0
            for _ in resp.iter_raw():
                chunks += 1
                assert gw.bound("long-1") == home  # also past the idle time of the turn's start
        assert chunks > 10
    finally:
        _faults(cluster, "w0", token_delay_s=0.0)
        _faults(cluster, "w1", token_delay_s=0.0)
    assert gw.bound("long-1") == home
    after = gw.metrics()
    assert after["created"] == before["created"] + 1 and after["expired"] == before["expired"]
    assert after["moves"] == before["moves"]



def test_after_the_idle_time_the_next_turn_is_a_new_binding_on_the_prefix_holder(cluster: Cluster) -> None:
    gw, prompt = cluster.short, _prompt("expiry")
    cluster.hold("w1", prompt)
    cluster.wait_held(gw, prompt, {"w1": 12})
    wait_until(lambda: gw.metric("mesh_sessions_live") == 0, what="earlier sessions expired")
    before = gw.metrics()
    assert gw.complete(prompt, "exp-1").headers["x-mesh-worker"] == "w1"
    wait_until(lambda: gw.bound("exp-1") is None, what="the binding expired")
    route = gw.route(prompt + " next", "exp-1")
    # every earlier session expired: all targets are equally spread, kv_aware picks the prefix holder
    assert route["decision"]["reason"].startswith("new session, spread (<= 1 live sessions) (kv_aware")
    assert route["decision"]["target"] == "w1"
    assert gw.complete(prompt + " next", "exp-1").headers["x-mesh-worker"] == "w1"
    after = gw.metrics()
    assert (after["created"], after["expired"], after["moves"]) == (
        before["created"] + 2, before["expired"] + 1, before["moves"])
    assert after["live"] == 1

# -- moves: when, where to, and the binding follows ----------------------------------------------

def _stream(gw: Gw, prompt: str, session: str | None, tokens: int = 40) -> httpx.Response:
    headers = {"x-session-id": session} if session is not None else {}
    req = gw.http.build_request("POST", "/v1/completions", headers=headers,
                                json={"model": MODEL, "prompt": prompt, "max_tokens": tokens, "stream": True})
    resp = gw.http.send(req, stream=True)
    assert resp.status_code == 200, resp.read()
    return resp


def _in_flight(gw: Gw, target: str) -> int:
    for w in gw.http.get("/workers", headers=ADMIN).json()["workers"]:
        for t in w["targets"]:
            if t["id"] == target:
                return int(t["in_flight"])
    raise AssertionError(f"{target} not registered")


def _placed(c: Cluster, tag: str, holders: dict[str, int]) -> str:
    """A prompt of 12 blocks whose prefixes ``holders`` hold (target -> blocks), indexed."""
    prompt = _prompt(tag)
    for target, blocks in holders.items():
        c.hold(target, prompt, blocks)
    c.wait_held(c.main, prompt, holders)
    return prompt


def _drain(c: Cluster, worker: str, undo: bool = False) -> None:
    resp = c.main.http.post(f"/workers/{worker}/drain", params={"undo": str(undo).lower()}, headers=ADMIN)
    assert resp.status_code == 200, resp.text


def _unhealthy(c: Cluster, worker: str, undo: bool = False) -> None:
    _faults(c, worker, unhealthy=not undo)
    wait_until(lambda: {w["name"]: w["healthy"] for w in c.main.http.get("/workers", headers=ADMIN).json()["workers"]}[worker]
               == undo, what=f"{worker} healthy={undo}")


@pytest.mark.parametrize(("breakage", "why"), [(_drain, "draining"), (_unhealthy, "unhealthy")])
def test_a_session_moves_to_the_longest_prefix_holder_and_its_binding_follows(cluster: Cluster, breakage: Any, why: str) -> None:
    gw, tag = cluster.main, f"mv-{why}"
    prompt = _placed(cluster, tag, {"w0": 12, "dp@1": 8, "dp@0": 3})  # w1 holds none
    before = gw.metrics()
    assert gw.complete(prompt, tag).headers["x-mesh-worker"] == "w0"
    breakage(cluster, "w0")
    try:
        route = gw.route(prompt + " next", tag)
        assert route["decision"]["reason"].startswith(f"rebound: bound target {why}"), route["decision"]
        assert route["decision"]["target"] == "dp@1" and route["session"]["bound_target"] == "w0"
        assert gw.complete(prompt + " next", tag).headers["x-mesh-worker"] == "dp@1"
        assert gw.bound(tag) == "dp@1"
    finally:
        breakage(cluster, "w0", undo=True)
    assert gw.route(prompt + " next again", tag)["decision"] | {"candidates": None} == {
        "target": "dp@1", "decode_target": None, "reason": "bound", "candidates": None}  # w0 is back: it stays
    after = gw.metrics()
    assert (after["created"], after["moves"], after["live"]) == (before["created"] + 1, before["moves"] + 1, before["live"] + 1)


def test_a_session_leaves_a_worker_over_the_configured_ceiling_for_the_next_prefix_holder(cluster: Cluster) -> None:
    gw = cluster.main
    prompt = _placed(cluster, "ceil", {"w0": 12, "dp@0": 9, "dp@1": 2})
    for sid in ("ceil-load-1", "ceil-load-2", "ceil"):
        assert gw.complete(prompt, sid).headers["x-mesh-worker"] == "w0"
    before = gw.metrics()
    _faults(cluster, "w0", token_delay_s=0.1)
    streams = []
    try:
        for sid in ("ceil-load-1", "ceil-load-2"):  # bound there: two turns in flight on w0
            streams.append(_stream(gw, prompt, sid))
            assert streams[-1].headers["x-mesh-worker"] == "w0"
        route = gw.route(prompt, "ceil")  # 2 in flight > mean 0.5 + 1
        assert route["decision"]["reason"].startswith("rebound: bound target over load ceiling"), route["decision"]
        assert route["decision"]["target"] == "dp@0"
        assert gw.complete(prompt, "ceil").headers["x-mesh-worker"] == "dp@0"
    finally:
        for resp in streams:
            resp.close()
        _faults(cluster, "w0", token_delay_s=0.0)
    wait_until(lambda: _in_flight(gw, "w0") == 0, what="w0 idle")
    assert gw.bound("ceil") == "dp@0" and gw.route(prompt, "ceil")["decision"]["reason"] == "bound"
    after = gw.metrics()
    assert (after["moves"], after["created"]) == (before["moves"] + 1, before["created"])


def test_a_session_leaves_a_worker_at_its_max_in_flight_and_says_so(cluster: Cluster) -> None:
    gw = cluster.main
    prompt = _placed(cluster, "full", {"w1": 12, "w0": 7, "dp@0": 2})
    assert gw.complete(prompt, "full").headers["x-mesh-worker"] == "w1"
    before = gw.metrics()
    _faults(cluster, "w1", token_delay_s=0.1)
    try:
        # w1's one slot (max_in_flight: 1) taken for 20 s: far past the 2 s the next request of
        # "full" waits for its home (admission.home_wait_s) on a loaded box; closed below
        resp = _stream(gw, prompt, "full-load", tokens=200)
        try:
            assert resp.headers["x-mesh-worker"] == "w1"
            route = gw.route(prompt, "full")
            assert route["decision"]["reason"].startswith("rebound: bound target at its admission limit"), route["decision"]
            assert route["decision"]["target"] == "w0" and route["session"]["bound_target"] == "w1"
            assert gw.complete(prompt, "full").headers["x-mesh-worker"] == "w0"
        finally:
            resp.close()
    finally:
        _faults(cluster, "w1", token_delay_s=0.0)
    assert gw.bound("full") == "w0"
    after = gw.metrics()
    assert (after["moves"], after["created"]) == (before["moves"] + 1, before["created"] + 1)  # + full-load


# -- data-parallel ranks --------------------------------------------------------------------------

def test_dp_ranks_are_separate_targets_with_their_own_events(cluster: Cluster) -> None:
    gw = cluster.main
    p1, p0 = _prompt("one-rank"), _prompt("zero-rank")
    cluster.hold("dp@1", p1)
    cluster.hold("dp@0", p0, 6)
    cluster.wait_held(gw, p1, {"dp@1": 12})  # rank 1's stream credits rank 1 only
    cluster.wait_held(gw, p0, {"dp@0": 6})
    assert gw.complete(p1, "rank-1").headers["x-mesh-worker"] == "dp@1"
    assert gw.complete(p0, "rank-0").headers["x-mesh-worker"] == "dp@0"
    assert (gw.bound("rank-1"), gw.bound("rank-0")) == ("dp@1", "dp@0")
    for _ in range(2):  # each stays on its rank
        assert gw.complete(p1 + " more", "rank-1").headers["x-mesh-worker"] == "dp@1"
        assert gw.complete(p0 + " more", "rank-0").headers["x-mesh-worker"] == "dp@0"
    sessions = {t["id"]: t["live_sessions"] for w in gw.http.get("/workers", headers=ADMIN).json()["workers"]
                for t in w["targets"]}
    assert sessions["dp@1"] >= 1 and sessions["dp@0"] >= 1


# -- session ids ----------------------------------------------------------------------------------

def _sid(gw: Gw, headers: dict[str, Any], body: dict[str, Any]) -> str | None:
    resp = gw.http.post("/debug/route", json={"model": MODEL, "prompt": "x", **body}, headers=headers)
    assert resp.status_code == 200, resp.text
    return resp.json()["request"]["session_id"]  # type: ignore[no-any-return]


def test_session_ids_from_header_and_body_field(cluster: Cluster) -> None:
    gw = cluster.main
    by_header = _sid(gw, {"x-session-id": "alpha"}, {})
    assert by_header is not None and len(by_header) == 32
    assert _sid(gw, {}, {"user": "alpha"}) == by_header  # the same id either way
    assert _sid(gw, {"x-session-id": "alpha"}, {"user": "beta"}) == by_header  # the header wins
    assert _sid(gw, {"x-session-id": ""}, {"user": "alpha"}) == by_header  # an empty header: the body
    assert _sid(gw, {}, {"user": ""}) is None and _sid(gw, {}, {"user": 7}) is None and _sid(gw, {}, {}) is None
    uni = "séance-✓-会话"
    assert _sid(gw, {"x-session-id": uni.encode()}, {}) == _sid(gw, {}, {"user": uni}) is not None
    # a turn by header and the next by body field are one session
    prompt = _prompt("ids")
    home = gw.complete(prompt, "ids-1").headers["x-mesh-worker"]
    resp = gw.http.post("/v1/completions", json={"model": MODEL, "prompt": prompt + " two", "max_tokens": 2, "user": "ids-1"})
    assert resp.status_code == 200 and resp.headers["x-mesh-worker"] == home
    huge = "h" * 300_000  # a huge id: accepted, bounded, sticky
    first = gw.http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1, "user": huge})
    assert first.status_code == 200
    route = gw.route(prompt, None, user=huge)
    assert route["decision"]["reason"] == "bound" and route["session"]["bound_target"] == first.headers["x-mesh-worker"]


def test_max_sessions_evicts_the_least_recently_used(cluster: Cluster) -> None:
    gw = cluster.small
    for sid in ("lru-1", "lru-2", "lru-3"):
        gw.complete(_prompt(sid), sid)
    assert all(gw.bound(s) for s in ("lru-1", "lru-2", "lru-3"))
    before = gw.metrics()
    gw.complete(_prompt("lru-1") + " again", "lru-1")  # lru-2 is now the least recently used
    gw.complete(_prompt("lru-4"), "lru-4")
    assert gw.bound("lru-2") is None and all(gw.bound(s) for s in ("lru-1", "lru-3", "lru-4"))
    after = gw.metrics()
    assert (after["evicted"], after["created"], after["live"]) == (before["evicted"] + 1, before["created"] + 1, 3)


# -- races ----------------------------------------------------------------------------------------

def test_concurrent_first_requests_of_a_session_converge_on_one_worker(cluster: Cluster) -> None:
    gw = cluster.small
    before = gw.metrics()

    async def storm() -> list[str]:
        async with httpx.AsyncClient(base_url=gw.proc.url, timeout=30) as client:
            async def one(i: int) -> str:
                resp = await client.post("/v1/completions", headers={"x-session-id": "race-1"},
                                         json={"model": MODEL, "prompt": _prompt("race") + f" {i}", "max_tokens": 2})
                assert resp.status_code == 200
                return resp.headers["x-mesh-worker"]
            return await asyncio.gather(*(one(i) for i in range(6)))

    placed = asyncio.run(storm())
    assert len(set(placed)) == 1 and gw.bound("race-1") == placed[0]
    after = gw.metrics()
    assert (after["created"], after["moves"]) == (before["created"] + 1, before["moves"])


def test_a_worker_removed_while_its_session_streams_is_not_bound_again(cluster: Cluster) -> None:
    gw = cluster.short
    _faults(cluster, "w0", token_delay_s=0.05)
    _faults(cluster, "w1", token_delay_s=0.05)
    prompt = _prompt("removed", 20)
    resp = _stream(gw, prompt, "rm-1", tokens=20)
    home = resp.headers["x-mesh-worker"]
    other = "w1" if home == "w0" else "w0"
    try:
        before = gw.metrics()
        assert gw.http.delete(f"/workers/{home}", headers=ADMIN).status_code == 200
        assert gw.bound("rm-1") is None
        for _ in resp.iter_raw():
            pass
        resp.close()
        assert gw.bound("rm-1") is None  # its end did not bind it back to the removed worker
        assert gw.metrics()["live"] == before["live"] - 1
        route = gw.route(prompt, "rm-1")
        assert route["decision"]["target"] == other and route["decision"]["reason"].startswith("new session")
        assert gw.complete(prompt, "rm-1").headers["x-mesh-worker"] == other and gw.bound("rm-1") == other
    finally:
        _faults(cluster, "w0", token_delay_s=0.0)
        _faults(cluster, "w1", token_delay_s=0.0)
        gw.http.post("/workers", json=cluster.configs[home], headers=ADMIN)
