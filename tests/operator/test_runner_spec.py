"""spec.engine.runner: rendered into the engine config as the daemon's option (only when set, so
the pods of InferenceServices without it stay as rendered), checked against the option's
choices, and refused with what serves generation only (LoRA adapters, disaggregation)."""

from __future__ import annotations

import pytest

from pagoda_daemon.config import EngineConfig
from pagoda_operator.spec import InvalidSpec, daemon_config, parse
from tests.operator.operator_fakes import every_capability, isvc
from tests.operator.test_lora_spec import ADAPTERS

MODEL = {"name": "m", "pvc": {"claimName": "w"}}


def _parse(**spec):
    return parse("embed", "default", isvc("embed", model=MODEL, **spec)["spec"], supports=every_capability)


def test_runner_renders_as_the_daemons_option():
    config = daemon_config(_parse(engine={"runner": "pooling"}))
    assert config["runner"] == "pooling"
    assert EngineConfig(model="/m", runner=config["runner"]).runner == "pooling"
    assert "runner" not in daemon_config(_parse())


@pytest.mark.parametrize(("spec", "needle"), [
    ({"engine": {"runner": "embed"}}, "engine.runner 'embed' must be one of auto, generate, pooling"),
    ({"engine": {"runner": "pooling"}, "lora": {"adapters": ADAPTERS}}, "engine.runner pooling"),
    ({"engine": {"runner": "pooling"}, "resources": {"gpusPerReplica": 2},
      "disaggregation": {"kvDiskGiB": 4}}, "engine.runner pooling"),
])
def test_what_cannot_combine_is_refused(spec, needle):
    with pytest.raises(InvalidSpec, match=needle):
        _parse(**spec)
