"""The gateway process with ``kv_events.bind`` (llm-d's layout: engines' publishers connect to the
gateway): a worker whose publisher connects and sends is "live"; one configured for the bound
endpoint that serves requests while nothing of its topic arrives is reported blind, naming the
bound endpoint and the fix; frames of a topic naming no worker are counted on ``/metrics`` and
warned about in the log; with the receiver thread and with the receiver process
(``index.ingest_process``). The publishers are the vLLM-style fake of ``tests/fakes/kv_publisher.py``
(a PUB that connects); the workers' HTTP side is the echo worker."""

from __future__ import annotations

import random
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.fakes.kv_publisher import Publisher, encode_events
from tests.procs import PYTHON, ProcessGroup, free_port, wait_http, wait_until

ADMIN = {"authorization": "Bearer adm"}


@pytest.mark.parametrize("process", [False, True], ids=["thread", "receiver-process"])
def test_connecting_publishers_live_a_silent_one_blind_an_unknown_topic_counted(procs: ProcessGroup, tmp_path: Path,
                                                                                  process: bool) -> None:
    rng = random.Random(31)
    bind = free_port()
    echoes = {name: procs.start([PYTHON, "-m", "mesh.echo_worker", "--port", str(port), "--name", name, "--model", "tiny"],
                                name=name, port=port) for name, port in (("live", free_port()), ("quiet", free_port()))}
    for proc in echoes.values():
        wait_http(proc.url + "/health", proc=proc, timeout_s=60)
    config = tmp_path / "mesh.yaml"
    config.write_text(yaml.safe_dump({
        "server": {"admin_key": "adm"},
        "kv_events": {"bind": f"tcp://*:{bind}"},
        "workers": [{"name": name, "url": proc.url, "models": ["tiny"], "kv_events": {}} for name, proc in echoes.items()],
        "health": {"interval_s": 0.5},
        "policy": "round_robin",
        "index": {"ingest_process": process},  # the receiver process binds kv_events.bind
    }))
    gateway = procs.gateway(config, port=free_port(), ready_path="/health")
    live = Publisher(connect=f"tcp://127.0.0.1:{bind}", topic=b"kv@live@tiny", with_replay=False)
    ghost = Publisher(connect=f"tcp://127.0.0.1:{bind}", topic=b"kv@ghost@tiny", with_replay=False)
    try:
        with httpx.Client(base_url=gateway.url, timeout=60) as client:
            def states() -> dict[str, str]:
                return {w["name"]: w["kv_events"] for w in client.get("/workers", headers=ADMIN).json()["workers"]}

            def published_until_live() -> bool:
                for pub in (live, ghost):
                    pub.publish(encode_events([], "map", "array3", "uint", rng))
                time.sleep(0.05)
                return states()["live"] == "live"

            wait_until(published_until_live, timeout_s=30, what="the connecting publisher's stream live")
            for i in range(8):  # round robin: four requests each, of several KV blocks
                prompt = f"request {i}: " + "a longer prompt that fills several KV blocks " * 3
                assert client.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 2}).status_code == 200

            def blind() -> str | None:
                now = states()["quiet"]
                return now if now.startswith("index blind") else None

            quiet = wait_until(blind, timeout_s=30, what="the silent bound stream reported blind")
            assert "quiet | kv@quiet@" in quiet and f"tcp://*:{bind}" in quiet and "GATEWAY_HOST" in quiet
            assert states()["live"] == "live"
            metrics = client.get("/metrics").text
            assert 'mesh_kv_events_unknown_topic_frames_total{topic="kv@ghost@tiny"}' in metrics
            assert 'mesh_kv_events_healthy{target="live",worker="live"} 1.0' in metrics
    finally:
        live.close()
        ghost.close()
    log = gateway.log_tail(20_000)
    assert "kv events of worker quiet" in log and "'kv@ghost@tiny' names no worker" in log
