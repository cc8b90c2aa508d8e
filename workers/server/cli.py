"""``mesh worker``: one process serving one model with an OpenAI-compatible API.

Heavy imports (torch, uvicorn, the engine) happen inside ``run``, so ``mesh --help`` stays fast
and the gateway never imports torch.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from mesh.commands.graceful import add_argument as add_shutdown_argument
from workers.transfer.disagg_config import add_arguments as add_disagg_arguments

CONTENT_FORMATS = ("auto", "string", "openai")  # mesh.request.chat.CONTENT_FORMATS (not imported: jinja2 at --help)
# The first line a worker prints once its imports are done (``mesh up`` reads it from the worker's
# log to say "loading model"; the next line, "mesh worker (ROLE): ...", comes when the model is built).
LOADING_LINE = "mesh worker: loading model"
PRESET_NAMES = "demo, tiny, tiny-hybrid, hybrid-0.5b, qwen2-0.5b, llama3-1b, llama3-3b, llama3-8b"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "worker",
        help="run the bundled engine: one model behind an OpenAI-compatible API",
        description=__doc__.splitlines()[0],
    )
    _add_arguments(p)
    p.set_defaults(func=run)
    return p


def _add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", default=None,
                     help=f"random-weight preset ({PRESET_NAMES}); demo: tiny with scripted, readable answers; default tiny")
    src.add_argument("--model", default=None, metavar="DIR", help="local Hugging Face directory (config.json, *.safetensors, tokenizer.json)")
    p.add_argument("--served-model-name", default=None, help="model name in the API and in block keys (default: preset or directory name)")
    p.add_argument("--worker-name", default=None,
                   help="how this worker names itself (the demo preset's answers say who served them); default HOST:PORT")
    p.add_argument("--host", default="127.0.0.1",
                   help="listen address of the API (and of a wildcard --kv-events-endpoint, and KV transfers); "
                        "the API has no auth: give 0.0.0.0 only on a trusted network")
    p.add_argument("--port", type=int, default=8000, help="listen port of the API")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda[:N]")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"],
                   help="attention kernels: triton on CUDA when available (auto), else torch")
    p.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"], help="override the model dtype")
    p.add_argument("--block-size", type=int, default=16, help="KV cache block size in tokens (the gateway's workers[].block_size)")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="KV capacity in blocks (default: from memory)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="share of the GPU's memory the engine may use (weights, activations, KV cache)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="most requests running at once")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192, help="most tokens computed in one step")
    p.add_argument("--chunked-prefill-size", type=int, default=None, help="most new tokens of one request per step")
    p.add_argument("--max-model-len", type=int, default=None, help="longest prompt plus output in tokens (default: the model's)")
    p.add_argument("--no-prefix-caching", action="store_true", help="do not reuse cached prompt prefixes")
    p.add_argument("--cpu-offload-blocks", type=int, default=0, metavar="N",
                   help="CPU offload tier: N blocks of host memory (pinned on CUDA) that keep evicted prefix blocks for restore; 0: off")
    p.add_argument("--state-checkpoints", type=int, default=256, metavar="N",
                   help="hybrid models: recurrent-state checkpoints kept (LRU pool); a prefix is resumable only "
                        "where one exists; 0: off")
    p.add_argument("--state-checkpoint-interval", type=int, default=512, metavar="TOKENS",
                   help="hybrid models: a checkpoint every TOKENS tokens (rounded up to whole blocks), besides the "
                        "one at each turn's end; 0: turn ends only")
    p.add_argument("--no-cuda-graphs", action="store_true", help="run decode steps eagerly (no CUDA graph capture)")
    p.add_argument("--cpu-threads", type=int, default=None, help="torch threads on CPU (default: torch's choice)")
    p.add_argument("--seed", type=int, default=0, help="seed of random weights and sampling")
    p.add_argument("--kv-events-endpoint", default=None, metavar="ADDR",
                   help="ZMQ PUB address of the KV cache events, e.g. tcp://*:5557 (bound; * is --host's address "
                        "unless --host is 0.0.0.0); a concrete address is connected to, as vLLM does")
    p.add_argument("--kv-events-replay-endpoint", default=None, metavar="ADDR", help="ZMQ ROUTER address, e.g. tcp://*:5558")
    p.add_argument("--kv-events-topic", default="", help="ZMQ topic of the KV events (the gateway's kv_events.topic)")
    p.add_argument("--chat-template-content-format", default="auto", choices=list(CONTENT_FORMATS),
                   help="how message content reaches the chat template, as vLLM's flag: auto (detected from the "
                        "template), string, or openai (a list of text parts); give the gateway pool the same")
    p.add_argument("--log-level", default="info", help="log level (debug, info, warning, error)")
    add_disagg_arguments(p)  # --role, --kv-transfer-*, --kv-max-pending* (workers.transfer.disagg_config)
    add_shutdown_argument(p)  # --shutdown-timeout


def build(args: argparse.Namespace) -> tuple[Any, Any, str, dict[str, Any]]:
    """Engine, tokenizer, served name and /health info from parsed arguments."""
    from dataclasses import replace

    from mesh.request.tokenizer import load_tokenizer
    from workers.config import EngineConfig, get_preset
    from workers.engine.llm_engine import AsyncLLMEngine, LLMEngine
    from workers.hf_config import config_from_hf

    if args.model:
        model_config = config_from_hf(args.model, dtype=args.dtype)
    else:
        model_config = get_preset(args.preset or "tiny")
        if args.dtype:
            model_config = replace(model_config, dtype=args.dtype)
    name = args.served_model_name or model_config.name
    config = EngineConfig(
        block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
        gpu_memory_utilization=args.gpu_memory_utilization, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, chunked_prefill_size=args.chunked_prefill_size,
        max_model_len=args.max_model_len, enable_prefix_caching=not args.no_prefix_caching,
        cpu_offload_blocks=args.cpu_offload_blocks,
        num_state_checkpoints=args.state_checkpoints, state_checkpoint_interval=args.state_checkpoint_interval,
        state_checkpoint_prompt_end=args.role == "prefill",  # hybrid: the state a decode worker resumes from
        device=args.device, attention_backend=args.attention_backend, cuda_graphs=not args.no_cuda_graphs,
        cpu_threads=args.cpu_threads, seed=args.seed, served_model_name=name,
        worker_name=args.worker_name or f"{args.host}:{args.port}",
        kv_events_endpoint=args.kv_events_endpoint, kv_events_replay_endpoint=args.kv_events_replay_endpoint,
        kv_events_topic=args.kv_events_topic, kv_events_bind_host=concrete_host(args.host),
    )
    tokenizer = load_tokenizer(model_config.tokenizer)
    engine = LLMEngine(model_config, config, eos_token_id=tokenizer.eos_token_id)
    info = {
        "block_size": config.block_size,
        "num_kv_blocks": engine.runner.num_blocks,
        "max_model_len": engine.max_model_len,
        "tokenizer": model_config.tokenizer,
        "device": str(engine.runner.device),
        "attention_backend": engine.runner.backend.name,
        "prefix_caching": config.enable_prefix_caching,
        "cpu_offload_blocks": config.cpu_offload_blocks,
        "hybrid": model_config.is_hybrid,  # recurrent layers: prefixes resume only at state checkpoints
        "kv_events_endpoint": config.kv_events_endpoint,
        "kv_events_replay_endpoint": config.kv_events_replay_endpoint,
        "chat_template_content_format": args.chat_template_content_format,
    }
    if model_config.demo_script:
        from workers.engine.demo_sampler import DEMO_NOTE

        info["note"] = DEMO_NOTE  # on /health and /v1/models
    return AsyncLLMEngine(engine), tokenizer, name, info


def concrete_host(host: str) -> str | None:
    """``host`` unless it means every interface (then None: a wildcard endpoint binds them all)."""
    return None if host in ("", "0.0.0.0", "::", "*", "[::]") else host


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from mesh.commands.graceful import GracefulServer
    from workers.server.app import end_in_flight
    from workers.transfer.disagg_server import build_app  # build() + KV transfer and the --role layer

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.shutdown_timeout < 0:
        print(f"mesh worker: --shutdown-timeout must be >= 0, not {args.shutdown_timeout:g}", file=sys.stderr)
        return 2
    what = f"from {args.model}" if args.model else f"preset {args.preset or 'tiny'}"
    print(f"{LOADING_LINE} ({what})", file=sys.stderr, flush=True)
    try:
        app, service, name, info = build_app(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"mesh worker: {exc}", file=sys.stderr)
        return 2
    print(
        f"mesh worker ({info['role']}): {name} on {info['device']} ({info['attention_backend']} attention), "
        f"{info['num_kv_blocks']} KV blocks of {info['block_size']}, http://{args.host}:{args.port}"
        + (f"\nmesh worker: {info['note']}" if "note" in info else ""),
        file=sys.stderr, flush=True,
    )
    # SIGTERM: requests in flight finish (up to --shutdown-timeout, then end with a clean error);
    # the lifespan's exit stops the engine and closes the KV event publisher (its sockets freed).
    server = GracefulServer(
        uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", access_log=False),
        name="mesh worker", shutdown_timeout_s=args.shutdown_timeout,
        on_timeout=lambda: end_in_flight(service.engine),
    )
    server.run()
    return server.exit_code if server.started else 3


def main(argv: list[str] | None = None) -> int:
    """``python -m workers.server.cli`` runs the worker without the rest of the mesh CLI."""
    parser = argparse.ArgumentParser(prog="mesh worker", description=__doc__.splitlines()[0])
    _add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
