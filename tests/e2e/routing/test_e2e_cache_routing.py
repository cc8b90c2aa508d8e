"""End to end: precise cache-aware routing over real bundled workers and real KV events.

Three tiny-preset worker processes publish their KV events over ZMQ; two gateway processes front
them: one on the default policy (session-sticky over kv_aware) with speculative index entries off
(so every overlap it sees comes from the engines' own events), one on round robin. Multi-turn chat
sessions extend their previous prompt with the reply and a new message every turn.

Shown: every turn after the first goes to the worker holding its prefix (``x-mesh-worker``) and that
worker's ``cached_tokens`` confirm the reuse; ``/debug/route`` shows the overlap on that worker
before the turn; the router's predicted cached tokens equal the workers' reported ones; round robin
on the same workload reuses far less; a worker removed and re-added at runtime drops its index
entries and gets them back from its publisher's replay; ``mesh up`` runs this stack by default.
"""

from __future__ import annotations

import json
import re
import signal
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.e2e_bundled import (
    ADMIN,
    BLOCK,
    Conversation,
    Gateway,
    overlaps,
    start_gateway,
    start_workers,
    wait_until,
    wait_workers,
    write_config,
)
from tests.procs import PYTHON, ProcessGroup, free_port, stop_process, wait_http

WORKERS = ["w0", "w1", "w2"]
SESSIONS, TURNS = 4, 4  # 4 sessions on 3 workers: round robin cannot line a session up by luck


class Cluster:
    def __init__(self, workers: dict[str, Any], kv: Gateway, rr: Gateway) -> None:
        self.workers, self.kv, self.rr = workers, kv, rr


@pytest.fixture(scope="module")
def cluster(module_procs: ProcessGroup) -> Iterator[Cluster]:
    workers = start_workers(module_procs, WORKERS, wait=False)
    ws = list(workers.values())
    kv_cfg = write_config(module_procs.log_dir / "kv.yaml", ws, index={"speculative_ttl_s": 0})
    rr_cfg = write_config(module_procs.log_dir / "rr.yaml", ws, policy="round_robin")
    kv = Gateway(start_gateway(module_procs, kv_cfg, "gateway-kv"))
    rr = Gateway(start_gateway(module_procs, rr_cfg, "gateway-rr"))
    wait_workers(workers)
    for w in ws:  # every worker caches the chat template's first block ("<|im_start|>user")
        body = {"model": "tiny", "messages": [{"role": "user", "content": f"warm up {w.name}"}], "max_tokens": 1}
        assert httpx.post(w.proc.url + "/v1/chat/completions", json=body, timeout=60).status_code == 200
    for gw in (kv, rr):
        gw.wait_ready(len(WORKERS))
    probe = {"model": "tiny", "messages": [{"role": "user", "content": "probe"}]}
    wait_until(lambda: len(overlaps(kv.route(probe)["decision"])) == 3, what="the index knows every warm-up")
    yield Cluster(workers, kv, rr)
    kv.close()
    rr.close()


def run_sessions(gw: Gateway, seeds: range, *, check: bool) -> tuple[int, int, list[list[str]]]:
    """Interleaved multi-turn sessions; returns (prompt tokens, cached tokens, workers per session).

    With ``check``: before each later turn, the index (``/debug/route``) must show the session's
    whole previous prompt on its holder and nowhere else, and the turn must land there and reuse it.
    """
    convs = [Conversation(seed) for seed in seeds]
    placed: list[list[str]] = [[] for _ in convs]
    prev_tokens = [0] * len(convs)
    prompt_total = cached_total = 0
    for turn in range(TURNS):
        for i, conv in enumerate(convs):
            session = f"s{conv.seed}" if i % 2 == 0 else None  # half with a session id, half without
            body = conv.next_body()
            seen = None
            if check and turn:
                seen = check_route(gw, body, session, placed[i][0], prev_tokens[i] // BLOCK)
            result = gw.chat_stream(body, session) if turn == TURNS - 1 else gw.chat(body, session)
            conv.answered(result.reply)
            placed[i].append(result.worker)
            if seen is not None:
                assert result.worker == placed[i][0], f"session {conv.seed} turn {turn} left its prefix"
                assert prev_tokens[i] // BLOCK * BLOCK <= result.cached_tokens <= result.prompt_tokens
                assert abs(result.cached_tokens - seen * BLOCK) < BLOCK, (result.cached_tokens, seen)
            prev_tokens[i] = result.prompt_tokens
            prompt_total += result.prompt_tokens
            cached_total += result.cached_tokens
    return prompt_total, cached_total, placed


def check_route(gw: Gateway, body: dict[str, Any], session: str | None, holder: str, blocks: int) -> int:
    """Wait until ``/debug/route`` shows ``blocks`` on ``holder``; check the decision; its overlap."""

    def explained() -> dict[str, Any] | None:
        route = gw.route(body, session)
        return route if overlaps(route["decision"]).get(holder, 0) >= blocks else None

    route = wait_until(explained, what=f"{blocks} blocks indexed on {holder}")
    decision = route["decision"]
    assert decision["target"] == holder
    if session is None:
        assert decision["reason"].startswith("kv_aware: lowest"), decision["reason"]
        costs = {t: c["scores"]["cost"] for t, c in decision["candidates"].items()}
        assert set(costs) == set(WORKERS) and min(costs, key=costs.__getitem__) == holder
    else:
        assert decision["reason"] == "bound" and route["session"]["bound_target"] == holder
        assert route["inner_decision"]["target"] == holder  # the index alone agrees with the binding
    others = {t: n for t, n in overlaps(decision).items() if t != holder}
    assert all(n <= 1 for n in others.values()), others  # the template's first block at most
    return overlaps(decision)[holder]


def test_each_turn_lands_on_its_prefix_holder_and_the_prediction_matches_the_reuse(cluster: Cluster) -> None:
    kv = cluster.kv
    predicted0, reported0 = kv.metric("mesh_prefix_predicted_tokens_total"), kv.metric("mesh_prefix_reported_tokens_total")
    prompt, cached, placed = run_sessions(kv, range(100, 100 + SESSIONS), check=True)
    assert all(len(set(ws)) == 1 for ws in placed), placed
    assert cached / prompt > 0.5, (cached, prompt)
    predicted = kv.metric("mesh_prefix_predicted_tokens_total") - predicted0
    reported = kv.metric("mesh_prefix_reported_tokens_total") - reported0
    assert reported == cached  # every answer, streamed or not, was counted
    assert abs(predicted - reported) <= 0.02 * reported, (predicted, reported)


def test_round_robin_reuses_far_less_on_the_same_workload(cluster: Cluster) -> None:
    kv_prompt, kv_cached, _ = run_sessions(cluster.kv, range(300, 300 + SESSIONS), check=False)
    rr_prompt, rr_cached, rr_placed = run_sessions(cluster.rr, range(200, 200 + SESSIONS), check=False)
    assert all(len(set(ws)) > 1 for ws in rr_placed)  # round robin moves every session around
    kv_rate, rr_rate = kv_cached / kv_prompt, rr_cached / rr_prompt
    assert kv_rate > 0.5 and kv_rate > 2 * rr_rate, (kv_rate, rr_rate)


def test_salted_prompts_are_indexed_in_their_salt_namespace(cluster: Cluster) -> None:
    """A salted request's blocks are announced with its salt (vLLM's ``extra_keys``), so the index
    keys them in that namespace: the same prompt under that salt matches them; under another salt
    or none it does not (no false hits, no affinity across tenants)."""
    body = Conversation(4242).next_body(words=60, cache_salt="tenant-a")
    first = cluster.kv.chat(body)
    blocks = first.prompt_tokens // BLOCK
    wait_until(lambda: overlaps(cluster.kv.route(body)["decision"]).get(first.worker, 0) >= blocks,
               what="the salted prompt indexed under its salt")
    unsalted = {k: v for k, v in body.items() if k != "cache_salt"}
    for other in ({**body, "cache_salt": "tenant-b"}, unsalted):
        seen = overlaps(cluster.kv.route(other)["decision"])
        assert all(n <= 1 for n in seen.values()), seen  # the warm-ups' unsalted template block at most
    again = cluster.kv.chat(body)
    assert again.worker == first.worker and again.cached_tokens >= (blocks - 1) * BLOCK


def test_a_removed_worker_drops_its_entries_and_a_readded_one_is_rebuilt_from_replay(cluster: Cluster) -> None:
    kv, w2 = cluster.kv, cluster.workers["w2"]
    conv = Conversation(400)
    body = conv.next_body()
    direct = httpx.post(w2.proc.url + "/v1/chat/completions", json=body, timeout=60)  # only w2 holds it
    assert direct.status_code == 200
    full = direct.json()["usage"]["prompt_tokens"] // BLOCK
    wait_until(lambda: overlaps(kv.route(body)["decision"]).get("w2") == full, what="w2's blocks indexed")

    assert kv.http.delete("/workers/w2", headers=ADMIN).status_code == 200
    wait_until(lambda: not any('worker="w2"' in k for k in kv.metric_values("mesh_kv_events_healthy")),
               what="w2's stream stopped")
    # Back without events: anything the index still held for w2 would show as overlap now.
    plain = {k: v for k, v in w2.config().items() if k != "kv_events"}
    assert kv.http.post("/workers", json=plain, headers=ADMIN).status_code == 201
    wait_until(lambda: kv.workers()["w2"]["healthy"], what="w2 healthy again")
    route = kv.route(body)
    assert "w2" in route["decision"]["candidates"] and overlaps(route["decision"])["w2"] == 0

    assert kv.http.delete("/workers/w2", headers=ADMIN).status_code == 200
    assert kv.http.post("/workers", json=w2.config(), headers=ADMIN).status_code == 201
    wait_until(lambda: overlaps(kv.route(body)["decision"]).get("w2") == full, what="w2 rebuilt from replay")
    route = kv.route(body)
    assert route["decision"]["target"] == "w2"
    assert kv.chat(body).worker == "w2"


def test_mesh_up_runs_bundled_workers_with_kv_aware_routing_by_default(procs: ProcessGroup) -> None:
    port = free_port()
    up = procs.start([PYTHON, "-m", "mesh.commands.up", "--workers", "2", "--port", str(port)], name="up", port=port)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/ready", proc=up, timeout_s=240)
    banner = wait_until(lambda: re.search(r"-d '(\{.*\})'", up.log_tail(6000)), what="banner with a curl")
    assert "bundled workers" in up.log_tail(6000)
    body = json.loads(banner.group(1))  # the printed curl, sent as printed
    headers = {"x-session-id": "demo"}
    first = httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=60)
    assert first.status_code == 200, first.text
    with httpx.Client(base_url=url, timeout=60) as http:
        wait_until(lambda: "mesh_kv_events_batches_total{" in http.get("/metrics").text
                   and _sum(http.get("/metrics").text, "mesh_kv_events_batches_total") > 0, what="KV events ingested")
        route = http.post("/debug/route", json=body, headers=headers).json()
        assert route["policy"]["name"] == "session_sticky" and route["policy"]["inner"]["name"] == "kv_aware"
        assert route["session"]["bound_target"] == first.headers["x-mesh-worker"]
        second = http.post("/v1/chat/completions", json=body, headers=headers)
    assert second.headers["x-mesh-worker"] == first.headers["x-mesh-worker"]
    assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    worker_ports = [int(p) for p in re.findall(r"worker-\d+:(\d+)", up.log_tail(6000))]
    assert len(worker_ports) == 2
    assert stop_process(up, signal.SIGTERM, timeout_s=30) == 0
    for wp in worker_ports:  # the workers went down with it
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{wp}/health", timeout=2)


def _sum(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))
