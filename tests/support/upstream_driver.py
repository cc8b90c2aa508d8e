"""A driver process running an upstream engine's own code (``tests/fakes/vllm_engine.py``), and the
checks of what Mesh's index made of its KV events.

``Driver`` starts the process on an extracted wheel and sends it JSON commands, one reply each.
``engine_keys`` turns the driver's truth (each held block's token prefix and namespace) into the
router keys Mesh computes for them, so ``index.keys_of(target)`` can be compared with it exactly.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mesh.core.keys import block_keys, namespace_seed
from mesh.events.subscriber import KvEventSubscriber

REPO = Path(__file__).resolve().parent.parent.parent


class Driver:
    def __init__(self, module: str, root: Path, config: dict[str, Any]) -> None:
        self.log = tempfile.TemporaryFile("w+")  # a file, not a pipe: its logs never block it
        env = {**os.environ, "VLLM_CONFIGURE_LOGGING": "0", "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen([sys.executable, "-m", module, str(root), json.dumps(config)], cwd=REPO,
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
