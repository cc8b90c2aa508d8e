"""Disaggregation of a hybrid model (``tiny-hybrid``: recurrent layers beside full attention) end to
end on loopback: real worker processes, the gateway relay and a ``Router`` with a prefill/decode
pipeline, as ``test_disagg.py``. The transfer moves the attention blocks and the recurrent state
at their end; the decode worker files the state as its own checkpoint and resumes there.

- greedy output equals a mixed hybrid worker's, token for token, for prompts on and off block
  and checkpoint-interval boundaries; the decode side resumes at exactly the transferred prefix;
- the decode worker's own checkpoint serves a repeated prompt (nothing pulled), and a prefix whose
  blocks it holds without a checkpoint pulls the state alone (a corrupted state is pulled again);
- a hybrid and an attention-only worker never pair (refused with the layouts named, the relay
  moves on), nor do two state shapes;
- the whole path through the gateway app with ``hybrid: true`` workers.

Every test ends with no leaked or pinned block or state checkpoint, no live transfer and no
pending admission on any live worker, and with every router lease settled.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest

from mesh.config import parse_config
from mesh.gateway.app import create_app
from mesh.gateway.disagg_relay import RelayStats
from policies.base import Decision
from tests.disagg_cluster import (
    PD_POLICY,
    Cluster,
    assert_leases_settled,
    assert_no_leaks,
    direct,
    parse_answer,
    prompt_tokens,
    relay,
    set_faults,
    status,
)
from tests.disagg_cluster import completion as _completion
from tests.procs import ProcessGroup

HYBRID = "tiny-hybrid"
BS = 16
INTERVAL = 64  # checkpoint interval (tokens) of every worker here: prompts hit and miss it
STATE_BYTES = 2 * 4 * 32 * 32 * 4  # tiny-hybrid: 2 recurrent layers, state [4, 32, 32] float32
POOL = ["p0", "d0"]


@pytest.fixture(scope="module")
def cluster(module_procs: ProcessGroup) -> Cluster:
    c = Cluster(module_procs, model=HYBRID)
    interval = ("--state-checkpoint-interval", str(INTERVAL))
    c.start("p0", "prefill", *interval)
    c.start("d0", "decode", *interval)
    c.start("m", "mixed", *interval)
    # an attention-only model under the same served name: its layout must never pair with a hybrid's
    c.start("t", "decode", "--preset", "tiny", "--served-model-name", HYBRID)
    c.wait()
    return c


@pytest.fixture(autouse=True)
def no_leaks(cluster: Cluster) -> Iterator[None]:
    yield
    for w in cluster.alive():
        set_faults(w.url, corrupt=0, truncate=0, delay_s=0.0, layout_override={})
    assert_no_leaks(cluster.alive())


def completion(prompt: list[int], max_tokens: int = 16, stream: bool = False) -> dict[str, Any]:
    return _completion(prompt, max_tokens, stream, model=HYBRID)


def _pair(prefill: str, decode: str) -> Decision:
    return Decision(prefill, "test pair", decode_target=decode)


def _prefill(url: str, body: dict[str, Any]) -> dict[str, Any]:
    """A prefill leg by hand: its ``kv_transfer_params``."""
    r = httpx.post(f"{url}/v1/completions", json={**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
                   timeout=60)
    r.raise_for_status()
    return dict(r.json()["kv_transfer_params"])


def _cancel(url: str, params: dict[str, Any]) -> None:
    httpx.post(f"{url}/kv_transfer/release", json={"transfer_id": params["transfer_id"], "cancel": True}, timeout=10)


def _delta(before: dict[str, Any], after: dict[str, Any], *keys: str) -> tuple[float, ...]:
    return tuple(after[k] - before[k] for k in keys)


@pytest.mark.parametrize("length", [15, 16, 17, 31, 32, 33, 63, 64, 65, 80, 129, 200])
async def test_disaggregated_hybrid_greedy_output_equals_a_mixed_worker(cluster: Cluster, length: int) -> None:
    """Prompts shorter than a block (nothing moves), on and off block boundaries, and whose
    transferred prefix ends at, before and after an interval checkpoint (64, 128)."""
    router = cluster.router(POOL)
    d0 = cluster.workers["d0"].url
    body = completion(prompt_tokens(length, seed=1000 + length), 16)
    ref, _ = direct(cluster.workers["m"].url, body)
    before = status(d0)
    got = await relay(router, body, decision=_pair("p0", "d0"))
    assert got.status == 200 and got.text == ref
    n = (length - 1) // BS  # the blocks a prefill offers: all but the last token's
    assert got.usage is not None and got.usage["prompt_tokens_details"]["cached_tokens"] == n * BS
    pulled, states = _delta(before, status(d0), "decode_blocks_pulled", "decode_states_pulled")
    assert (pulled, states) == (n, 1 if n else 0)
    assert_leases_settled(router)


async def test_a_repeated_prompt_resumes_from_the_decode_workers_own_checkpoint(cluster: Cluster) -> None:
    """The imported state was filed as the decode worker's checkpoint: the same prompt again
    pulls nothing (blocks and state local) and still resumes at the transferred prefix."""
    router = cluster.router(POOL)
    d0 = cluster.workers["d0"].url
    body = completion(prompt_tokens(150, seed=2), 12)
    ref, _ = direct(cluster.workers["m"].url, body)
    first = await relay(router, body, decision=_pair("p0", "d0"))
    before = status(d0)
    again = await relay(router, body, decision=_pair("p0", "d0"))
    assert first.text == again.text == ref
    assert _delta(before, status(d0), "decode_blocks_pulled", "decode_states_pulled", "decode_states_local",
                  "decode_blocks_local") == (0, 0, 1, 9)
    assert again.usage is not None and again.usage["prompt_tokens_details"]["cached_tokens"] == 144
    assert_leases_settled(router)


async def test_blocks_held_without_a_checkpoint_pull_the_state_alone_and_a_corrupt_state_again(cluster: Cluster) -> None:
    """The decode worker holds a prefix's blocks but no checkpoint where the transfer ends (its
    own request checkpointed at 64 and 112, the transfer ends at 96): only the state crosses.
    The first state frame arrives corrupted: detected by its checksum and pulled again."""
    router = cluster.router(POOL)
    p0, d0 = cluster.workers["p0"].url, cluster.workers["d0"].url
    longer = prompt_tokens(120, seed=3)
    direct(d0, completion(longer, 1))  # an ordinary request on the decode worker
    body = completion(longer[:100], 12)
    ref, _ = direct(cluster.workers["m"].url, body)
    set_faults(p0, corrupt=1)
    before = status(d0)
    got = await relay(router, body, decision=_pair("p0", "d0"))
    assert got.text == ref
    after = status(d0)
    assert _delta(before, after, "decode_blocks_pulled", "decode_blocks_local", "decode_states_pulled",
                  "decode_pull_retries", "decode_bytes_pulled") == (0, 6, 1, 1, STATE_BYTES)
    assert after["states_imported"] - before["states_imported"] == 1
    assert got.usage is not None and got.usage["prompt_tokens_details"]["cached_tokens"] == 96
    assert_leases_settled(router)


async def test_a_hybrid_and_an_attention_only_worker_never_pair(cluster: Cluster) -> None:
    """Both directions are refused with a 409 naming the recurrent state (never a silent
    attention-only resume), and the relay moves on to a decode worker that matches."""
    p0, d0, t = (cluster.workers[n].url for n in ("p0", "d0", "t"))
    body = completion(prompt_tokens(100, seed=4), 8)
    for prefill, decode in ((p0, t), (t, d0)):
        params = _prefill(prefill, body)
        refused = httpx.post(f"{decode}/v1/completions", json={**body, "kv_transfer_params": params}, timeout=60)
        assert refused.status_code == 409, refused.text
        err = refused.json()["error"]
        assert err["code"] == "kv_layout_mismatch" and "no recurrent state (an attention-only model)" in err["message"]
        assert "recurrent state float32 [2, 4, 32, 32]" in err["message"]
        _cancel(prefill, params)
    router = cluster.router(POOL + ["t"])
    stats = RelayStats()
    got = await relay(router, body, decision=_pair("p0", "t"), stats=stats)
    assert got.decode == "d0" and stats.decode_failures == 1
    assert got.text == direct(cluster.workers["m"].url, body)[0]
    assert_leases_settled(router)


async def test_a_state_of_another_shape_is_refused_at_the_pull(cluster: Cluster) -> None:
    """A prefill stream whose state pool has another geometry or dtype is refused by the decode
    worker (409, not retried), whatever its blocks."""
    p0, d0 = cluster.workers["p0"].url, cluster.workers["d0"].url
    body = completion(prompt_tokens(90, seed=5), 8)
    state = {"dtype": "float32", "num_layers": 2, "num_heads": 4, "key_dim": 32, "value_dim": 32}
    for other in ({"key_dim": 64}, {"dtype": "bfloat16"}, {"num_layers": 3}):
        set_faults(p0, layout_override={"state": {**state, **other}})
        params = _prefill(p0, body)
        refused = httpx.post(f"{d0}/v1/completions", json={**body, "kv_transfer_params": params}, timeout=60)
        assert refused.status_code == 409, refused.text
        err = refused.json()["error"]
        assert err["code"] == "kv_layout_mismatch" and "state: recurrent state" in err["message"], err
        _cancel(p0, params)


@contextlib.asynccontextmanager
async def _gateway(cluster: Cluster) -> AsyncIterator[httpx.AsyncClient]:
    workers = [{"name": n, "url": cluster.workers[n].url, "role": cluster.workers[n].role.value, "hybrid": True}
               for n in POOL]
    app = create_app(parse_config({"workers": workers, "policy": PD_POLICY, "health": {"interval_s": 60}}))
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://mesh", timeout=120) as client:
            yield client


async def test_the_gateway_serves_a_hybrid_model_through_a_prefill_decode_pair(cluster: Cluster) -> None:
    d0 = cluster.workers["d0"].url
    before = status(d0)
    async with _gateway(cluster) as client:
        for stream in (False, True):
            body = completion(prompt_tokens(300, seed=60 + stream), 16, stream)
            resp = await client.post("/v1/completions", json=body)
            assert resp.status_code == 200, resp.text
            assert resp.headers["x-mesh-worker"] == "d0" and resp.headers["x-mesh-prefill-worker"] == "p0"
            assert parse_answer(resp.content, stream, "/v1/completions")[0] == direct(cluster.workers["m"].url, body)[0]
    assert _delta(before, status(d0), "decode_requests", "decode_states_pulled") == (2, 2)
