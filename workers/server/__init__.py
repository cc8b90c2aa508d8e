"""The worker's OpenAI HTTP server, its CLI and its KV event publisher."""
