"""The mixture-of-experts family's :class:`~simplefsdp.models.spec.ModelSpec`.

Composes like Llama 3: tensor parallelism (attention, dense feed-forward
layers, shared experts and the routed experts' hidden dim split over tp;
the router replicated), pipeline stages (the shared decoder split), float8 for
the dense linears (the router gate and the grouped routed experts stay in
high precision) and expert parallelism (the ``experts`` modules over ep).
Expert and tensor parallelism together are refused.
"""

from __future__ import annotations

from simplefsdp.models.common.decoder_spec import decoder_spec
from simplefsdp.models.common.tensor_parallel import apply_decoder_tp
from simplefsdp.models.common.validate import moe_decoder_validate
from simplefsdp.models.moe.args import MoEArgs, num_active_params, num_params
from simplefsdp.models.moe.configs import MOE_CONFIGS
from simplefsdp.models.moe.model import Transformer


def flops_per_token(args: MoEArgs, seq_len: int) -> int:
    """Training FLOPs per token, torchtitan's count: ``6 *`` the parameters
    one token uses (``top_k`` routed experts per layer, no input embedding)
    plus attention's ``12 * n_layers * dim * seq_len``."""
    n = num_active_params(args, exclude_embeddings=True)
    return 6 * n + 12 * args.n_layers * args.dim * seq_len


def tp_split_sizes(config: MoEArgs, *, loss_parallel: bool = False) -> dict[str, int]:
    """The sizes the TP plan splits over the TP ranks: heads, the dense
    feed-forward hidden dim (if any dense block), the shared experts' hidden
    dim (if any), and with ``loss_parallel`` the vocabulary."""
    sizes = {"n_heads": config.n_heads, "n_kv_heads": config.n_kv_heads}
    if config.n_dense_layers:
        sizes["feed-forward hidden dim"] = config.dense_hidden_dim
    if config.num_shared_experts and config.n_moe_layers:
        sizes["shared-experts hidden dim"] = config.moe_hidden_dim * config.num_shared_experts
    if loss_parallel:
        sizes["vocab_size"] = config.vocab_size
    return sizes


#: The MoE model against the layout: the decoder's rules, experts vs ep, ep
#: with tp (refused); see :class:`~simplefsdp.models.spec.ModelSpec` for the
#: arguments.
validate = moe_decoder_validate(tp_split_sizes)

SPEC = decoder_spec(
    experts=True,
    family="moe",
    description="mixture-of-experts decoder (token-choice routing, shared experts)",
    config_type=MoEArgs,
    flavors=MOE_CONFIGS,
    build=Transformer,
    num_params=num_params,
    num_active_params=num_active_params,
    flops_per_token=flops_per_token,
    validate=validate,
    capabilities=frozenset({"tp", "pp", "ep", "cp", "float8"}),
    tensor_parallel=apply_decoder_tp,
)
