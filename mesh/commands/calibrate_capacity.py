"""The KV capacity of the worker ``mesh calibrate`` measures, as the worker reports it.

Read as the gateway's registry reads it (``mesh.cluster.worker_metrics``): ``/metrics`` gives
vLLM's ``cache_config_info`` (blocks and block size), SGLang's token count or the bundled worker's
``mesh_worker_kv_blocks_total``; the bundled worker's ``/health`` adds its block size (and its
block count, when ``/metrics`` is not there). Several data-parallel ranks: the smallest one's (a
profile describes one engine). Nothing reported (an OpenAI service, a gateway in front): None,
and the caller says so.
"""

from __future__ import annotations

from typing import Any

from simulator.calibrate_summary import WorkerCapacity


def read_capacity(url: str, api_key: str | None, timeout_s: float) -> WorkerCapacity | None:
    import httpx

    base = url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(base_url=base, headers=headers, timeout=min(timeout_s, 10.0)) as client:
        health = _health(client)
        from_metrics = _from_metrics(client)
    block_size = health.get("block_size") if isinstance(health.get("block_size"), int) else None
    if from_metrics is not None:
        blocks, size, source = from_metrics
        return WorkerCapacity(blocks, size or block_size, source)
    reported = health.get("num_kv_blocks")
    if isinstance(reported, int) and reported > 0:
        return WorkerCapacity(reported, block_size, f"the worker's /health: num_kv_blocks {reported}")
    return None


def _health(client: Any) -> dict[str, Any]:
    try:
        r = client.get("/health")
        data = r.json() if r.status_code == 200 else {}
    except Exception:  # noqa: BLE001 - no /health, or not JSON: nothing reported there
        return {}
    return data if isinstance(data, dict) else {}


def _from_metrics(client: Any) -> tuple[int, int | None, str] | None:
    """(blocks, tokens per block or None, where) from ``/metrics``, the smallest rank's."""
    from mesh.cluster.worker_metrics import MetricsError, parse

    try:
        r = client.get("/metrics")
        if r.status_code != 200:
            return None
        ranks = parse(r.content)
    except (MetricsError, Exception):  # noqa: BLE001 - unreachable or unreadable: not reported
        return None
    loads = [load for load in ranks.values() if load.kv_blocks]
    if not loads:
        return None
    load = min(loads, key=lambda x: x.kv_blocks * (x.kv_block_size or 1))  # type: ignore[operator]
    size = load.kv_block_size
    blocks = int(load.kv_blocks or 0)
    if size == 1:  # SGLang reports tokens: the caller converts them to its blocks
        return blocks, 1, f"the worker's /metrics: {blocks:,} tokens"
    return blocks, size, f"the worker's /metrics: {blocks:,} blocks" + (f" of {size} tokens" if size else "")
