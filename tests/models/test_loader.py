"""Loading Hugging Face-format directories: sharded and single files, dtypes, clear errors."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagoda_daemon import LLM, SamplingParams
from pagoda_daemon.attention.torch_paged import TorchPagedAttention
from pagoda_daemon.models import loader
from pagoda_daemon.models.layers import compute_inv_freq, rope_parameters


def copy_model(src: str, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def rewrite_single_file(path: Path, edit) -> None:
    f = path / "model.safetensors"
    tensors = load_file(str(f))
    edit(tensors)
    save_file(tensors, str(f), metadata={"format": "pt"})


def load(path) -> torch.nn.Module:
    config = loader.load_config(path)
    return loader.load_model(path, config, torch.float32, torch.device("cpu"), TorchPagedAttention, 128)


def test_sharded_checkpoint_loads_every_tensor_in_sorted_file_order(tiny_models):
    path = Path(tiny_models["llama"])
    index = json.loads((path / "model.safetensors.index.json").read_text())
    files = loader.safetensors_files(path)
    assert len(files) > 1 and files == sorted(files)
    assert {f.name for f in files} == set(index["weight_map"].values())
    model = load(path)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    hf_params = dict(hf.named_parameters())
    layer = model.model.layers[1]
    q = hf_params["model.layers.1.self_attn.q_proj.weight"]
    torch.testing.assert_close(layer.self_attn.qkv_proj.weight[: q.shape[0]], q, rtol=0, atol=0)
    torch.testing.assert_close(model.lm_head.weight, hf_params["lm_head.weight"], rtol=0, atol=0)
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()


def test_tied_embeddings_share_one_tensor(tiny_models):
    model = load(tiny_models["qwen3"])
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_moe_experts_are_stacked_from_per_expert_tensors(tiny_models):
    path = tiny_models["qwen3_moe"]
    model = load(path)
    tensors = load_file(str(Path(path) / "model.safetensors"))
    moe = model.model.layers[0].mlp
    inter = moe.w2.shape[2]
    for e in (0, 5):
        up = tensors[f"model.layers.0.mlp.experts.{e}.up_proj.weight"]
        torch.testing.assert_close(moe.w13[e, inter:], up, rtol=0, atol=0)
        down = tensors[f"model.layers.0.mlp.experts.{e}.down_proj.weight"]
        torch.testing.assert_close(moe.w2[e], down, rtol=0, atol=0)


def test_missing_tensor_is_named(tiny_models, tmp_path):
    path = copy_model(tiny_models["qwen3"], tmp_path / "m")
    rewrite_single_file(path, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(loader.WeightLoadError, match=r"model\.layers\.1\.self_attn\.qkv_proj\.weight\[k_proj\]"):
        load(path)


def test_missing_expert_is_named(tiny_models, tmp_path):
    path = copy_model(tiny_models["qwen3_moe"], tmp_path / "m")
    rewrite_single_file(path, lambda t: t.pop("model.layers.1.mlp.experts.6.down_proj.weight"))
    with pytest.raises(loader.WeightLoadError, match=r"model\.layers\.1\.mlp\.w2\[\(6, 'down_proj'\)\]"):
        load(path)


def test_mismatched_shape_is_named(tiny_models, tmp_path):
    path = copy_model(tiny_models["qwen3"], tmp_path / "m")

    def shrink(t):
        t["model.layers.0.mlp.up_proj.weight"] = t["model.layers.0.mlp.up_proj.weight"][:-1].contiguous()

    rewrite_single_file(path, shrink)
    with pytest.raises(loader.WeightLoadError, match=r"model\.layers\.0\.mlp\.up_proj\.weight.*shape"):
        load(path)


def test_unexpected_tensor_is_named(tiny_models, tmp_path):
    path = copy_model(tiny_models["qwen3"], tmp_path / "m")
    rewrite_single_file(path, lambda t: t.__setitem__("model.layers.9.mlp.up_proj.weight", torch.zeros(2, 2)))
    with pytest.raises(loader.WeightLoadError, match=r"model\.layers\.9\.mlp\.up_proj\.weight"):
        load(path)


def test_index_naming_a_missing_file_is_an_error(tiny_models, tmp_path):
    path = copy_model(tiny_models["llama"], tmp_path / "m")
    victim = sorted(path.glob("*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(loader.WeightLoadError, match=victim.name):
        load(path)


@pytest.mark.parametrize("escape", ["../outside.safetensors", "/etc/passwd", "shards/../../outside.safetensors"])
def test_index_naming_a_file_outside_the_model_directory_is_refused(tiny_models, tmp_path, escape):
    """The index is the model publisher's data: it must not make the daemon open files elsewhere,
    even one that exists and holds tensors."""
    path = copy_model(tiny_models["llama"], tmp_path / "m")
    victim = sorted(path.glob("*.safetensors"))[0]
    shutil.copy(victim, tmp_path / "outside.safetensors")
    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    index["weight_map"] = {k: escape if v == victim.name else v for k, v in index["weight_map"].items()}
    index_file.write_text(json.dumps(index))
    with pytest.raises(loader.WeightLoadError, match=re.escape(f"{escape!r} outside the model directory")):
        load(path)


def test_llama3_rope_scaling_matches_transformers(tiny_models):
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = AutoConfig.from_pretrained(tiny_models["llama"])
    params = rope_parameters(config)
    assert params["rope_type"] == "llama3"
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    torch.testing.assert_close(compute_inv_freq(config.head_dim, params), expected, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_dtypes_load_and_generate(tiny_models, dtype):
    llm = LLM(tiny_models["qwen3_moe"], dtype=dtype, num_kv_blocks=32, max_model_len=128)
    params = next(llm.engine.core.executor.worker.runner.model.parameters())
    assert params.dtype == getattr(torch, dtype)
    assert llm.engine.core.executor.worker.runner.kv_cache.dtype == getattr(torch, dtype)
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 5


def test_kv_cache_too_small_for_one_sequence_is_a_clear_error(tiny_models):
    with pytest.raises(ValueError, match="fewer than one sequence"):
        LLM(tiny_models["qwen3"], num_kv_blocks=4, max_model_len=256)
    with pytest.raises(ValueError, match="block_size"):
        LLM(tiny_models["qwen3"], block_size=24)
    with pytest.raises(ValueError, match="unknown engine argument"):
        LLM(tiny_models["qwen3"], max_num_seq=3)


def test_cpu_cache_is_sized_from_the_byte_budget(tiny_models):
    llm = LLM(tiny_models["qwen3"], device="cpu", kv_cache_memory_bytes=4 << 20, max_model_len=256)
    worker = llm.engine.core.executor.worker
    assert llm.get_stats().num_kv_blocks == (4 << 20) // worker.kv_block_bytes()


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_each_tensor_parallel_rank_reads_only_its_shard(tiny_models, arch, monkeypatch):
    """Rank r of 2 reads its rows/columns of every split tensor (safetensors slices: only those
    bytes) and the ranks' shards put back together are the checkpoint."""
    from pagoda_daemon.distributed.parallel_state import TensorParallel

    path = tiny_models[arch]
    config = loader.load_config(path)
    full = dict(loader.iterate_weights(path))
    total = sum(t.read().numel() for t in full.values())
    read: list[int] = []
    original = loader.CheckpointTensor.read

    def counting(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        read.append(out.numel())
        return out

    monkeypatch.setattr(loader.CheckpointTensor, "read", counting)
    shards = []
    for rank in range(2):
        read.clear()
        shards.append(loader.load_model(path, config, torch.float32, torch.device("cpu"), TorchPagedAttention, 128,
                                        tp=TensorParallel(rank, 2)))
        assert sum(read) < 0.6 * total, (rank, sum(read), total)  # norms and the router are whole on each
    monkeypatch.undo()
    whole = load(path)
    params = [dict(m.named_parameters()) for m in shards]
    q = whole.model.layers[0].self_attn.qkv_proj
    q_rows = q.shard_offsets["q_proj"][1]
    assert torch.equal(torch.cat([p["model.layers.0.self_attn.qkv_proj.weight"][: q_rows // 2] for p in params]),
                       q.weight[:q_rows])
    assert torch.equal(torch.cat([p["model.layers.0.self_attn.o_proj.weight"] for p in params], dim=1),
                       whole.model.layers[0].self_attn.o_proj.weight)
    assert torch.equal(torch.cat([p["model.embed_tokens.weight"] for p in params]), whole.model.embed_tokens.weight)


def test_each_expert_parallel_rank_reads_only_its_experts(tiny_models, monkeypatch):
    """Expert size 2 over 2 ranks: rank r holds experts 4r..4r+3 whole and opens no other
    expert's tensor; the two ranks' experts together are the checkpoint's."""
    from pagoda_daemon.distributed.parallel_state import TensorParallel

    path = tiny_models["qwen3_moe"]
    config = loader.load_config(path)
    opened: list[str] = []
    original = loader.iterate_weights

    def recording(p):
        for name, tensor in original(p):
            original_read = tensor.read

            def read(*args, _name=name, _read=original_read, **kwargs):
                opened.append(_name)
                return _read(*args, **kwargs)

            tensor.read = read  # type: ignore[method-assign]
            yield name, tensor

    monkeypatch.setattr(loader, "iterate_weights", recording)
    whole = load(path).model.layers[0].mlp
    monkeypatch.setattr(loader, "iterate_weights", recording)
    for rank in range(2):
        opened.clear()
        model = loader.load_model(path, config, torch.float32, torch.device("cpu"), TorchPagedAttention, 128,
                                  tp=TensorParallel(rank, 2, expert_groups=2))
        moe = model.model.layers[0].mlp
        assert moe.first_expert == 4 * rank and moe.w13.shape[0] == 4
        experts_read = {int(n.split(".mlp.experts.")[1].split(".")[0]) for n in opened if ".mlp.experts." in n}
        assert experts_read == set(range(4 * rank, 4 * rank + 4))
        assert torch.equal(moe.w13, whole.w13[4 * rank: 4 * rank + 4])
        assert torch.equal(moe.w2, whole.w2[4 * rank: 4 * rank + 4])
