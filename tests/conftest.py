"""Shared fixtures: tiny random checkpoints written in Hugging Face format, once per session."""

from __future__ import annotations

import os

import pytest
import torch

# Tiny models do tiny ops: one intra-op thread is faster than two fighting over the cores.
torch.set_num_threads(1)

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    """One model per supported architecture. Llama is sharded (index.json path) with untied
    embeddings and llama3 rope scaling; Qwen3 ties its embeddings; Qwen3-MoE routes 2 of 8."""
    from pagoda_daemon.models.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("models")
    return {
        "llama": str(build_tiny_model("llama", root / "llama", seed=1, max_shard_size="100KB")),
        "qwen3": str(build_tiny_model("qwen3", root / "qwen3", seed=2)),
        "qwen3_moe": str(build_tiny_model("qwen3_moe", root / "qwen3_moe", seed=3)),
    }
