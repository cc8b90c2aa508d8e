"""Disaggregation across nodes: the prefill, decode and mixed workers each run in their own
network namespace (``tests/netns.py``: veth pairs on a bridge, 10.x addresses); the relay runs in
the test process (root namespace). The KV pull goes from the decode node to the prefill node's
address, so it crosses both nodes' interfaces (their byte counters prove it).

Needs root and iproute2: without them these tests FAIL with the reason (.ci/run installs
iproute2); they are never skipped.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from mesh.core.index import PrefixIndex
from mesh.events.subscriber import KvEventSubscriber, WorkerEvents
from policies.base import Decision
from tests.disagg_cluster import (
    MODEL,
    Cluster,
    assert_leases_settled,
    assert_no_leaks,
    completion,
    direct,
    prompt_tokens,
    relay,
    request_info,
    set_faults,
    status,
)
from tests.netns import NetnsUnavailable, Topology
from tests.procs import ProcessGroup

pytestmark = pytest.mark.netns
EVENTS = ["--kv-events-endpoint", "tcp://*:5557", "--kv-events-replay-endpoint", "tcp://*:5558"]


@pytest.fixture(scope="module")
def topo() -> Iterator[Topology]:
    try:
        t = Topology.create("pdn", 3)
    except NetnsUnavailable as exc:
        pytest.fail(f"network namespaces are needed for the multi-node disaggregation tests: {exc}")
    try:
        yield t
    finally:
        t.destroy()


@pytest.fixture(scope="module")
def cluster(topo: Topology, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    group = ProcessGroup(tmp_path_factory.mktemp("netns"))
    c = Cluster(group)
    try:
        for node, (name, role, extra) in zip(topo.nodes, [("p0", "prefill", []), ("d0", "decode", EVENTS),
                                                          ("m", "mixed", [])], strict=True):
            c.start(name, role, *extra, host=node.address, prefix=topo.exec_args(node))
        c.wait()
        yield c
    finally:
        group.stop_all()


@pytest.fixture(autouse=True)
def no_leaks(cluster: Cluster) -> Iterator[None]:
    yield
    set_faults(cluster.workers["p0"].url, corrupt=0)
    assert_no_leaks(cluster.alive())


def _node_bytes(topo: Topology) -> list[int]:
    return [topo.interface_bytes(n) for n in topo.nodes]


async def test_kv_crosses_the_interfaces_and_greedy_output_matches(cluster: Cluster, topo: Topology) -> None:
    router = cluster.router()
    p0, d0, m = (cluster.workers[n].url for n in ("p0", "d0", "m"))
    assert p0.startswith("http://10.") and d0.startswith("http://10.")
    for i, stream in enumerate((False, True)):
        body = completion(prompt_tokens(400, seed=20 + i), 16, stream)
        ref, _ = direct(m, body)
        before, pulled = _node_bytes(topo), status(d0)["decode_bytes_pulled"]
        got = await relay(router, body)
        after = _node_bytes(topo)
        moved = status(d0)["decode_bytes_pulled"] - pulled
        assert got.text == ref and (got.prefill, got.decode) == ("p0", "d0")
        assert moved == 24 * 32 * 1024  # 24 blocks of 32 KiB
        assert after[0] - before[0] >= moved and after[1] - before[1] >= moved  # both nodes' veths
    assert_leases_settled(router)


async def test_the_router_index_learns_the_blocks_the_decode_node_received(cluster: Cluster, topo: Topology) -> None:
    """The decode node's KV events (over the bridge) announce the imported blocks as stored, so
    the next turn of the conversation can be routed to the decode node that holds it."""
    d0_addr = topo.nodes[1].address
    index = PrefixIndex()
    sub = KvEventSubscriber(index)
    sub.add_worker(WorkerEvents("d0", f"tcp://{d0_addr}:5557", f"tcp://{d0_addr}:5558", model=MODEL, block_size=16))
    try:
        router = cluster.router()
        prompt = prompt_tokens(300, seed=30)
        info = request_info(prompt, 8)
        got = await relay(router, completion(prompt, 8), info=info)
        assert got.text == direct(cluster.workers["m"].url, completion(prompt, 8))[0]
        deadline = time.monotonic() + 20
        while index.match(info.block_keys).get("d0") is None or index.match(info.block_keys)["d0"].gpu_blocks < 18:
            assert time.monotonic() < deadline, f"index has {dict(index.match(info.block_keys))}"
            await asyncio.sleep(0.05)
        # The next turn: the decode node already holds the first 18 blocks and pulls only the rest.
        before = status(cluster.workers["d0"].url)
        turn2 = prompt + prompt_tokens(40, seed=31)
        got2 = await relay(router, completion(turn2, 8), decision=Decision("p0", "next turn", decode_target="d0"))
        after = status(cluster.workers["d0"].url)
        assert got2.text == direct(cluster.workers["m"].url, completion(turn2, 8))[0]
        assert after["decode_blocks_local"] - before["decode_blocks_local"] >= 18
        assert got2.prefill_usage is not None and got2.prefill_usage["prompt_tokens_details"]["cached_tokens"] >= 288
        assert_leases_settled(router)
    finally:
        await sub.stop()


async def test_a_corrupted_block_on_the_wire_is_caught_across_nodes(cluster: Cluster) -> None:
    p0, d0 = cluster.workers["p0"].url, cluster.workers["d0"].url
    set_faults(p0, corrupt=1)
    retries = status(d0)["decode_pull_retries"]
    body = completion(prompt_tokens(200, seed=40), 8)
    got = await relay(cluster.router(), body)
    assert got.text == direct(cluster.workers["m"].url, body)[0]
    assert status(d0)["decode_pull_retries"] == retries + 1

