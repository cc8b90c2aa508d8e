"""End to end on hybrid workers: the tiny-hybrid preset (recurrent layers beside full attention)
in two real worker processes publishing KV events, one gateway on the default policy with
speculative entries off (every overlap it sees comes from the engines' events) and
``workers[].hybrid`` set.

Shown: multi-turn conversations land on the worker holding their prefix; each later turn resumes
at least from the end-of-turn checkpoint the previous turn left (its prompt and reply reused)
and computes only the rest; ``/debug/route``'s overlap before the turn equals the ``cached_tokens``
the worker reports, and so do the gateway's predicted and reported token counters; the worker's
own counters agree (computed prompt tokens = prompt - cached)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.e2e_bundled import BLOCK, Conversation, Gateway, overlaps, start_gateway, start_workers, wait_until, write_config
from tests.procs import ProcessGroup

WORKERS = ["h0", "h1"]
# The byte tokenizer round-trips ASCII only (ids >= 256 decode to nothing, lone bytes >= 128 to
# U+FFFD): a reply that stops before its first other token comes back in the next turn's prompt
# exactly as it was generated, so its blocks (and the checkpoint after them) are reusable.
ASCII_ONLY = list(range(128, 512))


@pytest.fixture(scope="module")
def hybrid(module_procs: ProcessGroup) -> Iterator[tuple[Gateway, dict[str, str]]]:
    workers = start_workers(module_procs, WORKERS, preset="tiny-hybrid", extra=("--state-checkpoint-interval", "64"))
    ws = list(workers.values())
    assert all(w.config()["hybrid"] for w in ws)
    cfg = write_config(module_procs.log_dir / "hybrid.yaml", ws, index={"speculative_ttl_s": 0})
    gw = Gateway(start_gateway(module_procs, cfg, "gateway-hybrid"))
    gw.wait_ready(len(WORKERS))
    yield gw, {w.name: w.proc.url for w in ws}
    gw.close()


def _worker_metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(f"mesh_worker_{name} ") or line.startswith(f"mesh_worker_{name}_total "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no mesh_worker_{name} on {url}")


def test_turns_resume_from_checkpoints_and_the_prediction_matches(hybrid: tuple[Gateway, dict[str, str]]) -> None:
    gw, urls = hybrid
    predicted0, reported0 = gw.metric("mesh_prefix_predicted_tokens_total"), gw.metric("mesh_prefix_reported_tokens_total")
    convs = [Conversation(seed) for seed in (11, 12, 13)]
    holder: dict[int, str] = {}
    prev_seen = [0] * len(convs)  # tokens the previous turn computed: its prompt and its reply
    cached_total = replies = 0
    for turn in range(4):
        for i, conv in enumerate(convs):
            body = conv.next_body(words=10, max_tokens=40, stop_token_ids=ASCII_ONLY)
            seen = 0
            if turn:
                # the previous turn's end-of-turn checkpoint covers its prompt and its reply
                want = prev_seen[i] // BLOCK
                route = wait_until(lambda b=body, h=holder[i], n=want: (  # noqa: B023
                    r if overlaps((r := gw.route(b))["decision"]).get(h, 0) >= n else None),
                    what=f"conversation {i} turn {turn}: its checkpoint indexed")
                assert route["decision"]["target"] == holder[i]
                seen = overlaps(route["decision"])[holder[i]]
            url = urls[holder[i]] if turn else None
            before = _worker_metric(url, "prefill_computed_tokens") if url else 0.0
            result = gw.chat(body)
            conv.answered(result.reply)
            if turn:
                assert result.worker == holder[i]
                assert result.cached_tokens == seen * BLOCK, (turn, result.cached_tokens, seen)
                assert result.cached_tokens >= prev_seen[i] // BLOCK * BLOCK  # the previous reply's blocks too
                computed = _worker_metric(url, "prefill_computed_tokens") - before  # type: ignore[arg-type]
                assert computed == result.prompt_tokens - result.cached_tokens  # only the suffix ran
            holder.setdefault(i, result.worker)
            prev_seen[i] = result.prompt_tokens + len(result.reply.encode())  # ASCII: one token a byte
            replies += len(result.reply)
            cached_total += result.cached_tokens
    assert cached_total > 0 and replies > 0
    predicted = gw.metric("mesh_prefix_predicted_tokens_total") - predicted0
    reported = gw.metric("mesh_prefix_reported_tokens_total") - reported0
    assert reported == cached_total and predicted == reported, (predicted, reported)
    restored = sum(_worker_metric(u, "state_checkpoints_restored") for u in urls.values())
    assert restored >= 3 * len(convs)
