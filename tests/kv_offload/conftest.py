"""The tiny model the offload tests run and one rank's KV block size for it (the tiers' sizes
are given in blocks)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def model(tiny_models) -> str:
    return tiny_models["llama"]


@pytest.fixture(scope="module")
def block_bytes(model) -> int:
    from pagoda_daemon import LLM
    from tests.kv_offload.test_offload import ENGINE

    return LLM(model, **ENGINE).engine.core.worker_info.kv_block_bytes
