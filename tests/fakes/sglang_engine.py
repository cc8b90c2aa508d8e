"""SGLang's own radix cache and KV event publisher, driven as its scheduler drives them (a process).

Run as ``python -m tests.fakes.sglang_engine ROOT`` with ROOT an extracted SGLang wheel
(``tests.support.upstream``); a ``start`` command's ``config`` builds it: ``page_size``, ``capacity`` (tokens the
pool holds; past it the tree's LRU leaves are evicted, as the scheduler does before admitting),
``port``, ``replay_port``, ``eagle`` (the tree keyed by token bigrams, as SGLang runs it under EAGLE: a page
is reused only when the token after it matches too; its events carry the pages' bigrams). The cache is SGLang's ``RadixCache`` (page-aligned inserts, lock refs,
LRU eviction, its ``KVCacheEventRecorder`` coalescing the events) with a token pool that only
counts; the publisher is SGLang's ``ZmqEventPublisher``. After each command the recorder's events
go out as one ``KVEventBatch``, as ``Scheduler`` publishes each step.

The command protocol is ``tests.fakes.vllm_engine``'s (``start``, ``serve`` with tokens and salt, ``clear``,
``lose_next``, ``truth``; truth is of the plain tree only), plus ``peek`` (the tokens a prompt would hit now,
nothing inserted) and ``offload`` (the blocks of a served prompt written back to host
memory: the recorder's store on ``StorageMedium.CPU``, ``"CPU_PINNED"`` on the wire, as SGLang's
hierarchical cache reports a write-back).
"""

from __future__ import annotations

import hashlib
import importlib
import sys
import time
import types
from array import array
from typing import Any

from tests.fakes.upstream_loader import install
from tests.fakes.vllm_engine import LosingSocket, command_loop

HOLLOW = ["sglang", "sglang.srt", "sglang.srt.configs", "sglang.srt.distributed"]
# not installed here, or only for GPUs: kernels, memory pools, layers, the model executor
ABSENT = ["psutil", "pybase64", "requests", "triton", "sglang.kernels", "sglang.srt.mem_cache.memory_pool",
          "sglang.srt.disaggregation.utils", "sglang.srt.layers", "sglang.srt.model_executor"]
USES = {
    "sglang.srt.disaggregation.kv_events": ["KVEventBatch", "StorageMedium", "ZmqEventPublisher"],
    "sglang.srt.mem_cache.base_prefix_cache": ["EvictParams", "InsertParams", "MatchPrefixParams"],
    "sglang.srt.mem_cache.radix_cache": ["RadixCache", "RadixKey"],
}


class CountingPool:
    """The token pool the tree frees into: SGLang's allocator interface, counting only."""

    device = "cpu"

    def free_segment(self, value: Any, start_pos: int = 0) -> None:
        pass

    def free(self, value: Any) -> None:
        pass


class Engine:
    def __init__(self, cfg: dict[str, Any], s: Any) -> None:
        self.s, self.page, self.capacity = s, cfg["page_size"], cfg["capacity"]
        self.cache = s.RadixCache.create_simulated(mock_allocator=CountingPool(), page_size=self.page,
                                                   enable_kv_cache_events=True)
        self.cache.is_eagle = bool(cfg.get("eagle"))  # CacheInitParams.is_eagle, which create_simulated omits
        self.cache.kv_events.take()  # the reset's AllBlocksCleared: nothing was published yet
        self.pub = s.ZmqEventPublisher(0, endpoint=f"tcp://*:{cfg['port']}",
                                       replay_endpoint=f"tcp://*:{cfg['replay_port']}")
        self.published = 0
        self.host: set[tuple[tuple[int, ...], str | None]] = set()  # (prefix, salt) written back to host

    def step(self) -> None:
        events = self.cache.kv_events.take()
        if events:
            self.pub.publish(self.s.KVEventBatch(ts=time.time(), events=events))
            self.published += 1

    def serve(self, cmd: dict[str, Any]) -> dict[str, Any]:
        s = self.s
        key = s.RadixKey(array("q", cmd["tokens"]), cache_salt=cmd.get("salt"))
        hit = self.cache.match_prefix(s.MatchPrefixParams(key=key)).device_prefix_len
        self.cache.insert(s.InsertParams(key=key))
        over = self.cache.total_size() - self.capacity
        if over > 0:
            self.cache.evict(s.EvictParams(num_tokens=over))
        self.step()
        return {"ok": True, "hit_tokens": hit}

    def offload(self, cmd: dict[str, Any]) -> dict[str, Any]:
        key = self.s.RadixKey(array("q", cmd["tokens"]), cache_salt=cmd.get("salt"))
        node = self.cache.match_prefix(self.s.MatchPrefixParams(key=key)).last_device_node
        path = []
        while node is not None and node.parent is not None:
            path.append(node)
            node = node.parent
        prefix: list[int] = []
        for n in reversed(path):
            self.cache.kv_events.record_store(n, medium=self.s.StorageMedium.CPU)
            tokens = prefix + list(n.key.token_ids)
            for end in range(len(prefix) + self.page, len(tokens) + 1, self.page):
                self.host.add((tuple(tokens[:end]), n.key.cache_salt))
            prefix = tokens
        self.step()
        return {"ok": True}

    def truth(self) -> list[dict[str, Any]]:
        """Every page the tree holds (tier GPU), then every page only the host holds (tier CPU)."""
        out: list[dict[str, Any]] = []
        todo: list[tuple[Any, list[int]]] = [(self.cache.root_node, [])]
        while todo:
            node, prefix = todo.pop()
            for child in node.children.values():
                tokens = prefix + list(child.key.token_ids)
                for end in range(len(prefix) + self.page, len(tokens) + 1, self.page):
                    out.append({"tokens": tokens[:end], "lora": None, "salt": child.key.cache_salt, "tier": "GPU"})
                todo.append((child, tokens))
        on_gpu = {(tuple(b["tokens"]), b["salt"]) for b in out}
        out += [{"tokens": list(t), "lora": None, "salt": salt, "tier": "CPU"}
                for t, salt in sorted(self.host - on_gpu, key=repr)]
        return out

    def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        op = cmd["op"]
        if op == "serve":
            return self.serve(cmd)
        if op == "peek":
            key = self.s.RadixKey(array("q", cmd["tokens"]), cache_salt=cmd.get("salt"))
            return {"ok": True, "hit_tokens": self.cache.match_prefix(self.s.MatchPrefixParams(key=key)).device_prefix_len}
        if op == "offload":
            return self.offload(cmd)
        if op == "truth":
            return {"ok": True, "blocks": self.truth()}
        if op == "lose_next":
            self.pub._event_queue.join()  # every earlier batch is on the wire
            self.pub._pub = LosingSocket(self.pub._pub)
            return {"ok": True}
        if op == "clear":
            self.cache.reset()
            self.host.clear()
            self.step()
            return {"ok": True}
        return {"ok": False, "error": f"unknown op {op!r}"}


class PageHasher:
    """Stands for SGLang's C++ page hasher (``hicache_hash_cpp``, compiled on first use, which this
    environment cannot do): a SHA-256 chain over each page's tokens, from ``prior_digest``, one hex
    digest per page, as the extension returns. Hashes are opaque to Mesh (it keys by tokens)."""

    @staticmethod
    def get_hash(raw: Any, logical_len: int, unit_width: int, is_bigram: bool, prior_digest: bytes | None,
                 page_size: int | None) -> str | list[str]:
        step = page_size or logical_len or 1
        if is_bigram:  # raw holds logical_len + 1 tokens: a page of bigrams spans one token past it
            units = [list(raw[a : min(a + step, logical_len) + 1]) for a in range(0, logical_len, step)]
        else:
            values = list(raw[: logical_len * unit_width])
            units = [values[a : a + step * unit_width] for a in range(0, len(values), step * unit_width)]
        out, prior = [], prior_digest or b""
        for unit in units:
            digest = hashlib.sha256(prior + array("q", unit).tobytes()).digest()
            out.append(digest.hex())
            prior = digest
        return out if page_size else (out[0] if out else hashlib.sha256(prior).hexdigest())


def _sglang(root: str) -> Any:
    install(root, HOLLOW, ABSENT)
    native = importlib.import_module("sglang.srt.mem_cache.cpp_utils.native_hash")
    native._load_native_hash_module = lambda: PageHasher  # type: ignore[attr-defined]
    s = types.SimpleNamespace()
    for module, names in USES.items():
        mod = importlib.import_module(module)
        for name in names:
            setattr(s, name, getattr(mod, name))
    return s


def main() -> None:
    s = _sglang(sys.argv[1])
    command_loop(lambda cfg: [Engine(cfg, s)])


if __name__ == "__main__":
    main()
