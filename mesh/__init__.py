"""Mesh: a cache-aware router and gateway for LLM serving."""

__version__ = "0.1.0"
