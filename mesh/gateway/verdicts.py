"""What a worker's answer means for the request and for the worker's health.

One rule for the ordinary proxy and the disaggregated relay, prefill and decode attempts alike
(``status_verdict``): 502/503/504 are retried elsewhere and charged at once; a 500 is retried and
only suspect (an input that crashes any worker must not open every circuit), charged once
another worker serves the request; a 429 is retried and never charged (busy is not broken); any
other status is the answer, but a 200 that is not what was asked for (``answer_problem``) is
retried and charged at once. ``UpstreamFailed`` is an attempt that failed before anything reached
the client; ``Failure`` is the last one, answered when no retry is left. What breaks because the
gateway itself is shutting down is nobody's failure (``shutdown_error``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from mesh.errors import MeshError

RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
MAX_ANSWER_BYTES = 64 << 20  # a non-streamed answer (held whole before it is relayed) larger than this is a 502
SHUTDOWN_MESSAGE = "the gateway is shutting down: the request was ended at its shutdown timeout"


@dataclass(frozen=True, slots=True)
class StatusVerdict:
    """What a worker's answer status means while nothing has reached the client yet."""

    retry: bool  # another worker may serve the request
    charge: bool  # a failure of the worker's at once (its circuit breaker)
    suspect: bool  # a failure of the worker's only once another worker serves the same request


def status_verdict(status: int) -> StatusVerdict:
    """The rule for a worker's answer status (the module docstring)."""
    return _VERDICTS.get(status, _ANSWER)


_ANSWER = StatusVerdict(retry=False, charge=False, suspect=False)
_VERDICTS = {s: StatusVerdict(retry=True, charge=s in (502, 503, 504), suspect=s == 500) for s in RETRY_STATUSES}


def shutdown_error() -> MeshError:
    """The answer to a request the gateway's shutdown timeout ended (no worker is charged)."""
    return MeshError(503, SHUTDOWN_MESSAGE, code="shutting_down")


class UpstreamFailed(Exception):
    """An attempt failed before anything reached the client: retry elsewhere."""

    def __init__(
        self,
        kind: str,
        message: str,
        *,
        status: int = 502,
        body: bytes | None = None,
        headers: list[tuple[bytes, bytes]] | None = None,
        worker_fault: bool = True,
        suspect: bool = False,
        detail: str | None = None,
    ) -> None:
        super().__init__(message)
        self.detail = detail  # what the log and the worker's last_error get (the message: the client's)
        self.kind = kind
        self.status = status
        self.body = body  # a worker's own error answer, passed through if no retry is left
        self.headers = headers
        # Counts toward the circuit breaker at once, unless only suspect (a 500: see ``Failure``).
        self.worker_fault = worker_fault
        self.suspect = suspect


@dataclass(slots=True)
class Failure:
    """The last failed attempt, answered to the client when no retry is left."""

    kind: str
    status: int
    message: str
    body: bytes | None = None
    headers: list[tuple[bytes, bytes]] | None = None
    # A worker's 500 may be the request's fault (an input that crashes any worker): it counts
    # toward that worker's circuit breaker only if another worker then serves the same request,
    # so one poison request retried everywhere cannot open every circuit.
    suspect: str | None = None  # target id


def answer_problem(headers: Iterable[tuple[bytes, bytes]], body: bytes, stream: bool) -> str | None:
    """Why a whole 200 answer (not an event stream) is not what an OpenAI request asked for, or
    None: it must be a JSON object with a JSON content-type (a stream request's too: a worker may
    answer one with JSON, relayed as such). A worker answering HTML fastest would draw most traffic."""
    ctype = next((v for k, v in headers if k == b"content-type"), b"").partition(b";")[0].strip().lower()
    if ctype != b"application/json" and not ctype.endswith(b"+json"):
        shown = ctype[:64].decode("latin-1") or "no content-type"
        return f"{shown}{' to a stream request' if stream else ''}, not JSON"
    # Its ends, not a parse: an answer can be megabytes, and an HTML page or a cut answer fails here.
    if body.lstrip()[:1] != b"{" or body.rstrip()[-1:] != b"}":
        return "a body that is not a JSON object"
    return None
