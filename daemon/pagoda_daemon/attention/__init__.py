"""Attention backends over the paged KV cache, and the metadata every backend reads."""

from pagoda_daemon.attention.backend import AttentionBackend, AttentionMetadata, get_attention_backend

__all__ = ["AttentionBackend", "AttentionMetadata", "get_attention_backend"]
