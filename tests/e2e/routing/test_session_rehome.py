"""A session whose home evicted its blocks, end to end: a real gateway (the default policy) in
front of two bundled tiny workers of 64 KV blocks each, real KV events. The session moves to the
other worker when that one has room for its footprint (the KV its active sessions need leaves
enough), and stays home, recomputing there, when the other worker's sessions fill it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.e2e_bundled import Conversation, Gateway, overlaps, start_gateway, start_workers, wait_until, write_config
from tests.procs import ProcessGroup

BLOCKS = 64  # per worker, of 16 tokens


@pytest.fixture(scope="module")
def workers(module_procs: ProcessGroup) -> Iterator[dict[str, Any]]:
    yield start_workers(module_procs, ["w0", "w1"], num_kv_blocks=BLOCKS)


def _gateway(procs: ProcessGroup, workers: dict[str, Any], name: str) -> Gateway:
    for w in workers.values():  # each test starts from empty caches
        assert httpx.post(w.proc.url + "/reset_prefix_cache", timeout=10).status_code == 200
    cfg = write_config(procs.log_dir / f"{name}.yaml", list(workers.values()), index={"speculative_ttl_s": 0})
    gw = Gateway(start_gateway(procs, cfg, name))
    gw.wait_ready(len(workers))
    wait_until(lambda: all(t.get("kv_capacity_blocks") == BLOCKS for w in gw.workers().values() for t in w["targets"]),
               what="both workers' KV capacity known")
    return gw


def _evict_home(gw: Gateway, workers: dict[str, Any], home: str, conv: Conversation, session: str) -> dict[str, Any]:
    """Clear ``home``'s prefix cache; wait until the index knows (its overlap of the next turn is 0)."""
    assert httpx.post(workers[home].proc.url + "/reset_prefix_cache", timeout=10).status_code == 200
    body = conv.next_body(words=2)
    wait_until(lambda: overlaps(gw.route(body, session)["decision"]).get(home, 0) == 0, what=f"{home} evicted in the index")
    return body


def test_an_evicted_session_moves_to_the_worker_with_room(module_procs: ProcessGroup, workers: dict[str, Any]) -> None:
    gw = _gateway(module_procs, workers, "gateway-rehome-room")
    conv = Conversation(1)
    first = gw.chat(conv.next_body(words=40), "x")  # ~20 blocks with its output
    conv.answered(first.reply)
    body = _evict_home(gw, workers, first.worker, conv, "x")
    decision = gw.route(body, "x")["decision"]
    other = next(n for n in workers if n != first.worker)
    assert decision["target"] == other and decision["reason"].startswith("rebound: evicted at home, room elsewhere"), decision
    turn = gw.chat(body, "x")
    assert turn.worker == other and gw.metric("mesh_session_moves_total") == 1
    conv.answered(turn.reply)
    again = gw.chat(conv.next_body(words=2), "x")  # the new home keeps it
    assert again.worker == other and again.cached_tokens >= turn.prompt_tokens // 16 * 16
    gw.close()


def test_an_evicted_session_stays_home_when_the_other_worker_is_full(
        module_procs: ProcessGroup, workers: dict[str, Any]) -> None:
    gw = _gateway(module_procs, workers, "gateway-rehome-full")
    small, big = Conversation(2), Conversation(3)
    first = gw.chat(small.next_body(words=40), "small")
    small.answered(first.reply)
    # a new session goes where the fewest sessions are: the other worker, which it then fills
    big_turn = gw.chat(big.next_body(words=130), "big")  # ~50 of 64 blocks: too little room left for "small"
    assert big_turn.worker != first.worker
    body = _evict_home(gw, workers, first.worker, small, "small")
    assert gw.route(body, "small")["decision"]["reason"] == "bound"
    turn = gw.chat(body, "small")
    assert turn.worker == first.worker and turn.cached_tokens < 32  # recomputed at home
    assert gw.metric("mesh_session_moves_total") == 0
    gw.close()
