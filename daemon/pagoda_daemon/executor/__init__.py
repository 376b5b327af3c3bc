"""Executors: how the engine core reaches its workers (one in-process worker today)."""
