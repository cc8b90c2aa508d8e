"""A driver process running an upstream engine's own code (``tests/fakes/vllm_engine.py``,
``tests/fakes/sglang_engine.py``), and the checks of what Mesh's index made of its KV events.

``Driver`` starts the process on an extracted wheel and sends it JSON commands, one reply each.
``stack`` gives it fresh engines with Mesh's real ``KvEventSubscriber`` and ``PrefixIndex`` subscribed to it.
``engine_keys`` turns the driver's truth (each held block's token prefix and namespace) into the
router keys Mesh computes for them, so ``index.keys_of(target)`` can be compared with it exactly.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from mesh.core.index import PrefixIndex
from mesh.core.keys import block_keys, namespace_seed
from mesh.events.limits import SubscriberLimits
from mesh.events.subscriber import KvEventSubscriber, WorkerEvents
from tests.procs import free_port

REPO = Path(__file__).resolve().parent.parent.parent


class Driver:
    """One driver process (imports done once); ``start`` gives it fresh engines for each test."""

    def __init__(self, module: str, root: Path) -> None:
        self.log = tempfile.TemporaryFile("w+")  # a file, not a pipe: its logs never block it
        env = {**os.environ, "VLLM_CONFIGURE_LOGGING": "0", "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen([sys.executable, "-m", module, str(root)], cwd=REPO,
                                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True)
        self.published: dict[int, int] = {}
        ready = self._reply()
        assert ready.get("ready"), ready

    def _reply(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("@@ "):
                reply: dict[str, Any] = json.loads(line[3:])
                return reply
        self.log.seek(0)
        err = self.log.read()
        raise AssertionError(f"the upstream driver exited ({self.proc.wait()}):\n{err[-6000:]}")

    def send(self, op: str, *, rank: int = 0, **fields: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, "rank": rank, **fields}) + "\n")
        self.proc.stdin.flush()
        reply = self._reply()
        assert reply["ok"], f"{op} on rank {rank}: {reply}"
        self.published[rank] = reply["published"]
        return reply

    def start(self, config: dict[str, Any]) -> None:
        """Shut the engines down and build fresh ones from ``config`` (their seqs start at 0)."""
        self.published.clear()
        self.send("start", config=config)
        self.published.clear()

    def close(self) -> None:
        """Kill it: an engine's orderly shutdown is not under test (vLLM's publisher waits up to 2 s)."""
        self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout, self.log):
            if f:
                f.close()


def engine_keys(blocks: list[dict[str, Any]], block_size: int, model: str) -> set[int]:
    """The router keys of the blocks an engine holds (its truth)."""
    return {block_keys(b["tokens"], block_size, namespace_seed(model, b["lora"], b["salt"]))[-1] for b in blocks}


async def wait_until(cond: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        if loop.time() > deadline:
            raise AssertionError(f"not reached in {timeout} s: {what}")
        await asyncio.sleep(0.01)


async def caught_up(sub: KvEventSubscriber, target: str, published: int) -> None:
    """Every batch the publisher sent (``published``) is applied, and the stream is healthy."""
    def done() -> bool:
        return (sub.health()[target].last_seq == published - 1 and sub.healthy(target)
                and sub.settled(target))
    await wait_until(done, f"{target} applies seq {published - 1} (at {sub.health()[target].last_seq})")


class Stack:
    """One driver process, and Mesh's subscriber and index on its streams (one target per rank)."""

    def __init__(self, driver: Driver, sub: KvEventSubscriber, index: PrefixIndex, targets: list[str],
                 block_size: int, model: str) -> None:
        self.driver, self.sub, self.index, self.targets = driver, sub, index, targets
        self.block_size, self.model = block_size, model

    async def serve(self, tokens: list[int], rank: int = 0, **kw: Any) -> dict[str, Any]:
        kw.setdefault("rid", f"r{random.getrandbits(48)}")
        reply = self.driver.send("serve", rank=rank, tokens=tokens, **kw)
        await self.synced(rank)
        return reply

    async def synced(self, rank: int = 0) -> None:
        await caught_up(self.sub, self.targets[rank], self.driver.published.get(rank, 0))

    def truth(self, rank: int = 0) -> list[dict[str, Any]]:
        blocks: list[dict[str, Any]] = self.driver.send("truth", rank=rank)["blocks"]
        return blocks

    def check_keys(self, rank: int = 0) -> list[dict[str, Any]]:
        """The index holds exactly the router keys of the rank's blocks; returns the blocks."""
        blocks = self.truth(rank)
        assert self.index.keys_of(self.targets[rank]) == engine_keys(blocks, self.block_size, self.model)
        return blocks


def ports(n: int) -> int:
    """A base port with ``n`` consecutive free ports (engines bind rank r at base + r)."""
    while True:
        got = [free_port() for _ in range(n)]
        if got == list(range(got[0], got[0] + n)):
            return got[0]


@asynccontextmanager
async def stack(driver: Driver, config: dict[str, Any], *, block_size: int, model: str,
                ranks: int = 1, lookahead_tokens: int | None = None) -> AsyncIterator[Stack]:
    """Fresh engines on ``driver`` (on new ports) and a fresh subscriber and index on them
    (``lookahead_tokens``: the worker's ``kv_events.lookahead_tokens``)."""
    port, replay = ports(ranks), ports(ranks)
    driver.start({**config, "ranks": ranks, "port": port, "replay_port": replay})
    index = PrefixIndex()
    sub = KvEventSubscriber(index, SubscriberLimits(replay_timeout_s=5.0))
    try:
        targets = sub.add_worker(WorkerEvents("engine", f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay}",
                                              dp_size=ranks, model=model, block_size=block_size,
                                              lookahead_tokens=lookahead_tokens))
        yield Stack(driver, sub, index, targets, block_size, model)
    finally:
        await sub.stop()
