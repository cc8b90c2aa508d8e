"""The CPU offload tier of the KV cache."""
