"""Which addresses Mesh may connect to: one policy for every worker URL and KV event endpoint.

Every address the gateway opens a connection to on a worker's behalf (its HTTP ``url``, its
``kv_events`` ``endpoint`` and ``replay_endpoint``, each data-parallel rank's) passes ``check_url``
or ``check_zmq`` of one ``ConnectPolicy`` before a worker holding it is registered: at config
load (``mesh serve``, ``mesh config validate``, a reload) and on the admin API's ``POST /workers``.
A refusal is a ``ValueError`` whose message names the address and the setting that allows it.

The rules, in order:
- The scheme must be allowed: ``http``/``https`` for URLs, ``tcp``/``ipc``/``inproc`` for ZMQ.
- ``ipc://PATH`` connects to a unix socket: allowed only when the path (made absolute, ``..``
  and symlinks resolved) is one of ``ipc_paths`` or lies under one of them (none by default: a
  socket such as ``/var/run/docker.sock`` is never reached by accident). ``inproc://`` stays in
  the process and is always allowed.
- The host is compared in canonical form (``canonical_host``): an IP literal in any spelling the
  resolver accepts (``127.1``, ``0x7f.0.0.1``, ``2130706433``, ``[::ffff:127.0.0.1]``) is its
  one standard text; a name is lower-cased without its trailing dot. A name must be ASCII (write
  internationalised names in their ``xn--`` form): a Unicode look-alike could normalise, in the
  resolver, to a name the policy refused.
- With ``allowed_hosts`` set, only the hosts (or ``CIDR`` networks) it lists are allowed; a
  listed host is allowed even when the next rule would refuse it.
- Without it, any host is allowed except link-local addresses (169.254.0.0/16, fe80::/10) and the
  cloud metadata services (``METADATA_HOSTS``): a worker URL pointing there reads the host's
  credentials. Loopback and private ranges stay allowed (workers run there).

Names are checked as written, not resolved: a name the operator allows is trusted to resolve
where it should (resolving here would not bind the later connect, which resolves again).
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
import urllib.parse
from collections.abc import Iterable
from dataclasses import dataclass, field

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

LINK_LOCAL: tuple[IPNetwork, ...] = (ipaddress.ip_network("169.254.0.0/16"), ipaddress.ip_network("fe80::/10"))
# Instance metadata services: AWS/GCP/Azure/OpenStack (169.254.169.254), AWS over IPv6,
# GCP by name, Alibaba Cloud. Refused unless listed in allowed_hosts.
METADATA_HOSTS = frozenset({"169.254.169.254", "fd00:ec2::254", "metadata.google.internal", "metadata",
                            "100.100.100.200"})
URL_SCHEMES = ("http", "https")
ZMQ_SCHEMES = ("tcp", "ipc", "inproc")
_NAME = re.compile(r"[a-z0-9_]([a-z0-9_\-]*[a-z0-9_])?(\.[a-z0-9_]([a-z0-9_\-]*[a-z0-9_])?)*")
_INET_ATON = re.compile(r"[0-9a-fx.]+")  # what inet_aton may read as an IPv4 address (hex, octal, short forms)


def canonical_host(host: str) -> str:
    """The one spelling of ``host``: an IP literal's standard text (an IPv4-mapped IPv6 address
    is its IPv4 address), else the lower-cased name without its trailing dot. Raises ValueError
    for what is neither (spaces, non-ASCII, empty)."""
    ip = parse_ip(host)
    if ip is not None:
        return str(ip)
    name = host.strip().lower().removesuffix(".")
    if not name or len(name) > 253 or not name.isascii() or not _NAME.fullmatch(name):
        raise ValueError(f"host {host!r} is not a host name or an IP address (write a non-ASCII name in its xn-- form)")
    return name


def parse_ip(host: str) -> IPAddress | None:
    """``host`` as an IP address, read as the resolver reads it; None when it is a name."""
    text = host.strip().lower().removeprefix("[").removesuffix("]").removesuffix(".")
    try:
        ip = ipaddress.ip_address(text.partition("%")[0])  # a zone id (fe80::1%eth0) names a link, not an address
    except ValueError:
        if not _INET_ATON.fullmatch(text) or not any(c.isdigit() for c in text):
            return None
        try:  # 127.1, 0x7f.0.0.1, 0177.0.0.1, 2130706433: glibc's inet_aton reads them all as 127.0.0.1
            return ipaddress.IPv4Address(socket.inet_aton(text))
        except OSError:
            return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


@dataclass(frozen=True)
class ConnectPolicy:
    """Hosts, schemes and unix socket paths Mesh may connect to (module docstring: the rules)."""

    allowed_hosts: tuple[str, ...] | None = None  # as configured; None = any host but the refused
    url_schemes: tuple[str, ...] = URL_SCHEMES
    zmq_schemes: tuple[str, ...] = ZMQ_SCHEMES
    ipc_paths: tuple[str, ...] = ()  # unix socket paths (or directories holding them) ipc:// may reach
    setting: str = "server.allowed_worker_hosts"  # named in refusals
    # derived in __post_init__: the allowlist canonicalised (a bad entry raises there)
    _hosts: frozenset[str] = field(init=False, repr=False)
    _nets: tuple[IPNetwork, ...] = field(init=False, repr=False)
    _paths: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        hosts, nets = _allowlist(self.allowed_hosts or ())
        object.__setattr__(self, "_hosts", hosts)  # (frozen: set once, here)
        object.__setattr__(self, "_nets", nets)
        object.__setattr__(self, "_paths", tuple(_real_path(p) for p in self.ipc_paths))

    def check_url(self, url: str, what: str = "worker url") -> None:
        """Raise ValueError unless ``url``'s scheme and host are allowed."""
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme not in self.url_schemes:
            raise ValueError(f"{what} {url!r}: scheme {parsed.scheme!r} not in allowed_schemes {list(self.url_schemes)}")
        self.check_host(parsed.hostname or "", f"{what} {url!r}")

    def check_zmq(self, endpoint: str, what: str = "kv_events endpoint") -> None:
        """Raise ValueError unless the ZMQ ``endpoint`` (``tcp://HOST:PORT``, ``ipc://PATH``,
        ``inproc://NAME``) is allowed."""
        scheme, sep, rest = endpoint.partition("://")
        if not sep or scheme not in self.zmq_schemes:
            raise ValueError(f"{what} {endpoint!r}: scheme {scheme!r} not in allowed_kv_event_schemes "
                             f"{list(self.zmq_schemes)}")
        if scheme == "tcp":
            self.check_host(rest.rpartition(":")[0], f"{what} {endpoint!r}")
        elif scheme == "ipc":
            self._check_ipc(rest, f"{what} {endpoint!r}")

    def check_host(self, host: str, what: str) -> None:
        """Raise ValueError unless ``host`` (any spelling) may be connected to."""
        canon = canonical_host(host)
        ip = parse_ip(canon)
        if canon in self._hosts or (ip is not None and any(ip in net for net in self._nets)):
            return
        if self.allowed_hosts is not None:
            raise ValueError(f"{what}: host {host!r} not in allowed_worker_hosts")
        if canon in METADATA_HOSTS:
            raise ValueError(f"{what}: host {host!r} is a cloud metadata service; list it in {self.setting} to allow it")
        if ip is not None and any(ip in net for net in LINK_LOCAL):
            raise ValueError(f"{what}: host {host!r} is link-local; list it in {self.setting} to allow it")

    def _check_ipc(self, path: str, what: str) -> None:
        if path.startswith("@"):  # Linux abstract namespace: a name, matched as written
            real = path
        elif not os.path.isabs(path):
            raise ValueError(f"{what}: an ipc path must be absolute")
        else:
            real = _real_path(path)
        if not any(real == p or real.startswith(p.rstrip("/") + "/") for p in self._paths):
            allowed = list(self.ipc_paths) or "none"
            raise ValueError(f"{what}: path {path!r} is not under server.allowed_ipc_paths ({allowed}); "
                             "list the socket or its directory there to allow it")


def _allowlist(entries: Iterable[str]) -> tuple[frozenset[str], tuple[IPNetwork, ...]]:
    """Canonical hosts and CIDR networks of an allowlist; raises ValueError on a bad entry."""
    hosts: set[str] = set()
    nets: list[IPNetwork] = []
    for entry in entries:
        if "/" in entry:
            try:
                nets.append(ipaddress.ip_network(entry.strip(), strict=False))
            except ValueError as exc:
                raise ValueError(f"allowed host {entry!r} is not a CIDR network: {exc}") from exc
        else:
            hosts.add(canonical_host(entry))
    return frozenset(hosts), tuple(nets)


def _real_path(path: str) -> str:
    """``path`` absolute, with ``..`` and symlinks resolved (an abstract ``@name`` as written)."""
    return path if path.startswith("@") else os.path.realpath(path)
