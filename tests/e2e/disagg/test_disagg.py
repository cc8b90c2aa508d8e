"""Prefill -> decode disaggregation end to end on loopback: real worker processes
(``workers.transfer.disagg_server``, tiny preset, CPU), the gateway relay (``mesh.gateway.disagg_relay``) and a
``Router`` with a prefill/decode pipeline, driven from the test process.

Every test ends with no leaked, pinned or in-use block, no live transfer and no pending
admission on any live worker (``/metrics``), and with every router lease settled.
The multi-node variant (workers in network namespaces) is ``test_disagg_netns.py``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import httpx
import pytest

from mesh.gateway.disagg_relay import DecodeQueue, RelayConfig, RelayError, RelayStats, prefill_body
from policies.base import Decision
from tests.disagg_cluster import (
    Cluster,
    assert_leases_settled,
    assert_no_leaks,
    astatus,
    completion,
    direct,
    metrics,
    prompt_tokens,
    relay,
    request_info,
    set_faults,
    status,
    wait_for,
)
from tests.procs import ProcessGroup, kill_process
from workers.transfer.kv_ipc import lease_blocks
from workers.transfer.kv_layout import Layout, TransferError

CHAT_PATH = "/v1/chat/completions"
POOL = ["p0", "p1", "d0", "d1"]


@pytest.fixture(scope="module")
def cluster(module_procs: ProcessGroup) -> Cluster:
    c = Cluster(module_procs)
    c.start("p0", "prefill")
    c.start("p1", "prefill")
    c.start("d0", "decode", "--kv-max-pending", "1")
    c.start("d1", "decode", "--kv-max-pending", "1")
    c.start("dx", "decode", "--dtype", "bfloat16")  # another KV layout
    c.start("pc", "prefill", "--kv-transfer-consumers", "decode,cpu_save", "--kv-transfer-ttl", "3")
    c.start("m", "mixed")
    c.wait()
    return c


@pytest.fixture(autouse=True)
def no_leaks(cluster: Cluster) -> Iterator[None]:
    yield
    for w in cluster.alive():
        set_faults(w.url, corrupt=0, truncate=0, delay_s=0.0, layout_override={})
    assert_no_leaks(cluster.alive())


def _pair(prefill: str, decode: str) -> Decision:
    return Decision(prefill, "test pair", decode_target=decode)


async def test_disaggregated_greedy_output_equals_one_mixed_worker(cluster: Cluster) -> None:
    router = cluster.router(POOL)
    m = cluster.workers["m"].url
    prompt = prompt_tokens(200, seed=1)
    for stream in (False, True):
        body = completion(prompt, 24, stream)
        ref, _ = direct(m, body)
        got = await relay(router, body)
        assert got.status == 200 and got.text == ref
        assert got.prefill in ("p0", "p1") and got.decode in ("d0", "d1")
        assert got.usage is not None and got.usage["completion_tokens"] == 24
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Tell me about foxes. " * 12}],
            "max_tokens": 20, "temperature": 0, "ignore_eos": True}
    for stream in (False, True):
        body = {**chat, "stream": stream}
        ref, _ = direct(m, body, CHAT_PATH)
        got = await relay(router, body, path=CHAT_PATH, info=request_info([1] * 260, 20))
        assert got.text == ref
    assert_leases_settled(router)


async def test_n_choices_prefill_once_and_decode_every_choice(cluster: Cluster) -> None:
    """``n`` through the relay: the prefill worker computes the prompt once for every choice (the
    gateway sends it ``n`` = 1), the decode worker runs the choices on the transferred blocks."""
    router = cluster.router(POOL)
    prompt = prompt_tokens(180, seed=24)  # its own prompt: a cached prefix would leave another test nothing to pull
    ref, _ = direct(cluster.workers["m"].url, completion(prompt, 12))
    before = {p: metrics(cluster.workers[p].url)["mesh_worker_prompt_tokens_total"] for p in ("p0", "p1")}
    got = await relay(router, {**completion(prompt, 12), "n": 3}, decision=_pair("p0", "d0"))
    assert got.status == 200
    answer = json.loads(got.raw)
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2]
    assert [c["text"] for c in answer["choices"]] == [ref] * 3
    assert answer["usage"]["completion_tokens"] == 36
    assert metrics(cluster.workers["p0"].url)["mesh_worker_prompt_tokens_total"] - before["p0"] == len(prompt)
    assert_leases_settled(router)
    # what the gateway sends a prefill worker (vLLM's would run n children of one token each)
    assert not {"n", "best_of"} & set(prefill_body({"model": "tiny", "prompt": "x", "n": 3, "best_of": 3}))


async def test_prefix_hits_on_the_prefill_and_the_decode_side(cluster: Cluster) -> None:
    router = cluster.router(POOL)
    m, d0 = cluster.workers["m"].url, cluster.workers["d0"].url
    first = prompt_tokens(320, seed=2)
    second = first + prompt_tokens(64, seed=3)  # the next turn of the same conversation
    a = await relay(router, completion(first, 12), decision=_pair("p0", "d0"))
    assert a.text == direct(m, completion(first, 12))[0]
    before = status(d0)
    b = await relay(router, completion(second, 12), decision=_pair("p0", "d0"))
    after = status(d0)
    assert b.text == direct(m, completion(second, 12))[0]
    assert b.prefill_usage is not None and b.prefill_usage["prompt_tokens_details"]["cached_tokens"] >= 304
    blocks = (len(second) - 1) // 16  # what the prefill offers
    local = after["decode_blocks_local"] - before["decode_blocks_local"]
    pulled = after["decode_blocks_pulled"] - before["decode_blocks_pulled"]
    assert local >= 19 and local + pulled == blocks and pulled <= 5  # only the new blocks crossed
    assert b.usage is not None and b.usage["prompt_tokens_details"]["cached_tokens"] == blocks * 16
    assert_leases_settled(router)


async def test_a_corrupted_block_is_detected_and_pulled_again(cluster: Cluster) -> None:
    router = cluster.router(POOL)
    p0, d0 = cluster.workers["p0"].url, cluster.workers["d0"].url
    prompt = prompt_tokens(150, seed=4)
    set_faults(p0, corrupt=1)
    before = status(d0)
    got = await relay(router, completion(prompt, 12), decision=_pair("p0", "d0"))
    assert got.text == direct(cluster.workers["m"].url, completion(prompt, 12))[0]
    assert got.prefill == "p0" and got.decode == "d0"
    assert status(d0)["decode_pull_retries"] == before["decode_pull_retries"] + 1
    assert "kv_transfer_corrupt" in httpx.get(f"{d0}/metrics").text


async def test_a_transfer_truncated_every_time_moves_to_another_pair(cluster: Cluster) -> None:
    router = cluster.router(POOL)
    p0 = cluster.workers["p0"].url
    prompt = prompt_tokens(150, seed=5)
    set_faults(p0, truncate=10)
    cancels = status(p0)["transfers_released_by_cancel"]
    stats = RelayStats()
    got = await relay(router, completion(prompt, 12), decision=_pair("p0", "d0"), stats=stats)
    assert got.text == direct(cluster.workers["m"].url, completion(prompt, 12))[0]
    assert got.prefill == "p1" and stats.transfer_failures == 1
    await wait_for(lambda: status(p0)["transfers_released_by_cancel"] == cancels + 1, what="p0 cancel")
    assert_leases_settled(router)


async def test_layout_mismatch_is_refused_cleanly_and_the_relay_moves_on(cluster: Cluster) -> None:
    p0, dx = cluster.workers["p0"].url, cluster.workers["dx"].url
    body = completion(prompt_tokens(100, seed=6), 8)
    pre = httpx.post(f"{p0}/v1/completions", json={**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}).json()
    refused = httpx.post(f"{dx}/v1/completions", json={**body, "kv_transfer_params": pre["kv_transfer_params"]})
    assert refused.status_code == 409
    err = refused.json()["error"]
    assert err["code"] == "kv_layout_mismatch" and "dtype" in err["message"]
    httpx.post(f"{p0}/kv_transfer/release", json={"transfer_id": pre["kv_transfer_params"]["transfer_id"], "cancel": True})
    router = cluster.router(POOL + ["dx"])
    stats = RelayStats()
    got = await relay(router, body, decision=_pair("p0", "dx"), stats=stats)
    assert got.decode in ("d0", "d1") and stats.decode_failures == 1
    assert got.text == direct(cluster.workers["m"].url, body)[0]
    assert_leases_settled(router)


async def test_a_transfer_arriving_after_cancel_fails_cleanly(cluster: Cluster) -> None:
    p0, d0 = cluster.workers["p0"].url, cluster.workers["d0"].url
    body = completion(prompt_tokens(120, seed=7), 8)
    pre = httpx.post(f"{p0}/v1/completions", json={**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}).json()
    kv = pre["kv_transfer_params"]
    assert httpx.post(f"{p0}/kv_transfer/release", json={"transfer_id": kv["transfer_id"], "cancel": True}).json()["released"]
    late = httpx.post(f"{d0}/v1/completions", json={**body, "kv_transfer_params": kv})
    assert late.status_code == 410 and late.json()["error"]["code"] == "kv_transfer_gone"
    assert status(p0)["transfer_late_pulls"] >= 1


async def test_client_cancel_mid_transfer_releases_both_sides(cluster: Cluster) -> None:
    router = cluster.router(POOL)
    p0, d0 = cluster.workers["p0"].url, cluster.workers["d0"].url
    set_faults(p0, delay_s=0.1)  # ~30 blocks: a 3 s pull
    before = status(p0)
    task = asyncio.create_task(relay(router, completion(prompt_tokens(500, seed=8), 8), decision=_pair("p0", "d0")))
    deadline = time.monotonic() + 30
    while (await astatus(d0))["admission_pending"] != 1:
        assert time.monotonic() < deadline and not task.done(), "the decode worker never started pulling"
        await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(200):
        if (await astatus(p0))["transfers_released_by_cancel"] == before["transfers_released_by_cancel"] + 1:
            break
        await asyncio.sleep(0.05)
    assert (await astatus(p0))["transfers_released_by_cancel"] == before["transfers_released_by_cancel"] + 1
    assert_leases_settled(router)


async def test_prefill_worker_dies_mid_transfer(cluster: Cluster) -> None:
    victim = cluster.start("pv", "prefill")
    cluster.wait()
    d0 = cluster.workers["d0"].url
    set_faults(victim.url, delay_s=0.1)
    router = cluster.router(POOL + ["pv"])
    prompt = prompt_tokens(500, seed=9)
    task = asyncio.create_task(relay(router, completion(prompt, 10), decision=_pair("pv", "d0")))
    deadline = time.monotonic() + 30
    while (await astatus(d0))["admission_pending"] != 1:  # d0 is pulling from the victim
        assert time.monotonic() < deadline and not task.done()
        await asyncio.sleep(0.05)
    kill_process(victim.proc)
    got = await task
    assert got.prefill in ("p0", "p1") and got.text == direct(cluster.workers["m"].url, completion(prompt, 10))[0]
    assert_leases_settled(router)


async def test_decode_worker_dies_after_admission(cluster: Cluster) -> None:
    victim = cluster.start("dv", "decode")
    cluster.wait()
    p0 = cluster.workers["p0"].url
    set_faults(p0, delay_s=0.1)
    router = cluster.router(POOL + ["dv"])
    prompt = prompt_tokens(500, seed=10)
    before = status(p0)
    task = asyncio.create_task(relay(router, completion(prompt, 10), decision=_pair("p0", "dv")))
    deadline = time.monotonic() + 30
    while (await astatus(victim.url))["admission_pending"] != 1:
        assert time.monotonic() < deadline and not task.done()
        await asyncio.sleep(0.05)
    kill_process(victim.proc)
    set_faults(p0, delay_s=0.0)
    got = await task
    assert got.prefill == "p0" and got.decode in ("d0", "d1")  # the same pinned blocks, another decode
    assert got.text == direct(cluster.workers["m"].url, completion(prompt, 10))[0]
    after = status(p0)
    assert after["transfers_released_by_consumer"] == before["transfers_released_by_consumer"] + 1
    assert_leases_settled(router)


async def test_blocks_stay_pinned_until_every_consumer_is_done(cluster: Cluster) -> None:
    """The multi-connector rule: with consumers ``decode,cpu_save`` the decode pull alone does not
    free the prefill's blocks; the second consumer's release does, exactly once."""
    pc = cluster.workers["pc"].url
    router = cluster.router(["pc", "d0", "d1"])
    body = completion(prompt_tokens(150, seed=11), 8)
    got = await relay(router, body, decision=_pair("pc", "d0"))
    assert got.text == direct(cluster.workers["m"].url, body)[0]
    await wait_for(lambda: _live(pc) and _live(pc)[0]["pending"] == ["cpu_save"], what="the decode's release")
    s = status(pc)
    assert s["transfers_active"] == 1 and s["pinned_blocks"] == 9  # decode done, cpu_save not yet
    tid = str(_live(pc)[0]["transfer_id"])
    r = httpx.post(f"{pc}/kv_transfer/release", json={"transfer_id": tid, "consumer": "cpu_save"}).json()
    assert r["released"]
    again = httpx.post(f"{pc}/kv_transfer/release", json={"transfer_id": tid, "consumer": "cpu_save"}).json()
    assert not again["released"]
    s = status(pc)
    assert s["transfers_active"] == 0 and s["transfer_duplicate_releases"] >= 1
    assert_leases_settled(router)


def _live(url: str) -> list[dict[str, object]]:
    """A prefill worker's live transfers (``GET /kv_transfer/transfers``)."""
    return list(httpx.get(f"{url}/kv_transfer/transfers").json()["transfers"])


async def test_an_unconsumed_transfer_is_released_at_its_deadline(cluster: Cluster) -> None:
    pc = cluster.workers["pc"].url
    body = completion(prompt_tokens(100, seed=12), 4)
    before = status(pc)
    httpx.post(f"{pc}/v1/completions", json={**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    assert status(pc)["transfers_active"] == 1
    await wait_for(lambda: status(pc)["transfers_released_by_timeout"] == before["transfers_released_by_timeout"] + 1,
                   timeout_s=10, what="the 3 s deadline")


async def test_a_burst_beyond_decode_headroom_is_absorbed(cluster: Cluster) -> None:
    """Two decode workers admit one pending transfer each; eight requests at once are spread and
    queued, never admitted beyond the bound, and all complete with the right tokens."""
    router = cluster.router(POOL)
    for p in ("p0", "p1"):
        set_faults(cluster.workers[p].url, delay_s=0.02)  # ~0.4 s per pull: the burst overlaps
    d = [cluster.workers[n].url for n in ("d0", "d1")]
    refused_before = sum(status(u)["admission_refused"] for u in d)
    prompts = [prompt_tokens(330, seed=100 + i) for i in range(8)]
    refs = [direct(cluster.workers["m"].url, completion(p, 6))[0] for p in prompts]
    queue, stats = DecodeQueue(max_waiting=16), RelayStats()
    config = RelayConfig(queue_wait_s=60, retry_after_cap_s=0.2)
    answers = await asyncio.gather(*(relay(router, completion(p, 6), queue=queue, stats=stats, config=config)
                                     for p in prompts))
    assert [a.text for a in answers] == refs
    after = [status(u) for u in d]
    assert all(s["admission_peak_pending"] <= 1 for s in after)  # never beyond the bound
    assert sum(s["admission_refused"] for s in after) > refused_before  # the burst exceeded headroom
    assert stats.decode_refusals > 0 and (queue.waits > 0 or {a.decode for a in answers} == {"d0", "d1"})
    assert queue.waiting == 0
    assert_leases_settled(router)


async def test_no_pair_answers_an_error_not_a_hang(cluster: Cluster) -> None:
    router = cluster.router(["p0", "dx"])  # the only decode worker cannot take this layout
    body = completion(prompt_tokens(100, seed=13), 4)
    with pytest.raises(RelayError) as err:
        await relay(router, body, decision=_pair("p0", "dx"))
    assert err.value.status in (409, 502, 503)
    assert_leases_settled(router)


async def test_an_ipc_read_lease_keeps_blocks_pinned_until_the_peer_is_done(cluster: Cluster) -> None:
    """The read lease a same-host peer holds while it copies blocks GPU to GPU (``workers.transfer.kv_ipc``),
    over the prefill worker's real TCP port: it answers the authoritative block ids, a release
    during the lease waits for it, a lease for other keys or a released transfer is refused."""
    p0 = cluster.workers["p0"].url
    body = completion(prompt_tokens(150, seed=21), 4)
    answer = httpx.post(f"{p0}/v1/completions", json={**body, "max_tokens": 1,
                                                      "kv_transfer_params": {"do_remote_decode": True}}).json()
    params = answer["kv_transfer_params"]
    keys = [int(k, 16) for k in params["remote_block_keys"]]
    layout = Layout.from_dict(params["layout"])
    with pytest.raises(TransferError) as wrong:
        async with lease_blocks(params, 0, keys[::-1], layout, timeout=10, num_peer_blocks=256):
            pass
    assert wrong.value.code == "kv_transfer_corrupt"
    async with lease_blocks(params, 0, keys, layout, timeout=10, num_peer_blocks=256) as lease:
        assert lease.block_ids == params["remote_block_ids"] and len(lease.block_ids) == 9
        r = httpx.post(f"{p0}/kv_transfer/release", json={"transfer_id": params["transfer_id"], "consumer": "decode"})
        assert r.json()["released"]
        (live,) = _live(p0)
        assert live["readers"] == 1 and live["released_by"] is not None
        assert status(p0)["pinned_blocks"] == 9  # released, but the peer is still reading
    await wait_for(lambda: not _live(p0) and status(p0)["pinned_blocks"] == 0, what="the unpin after the lease")
    with pytest.raises(TransferError) as gone:
        async with lease_blocks(params, 0, keys, layout, timeout=10, num_peer_blocks=256):
            pass
    assert gone.value.status == 410


async def test_a_lease_naming_blocks_outside_the_peer_cache_is_refused(cluster: Cluster) -> None:
    p0 = cluster.workers["p0"].url
    body = completion(prompt_tokens(150, seed=22), 4)
    params = httpx.post(f"{p0}/v1/completions", json={**body, "max_tokens": 1,
                                                      "kv_transfer_params": {"do_remote_decode": True}}).json()["kv_transfer_params"]
    keys = [int(k, 16) for k in params["remote_block_keys"]]
    with pytest.raises(TransferError) as bad:  # 9 distinct ids cannot all be block 0
        async with lease_blocks(params, 0, keys, Layout.from_dict(params["layout"]), timeout=10, num_peer_blocks=1):
            pass
    assert bad.value.code == "kv_transfer_corrupt"
    httpx.post(f"{p0}/kv_transfer/release", json={"transfer_id": params["transfer_id"], "consumer": "decode"})


async def test_forged_or_unsigned_transfer_params_are_refused(cluster: Cluster) -> None:
    """Workers of a deployment share a secret: a decode worker takes transfer parameters only
    as a prefill worker of that deployment signed them (else a client could point it at its own
    server and plant KV in its prefix cache), answering 403; genuine ones still work."""
    p0, d0 = cluster.workers["p0"].url, cluster.workers["d0"].url
    body = completion(prompt_tokens(150, seed=23), 4)
    params = httpx.post(f"{p0}/v1/completions", json={**body, "max_tokens": 1,
                                                      "kv_transfer_params": {"do_remote_decode": True}}).json()["kv_transfer_params"]
    assert isinstance(params.get("signature"), str)
    unsigned = {k: v for k, v in params.items() if k != "signature"}
    for forged in ({**params, "remote_host": "10.9.9.9"}, {**params, "remote_block_keys": params["remote_block_keys"][:2]},
                   unsigned, {**params, "signature": "0" * 64}):
        r = httpx.post(f"{d0}/v1/completions", json={**body, "kv_transfer_params": forged}, timeout=30)
        assert r.status_code == 403, r.text
        assert r.json()["error"]["code"] == "kv_params_forged"
    r = httpx.post(f"{d0}/v1/completions", json={**body, "kv_transfer_params": params}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == direct(cluster.workers["m"].url, body)[0]
