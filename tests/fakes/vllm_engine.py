"""vLLM's own prefix cache and KV event publisher, driven as its scheduler drives them (a process).

Run as ``python -m tests.fakes.vllm_engine ROOT`` with ROOT an extracted vLLM wheel
(``tests.support.upstream``); a ``start`` command's ``config`` builds the engine: ``block_size``,
``num_blocks``, ``ranks`` (data-parallel ranks), ``port`` and ``replay_port`` (rank 0's; vLLM
binds rank r's at port + r), ``lookahead`` (``num_hash_lookahead_tokens``, as vLLM configures it under
EAGLE: each block hashed with the tokens after it, the trailing-block drop off).
Each rank is one vLLM ``KVCacheManager`` (its ``BlockPool``, prefix caching, eviction, events) and
one ``ZmqEventPublisher`` (PUB + ROUTER replay, seq, ``data_parallel_rank``), unchanged: after
every command the rank's events are taken and published as one ``KVEventBatch``, as
``Scheduler.update_from_output`` does each step.

Commands are JSON lines on stdin; each gets one JSON reply line on stdout, prefixed ``@@ `` (vLLM
may log there too; ``command_loop``):
- ``serve``: rank, rid, tokens, lora (name or null), salt, xargs (``vllm_xargs``, e.g.
  ``{"kv_cache_report_mode": "full"}``), keep (hold the blocks as a running request until ``free``);
- ``peek``: rank, tokens, lora, salt: the tokens vLLM's prefix cache would hit for that prompt now
  (``get_computed_blocks``, nothing allocated);
- ``free``: rank, rid;  ``clear``: rank (``reset_prefix_cache``: AllBlocksCleared);
- ``lose_next``: rank: the next live frame of that rank never reaches the wire (a lost frame: it
  stays in the publisher's replay buffer);
- ``truth``: every block the rank's cache holds: its token prefix, LoRA, salt, published hash, copies.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
import types
from collections.abc import Callable
from typing import Any

from tests.fakes.upstream_loader import install

# vLLM's package __init__s that import its whole engine, and what this environment lacks
HOLLOW = ["vllm", "vllm.distributed", "vllm.config", "vllm.multimodal", "vllm.v1.structured_output",
          "vllm.tokenizers"]
ABSENT = ["psutil", "cbor2", "urllib3", "pybase64", "requests", "cloudpickle", "cpuinfo",
          "vllm.compilation.cuda_graph"]


class LosingSocket:
    """The PUB socket, losing its next frame (the replay buffer still keeps it)."""

    def __init__(self, sock: Any) -> None:
        self.sock = sock
        self.lose = True

    def send_multipart(self, frames: Any) -> None:
        if self.lose:
            self.lose = False
            return
        self.sock.send_multipart(frames)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sock, name)


class Rank:
    def __init__(self, rank: int, cfg: dict[str, Any], v: Any) -> None:
        self.v, self.bs, self.la = v, cfg["block_size"], cfg.get("lookahead", 0)
        spec = v.FullAttentionSpec(block_size=self.bs, num_kv_heads=1, head_size=1, dtype=v.float32)
        kv = v.KVCacheConfig(num_blocks=cfg["num_blocks"], kv_cache_tensors=[],
                             kv_cache_groups=[v.KVCacheGroupSpec(["layer"], spec)])
        self.manager = v.KVCacheManager(kv, max_model_len=4096, scheduler_block_size=self.bs,
                                        hash_block_size=self.bs, enable_caching=True, enable_kv_cache_events=True,
                                        num_hash_lookahead_tokens=self.la)
        self.pub = v.ZmqEventPublisher(rank, endpoint=f"tcp://*:{cfg['port']}",
                                       replay_endpoint=f"tcp://*:{cfg['replay_port']}")
        self.running: dict[str, Any] = {}
        self.blocks: dict[bytes, tuple[list[int], str | None, str | None]] = {}  # hash -> prefix, LoRA, salt
        self.published = 0

    def step(self) -> None:
        events = self.manager.take_events()
        if events:
            self.pub.publish(self.v.KVEventBatch(ts=time.time(), events=events))
            self.published += 1

    def request(self, cmd: dict[str, Any]) -> Any:
        v, lora = self.v, cmd.get("lora")
        lreq = v.LoRARequest(lora, 1 + sum(map(ord, lora)), "/nowhere") if lora else None
        return v.Request(cmd.get("rid", "peek"), list(cmd["tokens"]),
                         v.SamplingParams(max_tokens=1, extra_args=cmd.get("xargs")), None,
                         lora_request=lreq, cache_salt=cmd.get("salt"),
                         block_hasher=v.get_request_block_hasher(self.bs, v.sha256, self.la))

    def serve(self, cmd: dict[str, Any]) -> dict[str, Any]:
        tokens, lora, req = list(cmd["tokens"]), cmd.get("lora"), self.request(cmd)
        blocks, hit, _ = self.manager.get_computed_blocks(req)
        if self.manager.allocate_slots(req, len(tokens) - hit, hit, blocks) is None:
            self.step()
            return {"ok": False, "error": "no free blocks"}
        for i, h in enumerate(req.block_hashes):
            self.blocks[bytes(h)] = (tokens[: (i + 1) * self.bs + self.la], lora, cmd.get("salt"))  # + its lookahead
        if cmd.get("keep"):
            self.running[cmd["rid"]] = req
        else:
            self.manager.free(req)
        self.step()
        return {"ok": True, "hit_tokens": hit}

    def truth(self) -> list[dict[str, Any]]:
        out = []
        cached = self.manager.block_pool.cached_block_hash_to_block  # vLLM's BlockHashToBlockMap
        dups = getattr(cached, "_dup_ids", {})  # 0.34: block ids of keys held by several blocks
        for key, blocks in cached._cache.items():
            h = self.v.get_block_hash(key)
            tokens, lora, salt = self.blocks[bytes(h)]
            copies = len(blocks) if isinstance(blocks, dict) else len(dups.get(key, ())) or 1  # 0.33: a dict
            out.append({"tokens": tokens, "lora": lora, "salt": salt, "hash": self.v.maybe_convert_block_hash(h),
                        "copies": copies})
        return out

    def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        op = cmd["op"]
        if op == "serve":
            return self.serve(cmd)
        if op == "peek":
            return {"ok": True, "hit_tokens": self.manager.get_computed_blocks(self.request(cmd))[1]}
        if op == "free":
            self.manager.free(self.running.pop(cmd["rid"]))
        elif op == "clear":
            ok = self.manager.reset_prefix_cache()
            if not ok:
                return {"ok": False, "error": "blocks in use"}
        elif op == "lose_next":
            self.pub._event_queue.join()  # every earlier batch is on the wire
            self.pub._pub = LosingSocket(self.pub._pub)
            return {"ok": True}
        elif op == "truth":
            return {"ok": True, "blocks": self.truth()}
        else:
            return {"ok": False, "error": f"unknown op {op!r}"}
        self.step()
        return {"ok": True}


# what the driver uses of vLLM, by module
USES = {
    "torch": ["float32"],
    "vllm.distributed.kv_events": ["KVEventBatch", "ZmqEventPublisher"],
    "vllm.lora.request": ["LoRARequest"],
    "vllm.sampling_params": ["SamplingParams"],
    "vllm.utils.hashing": ["sha256"],
    "vllm.v1.core.kv_cache_manager": ["KVCacheManager"],
    "vllm.v1.core.kv_cache_utils": ["get_block_hash", "get_request_block_hasher", "init_none_hash",
                                    "maybe_convert_block_hash"],
    "vllm.v1.kv_cache_interface": ["FullAttentionSpec", "KVCacheConfig", "KVCacheGroupSpec"],
    "vllm.v1.request": ["Request"],
}


def _vllm(root: str) -> Any:
    install(root, HOLLOW, ABSENT)
    importlib.import_module("vllm.config")
    sys.modules["vllm.config"].get_current_vllm_config_or_none = lambda: None  # no engine config
    v = types.SimpleNamespace()
    for module, names in USES.items():
        mod = importlib.import_module(module)
        for name in names:
            setattr(v, name, getattr(mod, name))
    v.init_none_hash(v.sha256)
    return v


def command_loop(start: Callable[[dict[str, Any]], list[Any]]) -> None:
    """Answer the JSON commands on stdin, one ``@@ `` reply line each. ``start`` (with a ``config``)
    shuts the engines down and builds fresh ones, one per rank, from ``start(config)`` (the
    process, its imports done, serves test after test); any other command goes to its rank's
    engine's ``handle``. Every reply says how many batches that rank has published."""
    engines: list[Any] = []
    out = os.fdopen(os.dup(1), "w", buffering=1)
    out.write("@@ " + json.dumps({"ok": True, "ready": True}) + "\n")
    for line in sys.stdin:
        cmd = json.loads(line)
        rank = cmd.get("rank", 0)
        try:
            if cmd["op"] == "start":
                for engine in engines:
                    engine.pub.shutdown()
                engines = start(cmd["config"])
                reply: dict[str, Any] = {"ok": True}
            else:
                reply = engines[rank].handle(cmd)
        except Exception as exc:  # the test shows it: an upstream API that changed, a stand-in reached
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        reply["published"] = engines[rank].published if rank < len(engines) else 0
        out.write("@@ " + json.dumps(reply) + "\n")


def main() -> None:
    v = _vllm(sys.argv[1])
    command_loop(lambda cfg: [Rank(r, cfg, v) for r in range(cfg.get("ranks", 1))])  # vLLM offsets the ports


if __name__ == "__main__":
    main()
