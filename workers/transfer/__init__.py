"""KV transfer between prefill and decode workers: layouts, the transfer registry, block
operations, TCP and CUDA IPC transports, the disaggregation routes."""
