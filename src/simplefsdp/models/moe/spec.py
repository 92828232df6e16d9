"""The mixture-of-experts family's :class:`~simplefsdp.models.spec.ModelSpec`.

Composes like Llama 3: tensor parallelism (attention, dense feed-forward
layers and shared experts split over tp; the router and the routed experts
replicated over tp), pipeline stages (the shared decoder split), float8 for
the dense linears (the router gate and the grouped routed experts stay in
high precision) and expert parallelism (the ``experts`` modules over ep).
Expert and tensor parallelism together are refused.
"""

from __future__ import annotations

from typing import Any

from simplefsdp.models.common.load_balance import after_optimizer_step, discard_step_state
from simplefsdp.models.common.stages import pipeline_split
from simplefsdp.models.common.validate import moe_decoder_errors
from simplefsdp.models.llama3.spec import cross_entropy
from simplefsdp.models.moe.args import MoEArgs, num_active_params, num_params
from simplefsdp.models.moe.configs import MOE_CONFIGS
from simplefsdp.models.moe.model import Transformer
from simplefsdp.models.spec import ModelSpec


def flops_per_token(args: MoEArgs, seq_len: int) -> int:
    """Training FLOPs per token, torchtitan's count: ``6 *`` the parameters
    one token uses (``top_k`` routed experts per layer, no input embedding)
    plus attention's ``12 * n_layers * dim * seq_len``."""
    n = num_active_params(args, exclude_embeddings=True)
    return 6 * n + 12 * args.n_layers * args.dim * seq_len


def _init_weights(model: Any, buffer_device: Any = None) -> None:
    model.init_weights(buffer_device=buffer_device)


def _tensor_parallel(
    model: Any, tp_mesh: Any, *, sequence_parallel: bool = True, loss_parallel: bool = False
) -> None:
    from simplefsdp.models.common.tensor_parallel import apply_decoder_tp

    apply_decoder_tp(
        model, tp_mesh, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel
    )


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


def validate(
    config: MoEArgs, layout: Any, *, loss_parallel: bool = False, build: bool = True, **inputs: Any
) -> list[str]:
    """The MoE model against the layout: the decoder's rules, experts vs ep,
    ep with tp (refused).

    See :class:`~simplefsdp.models.spec.ModelSpec` for the arguments.
    """
    tp_sizes = tp_split_sizes(config, loss_parallel=loss_parallel)
    return moe_decoder_errors(config, layout, tp_sizes=tp_sizes, **inputs)


SPEC = ModelSpec(
    family="moe",
    description="mixture-of-experts decoder (token-choice routing, shared experts)",
    config_type=MoEArgs,
    flavors=MOE_CONFIGS,
    build=Transformer,
    init_weights=_init_weights,
    loss=cross_entropy,
    num_params=num_params,
    num_active_params=num_active_params,
    flops_per_token=flops_per_token,
    validate=validate,
    capabilities=frozenset({"tp", "pp", "ep", "cp", "float8"}),
    tensor_parallel=_tensor_parallel,
    pipeline_split=pipeline_split,
    fullgraph=False,
    plan_method="analytic",
    after_optimizer_step=after_optimizer_step,
    discard_step_state=discard_step_state,
    float8_skip_fqns=("router.gate",),
)
