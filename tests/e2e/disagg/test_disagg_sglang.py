"""SGLang's prefill/decode protocol (``disagg.protocol: sglang``) through a ``mesh serve`` gateway,
over stand-in SGLang workers (``tests/fakes/sglang_pd_worker.py``: real processes, SGLang's rules:
no room, refused; each side waits for the other by room):

- streamed and non-streamed requests, completions and chat, complete with the decode worker's
  answer, its KV from the prefill worker; both got the same body; every request its own room;
- a prefill worker that fails: the client gets its status, the decode leg is aborted at once
  (not left to its transfer timeout), no load leaks, and the failing worker is charged; a failing
  decode worker likewise ends the prefill leg;
- with another prefill worker, the request is served through it instead;
- a client that leaves while both legs wait ends both; a client cannot set the bootstrap fields;
- an SGLang pool beside a vLLM one: each request pairs within its prefill worker's protocol.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.fakes import pd_worker
from tests.fakes.sglang_pd_worker import start_sglang_worker
from tests.procs import PYTHON, Proc, ProcessGroup, free_port, wait_until
from tests.support.pd_gateway import ADMIN, circuits, error_of, fake_state, pd_gateway

SGLANG = {"disagg": {"protocol": "sglang"}}
PROMPT = {"model": "m", "prompt": "the quick brown fox", "max_tokens": 4}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4}


def loads(gateway: Proc) -> dict[str, tuple[int, int, int]]:
    """Each target's (in_flight, prefill_tokens, decode_tokens), as ``/workers`` reports them."""
    workers = httpx.get(gateway.url + "/workers", headers=ADMIN, timeout=10).json()["workers"]
    return {t["id"]: (t["in_flight"], t["prefill_tokens"], t["decode_tokens"]) for w in workers for t in w["targets"]}


def text_of(resp: httpx.Response) -> str:
    """The completion's text, streamed or whole."""
    if resp.headers["content-type"].startswith("text/event-stream"):
        return streamed_text(resp)
    return str(resp.json()["choices"][0]["text"])


def streamed_text(resp: httpx.Response) -> str:
    out = []
    for line in resp.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[6:])["choices"][0]["text"])
    return "".join(out).strip()


def test_streamed_and_whole_answers_come_from_the_decode_worker_one_room_each(procs: ProcessGroup, tmp_path: Path) -> None:
    p0, bootstrap = start_sglang_worker(procs, "p0", "prefill")
    d0, _ = start_sglang_worker(procs, "d0", "decode")
    # The stand-ins follow SGLang's scheduler: a request without a room is refused.
    direct = httpx.post(d0.url + "/v1/completions", json=PROMPT, timeout=10)
    assert direct.status_code == 400 and "without bootstrap room id" in direct.json()["message"]
    gateway, _ = pd_gateway(procs, tmp_path, {"p0": (p0, "prefill"), "d0": (d0, "decode")}, sections=SGLANG,
                            worker_fields={"p0": {"bootstrap_port": bootstrap}})
    want = "decoded by d0 with kv from p0"
    for path, body in (("/v1/completions", PROMPT), ("/v1/chat/completions", CHAT)):
        whole = httpx.post(gateway.url + path, json=body, timeout=30)
        assert whole.status_code == 200, whole.text
        assert whole.json()["choices"][0]["text"] == want
        assert (whole.headers["x-mesh-worker"], whole.headers["x-mesh-prefill-worker"]) == ("d0", "p0")
        streamed = httpx.post(gateway.url + path, json={**body, "stream": True}, timeout=30)
        assert streamed.status_code == 200 and streamed.headers["content-type"].startswith("text/event-stream")
        assert streamed_text(streamed) == want and streamed.text.rstrip().endswith("data: [DONE]")
    # SGLang's legs run concurrently: the prefill leg may finish after the client has its answer
    wait_until(lambda: fake_state(p0)["served"] == 4, what="the prefill worker's four legs served")
    prefill, decode = fake_state(p0), fake_state(d0)
    assert (prefill["posts"], decode["posts"] - 1) == (4, 4)  # the decode worker's refused one above
    assert (prefill["served"], decode["served"], prefill["refused"], decode["refused"]) == (4, 4, 0, 1)
    assert decode["mismatched"] == 0  # both got the same body
    rooms = decode["rooms"]
    assert sorted(rooms) == sorted(prefill["rooms"]) and len(set(rooms)) == 4
    assert all(isinstance(r, int) and 0 <= r < 2**63 for r in rooms)
    assert set(loads(gateway).values()) == {(0, 0, 0)}


def test_a_failing_prefill_worker_ends_the_decode_leg_and_leaks_no_load(procs: ProcessGroup, tmp_path: Path) -> None:
    # The decode stand-in would wait 60 s for the room's KV: its abort must come from the relay.
    p0, bootstrap = start_sglang_worker(procs, "p0", "prefill", mode="fail:503")
    d0, _ = start_sglang_worker(procs, "d0", "decode", wait_s=60)
    gateway, _ = pd_gateway(procs, tmp_path, {"p0": (p0, "prefill"), "d0": (d0, "decode")}, sections=SGLANG,
                            worker_fields={"p0": {"bootstrap_port": bootstrap}}, threshold=2)
    for stream in (False, True):
        resp = httpx.post(gateway.url + "/v1/completions", json={**PROMPT, "stream": stream}, timeout=30)
        assert resp.status_code == 503, resp.text
        assert resp.headers["x-mesh-prefill-worker"] == "p0"
        assert "failed by p0" in error_of(resp.json())["message"]
    assert circuits(gateway)["p0"] == "open"  # charged once per request: two failures, threshold 2
    wait_until(lambda: fake_state(d0)["aborted"] == 2, timeout_s=10, what="the decode legs aborted")
    decode = fake_state(d0)
    assert (decode["posts"], decode["served"], decode["open"]) == (2, 0, 0)
    assert set(loads(gateway).values()) == {(0, 0, 0)}
    assert circuits(gateway)["d0"] == "closed"  # the decode worker is not charged


def test_a_failing_decode_worker_ends_the_prefill_leg(procs: ProcessGroup, tmp_path: Path) -> None:
    # The prefill stand-in would wait 60 s for the decode side's pull: its abort must come from the relay.
    p0, bootstrap = start_sglang_worker(procs, "p0", "prefill", wait_s=60)
    d0, _ = start_sglang_worker(procs, "d0", "decode", mode="fail:503")
    gateway, _ = pd_gateway(procs, tmp_path, {"p0": (p0, "prefill"), "d0": (d0, "decode")}, sections=SGLANG,
                            worker_fields={"p0": {"bootstrap_port": bootstrap}})
    resp = httpx.post(gateway.url + "/v1/completions", json={**PROMPT, "stream": True}, timeout=30)
    assert resp.status_code == 503 and resp.headers["x-mesh-worker"] == "d0", resp.text
    assert "failed by d0" in error_of(resp.json())["message"]
    wait_until(lambda: fake_state(p0)["aborted"] == 1, timeout_s=10, what="the prefill leg aborted")
    assert (fake_state(p0)["open"], fake_state(p0)["served"]) == (0, 0)
    assert set(loads(gateway).values()) == {(0, 0, 0)}
    assert circuits(gateway) == {"p0": "closed", "d0": "open"}  # the decode worker is charged, not the prefill


def test_another_prefill_worker_serves_the_request_after_one_fails(procs: ProcessGroup, tmp_path: Path) -> None:
    bad, bad_port = start_sglang_worker(procs, "pbad", "prefill", mode="fail:502")
    good, good_port = start_sglang_worker(procs, "pgood", "prefill")
    d0, _ = start_sglang_worker(procs, "d0", "decode", wait_s=60)
    gateway, _ = pd_gateway(procs, tmp_path, {"pbad": (bad, "prefill"), "pgood": (good, "prefill"),
                                              "d0": (d0, "decode")}, sections=SGLANG, threshold=100,
                            worker_fields={"pbad": {"bootstrap_port": bad_port}, "pgood": {"bootstrap_port": good_port}})
    def post(i: int) -> httpx.Response:
        return httpx.post(gateway.url + "/v1/completions", json={**PROMPT, "stream": bool(i % 2)}, timeout=30)

    # At once: the prefill load scorer sends some to "pbad" while "pgood" holds others, then a new pair.
    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(post, range(6)))
    for resp in answers:
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-mesh-prefill-worker"] == "pgood"
        assert text_of(resp) == "decoded by d0 with kv from pgood"
    assert fake_state(bad)["posts"] >= 1
    wait_until(lambda: fake_state(d0)["aborted"] == fake_state(bad)["posts"], timeout_s=10, what="decode legs aborted")
    decode = fake_state(d0)
    assert decode["served"] == 6 and len(set(decode["rooms"])) == decode["posts"] == 6 + fake_state(bad)["posts"]
    assert set(loads(gateway).values()) == {(0, 0, 0)}


def test_a_client_that_leaves_ends_both_legs(procs: ProcessGroup, tmp_path: Path) -> None:
    p0, bootstrap = start_sglang_worker(procs, "p0", "prefill", mode="hold")
    d0, _ = start_sglang_worker(procs, "d0", "decode", wait_s=60)
    gateway, _ = pd_gateway(procs, tmp_path, {"p0": (p0, "prefill"), "d0": (d0, "decode")}, sections=SGLANG,
                            worker_fields={"p0": {"bootstrap_port": bootstrap}})
    with pytest.raises(httpx.ReadTimeout):  # both legs wait on each other: the client gives up, closing
        httpx.post(gateway.url + "/v1/completions", json={**PROMPT, "stream": True}, timeout=1.5)
    wait_until(lambda: (fake_state(p0)["aborted"], fake_state(d0)["aborted"]) == (1, 1), timeout_s=10,
               what="both legs aborted")
    wait_until(lambda: set(loads(gateway).values()) == {(0, 0, 0)}, timeout_s=10, what="no load left")
    assert circuits(gateway) == {"p0": "closed", "d0": "closed"}  # nobody's failure


def test_a_client_cannot_set_the_bootstrap_fields(procs: ProcessGroup, tmp_path: Path) -> None:
    p0, bootstrap = start_sglang_worker(procs, "p0", "prefill")
    d0, _ = start_sglang_worker(procs, "d0", "decode")
    gateway, _ = pd_gateway(procs, tmp_path, {"p0": (p0, "prefill"), "d0": (d0, "decode")}, sections=SGLANG,
                            worker_fields={"p0": {"bootstrap_port": bootstrap}})
    for key, value in (("bootstrap_room", 7), ("bootstrap_host", "10.9.9.9"), ("bootstrap_port", 1)):
        resp = httpx.post(gateway.url + "/v1/completions", json={**PROMPT, key: value}, timeout=10)
        assert resp.status_code == 400 and error_of(resp.json())["param"] == key
    assert fake_state(p0)["posts"] == fake_state(d0)["posts"] == 0


def test_an_sglang_pool_beside_a_vllm_pool_pairs_within_its_own_protocol(procs: ProcessGroup, tmp_path: Path) -> None:
    """The config's protocol is vllm; two workers say sglang (``disagg_protocol``). Every decision
    the policy makes across the pools is made again within the prefill worker's protocol."""
    ps, bootstrap = start_sglang_worker(procs, "ps", "prefill")
    ds, _ = start_sglang_worker(procs, "ds", "decode")
    script = procs.log_dir / "pd_worker.py"
    script.write_text(pd_worker.SCRIPT)
    vllm = {name: procs.start_http([PYTHON, str(script), name, role, str(port)], name=name, port=port, ready_path="/")
            for name, role, port in (("pv", "prefill-now", free_port()), ("dv", "decode", free_port()))}
    sglang = {"disagg_protocol": "sglang"}
    gateway, _ = pd_gateway(procs, tmp_path, {"ps": (ps, "prefill"), "ds": (ds, "decode"), "pv": (vllm["pv"], "prefill"),
                                              "dv": (vllm["dv"], "decode")},
                            worker_fields={"ps": {**sglang, "bootstrap_port": bootstrap}, "ds": sglang})

    def post(i: int) -> httpx.Response:
        return httpx.post(gateway.url + "/v1/completions", json={**PROMPT, "stream": bool(i % 2)}, timeout=30)

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(post, range(16)))
    pairs = []
    for resp in answers:
        assert resp.status_code == 200, resp.text
        pair = (resp.headers["x-mesh-prefill-worker"], resp.headers["x-mesh-worker"])
        assert pair in {("ps", "ds"), ("pv", "dv")}
        assert text_of(resp) == ("decoded by ds with kv from ps" if pair == ("ps", "ds") else "from dv")
        pairs.append(pair)
    assert set(pairs) == {("ps", "ds"), ("pv", "dv")}  # both pools served
    assert (fake_state(ds)["refused"], fake_state(ps)["refused"]) == (0, 0)  # an SGLang worker always got a room
    assert set(loads(gateway).values()) == {(0, 0, 0)}
