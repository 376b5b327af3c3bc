"""The operator renders what the daemon accepts: the example InferenceService's Deployment args
and engine ConfigMap parse through `pagoda serve`'s own option handling."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pagoda_daemon.cli import _explicit_options, build_parser
from pagoda_daemon.server.serve import resolve_options
from pagoda_operator import builders, spec

ROOT = Path(__file__).resolve().parents[1]


def rendered(tmp_path: Path, overrides: dict | None = None):
    resource = yaml.safe_load((ROOT / "examples" / "inferenceservice.yaml").read_text())
    body = {**resource["spec"], **(overrides or {})}
    svc = spec.parse(resource["metadata"]["name"], "default", body)
    config_file = tmp_path / "engine.yaml"
    config_file.write_text(yaml.safe_dump(builders.daemon_config(svc)))
    argv = builders.daemon_args(svc)
    argv[argv.index("--config") + 1] = str(config_file)
    return svc, argv


def test_daemon_accepts_the_operators_rendering(tmp_path):
    svc, argv = rendered(tmp_path)
    args = build_parser().parse_args(argv)
    options = resolve_options(args, _explicit_options(argv))
    assert options["served_model_name"] == svc.model.name
    assert options["block_size"] == svc.engine.block_size
    assert options["enable_prefix_caching"] == svc.engine.enable_prefix_caching
    assert options["numa_policy"] == svc.placement.numa_policy


def test_unsupported_rendered_options_are_refused_by_name(tmp_path):
    _, argv = rendered(tmp_path, {"engine": {"kvCacheDtype": "fp8"}})
    args = build_parser().parse_args(argv)
    with pytest.raises(ValueError, match="kv-cache-dtype"):
        resolve_options(args, _explicit_options(argv))
