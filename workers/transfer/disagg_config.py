"""Configuration of a worker's prefill/decode role and KV transfer (no heavy imports: the CLI
reads it for ``--help``). Used by ``workers.transfer.disagg_server``."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

from workers.transfer.auth import secret_from_env

ROLES = ("mixed", "prefill", "decode")
FAULTS_ENV = "MESH_KV_TRANSFER_FAULTS"  # "1": POST /kv_transfer/faults is enabled (tests only)


@dataclass(frozen=True)
class TransferConfig:
    role: str = "mixed"
    transport: str = "tcp"  # what this worker offers for pulls: tcp (measured faster) or http
    tcp_port: int = 0  # 0: an ephemeral port, advertised in kv_transfer_params
    bind_host: str = "127.0.0.1"
    advertise_host: str | None = None  # None: the address the prefill request arrived on
    ttl_s: float = 30.0  # a prefill's blocks are released by then if nobody consumed them
    consumers: tuple[str, ...] = ("decode",)  # e.g. ("decode", "cpu_save") with CPU offload
    max_pending: int = 8  # decode: inbound transfers admitted at once
    max_pending_bytes: int | None = None  # decode: None = half of this worker's KV cache
    pull_timeout_s: float = 30.0
    pull_attempts: int = 2  # a corrupt or truncated stream is pulled again (resuming) once
    chunk_bytes: int = 8 << 20  # pages per engine-thread gather/import call (bounded buffers)
    ipc: bool = True  # same host, CUDA: offer / use GPU-to-GPU peer copies (workers.transfer.kv_ipc)
    # pages per engine-thread peer copy (~0.2 ms over NVLink); its gather buffer sits on the peer's GPU
    ipc_chunk_bytes: int = 64 << 20
    secret: bytes | None = field(default=None, repr=False)  # signs kv_transfer_params (workers.transfer.auth)
    retry_after_s: int = 1
    faults: bool = False  # POST /kv_transfer/faults (tests only)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.transport not in ("tcp", "http"):
            raise ValueError(f"transport must be tcp or http, got {self.transport!r}")
        if not self.consumers:
            raise ValueError("at least one transfer consumer is needed")


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("prefill/decode disaggregation")
    g.add_argument("--role", default="mixed", choices=ROLES, help="advertised role (every role can prefill for and decode from others)")
    g.add_argument("--kv-transfer-transport", default="tcp", choices=["tcp", "http"], help="how this worker serves KV pulls")
    g.add_argument("--kv-transfer-port", type=int, default=0, help="raw TCP port for KV pulls (0: ephemeral)")
    g.add_argument("--kv-transfer-host", default=None, help="address advertised to decode workers (default: the one the prefill request came to)")
    g.add_argument("--kv-transfer-ttl", type=float, default=30.0, help="seconds a finished prefill's blocks stay pinned without a consumer")
    g.add_argument("--kv-transfer-consumers", default="decode", help="comma-separated consumers that must finish before blocks are freed")
    g.add_argument("--kv-transfer-ipc", default="auto", choices=["auto", "off"],
                   help="same-host GPU workers: copy KV GPU to GPU over CUDA IPC (auto) or always pull over TCP (off)")
    g.add_argument("--kv-max-pending", type=int, default=8, help="decode: inbound transfers admitted at once")
    g.add_argument("--kv-max-pending-bytes", type=int, default=None, help="decode: inbound bytes admitted at once (default: half the KV cache)")


def transfer_config(args: argparse.Namespace) -> TransferConfig:
    return TransferConfig(
        role=args.role, transport=args.kv_transfer_transport, tcp_port=args.kv_transfer_port,
        bind_host=args.host, advertise_host=args.kv_transfer_host, ttl_s=args.kv_transfer_ttl,
        consumers=tuple(c.strip() for c in args.kv_transfer_consumers.split(",") if c.strip()),
        max_pending=args.kv_max_pending, max_pending_bytes=args.kv_max_pending_bytes,
        faults=os.environ.get(FAULTS_ENV) == "1", ipc=getattr(args, "kv_transfer_ipc", "auto") == "auto",
        secret=secret_from_env(),
    )
