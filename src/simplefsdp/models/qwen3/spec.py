"""The dense Qwen3 family's :class:`~simplefsdp.models.spec.ModelSpec`.

Composes like Llama 3: tensor parallelism (heads and the feed-forward
network split; the QK-norms see their rank's heads, see
:mod:`.tensor_parallel`), pipeline stages (the shared decoder split), float8
linears and Hugging Face weights in and out (``model_type`` ``qwen3``).
The mixture-of-experts models are the ``qwen3_moe`` family
(:mod:`.moe_spec`).
"""

from __future__ import annotations

from simplefsdp.models.common.decoder_spec import decoder_spec
from simplefsdp.models.common.validate import dense_decoder_validate
from simplefsdp.models.qwen3.args import Qwen3Args, flops_per_token, num_params
from simplefsdp.models.qwen3.configs import QWEN3_CONFIGS
from simplefsdp.models.qwen3.hf_adapter import QWEN3_HF_ADAPTER
from simplefsdp.models.qwen3.model import Transformer
from simplefsdp.models.qwen3.tensor_parallel import apply_tensor_parallel


def tp_split_sizes(config: Qwen3Args, *, loss_parallel: bool = False) -> dict[str, int]:
    """The sizes the TP plan splits over the TP ranks: heads, the dense
    feed-forward hidden dim (if any dense block), and with ``loss_parallel``
    the vocabulary."""
    sizes = {"n_heads": config.n_heads, "n_kv_heads": config.n_kv_heads}
    if getattr(config, "n_dense_layers", config.n_layers):
        sizes["feed-forward hidden dim"] = config.hidden_dim
    if loss_parallel:
        sizes["vocab_size"] = config.vocab_size
    return sizes


#: Dense Qwen3 against the layout: sequence vs ``max_seq_len``, heads and
#: hidden size vs tp, layers vs stages, no experts for ep (see
#: :class:`~simplefsdp.models.spec.ModelSpec` for the arguments).
validate = dense_decoder_validate(
    tp_split_sizes,
    unnamed="this dense Qwen3 model",
    with_experts="a Qwen3 MoE model (e.g. qwen3_30b_a3b)",
)


SPEC = decoder_spec(
    family="qwen3",
    description="Qwen3 dense decoder (QK-norm, explicit head size)",
    config_type=Qwen3Args,
    flavors=QWEN3_CONFIGS,
    build=Transformer,
    num_params=num_params,
    flops_per_token=flops_per_token,
    validate=validate,
    capabilities=frozenset({"tp", "pp", "cp", "float8", "hf"}),
    tensor_parallel=apply_tensor_parallel,
    hf_adapter=QWEN3_HF_ADAPTER,
)
