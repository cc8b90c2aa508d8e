"""``mesh up --workers 3`` (bundled workers, real KV events): sequential new conversations spread
over every worker, and each later turn returns to its conversation's worker."""

from __future__ import annotations

from collections import Counter

import httpx

from tests.procs import PYTHON, ProcessGroup, free_port, wait_http, wait_until

SYSTEM = "You are a careful coding agent. Answer briefly, cite the file you changed, and run the tests. "


def _chat(client: httpx.Client, session: str, turns: list[str]) -> str:
    messages = [{"role": "system", "content": SYSTEM * 4}]
    for text in turns:
        messages.append({"role": "user", "content": text})
    body = {"model": "demo", "messages": messages, "max_tokens": 4, "temperature": 0}
    resp = client.post("/v1/chat/completions", json=body, headers={"x-session-id": session})
    assert resp.status_code == 200, resp.text
    return resp.headers["x-mesh-worker"]


def test_nine_sequential_new_conversations_use_all_three_workers(procs: ProcessGroup) -> None:
    port = free_port()
    up = procs.start([PYTHON, "-m", "mesh", "up", "--workers", "3", "--port", str(port)], name="up", port=port)
    wait_http(f"http://127.0.0.1:{port}/ready", proc=up, timeout_s=180)
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as client:
        def streams_live() -> bool:
            text = client.get("/metrics").text
            return sum(1 for line in text.splitlines()
                       if line.startswith("mesh_kv_events_healthy{") and line.endswith(" 1.0")) == 3
        wait_until(streams_live, timeout_s=60, what="three live KV event streams")
        homes = {f"conv-{i}": _chat(client, f"conv-{i}", [f"task {i}: fix the failing test in module {i}"])
                 for i in range(9)}
        spread = Counter(homes.values())
        # within session_slack (1) of the fewest live sessions: never more than one ahead
        assert set(spread) == {"worker-0", "worker-1", "worker-2"} and max(spread.values()) <= 4, homes
        for sid, home in homes.items():  # every later turn goes home, whatever the others cache
            i = sid.split("-")[1]
            for turn in range(2):
                turns = [f"task {i}: fix the failing test in module {i}", "done; now the next one", f"step {turn}"]
                assert _chat(client, sid, turns[: 2 + turn]) == home
