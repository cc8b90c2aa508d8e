"""Review 7: session-sticky routing over kv_aware (the default policy) on real gateway processes,
real echo workers and real KV event streams (a ZMQ publisher per worker rank, owned by the test,
that says which worker holds which prefix; the gateway keys the blocks itself from the tokens).

Workers: ``w0``, ``w1`` and ``dp`` (``dp_size: 2``: targets ``dp@0`` and ``dp@1``, one event
stream per rank on port + rank). Gateways: ``main`` (idle time 600 s), ``short`` (1 s idle time,
in front of ``w0``/``w1``) and ``small`` (``max_sessions: 3``).
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

from tests.procs import PYTHON, Proc, ProcessGroup, free_port, wait_http, wait_until
from tests.test_subscriber import Publisher

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
    gws = {
        "main": _gateway(procs, "gw-main", _config(cfgs)),
        "short": _gateway(procs, "gw-short", _config(cfgs[:2], sessions={"idle_ttl_s": 1.0})),
        "small": _gateway(procs, "gw-small", _config(cfgs, sessions={"max_sessions": 3})),
    }
    for proc in [*workers.values(), *gws.values()]:
        wait_http(proc.url + "/health", proc=proc, timeout_s=60)
    clients = {n: httpx.Client(base_url=p.url, timeout=30) for n, p in gws.items()}
    c = Cluster(procs, workers, pubs, *(Gw(gws[n], clients[n]) for n in ("main", "short", "small")))
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
