"""LoRA adapters: a request for an adapter is keyed where the engine's KV events put its blocks.

vLLM serves an adapter under its own model name, lists it in ``/v1/models`` with ``parent`` = the
base model, and announces its blocks with ``lora_name``; the subscriber keys those in
``namespace_seed(base, adapter)``, and so must the gateway key a request for the adapter.

The end-to-end test runs real echo worker processes (one listing an adapter), a real gateway
process, and the independent vLLM-format ZMQ publisher of ``tests/fakes/kv_publisher.py`` with
BlockStored payloads encoded here (vLLM's current map layout, ``lora_name`` and ``extra_keys``).
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import msgspec
import pytest
import yaml

from mesh.cluster.registry import WorkerRegistry, split_models
from mesh.config import ConfigError, WorkerConfig, parse_config
from mesh.gateway.upstream import UpstreamPool
from tests.fakes.kv_publisher import Publisher
from tests.procs import ProcessGroup, free_port, wait_until

BS = 4
BASE, LORA = "base-model", "my-lora"
ADMIN = {"authorization": "Bearer admin-secret"}


# ------------------------------------------------------------------ config and discovery
def test_static_loras_as_a_mapping_or_a_list_and_clear_errors() -> None:
    w = WorkerConfig(name="w", url="http://h:1", models=[BASE, "other"], loras={LORA: BASE})
    assert w.loras == {LORA: BASE}
    listed = WorkerConfig.model_validate({"name": "w", "url": "http://h:1", "models": [BASE], "loras": [LORA, "b"]})
    assert listed.loras == {LORA: BASE, "b": BASE}  # a list runs on the first of models
    assert WorkerConfig(name="w", url="http://h:1").loras is None  # a config without loras: none
    assert WorkerConfig(name="w", url="http://h:1", loras={LORA: BASE}).loras == {LORA: BASE}  # models discovered
    bad = [
        ({"models": [BASE], "loras": {LORA: "nope"}}, "runs on 'nope', which is not in models"),
        ({"models": [BASE, LORA], "loras": {LORA: BASE}}, "also listed in models"),
        ({"loras": [LORA]}, "a list of LoRA adapters needs `models`"),
        ({"models": [BASE], "loras": {"": BASE}}, "must be 1-256 printable characters"),
        ({"models": [BASE], "loras": "my-lora"}, "workers[0].loras"),
    ]
    for fields, message in bad:
        with pytest.raises(ConfigError) as info:
            parse_config({"workers": [{"name": "w", "url": "http://h:1", **fields}]})
        assert message in str(info.value), (fields, str(info.value))


def test_split_models_tells_adapters_from_base_models() -> None:
    entries = [
        {"id": BASE, "parent": None, "root": "/models/base"},
        {"id": LORA, "parent": BASE, "root": "/adapters/my-lora"},
        {"id": "orphan", "parent": "not-listed"},  # nothing here serves its parent: a model
        {"id": "chained", "parent": LORA},  # an adapter's parent is a base model, never an adapter
        {"id": "plain"},  # older servers: no parent field
        {"parent": BASE},
        "junk",
    ]
    bases, loras = split_models(entries)
    assert bases == {BASE, "orphan", "chained", "plain"} and loras == {LORA: BASE}
    assert split_models("junk") == (frozenset(), {})


@pytest.fixture
async def pool() -> AsyncIterator[UpstreamPool]:
    p = UpstreamPool(connect_timeout_s=1.0)
    yield p
    await p.close()


async def test_discovery_fills_base_models_and_adapters_of_targets(procs: ProcessGroup, pool: UpstreamPool) -> None:
    echo = procs.echo_worker("e1", "--model", BASE, "--lora", LORA)
    reg = WorkerRegistry(parse_config({}))
    w = reg.add(WorkerConfig(name="e1", url=echo.url))
    version = reg.version
    await reg.check(w, pool)
    assert w.discovered_models == {BASE} and w.discovered_loras == {LORA: BASE} and reg.version > version
    t = reg.targets["e1"]
    assert t.models == {BASE, LORA} and t.loras == {LORA}
    assert reg.models() == [BASE, LORA] and reg.lora_base(LORA) == BASE and reg.lora_base(BASE) is None
    assert w.describe()["loras"] == {LORA: BASE}
    static = reg.add(WorkerConfig(name="s", url=echo.url, models=[BASE], loras={"sql": BASE}))
    assert reg.targets["s"].loras == {"sql"} and static.models == {BASE, "sql"}


# ------------------------------------------------------------------ end to end
def stored(tokens: list[int], lora: str | None, rng: random.Random) -> bytes:
    """One vLLM batch with one BlockStored of ``tokens`` (full blocks); engine hashes are opaque."""
    n = len(tokens) // BS
    event: dict[str, Any] = {
        "type": "BlockStored", "block_hashes": [rng.getrandbits(64) for _ in range(n)], "parent_block_hash": None,
        "token_ids": tokens[: n * BS], "block_size": BS, "lora_id": 1 if lora else None, "medium": "GPU",
        "lora_name": lora, "extra_keys": [[lora] for _ in range(n)] if lora else None, "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
    }
    return msgspec.msgpack.encode([time.time(), [event], 0])


class Stack:
    def __init__(self, url: str, pub: Publisher) -> None:
        self.url, self.pub = url, pub
        self.http = httpx.Client(base_url=url, timeout=30)
        self.rng = random.Random(11)

    def route(self, model: str, prompt: str) -> dict[str, Any]:
        resp = self.http.post("/debug/route", json={"model": model, "prompt": prompt})
        assert resp.status_code == 200, resp.text
        return resp.json()

    def until_indexed(self, payload: bytes, model: str, prompt: str, blocks: int) -> None:
        """Publish ``payload`` (again: a stored event is idempotent) until ``model``'s request sees it."""
        wait_until(lambda: (self.pub.publish(payload), self.overlaps(model, prompt).get("wl") == blocks)[1],
                   what=f"{blocks} blocks of {model} indexed on wl")

    def overlaps(self, model: str, prompt: str) -> dict[str, int]:
        cands = self.route(model, prompt)["decision"]["candidates"]
        return {tid: c["overlap"]["gpu_blocks"] for tid, c in cands.items()}


@pytest.fixture(scope="module")
def stack(module_procs: ProcessGroup) -> Iterator[Stack]:
    pub = Publisher()
    try:
        wl = module_procs.echo_worker("wl", "--model", BASE, "--lora", LORA)
        wb = module_procs.echo_worker("wb", "--model", BASE)
        cfg = {
            "server": {"admin_key": "admin-secret"},
            "workers": [
                {"name": "wl", "url": wl.url, "block_size": BS,
                 "kv_events": {"endpoint": pub.endpoint, "replay_endpoint": pub.replay_endpoint, "topic": "kv"}},
                {"name": "wb", "url": wb.url, "block_size": BS},
            ],
            "health": {"interval_s": 0.2, "timeout_s": 1},
            "index": {"speculative_ttl_s": 0},  # every overlap seen comes from the published events
        }
        path = module_procs.log_dir / "lora.yaml"
        path.write_text(yaml.safe_dump(cfg))
        gw = module_procs.gateway(path, port=free_port(), name="gateway-lora")
        s = Stack(gw.url, pub)
        wait_until(lambda: s.http.get("/workers", headers=ADMIN).json()["workers"][0]["loras"] == {LORA: BASE},
                   what="wl's adapter discovered")
        wait_until(lambda: 'mesh_kv_events_healthy{' in (m := s.http.get("/metrics").text)
                   and any(line.startswith("mesh_kv_events_healthy{") and line.endswith(" 1.0")
                           for line in m.splitlines()), what="wl's event stream live")
        yield s
        s.http.close()
    finally:
        pub.close()


def test_adapter_requests_match_blocks_announced_with_its_lora_name(stack: Stack) -> None:
    prompt = "a prompt that only the adapter has seen, in full blocks"
    tokens = list(prompt.encode())  # the byte tokenizer (the gateway's default)
    blocks = len(tokens) // BS
    stack.until_indexed(stored(tokens, LORA, stack.rng), LORA, prompt, blocks)
    route = stack.route(LORA, prompt)
    assert route["request"]["model"] == LORA and route["decision"]["target"] == "wl"
    assert set(route["decision"]["candidates"]) == {"wl"}  # wb serves the base model only
    base = stack.overlaps(BASE, prompt)
    assert set(base) == {"wl", "wb"} and base == {"wl": 0, "wb": 0}  # same tokens, other namespace
    # the request itself goes through to the worker serving the adapter
    resp = stack.http.post("/v1/completions", json={"model": LORA, "prompt": prompt, "max_tokens": 2})
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-mesh-worker"] == "wl" and resp.json()["model"] == LORA
    models = {m["id"] for m in stack.http.get("/v1/models").json()["data"]}
    assert models == {BASE, LORA}


def test_base_model_blocks_do_not_match_adapter_requests(stack: Stack) -> None:
    prompt = "another prompt, this one served by the base model itself"
    tokens = list(prompt.encode())
    blocks = len(tokens) // BS
    stack.until_indexed(stored(tokens, None, stack.rng), BASE, prompt, blocks)
    assert stack.route(BASE, prompt)["decision"]["target"] == "wl"
    assert stack.overlaps(LORA, prompt) == {"wl": 0}
    salted = stack.http.post("/debug/route", json={"model": LORA, "prompt": prompt, "cache_salt": "t"})
    assert json.loads(salted.text)["decision"]["candidates"]["wl"]["overlap"]["gpu_blocks"] == 0
