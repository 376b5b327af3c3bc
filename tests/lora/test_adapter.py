"""Reading PEFT LoRA adapters: real ones saved by PEFT read and scale as PEFT scales them, and
every hostile or invalid adapter is refused with an AdapterError that names the problem."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagoda_daemon.lora.adapter import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    MAX_CONFIG_BYTES,
    projection_shapes,
    read_adapter,
)
from pagoda_daemon.lora.names import MAX_NAME_CHARS, AdapterError, check_name, parse_lora_modules
from pagoda_daemon.lora.request import LoRARequest

P = "base_model.model."  # PEFT's prefix on every saved tensor key
HIDDEN, Q, KV, INTER, LAYERS = 64, 64, 32, 128, 2  # tiny_config: 4 heads x 16, 2 KV heads, 2 layers
MAX_RANK = 16


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    from pagoda_daemon.models.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("lora_models")
    return {arch: build_tiny_model(arch, root / arch, seed=7) for arch in ("llama", "qwen3_moe")}


@pytest.fixture(scope="module")
def configs(models) -> dict:
    from transformers import AutoConfig

    return {arch: AutoConfig.from_pretrained(str(path)) for arch, path in models.items()}


def peft_adapter(model_dir: Path, out: Path, **lora_kwargs):
    """Save a random (non-zero) PEFT LoRA adapter on the model at ``model_dir``; the PeftModel."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(lora_kwargs.pop("seed", 0))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(init_lora_weights=False, **lora_kwargs))
    peft_model.save_pretrained(str(out))
    return peft_model


def peft_scaling(peft_model, module: str) -> float:
    return peft_model.base_model.model.get_submodule(module).scaling["default"]


@pytest.fixture(scope="module")
def basic(models, tmp_path_factory):
    """r=4, alpha=8 on q_proj and v_proj of the tiny Llama; (directory, PeftModel)."""
    out = tmp_path_factory.mktemp("basic")
    return out, peft_adapter(models["llama"], out, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])


def spec(**fields) -> dict:
    base = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "bias": "none", "use_dora": False,
            "lora_bias": False, "modules_to_save": None, "target_modules": ["q_proj"]}
    base.update(fields)
    return base


def pair(module: str = "model.layers.0.self_attn.q_proj", rank: int = 4, in_features: int = HIDDEN,
         out_features: int = Q, dtype=torch.float32) -> dict[str, torch.Tensor]:
    return {f"{P}{module}.lora_A.weight": torch.randn(rank, in_features).to(dtype),
            f"{P}{module}.lora_B.weight": torch.randn(out_features, rank).to(dtype)}


def write(root: Path, tensors: dict[str, torch.Tensor] | None = None, config: dict | list | str | None = None,
          ) -> Path:
    """A hand-made adapter directory: tensors via safetensors, config as JSON (or raw text)."""
    root.mkdir(parents=True, exist_ok=True)
    save_file(pair() if tensors is None else tensors, str(root / ADAPTER_WEIGHTS))
    text = config if isinstance(config, str) else json.dumps(spec() if config is None else config)
    (root / ADAPTER_CONFIG).write_text(text)
    return root


def refused(path: Path, config, *words: str, max_rank: int = MAX_RANK) -> str:
    with pytest.raises(AdapterError) as info:
        read_adapter("hostile", path, config, max_rank)
    message = str(info.value)
    assert "'hostile'" in message
    for word in words:
        assert word in message, (word, message)
    return message


# ---------------------------------------------------------------------------------------------
# Real adapters saved by PEFT


def test_peft_adapter_reads_with_base_model_module_names(basic, configs):
    out, _ = basic
    adapter = read_adapter("a", out, configs["llama"], MAX_RANK)
    assert adapter.name == "a" and adapter.path == str(out)
    assert sorted(adapter.weights) == sorted(f"model.layers.{i}.self_attn.{p}" for i in range(LAYERS)
                                             for p in ("q_proj", "v_proj"))
    assert adapter.rank == 4
    for module, w in adapter.weights.items():
        out_features = Q if module.endswith("q_proj") else KV
        assert w.a.shape == (4, HIDDEN) and w.b.shape == (out_features, 4)
        assert w.a.dtype == w.b.dtype == torch.float32
        assert w.a.is_contiguous() and w.b.is_contiguous()
    assert adapter.request() == LoRARequest("a", str(out), adapter.digest)


def test_b_is_scaled_by_alpha_over_r(basic, configs):
    out, peft_model = basic
    adapter = read_adapter("a", out, configs["llama"], MAX_RANK)
    saved = load_file(str(out / ADAPTER_WEIGHTS))
    for module, w in adapter.weights.items():
        a, b = saved[f"{P}{module}.lora_A.weight"], saved[f"{P}{module}.lora_B.weight"]
        assert b.abs().sum() > 0  # init_lora_weights=False: B is random, not PEFT's zeros
        torch.testing.assert_close(w.a, a, rtol=0, atol=0)
        torch.testing.assert_close(w.b, b * (8 / 4))
        assert peft_scaling(peft_model, module) == pytest.approx(8 / 4)


def test_lora_delta_matches_peft(basic, configs):
    """x·Aᵀ·Bᵀ from the read weights is what PEFT adds to the base projection."""
    out, peft_model = basic
    adapter = read_adapter("a", out, configs["llama"], MAX_RANK)
    x = torch.randn(3, HIDDEN)
    for module, w in adapter.weights.items():
        layer = peft_model.base_model.model.get_submodule(module)
        with torch.no_grad():
            expected = layer(x) - layer.base_layer(x)
        torch.testing.assert_close(x @ w.a.T @ w.b.T, expected, rtol=1e-4, atol=1e-5)


def test_rslora_scales_by_alpha_over_sqrt_r(models, configs, tmp_path):
    peft_model = peft_adapter(models["llama"], tmp_path, r=9, lora_alpha=6, use_rslora=True,
                              target_modules=["o_proj"])
    adapter = read_adapter("rs", tmp_path, configs["llama"], MAX_RANK)
    saved = load_file(str(tmp_path / ADAPTER_WEIGHTS))
    assert sorted(adapter.weights) == [f"model.layers.{i}.self_attn.o_proj" for i in range(LAYERS)]
    for module, w in adapter.weights.items():
        torch.testing.assert_close(w.b, saved[f"{P}{module}.lora_B.weight"] * (6 / math.sqrt(9)))
        assert peft_scaling(peft_model, module) == pytest.approx(6 / 3)


def test_all_projections_and_per_module_rank_and_alpha(models, configs, tmp_path):
    """rank_pattern / alpha_pattern give some modules their own rank and alpha: rank is the
    largest, and each B is scaled as PEFT scales that module."""
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft_model = peft_adapter(models["llama"], tmp_path, r=4, lora_alpha=8, target_modules=targets,
                              rank_pattern={"down_proj": 8, "model.layers.1.self_attn.k_proj": 2},
                              alpha_pattern={"up_proj": 3})
    adapter = read_adapter("mix", tmp_path, configs["llama"], MAX_RANK)
    assert len(adapter.weights) == LAYERS * len(targets)
    assert adapter.rank == 8
    saved = load_file(str(tmp_path / ADAPTER_WEIGHTS))
    shapes = projection_shapes(configs["llama"])
    for module, w in adapter.weights.items():
        in_features, out_features = shapes[module.split(".", 3)[3]]
        rank = 8 if "down_proj" in module else 2 if module == "model.layers.1.self_attn.k_proj" else 4
        assert w.a.shape == (rank, in_features) and w.b.shape == (out_features, rank)
        scaling = peft_scaling(peft_model, module)
        assert scaling == pytest.approx((3 if "up_proj" in module else 8) / rank)
        torch.testing.assert_close(w.b, saved[f"{P}{module}.lora_B.weight"] * scaling)


def test_attention_adapter_on_moe_model(models, configs, tmp_path):
    peft_adapter(models["qwen3_moe"], tmp_path, r=4, lora_alpha=4, target_modules=["q_proj", "k_proj"])
    adapter = read_adapter("moe", tmp_path, configs["qwen3_moe"], MAX_RANK)
    assert sorted(adapter.weights) == sorted(f"model.layers.{i}.self_attn.{p}" for i in range(LAYERS)
                                             for p in ("q_proj", "k_proj"))


def test_projection_shapes(configs):
    attention = {"self_attn.q_proj": (HIDDEN, Q), "self_attn.k_proj": (HIDDEN, KV),
                 "self_attn.v_proj": (HIDDEN, KV), "self_attn.o_proj": (Q, HIDDEN)}
    assert projection_shapes(configs["llama"]) == {
        **attention, "mlp.gate_proj": (HIDDEN, INTER), "mlp.up_proj": (HIDDEN, INTER),
        "mlp.down_proj": (INTER, HIDDEN)}
    assert projection_shapes(configs["qwen3_moe"]) == attention  # no dense MLP to put a LoRA on


def test_half_precision_weights_are_read_as_float32(configs, tmp_path):
    tensors = {**pair(dtype=torch.bfloat16),
               **pair("model.layers.1.self_attn.o_proj", 2, Q, HIDDEN, torch.float16)}
    adapter = read_adapter("half", write(tmp_path, tensors), configs["llama"], MAX_RANK)
    for module, w in adapter.weights.items():
        assert w.a.dtype == w.b.dtype == torch.float32
        torch.testing.assert_close(w.a, tensors[f"{P}{module}.lora_A.weight"].float(), rtol=0, atol=0)


def test_lora_alpha_default_is_peft_default(configs, tmp_path):
    from peft import LoraConfig

    config = spec(r=4)
    del config["lora_alpha"]
    tensors = pair()
    adapter = read_adapter("noalpha", write(tmp_path, tensors, config), configs["llama"], MAX_RANK)
    module = "model.layers.0.self_attn.q_proj"
    peft_alpha = LoraConfig(r=4).lora_alpha
    expected = tensors[f"{P}{module}.lora_B.weight"] * (peft_alpha / 4)
    torch.testing.assert_close(adapter.weights[module].b, expected)


# ---------------------------------------------------------------------------------------------
# The digest: the adapter's identity in slots, caches and KV block hashes


def test_digest_is_stable_and_content_addressed(basic, configs, tmp_path):
    out, _ = basic
    first = read_adapter("a", out, configs["llama"], MAX_RANK).digest
    assert len(first) == 64 and int(first, 16) >= 0
    assert read_adapter("b", out, configs["llama"], MAX_RANK).digest == first  # the name is not identity
    copy = shutil.copytree(out, tmp_path / "copy")
    assert read_adapter("a", copy, configs["llama"], MAX_RANK).digest == first


def flip_first_weight_bit(file: Path) -> bytes:
    """The file's bytes with the lowest mantissa bit of its first float flipped (still finite)."""
    data = bytearray(file.read_bytes())
    data[8 + int.from_bytes(data[:8], "little")] ^= 1  # data starts after the 8-byte length and header
    return bytes(data)


def test_digest_changes_when_a_weight_byte_changes(basic, configs, tmp_path):
    out, _ = basic
    before = read_adapter("a", out, configs["llama"], MAX_RANK)
    copy = shutil.copytree(out, tmp_path / "copy")
    (copy / ADAPTER_WEIGHTS).unlink()  # a new file, not a rewrite of the one that was read
    (copy / ADAPTER_WEIGHTS).write_bytes(flip_first_weight_bit(out / ADAPTER_WEIGHTS))
    after = read_adapter("a", copy, configs["llama"], MAX_RANK)
    assert after.digest != before.digest
    changed = [m for m in before.weights if not (torch.equal(after.weights[m].a, before.weights[m].a)
                                                   and torch.equal(after.weights[m].b, before.weights[m].b))]
    assert changed == ["model.layers.0.self_attn.q_proj"]


def test_digest_changes_when_the_config_changes(basic, configs, tmp_path):
    out, _ = basic
    copy = shutil.copytree(out, tmp_path / "copy")
    before = read_adapter("a", copy, configs["llama"], MAX_RANK).digest
    config = json.loads((copy / ADAPTER_CONFIG).read_text())
    config["lora_alpha"] = 16
    (copy / ADAPTER_CONFIG).write_text(json.dumps(config))
    assert read_adapter("a", copy, configs["llama"], MAX_RANK).digest != before


# ---------------------------------------------------------------------------------------------
# Refusals: files


def test_missing_directory(configs, tmp_path):
    refused(tmp_path / "nowhere", configs["llama"], "not a directory")
    (tmp_path / "file").write_text("x")
    refused(tmp_path / "file", configs["llama"], "not a directory")


def test_missing_config(configs, tmp_path):
    write(tmp_path)
    (tmp_path / ADAPTER_CONFIG).unlink()
    refused(tmp_path, configs["llama"], ADAPTER_CONFIG)


def test_missing_weights(configs, tmp_path):
    write(tmp_path)
    (tmp_path / ADAPTER_WEIGHTS).unlink()
    message = refused(tmp_path, configs["llama"], ADAPTER_WEIGHTS)
    assert "pickle" not in message


def test_pickled_bin_is_refused(configs, tmp_path):
    write(tmp_path)
    (tmp_path / ADAPTER_WEIGHTS).unlink()
    torch.save(pair(), str(tmp_path / "adapter_model.bin"))
    refused(tmp_path, configs["llama"], ADAPTER_WEIGHTS, "adapter_model.bin", "pickle")


def test_corrupt_safetensors(configs, tmp_path):
    write(tmp_path)
    (tmp_path / ADAPTER_WEIGHTS).write_bytes(os.urandom(4096))
    refused(tmp_path, configs["llama"], "cannot read", ADAPTER_WEIGHTS)


def test_truncated_safetensors(configs, tmp_path):
    write(tmp_path)
    file = tmp_path / ADAPTER_WEIGHTS
    file.write_bytes(file.read_bytes()[:-10])
    refused(tmp_path, configs["llama"], "cannot read", ADAPTER_WEIGHTS)


def test_empty_safetensors(configs, tmp_path):
    write(tmp_path, tensors={})
    refused(tmp_path, configs["llama"], "no LoRA weights")


def test_config_larger_than_a_mebibyte(configs, tmp_path):
    write(tmp_path)
    text = json.dumps(spec()) + " " * MAX_CONFIG_BYTES  # valid JSON, only too large
    (tmp_path / ADAPTER_CONFIG).write_text(text)
    refused(tmp_path, configs["llama"], ADAPTER_CONFIG, "larger than")


@pytest.mark.parametrize("text", ["not json", "{", "", '{"peft_type": "LORA",}'])
def test_config_not_json(configs, tmp_path, text):
    refused(write(tmp_path, config=text), configs["llama"], "not valid JSON")


def test_config_not_utf8(configs, tmp_path):
    write(tmp_path)
    (tmp_path / ADAPTER_CONFIG).write_bytes(b'{"peft_type": "\xff\xfe\xfa"}')
    refused(tmp_path, configs["llama"], "not valid JSON")


@pytest.mark.parametrize("config", [[spec()], "42", '"LORA"', "null"])
def test_config_not_an_object(configs, tmp_path, config):
    refused(write(tmp_path, config=config), configs["llama"], "not a JSON object")


# ---------------------------------------------------------------------------------------------
# Refusals: config fields


@pytest.mark.parametrize("peft_type", ["LOHA", "IA3", "lora", None, 1])
def test_peft_type_not_lora(configs, tmp_path, peft_type):
    refused(write(tmp_path, config=spec(peft_type=peft_type)), configs["llama"], "peft_type")


def test_peft_type_missing(configs, tmp_path):
    config = spec()
    del config["peft_type"]
    refused(write(tmp_path, config=config), configs["llama"], "peft_type")


@pytest.mark.parametrize(("field", "value"), [
    ("use_dora", True),
    ("lora_bias", True),
    ("modules_to_save", ["lm_head"]),
    ("trainable_token_indices", [1, 2]),
    ("target_parameters", ["mlp.experts.gate_up_proj"]),
    ("fan_in_fan_out", True),
    ("layer_replication", [[0, 1]]),
    ("alora_invocation_tokens", [5]),
])
def test_unsupported_options(configs, tmp_path, field, value):
    refused(write(tmp_path, config=spec(**{field: value})), configs["llama"], field, "not supported")


@pytest.mark.parametrize("bias", ["all", "lora_only", None])
def test_bias_other_than_none(configs, tmp_path, bias):
    refused(write(tmp_path, config=spec(bias=bias)), configs["llama"], "bias", "not supported")


@pytest.mark.parametrize("r", [0, -4, "4", True, 4.0, None, [4]])
def test_bad_r(configs, tmp_path, r):
    refused(write(tmp_path, config=spec(r=r)), configs["llama"], "r must be a positive integer")


def test_missing_r(configs, tmp_path):
    config = spec()
    del config["r"]
    refused(write(tmp_path, config=config), configs["llama"], "r must be a positive integer")


@pytest.mark.parametrize("alpha", ["8", True, None, [8], {"x": 8}])
def test_bad_lora_alpha(configs, tmp_path, alpha):
    refused(write(tmp_path, config=spec(lora_alpha=alpha)), configs["llama"], "lora_alpha")


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_non_finite_lora_alpha(configs, tmp_path, literal):
    """Python's json accepts NaN and Infinity literals, and 1e999 parses to inf."""
    text = json.dumps(spec(lora_alpha=0)).replace('"lora_alpha": 0', f'"lora_alpha": {literal}')
    assert literal in text
    refused(write(tmp_path, config=text), configs["llama"], "lora_alpha", "finite")


@pytest.mark.parametrize("pattern", [{"q_proj": 0}, {"q_proj": "4"}, {"q_proj": True}, ["q_proj"]])
def test_bad_rank_pattern(configs, tmp_path, pattern):
    refused(write(tmp_path, config=spec(rank_pattern=pattern)), configs["llama"], "rank_pattern")


@pytest.mark.parametrize("pattern", [{"q_proj": "8"}, {"q_proj": None}, "q_proj"])
def test_bad_alpha_pattern(configs, tmp_path, pattern):
    refused(write(tmp_path, config=spec(alpha_pattern=pattern)), configs["llama"], "alpha_pattern")


def test_non_finite_alpha_pattern(configs, tmp_path):
    text = json.dumps(spec(alpha_pattern={"q_proj": 0})).replace('"q_proj": 0', '"q_proj": NaN')
    refused(write(tmp_path, config=text), configs["llama"], "alpha_pattern")


# ---------------------------------------------------------------------------------------------
# Refusals: tensors


def test_rank_above_max_rank(configs, tmp_path):
    write(tmp_path, pair(rank=8), spec(r=8))
    refused(tmp_path, configs["llama"], "rank 8", "--max-lora-rank 4", max_rank=4)
    assert read_adapter("ok", tmp_path, configs["llama"], 8).rank == 8


def test_peft_adapter_above_max_rank(models, configs, tmp_path):
    peft_adapter(models["llama"], tmp_path, r=32, lora_alpha=32, target_modules=["q_proj"])
    refused(tmp_path, configs["llama"], "rank 32", f"--max-lora-rank {MAX_RANK}")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("half", ["A", "B"])
def test_non_finite_tensor(configs, tmp_path, bad, half):
    tensors = pair()
    tensors[f"{P}model.layers.0.self_attn.q_proj.lora_{half}.weight"][1, 2] = bad
    refused(write(tmp_path, tensors), configs["llama"], "model.layers.0.self_attn.q_proj", "non-finite")


def test_non_finite_half_precision_tensor(configs, tmp_path):
    tensors = pair(dtype=torch.bfloat16)
    tensors[f"{P}model.layers.0.self_attn.q_proj.lora_B.weight"][0, 0] = float("nan")
    refused(write(tmp_path, tensors), configs["llama"], "non-finite")


@pytest.mark.parametrize("key", [
    f"{P}model.embed_tokens.lora_embedding_A",
    f"{P}model.embed_tokens.lora_A.weight",
    f"{P}lm_head.lora_A.weight",
    f"{P}model.layers.0.self_attn.q_proj.lora_magnitude_vector",
    f"{P}model.layers.0.self_attn.q_proj.lora_B.bias",
    f"{P}model.layers.0.self_attn.q_proj.base_layer.weight",
    "model.layers.0.self_attn.q_proj.lora_A.weight",  # without PEFT's prefix
    f"{P}model.layers.0.self_attn.q_proj.lora_A.default.weight",  # the adapter name left in
    f"{P}model.layers.0.self_attn.q_proj.lora_C.weight",
])
def test_tensor_that_is_not_a_lora_weight(configs, tmp_path, key):
    tensors = {**pair(), key: torch.randn(4, HIDDEN)}
    refused(write(tmp_path, tensors), configs["llama"], repr(key))


@pytest.mark.parametrize("module", [
    f"model.layers.{LAYERS}.self_attn.q_proj",  # one past the last layer
    "model.layers.1000000.self_attn.q_proj",
    "model.layers.-1.self_attn.q_proj",
    "model.layers.x.self_attn.q_proj",
    "model.layers.0.self_attn.qkv_proj",
    "model.layers.0.self_attn.q_norm",
    "model.layers.0.q_proj",
    "model.layers.0.mlp.experts.0.gate_proj",
    "model.decoder.layers.0.self_attn.q_proj",
    "transformer.layers.0.self_attn.q_proj",
    "model.layers..self_attn.q_proj",
])
def test_target_module_the_model_lacks(configs, tmp_path, module):
    refused(write(tmp_path, {**pair(), **pair(module)}), configs["llama"], module, "cannot take a LoRA")


@pytest.mark.parametrize(("module", "in_features", "out_features", "dense"), [
    ("model.layers.0.mlp.gate_proj", HIDDEN, INTER, True),
    ("model.layers.0.mlp.up_proj", HIDDEN, INTER, True),
    ("model.layers.1.mlp.down_proj", INTER, HIDDEN, True),
    ("model.layers.0.mlp.experts.0.gate_proj", HIDDEN, 32, False),
    ("model.layers.0.mlp.experts.7.down_proj", 32, HIDDEN, False),
    ("model.layers.0.mlp.gate", HIDDEN, 8, False),  # the router
])
def test_moe_model_refuses_mlp_targets(configs, tmp_path, module, in_features, out_features, dense):
    """projection_shapes leaves out the MLP of a Qwen3-MoE model: no LoRA on experts or router."""
    write(tmp_path, {**pair(), **pair(module, 4, in_features, out_features)})
    refused(tmp_path, configs["qwen3_moe"], module, "cannot take a LoRA")
    if dense:  # the same projection of a dense MLP is fine on Llama
        assert module in read_adapter("dense", tmp_path, configs["llama"], MAX_RANK).weights


@pytest.mark.parametrize("half", ["A", "B"])
def test_one_half_without_the_other(configs, tmp_path, half):
    tensors = {**pair(), **pair("model.layers.1.self_attn.v_proj", out_features=KV)}
    del tensors[f"{P}model.layers.1.self_attn.v_proj.lora_{half}.weight"]
    other = "B" if half == "A" else "A"
    refused(write(tmp_path, tensors), configs["llama"], "model.layers.1.self_attn.v_proj",
            f"has lora_{other} but no lora_{half}")


@pytest.mark.parametrize(("a_shape", "b_shape"), [
    ((4, HIDDEN + 1), (Q, 4)),  # A with the wrong in_features
    ((4, HIDDEN), (KV, 4)),  # B with the wrong out_features (q_proj's is Q)
    ((4, HIDDEN), (Q, 3)),  # ranks of A and B differ
    ((4, HIDDEN), (4, Q)),  # B transposed
    ((HIDDEN, 4), (Q, 4)),  # A transposed
    ((4 * HIDDEN,), (Q, 4)),  # A flat
    ((4, HIDDEN), (Q, 4, 1)),  # B with a third dimension
    ((1, 4, HIDDEN), (Q, 4)),
    ((), (Q, 4)),  # A a scalar
])
def test_shape_mismatch(configs, tmp_path, a_shape, b_shape):
    module = "model.layers.0.self_attn.q_proj"
    tensors = {f"{P}{module}.lora_A.weight": torch.randn(a_shape),
               f"{P}{module}.lora_B.weight": torch.randn(b_shape)}
    refused(write(tmp_path, tensors), configs["llama"], module, "this model needs")


def test_kv_shapes_follow_the_model(configs, tmp_path):
    """k_proj's out_features is num_key_value_heads x head_dim, not hidden_size."""
    write(tmp_path / "wrong", pair("model.layers.0.self_attn.k_proj", out_features=HIDDEN))
    refused(tmp_path / "wrong", configs["llama"], "k_proj", f"({KV}, rank)")
    write(tmp_path / "right", pair("model.layers.0.self_attn.k_proj", out_features=KV))
    assert read_adapter("kv", tmp_path / "right", configs["llama"], MAX_RANK).rank == 4


@pytest.mark.parametrize("dtype", [torch.int32, torch.int8, torch.int64, torch.uint8, torch.bool])
def test_non_float_tensors(configs, tmp_path, dtype):
    tensors = {k: (torch.randn(v.shape) * 10).to(dtype) for k, v in pair().items()}
    refused(write(tmp_path, tensors), configs["llama"], "not floating point")


def test_one_integer_half(configs, tmp_path):
    tensors = pair()
    key = f"{P}model.layers.0.self_attn.q_proj.lora_B.weight"
    tensors[key] = (tensors[key] * 10).to(torch.int16)
    refused(write(tmp_path, tensors), configs["llama"], "not floating point")


# ---------------------------------------------------------------------------------------------
# Adapters that once escaped as something other than an AdapterError, or were accepted and then
# not applied, not finite, or changed on disk underneath the engine.


@pytest.mark.parametrize("rslora", [False, True])
def test_zero_rank_tensors_are_refused(configs, tmp_path, rslora):
    refused(write(tmp_path, pair(rank=0), spec(use_rslora=rslora)), configs["llama"], "rank")


def test_a_deeply_nested_config_is_refused(configs, tmp_path):
    refused(write(tmp_path, config='{"x": ' + "[" * 200_000), configs["llama"], ADAPTER_CONFIG)


def test_a_unicode_digit_layer_index_is_refused(configs, tmp_path):
    refused(write(tmp_path, {**pair(), **pair("model.layers.².self_attn.q_proj")}), configs["llama"],
            "cannot take a LoRA")


@pytest.mark.parametrize("index", ["01", "٠", "00"])
def test_a_non_canonical_layer_index_is_refused(configs, tmp_path, index):
    refused(write(tmp_path, pair(f"model.layers.{index}.self_attn.q_proj")), configs["llama"], index)


def test_b_that_overflows_once_scaled_is_refused(configs, tmp_path):
    tensors = pair()
    tensors[f"{P}model.layers.0.self_attn.q_proj.lora_B.weight"] *= 1e37
    write(tmp_path, tensors, spec(lora_alpha=1e6))
    adapter = None
    try:
        adapter = read_adapter("big", tmp_path, configs["llama"], MAX_RANK)
    except AdapterError:
        return
    assert torch.isfinite(adapter.weights["model.layers.0.self_attn.q_proj"].b).all()


def test_a_regex_alpha_pattern_is_refused_not_ignored(models, configs, tmp_path):
    peft_model = peft_adapter(models["llama"], tmp_path, r=4, lora_alpha=8, target_modules=["q_proj"],
                              alpha_pattern={r"layers\.0\.self_attn\.q_proj": 2})
    module = "model.layers.0.self_attn.q_proj"
    assert peft_scaling(peft_model, module) == pytest.approx(2 / 4)
    try:
        adapter = read_adapter("re", tmp_path, configs["llama"], MAX_RANK)
    except AdapterError:
        return  # refusing a pattern it cannot match is as good as matching it
    saved = load_file(str(tmp_path / ADAPTER_WEIGHTS))
    torch.testing.assert_close(adapter.weights[module].b, saved[f"{P}{module}.lora_B.weight"] * (2 / 4))


def test_weights_are_copies_not_the_file_on_disk(basic, configs, tmp_path):
    out, _ = basic
    copy = shutil.copytree(out, tmp_path / "copy")
    adapter = read_adapter("a", copy, configs["llama"], MAX_RANK)
    module = "model.layers.0.self_attn.q_proj"
    a = adapter.weights[module].a.clone()
    file = copy / ADAPTER_WEIGHTS
    with open(file, "r+b") as f:  # same size, in place: never truncate a mapped file (SIGBUS)
        f.write(flip_first_weight_bit(file))
    assert torch.equal(adapter.weights[module].a, a)


# ---------------------------------------------------------------------------------------------
# --lora-modules and adapter names


def test_parse_name_equals_path():
    assert parse_lora_modules("a=/x\nb=/y") == [("a", "/x"), ("b", "/y")]


def test_parse_json_lines_and_blank_lines():
    text = ('\n  {"name": "a", "path": "/x"}  \n\n   \nb=/y/z=w\n'
            '{"name": "c", "path": "/c", "base_model_name": "m"}\n')
    assert parse_lora_modules(text) == [("a", "/x"), ("b", "/y/z=w"), ("c", "/c")]


@pytest.mark.parametrize("text", [None, "", "\n\n  \n"])
def test_parse_nothing(text):
    assert parse_lora_modules(text) == []


@pytest.mark.parametrize(("text", "words"), [
    ("noequals", ["not NAME=PATH"]),
    ("a=", ["not NAME=PATH"]),
    ("a=/x\nb=/y\na=/z", ["twice", "'a'"]),
    ('a=/x\n{"name": "a", "path": "/y"}', ["twice"]),
    ('{"name": "a"}', ["path"]),
    ('{"name": "a", "path": 3}', ["path"]),
    ('{"name": 3, "path": "/x"}', ["adapter name"]),
    ('{"path": "/x"}', ["adapter name"]),
    ('{"name": "a", "path": "/x"', ["not valid JSON"]),
    ("{not json}", ["not valid JSON"]),
    ('{"name": "a b", "path": "/x"}', ["whitespace"]),
    ("a b=/x", ["whitespace"]),
    ("a\tb=/x", ["whitespace"]),
    ("a\x00b=/x", ["unprintable"]),
    ("a" * (MAX_NAME_CHARS + 1) + "=/x", [f"1 to {MAX_NAME_CHARS}"]),
    ("=/x", [f"1 to {MAX_NAME_CHARS}"]),
])
def test_parse_errors(text, words):
    with pytest.raises(AdapterError) as info:
        parse_lora_modules(text)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_parse_longest_name():
    name = "n" * MAX_NAME_CHARS
    assert parse_lora_modules(f"{name}=/x") == [(name, "/x")]


def test_check_name():
    assert check_name("sql-lora", "base") == "sql-lora"
    assert check_name("org/model:v1.2") == "org/model:v1.2"
    with pytest.raises(AdapterError, match="base model's served name"):
        check_name("base", "base")


@pytest.mark.parametrize("name", [None, 3, b"a", ["a"], {"a": 1}, True, "", " a", "a\n", "é" * 257, "a=b", "=x"])
def test_check_name_refuses(name):
    with pytest.raises(AdapterError):
        check_name(name, "base")


def test_a_weights_file_larger_than_the_model_can_take_is_refused_before_it_is_read(configs, tmp_path):
    from pagoda_daemon.lora.adapter import max_weights_bytes

    write(tmp_path, pair())
    limit = max_weights_bytes(configs["llama"], MAX_RANK)
    with open(tmp_path / ADAPTER_WEIGHTS, "r+b") as f:  # sparse: the size, not the bytes, is what counts
        f.truncate(limit + 1)
    refused(tmp_path, configs["llama"], "more than the")
