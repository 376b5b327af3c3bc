"""Which parallel layouts a model can be split into, from its config alone.

Torch-free, so that the operator refuses at apply time what a daemon would refuse at start
(``pagoda_operator.model_config``): the messages name the daemon's options, which the operator
turns into InferenceService fields (``spec.in_crd_terms``).
"""

from __future__ import annotations


def num_experts_of(model_config) -> int:
    """The MoE experts of a model (Qwen3-MoE's num_experts, Mixtral's num_local_experts), 0 for a dense one."""
    return getattr(model_config, "num_experts", None) or getattr(model_config, "num_local_experts", None) or 0


RANKS = "tensor_parallel_size × expert_parallel_size"


def check_layout(model_config, tensor: int, expert: int, eplb: bool = False, redundant: int = 0,
                 elastic_max: int = 0, data_experts: int = 0) -> None:
    """Refuse, in one line, a layout the model cannot be split into (before any rank starts;
    the layers check again as they are built). The line names options as the config file
    does, so that the operator can name the InferenceService fields instead. Elastic EP (``elastic_max`` > 0) splits only
    the experts, whatever their number: a size that does not divide them takes redundant slots.
    ``data_experts``: the data-parallel engines the experts are spread over (data_parallel_experts)."""
    if elastic_max:
        return _check_elastic_layout(model_config, elastic_max)
    if data_experts:
        _check_data_experts_layout(model_config)
    ranks = tensor * expert
    groups = data_experts or expert  # the ranks, or engines, the experts are spread over
    spread_over = "data_parallel_size" if data_experts else "expert_parallel_size"
    heads = model_config.num_attention_heads
    kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
    experts = num_experts_of(model_config)
    is_moe = experts > 0 and (getattr(model_config, "num_experts_per_tok", 0) or 0) > 0
    problems = []
    if heads % ranks:
        problems.append(f"the number of attention heads ({heads}) is not divisible by {RANKS} = {ranks}")
    elif (ranks % kv_heads) if ranks > kv_heads else (kv_heads % ranks):
        problems.append(f"{RANKS} = {ranks} is neither a divisor nor a multiple of the number of KV "
                        f"heads ({kv_heads})")
    if expert > 1 and not is_moe:
        problems.append(f"expert_parallel_size {expert} needs a mixture-of-experts model; this one has no experts")
    if is_moe and (experts + redundant) % groups:
        problems.append(f"the number of experts ({experts})" + (f" plus num_redundant_experts ({redundant})"
                                                                 if redundant else "")
                        + f" is not divisible by {spread_over} {groups}"
                        + (" (data_parallel_experts spreads them evenly over the engines)" if data_experts else ""))
    if eplb and (groups < 2 or not is_moe):
        problems.append("enable_eplb needs a mixture-of-experts model and expert_parallel_size of 2 or more "
                        "(or data_parallel_experts)")
    if redundant and not eplb:
        problems.append("num_redundant_experts needs enable_eplb")
    if eplb and is_moe and redundant > experts * (groups - 1):
        problems.append(f"num_redundant_experts ({redundant}) is more than experts × ({spread_over} - 1) "
                        f"= {experts * (groups - 1)}: a rank would hold two copies of one expert")
    moe_inter = getattr(model_config, "moe_intermediate_size", None)
    if is_moe and moe_inter and moe_inter % tensor:
        problems.append(f"the experts' intermediate size ({moe_inter}) is not divisible by tensor_parallel_size "
                        f"{tensor}")
    inter = getattr(model_config, "intermediate_size", None)
    dense_layers = not is_moe or getattr(model_config, "mlp_only_layers", None) or (
        getattr(model_config, "decoder_sparse_step", 1) or 1) > 1
    if inter and dense_layers and inter % ranks:
        problems.append(f"the intermediate size ({inter}) is not divisible by {RANKS} = {ranks}")
    if problems:
        raise ValueError("; ".join(problems))


def _check_elastic_layout(model_config, elastic_max: int) -> None:
    experts = num_experts_of(model_config)
    if not experts or not (getattr(model_config, "num_experts_per_tok", 0) or 0):
        raise ValueError(f"elastic_ep_max_size {elastic_max}: elastic expert parallelism needs a mixture-of-experts "
                         "model; this one has no experts")
    if elastic_max > experts:
        raise ValueError(f"elastic_ep_max_size {elastic_max} is more than the model's {experts} experts: a rank "
                         "would hold only copies")


def _check_data_experts_layout(model_config) -> None:
    experts = num_experts_of(model_config)
    if not experts or not (getattr(model_config, "num_experts_per_tok", 0) or 0):
        raise ValueError("data_parallel_experts needs a mixture-of-experts model; this one has no experts")
