"""Shared fixtures for the operator's unit tests: no cluster, no network."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
try:
    import pagoda_operator  # noqa: F401  (installed with `pip install -e .[operator]`)
except ImportError:  # running from a bare checkout
    sys.path.insert(0, str(ROOT / "operator"))

from tests.operator.operator_fakes import FakeKube  # noqa: E402


@pytest.fixture
def fake_kube() -> FakeKube:
    return FakeKube()
