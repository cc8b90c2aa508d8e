"""A multi-node topology on one machine: one network namespace per node, each with a veth pair
whose host end is enslaved to a bridge in the root namespace (the test process sits there, at
the bridge's address). Traffic between nodes crosses two veth interfaces and the bridge: a real
network path with its own addresses (10.a.b.0/24), not loopback.

Needs root and iproute2 (``ip netns``, ``ip link ... type veth|bridge``). ``Topology.create``
raises ``NetnsUnavailable`` with the reason otherwise: the tests that use it fail with that
message (they are never skipped).

Names and the subnet derive from the process id, so concurrent test runs do not collide;
``destroy`` removes everything (deleting a namespace removes its veth pair).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field


class NetnsUnavailable(RuntimeError):
    pass


@dataclass(frozen=True)
class Node:
    name: str  # the namespace
    address: str  # its address on the bridge subnet
    host_if: str  # veth end on the bridge (root namespace)


@dataclass
class Topology:
    bridge: str
    gateway_address: str  # the bridge's address: the root namespace's side
    nodes: list[Node] = field(default_factory=list)

    @classmethod
    def create(cls, prefix: str, count: int) -> Topology:
        check_available()
        pid = os.getpid()
        tag = f"{prefix[:3]}{pid % 100000}"
        a, b = 100 + (pid >> 8) % 100, pid % 256
        topo = cls(bridge=f"{tag}b", gateway_address=f"10.{a}.{b}.1")
        try:
            _ip("link", "add", topo.bridge, "type", "bridge")
            _ip("addr", "add", f"{topo.gateway_address}/24", "dev", topo.bridge)
            _ip("link", "set", topo.bridge, "up")
            for i in range(count):
                topo.nodes.append(topo._add_node(f"{tag}n{i}", f"10.{a}.{b}.{i + 2}", f"{tag}h{i}", f"{tag}p{i}"))
        except BaseException:
            topo.destroy()
            raise
        return topo

    def _add_node(self, ns: str, address: str, host_if: str, peer_if: str) -> Node:
        _ip("netns", "add", ns)
        node = Node(ns, address, host_if)
        _ip("link", "add", host_if, "type", "veth", "peer", "name", peer_if)
        _ip("link", "set", peer_if, "netns", ns)
        _ip("link", "set", host_if, "master", self.bridge)
        _ip("link", "set", host_if, "up")
        _ip("-n", ns, "addr", "add", f"{address}/24", "dev", peer_if)
        _ip("-n", ns, "link", "set", peer_if, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", ns, "route", "add", "default", "via", self.gateway_address)
        return node

    def exec_args(self, node: Node) -> list[str]:
        """Prefix of a command that runs inside ``node``'s namespace."""
        return ["ip", "netns", "exec", node.name]

    def destroy(self) -> None:
        for node in self.nodes:
            _ip("netns", "del", node.name, check=False)
            _ip("link", "del", node.host_if, check=False)
        _ip("link", "del", self.bridge, check=False)
        self.nodes = []

    def interface_bytes(self, node: Node) -> int:
        """Bytes received + sent on ``node``'s veth end (proof that traffic crossed it)."""
        total = 0
        for stat in ("rx_bytes", "tx_bytes"):
            with open(f"/sys/class/net/{node.host_if}/statistics/{stat}") as f:
                total += int(f.read())
        return total


def check_available() -> None:
    """Raise ``NetnsUnavailable`` saying why namespaces cannot be made here."""
    if shutil.which("ip") is None:
        raise NetnsUnavailable("iproute2 is not installed (`ip` not found); .ci/run installs it")
    if os.geteuid() != 0:
        raise NetnsUnavailable(f"network namespaces need root (running as uid {os.geteuid()})")
    probe = f"meshprobe{os.getpid() % 100000}"
    res = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if res.returncode != 0:
        raise NetnsUnavailable(f"`ip netns add` failed: {res.stderr.strip()}")
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)


def _ip(*args: str, check: bool = True) -> None:
    res = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and res.returncode != 0:
        raise NetnsUnavailable(f"`ip {' '.join(args)}` failed: {res.stderr.strip()}")
