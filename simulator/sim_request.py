"""One routed request's progress on its simulated worker (``SimRequest``), and the error of a
request no worker of the cluster could ever hold (``CapacityError``). Ownership: the worker
model it is on writes its progress; the engine reads it when it ends."""

from __future__ import annotations

from typing import Any

from mesh.core.router import Lease


class CapacityError(RuntimeError):
    """A request that can never fit in one worker's KV capacity."""


class SimRequest:
    """One routed request's progress on its worker."""

    __slots__ = (
        "idx", "session", "n", "out", "keys", "nfull", "arrival", "lease", "worker",
        "target", "computed", "registered", "own", "g", "first_t", "finish_t", "hit_tokens",
        "cpu_tokens", "admitted", "preemptions", "decode_to", "on_decode", "importing", "seq", "info",
    )

    def __init__(self, idx: int, session: str | None, n: int, out: int, keys: list[int], arrival: float,
                 lease: Lease | None, worker: int) -> None:
        self.idx = idx
        self.session = session
        self.n = n
        self.out = out if out > 0 else 1  # every request yields at least its first token
        self.keys = keys
        self.nfull = len(keys)
        self.arrival = arrival
        self.lease = lease
        self.worker = worker
        self.target = n  # tokens to compute before the (next) token: prompt, or prompt+generated
        self.computed = 0
        self.registered = 0  # leading prompt blocks this request holds in the cache
        self.own = 0  # blocks this request holds outside the cache
        self.g = 0  # generated tokens
        self.first_t = -1.0
        self.finish_t = -1.0
        self.hit_tokens = -1  # at first admission: GPU + CPU prefix hit, tokens
        self.cpu_tokens = 0
        self.admitted = False
        self.preemptions = 0
        self.decode_to: int = -1  # PD: the decode worker, when the decision named a pair
        self.on_decode = False  # PD: handed to its decode worker (it stays there, preempted or not)
        self.importing = False  # PD: its next admission imports the transferred prompt blocks
        self.seq = 0
        self.info: Any = None  # PD: the RequestInfo, for the decode worker's lease
