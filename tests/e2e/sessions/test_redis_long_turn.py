"""A turn longer than the idle time keeps its shared binding alive (``state.backend: redis``).

The local table pins a session while a request of it runs, and the Redis copy, written with
``PX idle_ttl`` when the turn started, is kept alive too: a turn longer than the idle time does
not let the key expire mid-turn, so another replica routes a concurrent turn of that session to
its bound worker.
Real redis-server, two real gateway replicas, a slow streaming echo worker.
"""

from __future__ import annotations

import contextlib
import threading
import time

import httpx
import yaml

from tests.procs import ProcessGroup, free_port, wait_until
from tests.support.redis_server import RedisServer, server  # noqa: F401 (server: the redis-server fixture)

IDLE_TTL_S = 1.0
TOKENS = 20
TOKEN_DELAY_S = 0.25  # a turn of ~5 s: several idle times
WORDS = " ".join(f"w{i}" for i in range(TOKENS))


def chat(stream: bool) -> dict[str, object]:
    return {"model": "echo", "messages": [{"role": "user", "content": WORDS}], "max_tokens": TOKENS, "stream": stream}


def write_config(procs: ProcessGroup, workers: dict[str, str], url: str) -> str:
    data = {
        "workers": [{"name": n, "url": u} for n, u in workers.items()],
        "health": {"interval_s": 0.3, "timeout_s": 1, "unhealthy_threshold": 1},
        "sessions": {"idle_ttl_s": IDLE_TTL_S},
        "policy": {"name": "session_sticky", "params": {"inner": "round_robin"}},
        "state": {"backend": "redis", "url": url, "key_prefix": "r9:", "timeout_s": 0.5},
    }
    path = procs.log_dir / "r9.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


class Turn(threading.Thread):
    """One slow streamed turn of a session on a replica; ``worker`` once its headers came."""

    def __init__(self, url: str, session: str) -> None:
        super().__init__(daemon=True)
        self.url, self.session = url, session
        self.worker: str | None = None
        self.body = b""
        self.done = threading.Event()

    def run(self) -> None:
        try:
            with httpx.Client(base_url=self.url, timeout=30) as c, \
                    c.stream("POST", "/v1/chat/completions", json=chat(True), headers={"x-session-id": self.session}) as r:
                self.worker = r.headers.get("x-mesh-worker")
                for part in r.iter_bytes():
                    self.body += part
        finally:
            self.done.set()


def test_a_turn_longer_than_the_idle_time_keeps_its_shared_binding(
        module_procs: ProcessGroup, server: RedisServer) -> None:  # noqa: F811
    workers = {n: module_procs.echo_worker(n, "--token-delay-s", str(TOKEN_DELAY_S)).url for n in ("s0", "s1", "s2")}
    config = write_config(module_procs, workers, server.url)
    a, b = (module_procs.gateway(config, port=free_port(), name=f"gateway-r9-{n}") for n in ("a", "b"))
    with contextlib.closing(httpx.Client(base_url=b.url, timeout=15)) as hb:
        for url in (a.url, b.url):
            with httpx.Client(base_url=url, timeout=5) as h:
                wait_until(lambda h=h: h.get("/health").json()["healthy_workers"] == 3, what="workers healthy")
        turn = Turn(a.url, "long-turn")
        start = time.monotonic()
        turn.start()
        wait_until(lambda: turn.worker is not None or turn.done.is_set(), what="the turn's headers")
        assert turn.worker is not None, turn.body
        # Past twice the idle time after the turn was bound (its key, written with PX 1 s, would
        # have expired by now), while the turn still streams.
        wait_until(lambda: time.monotonic() - start > 2.5 * IDLE_TTL_S, what="two idle times")
        route = hb.post("/debug/route", json=chat(False), headers={"x-session-id": "long-turn"}).json()
        still_running = not turn.done.is_set()
        assert still_running, "the turn ended before the check: it must outlast the idle time"
        assert route["decision"]["reason"] == "bound", route
        assert route["decision"]["target"] == turn.worker, route
        assert route["session"]["bound_target"] == turn.worker, route
        turn.join(30)
        assert b"[DONE]" in turn.body, turn.body[-300:]
        # Once the turn ended, the binding idles out in Redis too (the keep-alive stops).
        wait_until(lambda: hb.post("/debug/route", json=chat(False), headers={"x-session-id": "long-turn"})
                   .json()["session"]["bound_target"] is None, what="the binding idled out after the turn")
