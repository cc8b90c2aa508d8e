"""A worker's answer as the proxy reads it: its first bytes (a stream's first chunk, else the
whole answer, bounded by ``MAX_ANSWER_BYTES``), what they mean (a status another worker may
serve, an empty or garbage 200: ``UpstreamFailed``), its error in the OpenAI shape, and the usage
it reported (``count_usage``, the one parse of it: serving counters, prefix reuse, access log).
"""

from __future__ import annotations

import re

from mesh.errors import openai_error_bytes
from mesh.gateway.client_io import Exchange
from mesh.gateway.headers import response_headers
from mesh.gateway.sse_relay import is_sse
from mesh.gateway.upstream import UpstreamResponse
from mesh.gateway.verdicts import MAX_ANSWER_BYTES, UpstreamFailed, answer_problem, status_verdict
from mesh.request_metrics import Series
from policies.base import TargetState

_PROMPT_TOKENS = re.compile(rb'"prompt_tokens"\s*:\s*(\d+)')
_COMPLETION_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
_CACHED_TOKENS = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')


def count_usage(tail: bytes, series: Series, state: Exchange) -> int | None:
    """Count the tokens an answer's worker reported (its last ``usage``: a stream's usage chunk)
    in ``series`` and ``state``; the cached tokens when it reported them, else None."""
    at = tail.rfind(b'"usage"')
    if at < 0:
        return None
    prompt = _PROMPT_TOKENS.search(tail, at)
    completion = _COMPLETION_TOKENS.search(tail, at)
    if prompt is None and completion is None:  # "usage": null
        return None
    found = _CACHED_TOKENS.search(tail, at)
    usage = (int(prompt.group(1)) if prompt else 0, int(found.group(1)) if found else 0,
             int(completion.group(1)) if completion else 0)
    series.usage(*usage)
    state.usage = usage
    return usage[1] if found is not None else None


def worker_error(resp: UpstreamResponse, body: bytes, target: TargetState) -> tuple[list[tuple[bytes, bytes]], bytes]:
    """A worker's error answer for the client, in the OpenAI shape (``openai_error_bytes``)."""
    headers = [*response_headers(resp.headers), (b"x-mesh-worker", target.id.encode())]
    out = openai_error_bytes(resp.status, f"worker {target.worker} answered {resp.status}", body)
    if out is body:
        return headers, body
    headers = [(k, v) for k, v in headers if k not in (b"content-type", b"content-encoding")]
    headers.append((b"content-type", b"application/json"))
    return headers, out


async def first_bytes(resp: UpstreamResponse, stream: bool, target: TargetState) -> bytes:
    """What the client gets first: a stream's first chunk, else the whole answer. Raises
    ``UpstreamFailed`` for a status another worker may serve, and for an empty answer."""
    verdict = status_verdict(resp.status)
    if verdict.retry:
        error_headers, error_body = worker_error(resp, await read_answer(resp, target), target)
        raise UpstreamFailed(
            f"status_{resp.status}",
            f"worker {target.worker} answered {resp.status}",
            status=resp.status,
            body=error_body,
            headers=error_headers,
            worker_fault=verdict.charge or verdict.suspect,
            suspect=verdict.suspect,
        )
    sse = resp.status == 200 and is_sse(resp.headers)
    if stream and sse:
        first = await resp.read_chunk()
        if not first:
            raise UpstreamFailed("empty", f"worker {target.worker} closed the stream before any data")
        return first
    first = await read_answer(resp, target)
    if resp.status == 200:
        if not first:  # no answer to relay: another worker may give one
            raise UpstreamFailed("empty", f"worker {target.worker} answered 200 with an empty body")
        problem = answer_problem(resp.headers, first, stream)
        if problem is not None:  # not what was asked for: another worker may give it; never relayed
            raise UpstreamFailed("bad_answer", f"worker {target.worker} answered 200 with {problem}")
    return first




async def read_answer(resp: UpstreamResponse, target: TargetState) -> bytes:
    """A whole (non-streamed) answer, which the gateway holds before relaying it: bounded, so a
    worker sending an endless body cannot grow the gateway's memory until the request timeout."""
    parts: list[bytes] = []
    size = 0
    while data := await resp.read_chunk():
        size += len(data)
        if size > MAX_ANSWER_BYTES:
            raise UpstreamFailed("too_large", f"worker {target.worker} answered over {MAX_ANSWER_BYTES >> 20} MiB")
        parts.append(data)
    return b"".join(parts)
