"""Attention backends behind one interface (see ``base.AttentionBackend``)."""

from workers.model.attention.base import AttentionBackend, get_backend

__all__ = ["AttentionBackend", "get_backend"]
