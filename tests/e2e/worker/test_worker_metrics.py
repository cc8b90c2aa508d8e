"""The gateway reads each worker's KV usage and capacity from its /metrics (mesh/cluster/worker_metrics.py,
``WorkerRegistry.read_metrics``).

Parsing: vLLM (two DP ranks, ``engine`` label), SGLang (``dp_rank``, ``tp_rank``), the bundled
worker's names, hostile text (escaped quotes and newlines in labels, NaN/Inf, garbage, lines and
bodies over the bounds), any split of a body into chunks. Real processes: fake vLLM / SGLang /
hostile workers (this file's ``__main__``: one process, one port per kind) behind a real gateway
and a real registry; two real bundled tiny workers behind a real gateway, one of them filled by a
long request sent to it directly (the gateway's own accounting never sees it): the gateway shows
its real usage and ``admission_headroom``'s ``max_kv_usage`` steers requests to the other.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import re
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from mesh.cluster.registry import WorkerRegistry, loads_for_targets
from mesh.cluster.worker_metrics import MAX_BODY_BYTES, MetricsError, MetricsScanner, RankLoad, Scrape, parse
from mesh.config import MeshConfig, WorkerConfig
from mesh.gateway.upstream import UpstreamPool
from tests.e2e_bundled import ADMIN, ADMIN_KEY, start_workers
from tests.procs import PYTHON, Proc, ProcessGroup, free_port, wait_http, wait_until

# ---- bodies as the engines write them ------------------------------------------------------------

_JUNK = "".join(  # what surrounds the few names a router needs: histograms, counters, comments
    f'# HELP vllm:h{i}_seconds h\n# TYPE vllm:h{i}_seconds histogram\n'
    + "".join(f'vllm:h{i}_seconds_bucket{{engine="{e}",le="{2 ** k}",model_name="m"}} {k}.0\n'
              for e in (0, 1) for k in range(12))
    for i in range(6)
)

VLLM_DP2 = (
    _JUNK
    + '# HELP vllm:num_requests_running Number of requests in model execution batches.\n'
    '# TYPE vllm:num_requests_running gauge\n'
    'vllm:num_requests_running{engine="0",model_name="we\\"ird\\\\name\\n"} 3.0\n'
    'vllm:num_requests_running{engine="1",model_name="we\\"ird\\\\name\\n"} 1.0\n'
    'vllm:num_requests_running_not_this{engine="0"} 99.0\n'
    '# TYPE vllm:num_requests_waiting gauge\n'
    'vllm:num_requests_waiting{model_name="m",engine="0"} 2.0\n'
    'vllm:num_requests_waiting{model_name="m",engine="1"} 0.0\n'
    '# TYPE vllm:gpu_cache_usage_perc gauge\n'
    'vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.95\n'
    'vllm:gpu_cache_usage_perc{engine="1",model_name="m"} 0.1\n'
    '# TYPE vllm:kv_cache_usage_perc gauge\n'
    'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.95\n'
    'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.1\n'
    '# TYPE vllm:cache_config_info gauge\n'
    'vllm:cache_config_info{block_size="32",cache_dtype="auto",enable_prefix_caching="True",engine="0",'
    'gpu_memory_utilization="0.9",num_cpu_blocks="None",num_gpu_blocks="2200"} 1.0\n'
    'vllm:cache_config_info{block_size="32",cache_dtype="auto",enable_prefix_caching="True",engine="1",'
    'gpu_memory_utilization="0.9",num_cpu_blocks="None",num_gpu_blocks="2200"} 1.0\n'
)

SGLANG_DP2 = "".join(
    f'sglang:{name}{{dp_rank="{dp}",engine_type="unified",model_name="m",pp_rank="0",tp_rank="{tp}"}} {value}\n'
    for dp, usage, running, queued in ((0, 0.3, 5, 0), (1, 0.7, 9, 4))
    for tp in (0, 1)
    for name, value in (("token_usage", usage - 0.1 * tp), ("max_total_num_tokens", 8000),
                        ("num_running_reqs", running), ("num_queue_reqs", queued), ("gen_throughput", 55.5))
)

BUNDLED = (
    "# TYPE mesh_worker_num_requests_running gauge\nmesh_worker_num_requests_running 2.0\n"
    "vllm:num_requests_running 2.0\nmesh_worker_num_requests_waiting 1.0\nvllm:num_requests_waiting 1.0\n"
    "mesh_worker_kv_cache_usage 0.25\nvllm:kv_cache_usage_perc 0.25\nmesh_worker_kv_blocks_total 64.0\n"
    "mesh_worker_kv_blocks_used 16.0\n"
)

# Lines that look like the names a router reads but are broken: each must be skipped, nothing else.
BROKEN = (
    'vllm:kv_cache_usage_perc{engine="0" 0.5\n'  # unterminated label set
    'vllm:kv_cache_usage_perc{engine="0",bad label="x"} 0.5\n'
    'vllm:kv_cache_usage_perc{engine="zero"} 0.5\n'  # a rank that is not a number
    'vllm:kv_cache_usage_perc{engine="0"} NaN\n'
    'vllm:kv_cache_usage_perc{engine="0"} not-a-number\n'
    'vllm:num_requests_running{engine="0"} +Inf\n'
    'vllm:num_requests_waiting{engine="0"} -3\n'
    'vllm:kv_cache_usage_perc{engine="0"}\n'  # no value
    'vllm:cache_config_info{engine="0",num_gpu_blocks="None"} 1.0\n'  # before memory profiling
)


def test_vllm_two_dp_ranks_are_told_apart_by_the_engine_label() -> None:
    got = parse(VLLM_DP2.encode())
    assert set(got) == {0, 1}
    # vLLM writes the API server's total (2200 over both engines) on every engine's line
    assert got[0] == RankLoad(kv_usage=0.95, kv_blocks=1100, kv_block_size=32, num_running=3, num_waiting=2)
    assert got[1] == RankLoad(kv_usage=0.1, kv_blocks=1100, kv_block_size=32, num_running=1, num_waiting=0)
    # the gateway counts blocks of its own size: 1100 blocks of 32 tokens are 2200 of 16
    assert got[0].capacity_blocks(16) == 2200 and got[0].capacity_blocks(32) == 1100


def _cache_info(engines: tuple[int, ...], total: int) -> str:
    return "".join(f'vllm:cache_config_info{{block_size="16",engine="{e}",num_gpu_blocks="{total}"}} 1.0\n'
                   for e in engines)


def test_vllm_capacity_is_the_api_servers_total_over_the_engines_it_lists() -> None:
    got = parse(_cache_info((0, 1, 2, 3), 4000).encode())  # one API server, DP 4
    assert {r: load.kv_blocks for r, load in got.items()} == dict.fromkeys((0, 1, 2, 3), 1000)
    # hybrid / external LB: this API server lists only its local engines 2 and 3 (global ranks)
    got = parse(_cache_info((2, 3), 2400).encode())
    assert {r: load.kv_blocks for r, load in got.items()} == {2: 1200, 3: 1200}
    assert parse(_cache_info((5,), 900).encode())[5].kv_blocks == 900  # external LB: one engine per server


def test_sglang_priority_counts_are_summed_and_tp_duplicates_not() -> None:
    body = "".join(f'sglang:{name}{{dp_rank="0",priority="{p}",tp_rank="{tp}"}} {value}\n'
                   for tp in (0, 1) for p, running, queued in ((0, 3, 1), (5, 4, 2))
                   for name, value in (("num_running_reqs", running), ("num_queue_reqs", queued)))
    got = parse((body + 'sglang:token_usage{dp_rank="0",tp_rank="0"} 0.5\n').encode())
    assert (got[0].num_running, got[0].num_waiting, got[0].kv_usage) == (7, 3, 0.5)


def test_sglang_dp_ranks_and_token_capacity() -> None:
    got = parse(SGLANG_DP2.encode())
    assert set(got) == {0, 1}
    # two tp_rank samples per dp_rank: the fullest one counts
    assert got[0].kv_usage == pytest.approx(0.3) and got[1].kv_usage == pytest.approx(0.7)
    assert (got[1].num_running, got[1].num_waiting) == (9, 4)
    assert got[0].kv_blocks == 8000 and got[0].kv_block_size == 1  # tokens
    assert got[0].capacity_blocks(16) == 500


def test_bundled_worker_names_have_no_rank() -> None:
    got = parse(BUNDLED.encode())
    assert got == {None: RankLoad(kv_usage=0.25, kv_blocks=64, kv_block_size=None, num_running=2, num_waiting=1)}
    assert got[None].capacity_blocks(16) == 64  # the worker's blocks are the gateway's (its block_size)


def test_broken_lines_are_skipped_and_the_good_ones_kept() -> None:
    scanner = MetricsScanner()
    scanner.feed((BROKEN + 'vllm:kv_cache_usage_perc{engine="1"} 0.5 1712345678000\n').encode())
    assert scanner.result() == {1: RankLoad(kv_usage=0.5)}
    assert scanner.skipped >= 6
    assert parse(BROKEN.encode()) == {}


def test_labels_with_escaped_quotes_braces_and_newlines() -> None:
    body = ('vllm:kv_cache_usage_perc{model_name="a\\"} 0.9\\nvllm:kv_cache_usage_perc{engine=\\"5\\"} 0.9",'
            'engine="1",x="}{\\\\"} 0.4\n')
    assert parse(body.encode()) == {1: RankLoad(kv_usage=0.4)}


def test_any_split_into_chunks_reads_the_same() -> None:
    body = (VLLM_DP2 + SGLANG_DP2).encode()
    whole = parse(body)
    rng = random.Random(3)
    for _ in range(40):
        scanner = MetricsScanner()
        pos = 0
        while pos < len(body):
            step = rng.choice((1, 2, 7, 64, 1000, 5000))
            scanner.feed(body[pos:pos + step])
            pos += step
        assert scanner.result() == whole


def test_bounds_on_lines_and_bodies() -> None:
    with pytest.raises(MetricsError, match="line"):
        parse(b"x" * (MetricsScanner().max_bytes // 4))  # no newline: one line over the bound
    scanner = MetricsScanner(max_bytes=1 << 20)
    with pytest.raises(MetricsError, match="over"):
        for _ in range(100):
            scanner.feed(b"# a comment line\n" * 4096)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=2000), st.lists(st.sampled_from(
    [b"vllm:kv_cache_usage_perc", b"{engine=\"", b"\"}", b" ", b"\n", b"\\", b"NaN", b"0.5", b"1e400", b"sglang:token_usage",
     b"dp_rank=\"1\"", b"mesh_worker_kv_blocks_total", b",", b"vllm:cache_config_info{num_gpu_blocks=\"7\"}"]), max_size=40))
def test_garbage_never_raises_anything_but_a_bounds_error(noise: bytes, parts: list[bytes]) -> None:
    body = noise + b"".join(parts)
    try:
        got = parse(body)
    except MetricsError:
        return
    for load in got.values():
        assert load.kv_usage is None or 0.0 <= load.kv_usage <= 1.0
        assert load.kv_blocks is None or load.kv_blocks > 0
        assert all(v is None or (v >= 0 and math.isfinite(v)) for v in (load.num_running, load.num_waiting))


def test_ranks_map_to_targets() -> None:
    a, b = RankLoad(kv_usage=0.5, kv_blocks=100), RankLoad(kv_usage=0.1, kv_blocks=300)
    assert loads_for_targets({0: a, 1: b}, 2) == [a, b]
    assert loads_for_targets({None: a}, 2) is None  # an unlabelled reading of a DP worker: unplaceable
    assert loads_for_targets({3: b, 2: a}, 2) == [a, b]  # vLLM hybrid LB: global ranks, sorted onto the targets
    assert loads_for_targets({0: a, 1: b, 2: a}, 2) is None  # more ranks than targets
    assert loads_for_targets({1: b}, 2) is None
    assert loads_for_targets({7: a}, 1) == [a]  # vLLM external LB: a one-engine server numbered by its global rank
    whole = loads_for_targets({0: a, 1: b}, 1)[0]  # several engines behind one target: one pool
    assert whole is not None and whole.kv_blocks == 400 and whole.kv_usage == pytest.approx(0.2)


# ---- fake workers (a real process; run as ``python -m tests.e2e.worker.test_worker_metrics --serve kind:port``) --

KINDS = ("vllm", "sglang", "bundled", "vllm_ext", "garbage", "huge_line", "huge_body", "absent", "slow", "error")
# vLLM hybrid / external LB: an API server managing engines 2 and 3 of DP 4 labels them by global rank
VLLM_EXT = VLLM_DP2.replace('engine="0"', 'engine="2"').replace('engine="1"', 'engine="3"')
HUGE = 50 << 20


class FakeWorker:
    """One port of the fake process: /health 200, /metrics as its kind says, POST /mode {kind}."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                method, path = head.split(b" ", 2)[:2]
                length = re.search(rb"(?i)content-length: *(\d+)", head)
                body = await reader.readexactly(int(length.group(1))) if length else b""
                if method == b"POST" and path == b"/mode":
                    self.kind = json.loads(body)["kind"]
                    await self._answer(writer, 200, b"{}")
                elif path == b"/health":
                    await self._answer(writer, 200, b"{}")
                elif path == b"/metrics":
                    await self._metrics(writer)
                else:
                    await self._answer(writer, 404, b"{}")
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()

    async def _answer(self, writer: asyncio.StreamWriter, status: int, body: bytes, length: int | None = None) -> None:
        writer.write(b"HTTP/1.1 %d X\r\ncontent-type: text/plain\r\ncontent-length: %d\r\n\r\n"
                     % (status, len(body) if length is None else length) + body)
        await writer.drain()

    async def _metrics(self, writer: asyncio.StreamWriter) -> None:
        kind = self.kind
        if kind in ("vllm", "sglang", "bundled", "vllm_ext"):
            bodies = {"vllm": VLLM_DP2, "sglang": SGLANG_DP2, "bundled": BUNDLED, "vllm_ext": VLLM_EXT}
            await self._answer(writer, 200, bodies[kind].encode())
        elif kind == "garbage":
            rng = random.Random(7)
            await self._answer(writer, 200, BROKEN.encode() + bytes(rng.randrange(256) for _ in range(200_000)))
        elif kind in ("huge_line", "huge_body"):
            chunk = b"7" * 65536 if kind == "huge_line" else b"# the same comment line, again and again\n" * 1600
            await self._answer(writer, 200, b"", length=HUGE)
            sent = 0
            while sent < HUGE:  # the gateway hangs up long before
                writer.write(chunk)
                await writer.drain()
                sent += len(chunk)
        elif kind == "slow":
            await asyncio.sleep(3600)
        elif kind == "error":
            await self._answer(writer, 500, b"oops")
        else:
            await self._answer(writer, 404, b"not found")


async def _serve(specs: list[str]) -> None:
    servers = []
    for spec in specs:
        kind, port = spec.split(":")
        servers.append(await asyncio.start_server(FakeWorker(kind).handle, "127.0.0.1", int(port)))
    await asyncio.gather(*(s.serve_forever() for s in servers))


def start_fakes(procs: ProcessGroup, kinds: list[str]) -> dict[str, str]:
    """One process serving every kind on its own port; kind -> base URL."""
    ports = {kind: free_port() for kind in kinds}
    specs = [a for kind, port in ports.items() for a in ("--serve", f"{kind}:{port}")]
    proc = procs.start([PYTHON, "-m", "tests.e2e.worker.test_worker_metrics", *specs], name="fakes")
    for port in ports.values():
        wait_http(f"http://127.0.0.1:{port}/health", proc=proc, timeout_s=30)
    return {kind: f"http://127.0.0.1:{port}" for kind, port in ports.items()}


# ---- the registry over real sockets --------------------------------------------------------------


def _registry(urls: dict[str, str], dp: dict[str, int]) -> WorkerRegistry:
    config = MeshConfig(health={"interval_s": 0.2, "timeout_s": 0.5})
    registry = WorkerRegistry(config)
    for kind, url in urls.items():
        registry.add(WorkerConfig(name=kind, url=url, dp_size=dp.get(kind, 1), block_size=16), source="config")
    return registry


async def _round(registry: WorkerRegistry, pool: UpstreamPool) -> None:
    """A health round, then the scrapes it started (they run on their own)."""
    await registry.check_all(pool)
    await registry.scrapes_done()


def _kv(registry: WorkerRegistry, tid: str) -> tuple[float, int]:
    t = registry.targets[tid]
    return t.kv_usage, t.kv_capacity_blocks


def test_registry_reads_targets_and_falls_back_to_unknown(procs: ProcessGroup) -> None:
    urls = start_fakes(procs, ["vllm", "sglang", "bundled"])
    registry = _registry(urls, {"vllm": 2, "sglang": 2})

    async def run() -> None:
        pool = UpstreamPool()
        try:
            await _round(registry, pool)
            assert _kv(registry, "vllm@0") == (0.95, 2200) and _kv(registry, "vllm@1") == (0.1, 2200)
            assert _kv(registry, "sglang@0") == (pytest.approx(0.3), 500)
            assert _kv(registry, "sglang@1") == (pytest.approx(0.7), 500)
            assert _kv(registry, "bundled") == (0.25, 64)
            assert all(w.healthy and w.metrics_result == "ok" for w in registry.workers.values())
            described = registry.workers["vllm"].describe()["targets"][0]
            assert (described["kv_usage"], described["reported_running"], described["reported_waiting"]) == (0.95, 3, 2)

            # a failing /metrics keeps the last reading for a while, then reads as unknown
            httpx.post(urls["vllm"] + "/mode", json={"kind": "error"})
            httpx.post(urls["sglang"] + "/mode", json={"kind": "slow"})
            await _round(registry, pool)
            assert registry.workers["vllm"].metrics_result == "http_error"
            assert registry.workers["sglang"].metrics_result == "unreachable"  # timed out
            assert _kv(registry, "vllm@0") == (0.95, 2200) and _kv(registry, "sglang@1")[1] == 500
            for name in ("vllm", "sglang"):
                registry.workers[name].metrics_ok_at -= registry.stale_after_s + 1  # time passes
            await _round(registry, pool)
            assert {tid: _kv(registry, tid) for tid in ("vllm@0", "vllm@1", "sglang@0", "sglang@1")} == \
                dict.fromkeys(("vllm@0", "vllm@1", "sglang@0", "sglang@1"), (0.0, 0))
            assert registry.workers["vllm"].describe()["targets"][0]["kv_usage"] is None
            assert registry.workers["sglang"].healthy  # /health still answers: a scrape never unhealths

            # a 404 is an answer: unknown at once, and asked again only after a while
            httpx.post(urls["bundled"] + "/mode", json={"kind": "absent"})
            await _round(registry, pool)
            assert _kv(registry, "bundled") == (0.0, 0) and registry.workers["bundled"].metrics_result == "absent"
            httpx.post(urls["bundled"] + "/mode", json={"kind": "bundled"})
            counts = dict(registry.workers["bundled"].metrics_counts)
            await _round(registry, pool)
            assert registry.workers["bundled"].metrics_counts == counts  # backed off: not asked
            registry.workers["bundled"].metrics_next_at = 0.0
            await _round(registry, pool)
            assert _kv(registry, "bundled") == (0.25, 64)
        finally:
            await pool.close()

    asyncio.run(run())


def test_hostile_bodies_read_as_unknown_in_bounded_memory(procs: ProcessGroup) -> None:
    urls = start_fakes(procs, ["garbage", "huge_line", "huge_body"])
    registry = _registry(urls, {})

    async def run() -> None:
        pool = UpstreamPool()
        try:
            tracemalloc.start()
            for _ in range(2):
                await _round(registry, pool)
            _, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
        finally:
            await pool.close()
        assert peak < 8 << 20, f"peak {peak} bytes while reading {HUGE}-byte bodies"
        got = {w.name: (w.metrics_result, w.healthy) for w in registry.workers.values()}
        assert got == {"garbage": ("empty", True), "huge_line": ("invalid", True), "huge_body": ("invalid", True)}
        assert "over" in (registry.workers["huge_body"].metrics_error or "")
        assert all(_kv(registry, t) == (0.0, 0) for t in registry.targets)

    asyncio.run(run())
    assert MAX_BODY_BYTES < HUGE


# ---- the registry over in-process fake workers (real sockets, one event loop) ------------------------


async def _fakes_here(kinds: list[str]) -> tuple[list[asyncio.Server], dict[str, str]]:
    """Fake workers served on this loop; kind -> base URL (close the servers when done)."""
    servers = [await asyncio.start_server(FakeWorker(kind).handle, "127.0.0.1", 0) for kind in kinds]
    return servers, {kind: f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}" for kind, srv in zip(kinds, servers)}


def _in_process(test: Any, kinds: list[str], **health: Any) -> None:
    async def run() -> None:
        servers, urls = await _fakes_here(kinds)
        registry = WorkerRegistry(MeshConfig(health={"interval_s": 0.2, "timeout_s": 0.5, **health}))
        pool = UpstreamPool()
        try:
            await test(registry, pool, urls)
        finally:
            await registry.stop()
            await pool.close()
            for srv in servers:
                srv.close()
    asyncio.run(run())


def _add(registry: WorkerRegistry, name: str, url: str, dp: int = 1) -> None:
    registry.add(WorkerConfig(name=name, url=url, dp_size=dp, block_size=16), source="admin")


def test_a_hanging_metrics_does_not_slow_health_and_its_scrape_ends_with_the_worker() -> None:
    async def test(registry: WorkerRegistry, pool: UpstreamPool, urls: dict[str, str]) -> None:
        _add(registry, "slow", urls["slow"])
        _add(registry, "vllm", urls["vllm"], dp=2)
        slow = registry.workers["slow"]
        for _ in range(3):  # health.timeout_s is 30: a round that waited for the scrape would not end
            await asyncio.wait_for(registry.check_all(pool), 10)
        assert all(w.healthy for w in registry.workers.values())
        task = registry._scrapes[slow]  # one scrape at most in flight per worker, the first still
        assert not task.done()
        await asyncio.wait_for(registry.scrapes_done(), 10) if registry.workers["vllm"] in registry._scrapes else None
        assert _kv(registry, "vllm@0") == (0.95, 2200)  # the other worker's scrape was not held up
        registry.remove("slow")
        with pytest.raises(asyncio.CancelledError):
            await task
        assert slow not in registry._scrapes and slow.metrics_result == ""  # nothing written after removal
        await registry.check_all(pool)
        await registry.stop()
        assert not registry._scrapes

    _in_process(test, ["slow", "vllm"], timeout_s=30)


def test_a_worker_added_at_runtime_is_scraped_at_once() -> None:
    async def test(registry: WorkerRegistry, pool: UpstreamPool, urls: dict[str, str]) -> None:
        await registry.check_all(pool)  # the gateway runs: rounds have started (no worker yet)
        _add(registry, "vllm", urls["vllm"], dp=2)  # POST /workers, a reload
        await asyncio.wait_for(registry.scrapes_done(), 10)  # no round in between
        assert _kv(registry, "vllm@1") == (0.1, 2200)

    _in_process(test, ["vllm"])


def test_turning_worker_metrics_off_by_reload_drops_every_reported_value() -> None:
    async def test(registry: WorkerRegistry, pool: UpstreamPool, urls: dict[str, str]) -> None:
        _add(registry, "vllm", urls["vllm"], dp=2)
        await _round(registry, pool)
        assert _kv(registry, "vllm@0") == (0.95, 2200)
        registry.reconfigure(MeshConfig(health={"interval_s": 0.2, "timeout_s": 0.5, "worker_metrics": False}))
        await _round(registry, pool)
        assert [_kv(registry, t) for t in ("vllm@0", "vllm@1")] == [(0.0, 0), (0.0, 0)]
        described = registry.workers["vllm"].describe()
        assert described["metrics"] == {"result": None, "error": None, "age_s": None}
        assert all(t["kv_usage"] is None and t["reported_running"] is None for t in described["targets"])
        families = {f.name: f.samples for f in registry.metric_families()}
        assert not any(families[n] for n in ("mesh_worker_kv_usage", "mesh_worker_kv_capacity_blocks",
                                             "mesh_worker_reported_running", "mesh_worker_metrics_age_seconds"))

    _in_process(test, ["vllm"])


def test_global_rank_labels_map_onto_targets_and_a_mismatch_is_not_ok(caplog: pytest.LogCaptureFixture) -> None:
    async def test(registry: WorkerRegistry, pool: UpstreamPool, urls: dict[str, str]) -> None:
        _add(registry, "ext", urls["vllm_ext"], dp=2)
        _add(registry, "wrong", urls["vllm_ext"] + "/", dp=3)  # 2 ranks listed, dp_size 3
        for _ in range(3):
            await _round(registry, pool)
            registry.workers["wrong"].metrics_next_at = 0.0
        assert registry.workers["ext"].metrics_result == "ok"
        assert [_kv(registry, t) for t in ("ext@0", "ext@1")] == [(0.95, 2200), (0.1, 2200)]
        wrong = registry.workers["wrong"]
        assert wrong.metrics_result == "unmatched" and "dp_size 3" in (wrong.metrics_error or "")
        assert wrong.metrics_counts == {"unmatched": 3}
        assert all(_kv(registry, f"wrong@{r}") == (0.0, 0) for r in range(3))
        assert len([r for r in caplog.records if "unmatched" in r.getMessage()]) == 1  # logged once

    with caplog.at_level("DEBUG", logger="mesh.cluster.registry"):
        _in_process(test, ["vllm_ext"])


def test_a_flapping_metrics_logs_rate_limited_and_timeouts_at_warning(caplog: pytest.LogCaptureFixture) -> None:
    registry = WorkerRegistry(MeshConfig())
    _add(registry, "w", "http://127.0.0.1:9")
    worker = registry.workers["w"]
    ok = Scrape("ok", {None: RankLoad(kv_usage=0.5)})
    with caplog.at_level("DEBUG", logger="mesh.cluster.registry"):
        for i in range(10):  # a /metrics that times out every other round
            registry._apply_scrape(worker, ok, 100.0 + i)
            registry._apply_scrape(worker, Scrape("unreachable", error="GET /metrics failed: timed out"), 100.5 + i)
    lines = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert [level for level, _ in lines] == ["INFO", "WARNING"], lines
    assert "timed out" in lines[1][1]
    assert worker.metrics_counts == {"ok": 10, "unreachable": 10}


# ---- a real gateway over fake workers --------------------------------------------------------------


def _gateway(procs: ProcessGroup, tmp_path: Path, workers: list[dict[str, Any]], policy: Any,
             worker_metrics: bool = True) -> tuple[Proc, httpx.Client]:
    config = {
        "server": {"admin_key": ADMIN_KEY, "request_timeout_s": 60},
        "workers": workers,
        "health": {"interval_s": 0.2, "timeout_s": 1, "unhealthy_threshold": 1, "worker_metrics": worker_metrics},
        "policy": policy,
    }
    path = tmp_path / "mesh.yaml"
    path.write_text(yaml.safe_dump(config))
    port = free_port()
    proc = procs.start_http([PYTHON, "-m", "mesh.commands.serve", "--config", str(path), "--port", str(port),
                             "--log-level", "warning"], name="gateway", port=port)
    return proc, httpx.Client(base_url=proc.url, timeout=30)


def _series(text: str, family: str) -> dict[str, float]:
    return {m.group(1): float(m.group(2))
            for m in re.finditer(rf'^{family}{{(?:target|worker)="([^"]+)"}} (\S+)$', text, re.M)}


KV_POLICY = {"name": "pipeline", "params": {
    "filters": [{"name": "admission_headroom", "params": {"max_kv_usage": 0.5}}],
    "scorers": [{"name": "kv_utilization", "weight": 1}], "picker": "max_score"}}


def test_gateway_shows_fake_engines_per_target_and_routes_on_them(procs: ProcessGroup, tmp_path: Path) -> None:
    urls = start_fakes(procs, ["vllm", "sglang", "garbage", "huge_body", "absent"])
    engines = ("vllm", "sglang")  # they serve "m"; the hostile ones "other"
    workers = [{"name": kind, "url": url, "block_size": 16, "dp_size": 2 if kind in engines else 1,
                "models": ["m" if kind in engines else "other"]} for kind, url in urls.items()]
    gateway, http = _gateway(procs, tmp_path, workers, KV_POLICY)
    with http:
        def scraped() -> str | None:
            text = http.get("/metrics").text
            names = set(re.findall(r'^mesh_worker_metrics_scrapes_total{result="\w+",worker="(\w+)"}', text, re.M))
            return text if names == set(urls) else None

        text = wait_until(scraped, 30, "every worker scraped")
        usage, capacity = _series(text, "mesh_worker_kv_usage"), _series(text, "mesh_worker_kv_capacity_blocks")
        assert usage == pytest.approx({"vllm@0": 0.95, "vllm@1": 0.1, "sglang@0": 0.3, "sglang@1": 0.7})
        assert capacity == {"vllm@0": 2200, "vllm@1": 2200, "sglang@0": 500, "sglang@1": 500}
        assert _series(text, "mesh_worker_reported_waiting") == {"vllm@0": 2, "vllm@1": 0, "sglang@0": 0, "sglang@1": 4}
        assert set(_series(text, "mesh_worker_metrics_age_seconds")) == {"vllm", "sglang"}
        assert _series(text, "mesh_worker_healthy") == dict.fromkeys(urls, 1.0)  # hostile /metrics: still healthy
        ws = {w["name"]: w for w in http.get("/workers", headers=ADMIN).json()["workers"]}
        assert ws["huge_body"]["metrics"]["result"] == "invalid" and ws["absent"]["metrics"]["result"] == "absent"
        assert [t["kv_capacity_blocks"] for t in ws["sglang"]["targets"]] == [500, 500]

        # vllm@0 and sglang@1 are over max_kv_usage 0.5; of the rest, the freest cache wins
        body = {"model": "m", "prompt": "hello", "max_tokens": 4}
        route = http.post("/debug/route", json=body).json()["decision"]
        assert route["target"] == "vllm@1", route
        scores = {tid: c["scores"] for tid, c in route["candidates"].items()}
        assert "vllm@0" not in scores and "sglang@1" not in scores
        assert scores["sglang@0"]["kv_utilization"] == pytest.approx(0.7)
        route = http.post("/debug/route", json={**body, "model": "other"}).json()["decision"]
        assert {tid: c["scores"]["kv_utilization"] for tid, c in route["candidates"].items()} == \
            dict.fromkeys(("garbage", "huge_body", "absent"), 1.0)  # unknown reads as empty (the scorer's rule)
    assert gateway.alive()


def test_a_request_no_worker_could_hold_is_a_400_not_a_retryable_503(procs: ProcessGroup, tmp_path: Path) -> None:
    """Under ``admission_headroom`` a prompt larger than every worker's KV cache was "no healthy
    worker" (503, retried by the SDKs) while both workers were healthy."""
    urls = start_fakes(procs, ["vllm", "sglang"])  # 2,200 and 500 blocks of 16 tokens
    workers = [{"name": kind, "url": url, "block_size": 16, "dp_size": 2, "models": ["m"]} for kind, url in urls.items()]
    policy = {"name": "pipeline", "params": {"filters": ["admission_headroom"], "scorers": [{"name": "load", "weight": 1}]}}
    _, http = _gateway(procs, tmp_path, workers, policy)
    with http:
        wait_until(lambda: "mesh_worker_kv_capacity_blocks{target=\"sglang@1\"} 500" in http.get("/metrics").text, 30,
                   "capacities scraped")
        resp = http.post("/v1/completions", json={"model": "m", "prompt": "x" * (2200 * 16), "max_tokens": 16})
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["code"] == "context_length_exceeded" and "2200" in error["message"], error
        # one that fits the largest worker's whole cache but not its free blocks now is no 400
        resp = http.post("/v1/completions", json={"model": "m", "prompt": "x" * (2100 * 16), "max_tokens": 16})
        assert resp.status_code != 400, resp.text


# ---- real bundled workers ------------------------------------------------------------------------


def _hold(url: str, prompt: str, max_tokens: int, started: threading.Event, stop: threading.Event,
          status: list[int]) -> None:
    """A long streamed completion sent straight to a worker; stops reading (and hangs up) on ``stop``."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=120) as client, client.stream("POST", url + "/v1/completions", json=body) as resp:
        status.append(resp.status_code)
        for _ in resp.iter_lines():
            started.set()
            if stop.is_set():
                return


def test_real_worker_usage_reaches_the_gateway_and_steers_admission(procs: ProcessGroup, tmp_path: Path) -> None:
    blocks = 128
    ws = start_workers(procs, ["w0", "w1"], num_kv_blocks=blocks)
    policy = {"name": "pipeline", "params": {
        "filters": [{"name": "admission_headroom", "params": {"max_kv_usage": 0.4}}],
        "scorers": [{"name": "load", "weight": 1}], "picker": "max_score"}}
    gateway, http = _gateway(procs, tmp_path, [w.config() for w in ws.values()], policy)

    def kv() -> tuple[dict[str, float], dict[str, float]]:
        text = http.get("/metrics").text
        return _series(text, "mesh_worker_kv_usage"), _series(text, "mesh_worker_kv_capacity_blocks")

    with http:
        usage, capacity = wait_until(lambda: (got := kv())[0].keys() == {"w0", "w1"} and got, 60, "both workers' KV read")
        assert capacity == {"w0": blocks, "w1": blocks}
        assert usage == {"w0": 0.0, "w1": 0.0}

        # ~1100 prompt tokens: over 0.4 of 128 blocks of 16 from its first step, more as it decodes
        prompt = " ".join(f"w{i}" for i in range(260))
        count = httpx.post(ws["w0"].proc.url + "/tokenize", json={"model": "tiny", "prompt": prompt}).json()["count"]
        prompt_blocks = -(-count // 16)
        assert prompt_blocks > 0.4 * blocks
        started, stop, status = threading.Event(), threading.Event(), []
        max_tokens = blocks * 16 - count - 16  # decodes until the cache is (nearly) full
        holder = threading.Thread(target=_hold, args=(ws["w0"].proc.url, prompt, max_tokens, started, stop, status),
                                  daemon=True)
        holder.start()
        try:
            assert started.wait(60) and status == [200], status
            seen = wait_until(lambda: (u := kv()[0].get("w0", 0.0)) > 0.4 and u, 30, "the gateway sees w0's cache fill")
            # the worker's own figure: whole blocks of its 128, at least the prompt's
            assert seen * blocks == pytest.approx(round(seen * blocks)) and prompt_blocks <= round(seen * blocks) <= blocks

            routed = []
            for i in range(4):
                before = kv()[0].get("w0", 0.0)
                resp = http.post("/v1/completions", json={"model": "tiny", "prompt": f"short {i}", "max_tokens": 2})
                after = kv()[0].get("w0", 0.0)
                assert resp.status_code == 200, resp.text
                if before > 0.4 and after > 0.4:  # w0 read as full for the whole decision
                    routed.append(resp.headers["x-mesh-worker"])
            assert routed and set(routed) == {"w1"}, routed
            route = http.post("/debug/route", json={"model": "tiny", "prompt": "x", "max_tokens": 2}).json()["decision"]
            if kv()[0].get("w0", 0.0) > 0.4:
                assert route["target"] == "w1" and "w0" not in route["candidates"]
        finally:
            stop.set()
            holder.join(60)
        # the request ends: the gateway sees the blocks freed and admits to w0 again
        wait_until(lambda: kv()[0].get("w0") == 0.0, 30, "w0's cache freed")
        route = http.post("/debug/route", json={"model": "tiny", "prompt": "x", "max_tokens": 2}).json()["decision"]
        assert "w0" in route["candidates"]
    assert gateway.alive()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="fake workers exposing engine-style /metrics")
    parser.add_argument("--serve", action="append", required=True, help="kind:port")
    asyncio.run(_serve(parser.parse_args().serve))


def test_worker_metrics_off_leaves_kv_unknown(procs: ProcessGroup, tmp_path: Path) -> None:
    """``health.worker_metrics: false``: no /metrics scrape; KV usage and capacity stay unknown."""
    urls = start_fakes(procs, ["vllm"])
    workers = [{"name": "vllm", "url": urls["vllm"], "block_size": 16, "dp_size": 2, "models": ["m"]}]
    gateway, http = _gateway(procs, tmp_path, workers, "round_robin", worker_metrics=False)
    with http:
        wait_until(lambda: _series(http.get("/metrics").text, "mesh_worker_healthy") == {"vllm": 1.0}, 30, "healthy")
        time.sleep(1.0)  # five health rounds
        text = http.get("/metrics").text
        assert "mesh_worker_metrics_scrapes_total{" not in text
        assert set(_series(text, "mesh_worker_kv_capacity_blocks").values()) <= {0.0}
