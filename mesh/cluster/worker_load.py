"""What the registry does with one ``/metrics`` scrape of a worker: readings placed on its
targets, back-off and staleness, and rate-limited log lines.

Ownership: ``apply_scrape`` is the only writer of a worker's ``metrics_*`` fields and, through
``Worker.set_reported``, of its targets' KV fields; ``WorkerRegistry`` calls it on the event
loop, after checking that the worker is still registered and scraping still on.

Invariants: a scrape never changes a worker's health. Values that no good scrape renewed for
``stale_after(interval_s)`` read as unknown; a worker whose ``/metrics`` answered but reports
nothing usable is asked again only after ``METRICS_ABSENT_RETRY_S``.
"""

from __future__ import annotations

import logging

from mesh.cluster.worker import Worker
from mesh.cluster.worker_metrics import RankLoad, Scrape
from mesh.log_limit import RateLimitedWarning

log = logging.getLogger("mesh.cluster.registry")  # the registry's log channel

# Worker-reported load: a module setting until the config has a field for it (the lead's call).
METRICS_ABSENT_RETRY_S = 10.0  # a worker whose /metrics answered 404 or held no load signals
METRICS_STALE_ROUNDS = 3  # values survive this many failed health rounds...
METRICS_STALE_MIN_S = 5.0  # ...and at least this long
METRICS_LOG_EVERY_S = 60.0  # per worker: at most one INFO line and one WARNING line per this


def stale_after(interval_s: float) -> float:
    """Values older than this (no good scrape since) are dropped to unknown."""
    return max(METRICS_STALE_MIN_S, METRICS_STALE_ROUNDS * interval_s)


def apply_scrape(worker: Worker, got: Scrape, now: float, stale_after_s: float) -> None:
    """Record one scrape's outcome on ``worker`` (and its readings on its targets)."""
    loads: list[RankLoad | None] | None = None
    if got.result == "ok":
        loads = loads_for_targets(got.ranks, len(worker.targets))
        if loads is None:  # ranks that cannot be placed on the targets: an answer, not a reading
            listed = sorted(r for r in got.ranks if r is not None)
            got = Scrape("unmatched", error=f"/metrics lists ranks {listed} (and {int(None in got.ranks)} "
                         f"unlabelled), the worker has dp_size {len(worker.targets)}")
    worker.metrics_counts[got.result] = worker.metrics_counts.get(got.result, 0) + 1
    if got.result != worker.metrics_result:
        log_scrape(worker, got, now)
    worker.metrics_result, worker.metrics_error = got.result, got.error
    if got.result == "ok" and loads is not None:
        worker.metrics_ok_at = now
        worker.set_reported(loads)
        return
    if got.result in ("absent", "empty", "unmatched"):  # an answer: it does not report them (usably)
        worker.metrics_next_at = now + METRICS_ABSENT_RETRY_S
        worker.metrics_ok_at = 0.0
    if now - worker.metrics_ok_at > stale_after_s and any(r is not None for r in worker.reported):
        worker.set_reported([None] * len(worker.targets))


def loads_for_targets(ranks: dict[int | None, RankLoad], n_targets: int) -> list[RankLoad | None] | None:
    """A worker's per-rank readings -> one per target (target ``i`` is ``worker@i``); None when
    they cannot be placed.

    A single-target worker takes its only reading whatever its rank label (vLLM's external
    load-balancing mode numbers each server's one engine by its global rank), or, when its
    engine runs several ranks behind one target, their sum (usage weighted by capacity). A
    multi-rank worker needs exactly ``n_targets`` labelled ranks: ``0..n-1`` map to themselves;
    other ranks (vLLM's hybrid / external load-balancing: an API server managing engines 2 and 3
    labels them 2, 3) map in sorted order. Another count (or unlabelled readings) cannot be
    placed."""
    if n_targets == 1:
        labelled = [load for rank, load in ranks.items() if rank is not None]
        if len(ranks) == 1:
            return list(ranks.values())
        return [combine(labelled) if labelled else None]
    listed = sorted(r for r in ranks if r is not None)
    if len(listed) != n_targets:
        return None
    return [ranks[r] for r in listed]


def combine(loads: list[RankLoad]) -> RankLoad:
    """Several ranks read as one pool: capacities and counts add, usage is capacity-weighted."""
    def total(values: list[int | None]) -> int | None:
        return None if any(v is None for v in values) else sum(v for v in values if v is not None)

    sizes = {load.kv_block_size for load in loads}
    blocks = total([load.kv_blocks for load in loads]) if len(sizes) == 1 else None
    usages = [load.kv_usage for load in loads]
    usage = None
    if all(u is not None for u in usages):
        weights = [load.kv_blocks or 0 for load in loads] if blocks else [1] * len(loads)
        usage = sum(u * w for u, w in zip(usages, weights, strict=True) if u is not None) / (sum(weights) or 1)
    return RankLoad(kv_usage=usage, kv_blocks=blocks, kv_block_size=sizes.pop() if blocks else None,
                    num_running=total([load.num_running for load in loads]),
                    num_waiting=total([load.num_waiting for load in loads]))


def log_scrape(worker: Worker, got: Scrape, now: float) -> None:
    """Logged when a worker's scrape outcome changes, rate-limited per worker: a flapping
    /metrics writes a WARNING (then a count of the ones held) and an INFO at most once per
    ``METRICS_LOG_EVERY_S``, not every round."""
    if got.result in ("ok", "absent", "empty"):
        if now - worker.metrics_info_at < METRICS_LOG_EVERY_S:
            return
        worker.metrics_info_at = now
        if got.result == "ok":
            log.info("worker %s reports its load on /metrics", worker.name)
        else:
            log.info("worker %s reports no load on /metrics (%s): its KV usage is unknown", worker.name, got.error)
        return
    if worker.metrics_warnings is None:
        worker.metrics_warnings = RateLimitedWarning(log, f"worker {worker.name}: /metrics failures",
                                                     every_s=METRICS_LOG_EVERY_S)
    worker.metrics_warnings.warning("worker %s: /metrics %s: %s", worker.name, got.result, got.error)
