"""``mesh.connect_policy``: hosts compared in one canonical spelling, link-local and metadata
hosts refused by default, ZMQ schemes and the ``ipc://`` path allowlist; and the config's use of
it (``mesh config validate`` lines name the worker's path)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mesh.config import ConfigError, MeshConfig, WorkerConfig, check_worker_addresses, parse_config
from mesh.connect_policy import ConnectPolicy, canonical_host

LOOPBACK_SPELLINGS = ["127.0.0.1", "127.1", "0x7f.0.0.1", "0177.0.0.1", "2130706433", "0x7f000001", "[::ffff:127.0.0.1]",
                      "::ffff:7f00:1", "127.0.0.1."]
METADATA_SPELLINGS = ["169.254.169.254", "2852039166", "0xa9.0xfe.0xa9.0xfe", "169.254.43518", "[::ffff:169.254.169.254]",
                      "[fd00:ec2::254]", "[FD00:EC2:0:0:0:0:0:254]", "metadata.google.internal", "METADATA.Google.Internal.",
                      "100.100.100.200"]


@pytest.mark.parametrize("host", LOOPBACK_SPELLINGS)
def test_every_spelling_of_loopback_is_one_host(host: str) -> None:
    assert canonical_host(host) == "127.0.0.1"


def test_names_are_lower_cased_without_the_trailing_dot_and_must_be_ascii() -> None:
    assert canonical_host("GPU-1.Example.") == "gpu-1.example"
    assert canonical_host("[2001:DB8::0:1]") == "2001:db8::1"
    for bad in ("ｍetadata.google.internal", "a b", "", "evil.example/x", "-lead"):
        with pytest.raises(ValueError):
            canonical_host(bad)


@pytest.mark.parametrize("host", METADATA_SPELLINGS)
def test_metadata_hosts_are_refused_by_default_in_every_spelling(host: str) -> None:
    with pytest.raises(ValueError, match="metadata service"):
        ConnectPolicy().check_url(f"http://{host}:80")


@pytest.mark.parametrize("url", ["http://169.254.1.2:8000", "http://[fe80::1]:8000", "http://[fe80::1%25eth0]:8000"])
def test_link_local_is_refused_by_default(url: str) -> None:
    with pytest.raises(ValueError, match="link-local"):
        ConnectPolicy().check_url(url)


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000", "http://10.0.0.5:8000", "http://192.168.1.9", "https://gpu-1:443",
                                 "http://[::1]:8000", "http://localhost:1"])
def test_loopback_private_and_names_stay_allowed_by_default(url: str) -> None:
    ConnectPolicy().check_url(url)


def test_an_allowlist_matches_any_spelling_and_networks_and_can_allow_a_refused_host() -> None:
    policy = ConnectPolicy(allowed_hosts=("127.0.0.1", "10.0.0.0/8", "GPU-1", "169.254.169.254"))
    for url in ("http://127.1:1", "http://[::ffff:127.0.0.1]:1", "http://10.200.3.4:1", "http://gpu-1.:1",
                "http://169.254.169.254:80"):
        policy.check_url(url)
    for url in ("http://127.0.0.2:1", "http://11.0.0.1:1", "http://gpu-2:1", "http://metadata.google.internal"):
        with pytest.raises(ValueError, match="not in allowed_worker_hosts"):
            policy.check_url(url)
    with pytest.raises(ValueError, match="not a CIDR network"):
        ConnectPolicy(allowed_hosts=("10.0.0.0/33",))


def test_zmq_endpoints_pass_the_same_host_rules_and_their_own_schemes() -> None:
    policy = ConnectPolicy()
    policy.check_zmq("tcp://10.0.0.5:5557")
    policy.check_zmq("inproc://kv")
    for endpoint, text in (("tcp://169.254.169.254:5557", "metadata"), ("tcp://[fe80::2]:5557", "link-local"),
                           ("tcp://0xa9fea9fe:5557", "metadata"), ("pgm://10.0.0.5:5557", "allowed_kv_event_schemes")):
        with pytest.raises(ValueError, match=text):
            policy.check_zmq(endpoint)
    with pytest.raises(ValueError, match="allowed_kv_event_schemes"):
        ConnectPolicy(zmq_schemes=("tcp",)).check_zmq("inproc://kv")


def test_ipc_paths_are_refused_unless_under_an_allowed_one_after_resolving(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="allowed_ipc_paths"):
        ConnectPolicy().check_zmq("ipc:///var/run/docker.sock")
    allowed = tmp_path / "mesh"
    allowed.mkdir()
    policy = ConnectPolicy(ipc_paths=(str(allowed),))
    policy.check_zmq(f"ipc://{allowed}/kv")
    policy.check_zmq(f"ipc://{allowed}")
    (allowed / "link").symlink_to("/var/run/docker.sock")
    for path in (f"{allowed}/../../var/run/docker.sock", f"{allowed}/link", f"{allowed}x/kv", "relative/kv"):
        with pytest.raises(ValueError, match="allowed_ipc_paths|absolute"):
            policy.check_zmq(f"ipc://{path}")
    assert os.path.islink(allowed / "link")


def test_config_errors_name_the_worker_and_cover_every_rank_and_the_replay_endpoint(tmp_path: Path) -> None:
    allowed = str(tmp_path)
    doc = {"server": {"allowed_ipc_paths": [allowed]}, "workers": [
        {"name": "ok", "url": "http://127.0.0.1:1", "dp_size": 2,
         "kv_events": {"endpoint": f"ipc://{allowed}/kv", "replay_endpoint": "tcp://127.0.0.1:5558"}},
        {"name": "meta", "url": "http://127.0.0.1:2", "kv_events": {"endpoint": "tcp://169.254.169.254:5557"}},
        {"name": "sock", "url": "http://127.0.0.1:3", "kv_events": {"endpoint": "tcp://127.0.0.1:5600",
                                                                       "replay_endpoint": "ipc:///var/run/docker.sock"}},
    ]}
    with pytest.raises(ConfigError) as info:
        parse_config(doc, check_policy=False)
    errors = info.value.errors
    assert len(errors) == 2, errors
    assert errors[0].startswith("workers[1]: kv_events endpoint 'tcp://169.254.169.254:5557'") and "metadata" in errors[0]
    assert errors[1].startswith("workers[2]: kv_events replay_endpoint 'ipc:///var/run/docker.sock'"), errors[1]
    with pytest.raises(ConfigError, match="allowed_ipc_paths"):  # rank 1's socket is kv_dp1: under the directory too
        parse_config({**doc, "server": {"allowed_ipc_paths": [f"{allowed}/kv"]}, "workers": doc["workers"][:1]},
                     check_policy=False)


def test_a_config_built_in_code_is_checked_too_and_the_admin_path_checks_one_worker() -> None:
    with pytest.raises(ValueError, match="workers\\[0\\] \\(m\\): worker url .* metadata"):
        MeshConfig(workers=[WorkerConfig(name="m", url="http://metadata.google.internal")])
    server = MeshConfig().server
    with pytest.raises(ValueError, match="allowed_ipc_paths"):
        check_worker_addresses(WorkerConfig(name="w", url="http://127.0.0.1:1",
                                            kv_events={"endpoint": "ipc:///var/run/docker.sock"}), server)  # type: ignore[arg-type]


def test_bad_allowlist_entries_are_config_errors() -> None:
    for server, text in (({"allowed_worker_hosts": ["a b"]}, "not a host name"),
                         ({"allowed_ipc_paths": ["tmp/kv"]}, "must be absolute"),
                         ({"allowed_kv_event_schemes": ["udp"]}, "server.allowed_kv_event_schemes")):
        with pytest.raises(ConfigError) as info:
            parse_config({"server": server}, check_policy=False)
        assert any(text in e for e in info.value.errors), info.value.errors
