"""The SGLang protocol's pieces (``mesh.gateway.disagg_sglang``) and its config: rooms, the pair's
body, SGLang's stream error event, ``disagg.protocol`` and ``bootstrap_port`` (validated, warned)."""

from __future__ import annotations

import json

import pytest

from mesh.config import ConfigError, parse_config
from mesh.config.checks import config_warnings
from mesh.gateway.disagg_sglang import ROOM_HEADROOM, leg_bodies, new_room, sglang_body, stream_error
from policies.base import TargetState, target_id


def test_rooms_are_random_63_bit_values_with_headroom_for_each_sequence() -> None:
    rooms = [new_room() for _ in range(2000)]
    assert len(set(rooms)) == len(rooms)
    assert all(0 <= r < (1 << 63) - ROOM_HEADROOM for r in rooms)
    assert max(rooms) > 1 << 60  # spread over the whole range, not a counter


def test_the_pair_body_is_the_clients_with_the_bootstrap_fields() -> None:
    client = {"model": "m", "prompt": "hi", "max_tokens": 3, "stream": True, "n": 2}
    body = sglang_body(client, "10.0.0.5", 8998, 42)
    assert body == {**client, "bootstrap_host": "10.0.0.5", "bootstrap_port": 8998, "bootstrap_room": 42}
    assert "bootstrap_room" not in client  # the client's own body is untouched


def test_data_parallel_legs_name_their_ranks_and_the_decode_learns_the_prefills() -> None:
    body = sglang_body({"prompt": "hi"}, "10.0.0.1", 8998, 7)
    single_p, single_d = TargetState("p", "p"), TargetState("d", "d")
    assert leg_bodies(body, single_p, single_d) == (body, body)  # no DP: SGLang's one body for both
    ranked_p = TargetState(target_id("p", 1, 2), "p", dp_rank=1)
    ranked_d = TargetState(target_id("d", 3, 4), "d", dp_rank=3)
    pre, dec = leg_bodies(body, ranked_p, ranked_d)
    assert pre == {**body, "routed_dp_rank": 1, "disagg_prefill_dp_rank": 1}
    assert dec == {**body, "routed_dp_rank": 3, "disagg_prefill_dp_rank": 1}
    pre, dec = leg_bodies(body, ranked_p, single_d)
    assert "routed_dp_rank" not in dec and dec["disagg_prefill_dp_rank"] == 1


def test_sglangs_stream_error_event_is_read_as_its_status() -> None:
    err = {"object": "error", "message": "Decode transfer failed", "type": "INTERNAL_SERVER_ERROR", "param": None,
           "code": 500}
    event = stream_error(b"data: " + json.dumps(err).encode() + b"\n\ndata: [DONE]\n\n")
    assert event is not None and event[0] == 500 and json.loads(event[1])["message"] == "Decode transfer failed"
    assert stream_error(b'data: {"error": {"message": "x", "code": "busy"}}\n\n') == (502, b'{"error": {"message": "x", "code": "busy"}}')
    assert stream_error(b'data: {"id": "x", "choices": [{"text": "a"}]}\n\n') is None
    assert stream_error(b"data: {trunc") is None and stream_error(b": keep-alive\n\n") is None


def test_the_protocol_and_bootstrap_ports_are_validated() -> None:
    config = parse_config({"disagg": {"protocol": "sglang"}, "workers": [
        {"name": "p", "url": "http://10.0.0.5:30000", "role": "prefill", "bootstrap_port": 9000}]})
    assert config.disagg.protocol == "sglang" and config.workers[0].bootstrap_port == 9000
    assert parse_config({}).disagg.protocol == "vllm" and parse_config({}).workers == []
    with pytest.raises(ConfigError) as exc:
        parse_config({"disagg": {"protocol": "mooncake"}, "workers": [
            {"name": "p", "url": "http://h:1", "bootstrap_port": 70000}]})
    text = " | ".join(exc.value.errors)
    assert "disagg.protocol" in text and "workers[0].bootstrap_port" in text


def test_a_bootstrap_port_nothing_reads_is_warned_about() -> None:
    workers = [{"name": "p", "url": "http://h:1", "role": "prefill", "bootstrap_port": 9000},
               {"name": "d", "url": "http://h:2", "role": "decode", "bootstrap_port": 9001}]
    vllm = {path for _, path, _ in config_warnings(parse_config({"workers": workers}))}
    assert {"workers[0].bootstrap_port", "workers[1].bootstrap_port"} <= vllm
    sglang = {path for _, path, _ in config_warnings(parse_config({"disagg": {"protocol": "sglang"}, "workers": workers}))}
    assert "workers[1].bootstrap_port" in sglang and "workers[0].bootstrap_port" not in sglang
    own = [{**workers[0], "disagg_protocol": "sglang"}]  # this worker's protocol, not the config's
    assert not [w for w in config_warnings(parse_config({"workers": own})) if w[1].endswith("bootstrap_port")]


def test_local_prefill_tokens_over_an_sglang_decode_pool_is_warned_about() -> None:
    workers = [{"name": "p", "url": "http://h:1", "role": "prefill"}, {"name": "d", "url": "http://h:2", "role": "decode"}]
    profiles = {"prefill": {"scorers": ["prefill_load"]}, "decode": {"scorers": ["load"]}}
    pipeline = {"name": "pipeline", "params": {"profiles": profiles, "local_prefill_tokens": 256}}
    sticky = {"name": "session_sticky", "params": {"inner": pipeline}}
    for policy, path in ((pipeline, "policy.params.local_prefill_tokens"),
                         (sticky, "policy.params.inner.params.local_prefill_tokens")):
        warned = [m for _, p, m in config_warnings(parse_config(
            {"disagg": {"protocol": "sglang"}, "workers": workers, "policy": policy})) if p == path]
        assert len(warned) == 1 and "256 uncached tokens" in warned[0] and "(d)" in warned[0], warned
        vllm = config_warnings(parse_config({"workers": workers, "policy": policy}))
        assert not [w for w in vllm if w[1] == path]  # a vLLM decode worker prefills short prompts itself
