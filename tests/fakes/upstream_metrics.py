"""vLLM's and SGLang's own Prometheus stat loggers, writing what their engines report (a process).

Run as ``python -m tests.fakes.upstream_metrics ENGINE ROOT CONFIG`` (ENGINE ``vllm`` or
``sglang``, ROOT its extracted wheel, CONFIG a JSON object).

- vLLM: one ``PrometheusStatLogger`` over the engines ``engines`` (a list of ``{running,
  waiting, usage}``), each recorded through ``record(SchedulerStats(...), None, engine_idx)``,
  and ``log_engine_initialized`` with a real ``CacheConfig`` (``block_size``, ``num_gpu_blocks``:
  the API server's sum over the engines). The body (``generate_latest``) goes to stdout.
- SGLang: one DP rank's scheduler process (``dp_rank``): a ``SchedulerMetricsCollector`` with
  the labels ``SchedulerMetricsCollectorContext`` gives it (``priority=""`` with priority
  scheduling), ``emit_constants`` (``max_total_num_tokens``) and ``log_stats`` of one
  ``SchedulerStats`` whose queues are ``QueueCount.from_reqs`` of requests with ``priorities``.
  Its values go to ``PROMETHEUS_MULTIPROC_DIR``, which SGLang's HTTP server reads back for
  ``/metrics`` (``MultiProcessCollector``): the caller does that, over every rank's process.
Only the engine-side configuration objects are plain namespaces (the attributes the loggers read).
"""

from __future__ import annotations

import importlib
import json
import sys
import types
from typing import Any

from tests.fakes import sglang_engine, vllm_engine
from tests.fakes.upstream_loader import install

NS = types.SimpleNamespace


def _vllm(root: str, cfg: dict[str, Any]) -> None:
    install(root, vllm_engine.HOLLOW, vllm_engine.ABSENT)
    importlib.import_module("vllm.config")
    sys.modules["vllm.config"].get_current_vllm_config_or_none = lambda: None
    import prometheus_client

    loggers = importlib.import_module("vllm.v1.metrics.loggers")
    stats = importlib.import_module("vllm.v1.metrics.stats")
    cache = importlib.import_module("vllm.config.cache").CacheConfig(block_size=cfg["block_size"])
    cache.num_gpu_blocks = cfg["num_gpu_blocks"]
    engines = cfg["engines"]
    vllm_config = NS(
        observability_config=NS(show_hidden_metrics=False, kv_cache_metrics=False, enable_mfu_metrics=False,
                                custom_histogram_buckets=None),
        model_config=NS(served_model_name=cfg["model"], max_model_len=4096, is_diffusion=False),
        speculative_config=None, lora_config=None, ec_transfer_config=None, kv_transfer_config=None,
        watermark_config=None, cache_config=cache, parallel_config=NS(data_parallel_size=len(engines)),
        compilation_config=NS(cudagraph_capture_sizes=[], cudagraph_mode=None))
    logger = loggers.PrometheusStatLogger(vllm_config, list(range(len(engines))))
    logger.log_engine_initialized()
    for i, e in enumerate(engines):
        logger.record(stats.SchedulerStats(num_running_reqs=e["running"], num_waiting_reqs=e["waiting"],
                                           kv_cache_usage=e["usage"]), None, engine_idx=i)
    sys.stdout.buffer.write(prometheus_client.generate_latest())


def _sglang(root: str, cfg: dict[str, Any]) -> None:
    install(root, sglang_engine.HOLLOW, sglang_engine.ABSENT)
    mc = importlib.import_module("sglang.srt.observability.metrics_collector")
    # the two runtime-config reads of the collector, answered with SGLang's own defaults (the
    # server would publish its ServerArgs' projection of them)
    schedule = importlib.import_module("sglang.srt.arg_groups.fields.schedule").Schedule()
    moe = importlib.import_module("sglang.srt.arg_groups.fields.exec_").ExecMoe()
    mc.get_schedule = lambda: schedule
    mc.exports_expert_balancedness_to_prometheus = lambda: moe.expert_balancedness_report_mode in ("prometheus", "both")
    labels: dict[str, Any] = {"model_name": cfg["model"], "engine_type": "unified", "tp_rank": 0, "pp_rank": 0,
                              "moe_ep_rank": 0}
    if cfg["priority_scheduling"]:
        labels["priority"] = ""
    if cfg.get("dp_rank") is not None:
        labels["dp_rank"] = cfg["dp_rank"]
    collector = mc.SchedulerMetricsCollector(labels=labels, server_args=NS(**cfg.get("server_args", {})))
    collector.emit_constants(max_total_num_tokens=cfg["max_total_num_tokens"], max_total_num_tokens_swa=None,
                             weight_memory_usage_gb=1.0, kv_cache_memory_usage_gb=1.0, graph_memory_usage_gb={},
                             max_running_requests_under_SLO=None, page_size=cfg.get("page_size", 1), num_pages=0,
                             context_len=4096, startup_available_gpu_memory_gb=1.0)

    def queue(priorities: list[int]) -> Any:
        reqs = [NS(priority=p) for p in priorities]
        return mc.QueueCount.from_reqs(reqs, enable_priority_scheduling=cfg["priority_scheduling"])

    collector.log_stats(mc.SchedulerStats(num_running_reqs=queue(cfg["running"]), num_queue_reqs=queue(cfg["waiting"]),
                                          token_usage=cfg["usage"]))


def main() -> None:
    engine, root, cfg = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    (_vllm if engine == "vllm" else _sglang)(root, cfg)


if __name__ == "__main__":
    main()
