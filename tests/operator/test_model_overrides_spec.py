"""spec.engine.hfOverrides and spec.engine.chatTemplate: rendered into the engine config as the
daemon's hf_overrides (compact JSON) and chat_template (only when set, so the pods of
InferenceServices without them stay as rendered), taken by the daemon's EngineConfig as they are;
an override the daemon could not parse and a template that is not Jinja text (a path into the pod,
which the daemon would read) refused by the operator."""

from __future__ import annotations

import json

import pytest

from pagoda_daemon.config import EngineConfig
from pagoda_daemon.templates import read_chat_template
from pagoda_operator.spec import InvalidSpec, daemon_config, parse
from tests.operator.operator_fakes import every_capability, isvc

MODEL = {"name": "m", "pvc": {"claimName": "w"}}
QWEN3_RERANKER = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
                  "is_original_qwen3_reranker": True}
TEMPLATE = "<Query>: {{ messages[0]['content'] }}\n<Document>: {{ messages[1]['content'] }}"


def _parse(**spec):
    return parse("rerank", "default", isvc("rerank", model=MODEL, **spec)["spec"], supports=every_capability)


def test_the_overrides_and_the_template_render_as_the_daemons_options():
    config = daemon_config(_parse(engine={"hfOverrides": QWEN3_RERANKER, "chatTemplate": TEMPLATE}))
    assert json.loads(config["hf_overrides"]) == QWEN3_RERANKER
    assert config["chat_template"] == TEMPLATE
    engine = EngineConfig(model="/m", hf_overrides=config["hf_overrides"], chat_template=config["chat_template"])
    assert read_chat_template(engine.chat_template) == TEMPLATE  # the text itself, no file looked for
    rendered = daemon_config(_parse())
    assert "hf_overrides" not in rendered and "chat_template" not in rendered


@pytest.mark.parametrize(("engine", "needle"), [
    ({"hfOverrides": {}}, "engine.hfOverrides: hf_overrides must be a JSON object with at least one key"),
    ({"hfOverrides": {"architectures": "Qwen3ForSequenceClassification"}}, "engine.hfOverrides: .*non-empty list"),
    ({"hfOverrides": {"a": "x" * 70000}}, "engine.hfOverrides: hf_overrides is longer than"),
    ({"hfOverrides": {"max_position_embeddings": float("inf")}}, "engine.hfOverrides: .*Infinity is not a number"),
    ({"hfOverrides": {"rope_theta": float("nan")}}, "engine.hfOverrides: .*NaN is not a number"),
    ({"chatTemplate": "/var/run/secrets/kubernetes.io/serviceaccount/token"}, "engine.chatTemplate must be a Jinja"),
    ({"chatTemplate": "plain words"}, "engine.chatTemplate must be a Jinja"),
    ({"chatTemplate": "{{ x }}" * 10000}, "engine.chatTemplate must be a Jinja template of at most 65536"),
    ({"chatTemplate": ["{{ x }}"]}, "engine.chatTemplate must be a Jinja"),
])
def test_what_the_daemon_could_not_take_is_refused(engine, needle):
    with pytest.raises(InvalidSpec, match=needle):
        _parse(engine=engine)


def test_the_reranker_example_is_valid_and_renders_the_model_cards_prompt():
    """examples/reranker-inferenceservice.yaml passes the CRD's schema and the operator's rules,
    and its template renders a pair as examples/templates/qwen3_reranker.jinja does."""
    from pagoda_daemon.models.tiny import build_tokenizer
    from pagoda_daemon.templates import PairFormat
    from tests.engine.test_token_classifiers import TEMPLATE as TEMPLATE_FILE
    from tests.operator.test_manifests import ROOT, isvc_schema, load, validate

    doc = load(ROOT / "examples" / "reranker-inferenceservice.yaml")
    assert validate(doc, isvc_schema()) == []
    config = daemon_config(parse(doc["metadata"]["name"], "default", doc["spec"]))
    assert json.loads(config["hf_overrides"]) == QWEN3_RERANKER and config["runner"] == "pooling"
    tokenizer = build_tokenizer()
    for variables in (None, {"instruction": "find the cats"}):
        pair = ("what is the capital of France?", "Paris is the capital.", variables)
        assert (PairFormat(read_chat_template(config["chat_template"])).render(tokenizer, *pair)
                == PairFormat(read_chat_template(TEMPLATE_FILE)).render(tokenizer, *pair))
