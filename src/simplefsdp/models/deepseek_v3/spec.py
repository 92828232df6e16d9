"""The DeepSeek-V3 family's :class:`~simplefsdp.models.spec.ModelSpec`.

Composes like the mixture-of-experts family: tensor parallelism (latent
attention's heads, dense feed-forward layers and shared experts split over
tp; the router and the routed experts replicated), pipeline stages, float8
for the dense linears (the router gate and the grouped routed experts stay
in high precision) and expert parallelism; expert and tensor parallelism
together are refused. Planned from its shapes (``plan_method="analytic"``).
"""

from __future__ import annotations

from typing import Any

from simplefsdp.models.common.stages import pipeline_split
from simplefsdp.models.deepseek_v3.args import (
    DeepSeekV3Args,
    flops_per_token,
    num_active_params,
    num_params,
)
from simplefsdp.models.deepseek_v3.configs import DEEPSEEK_V3_CONFIGS
from simplefsdp.models.deepseek_v3.hf_adapter import DEEPSEEK_V3_HF_ADAPTER
from simplefsdp.models.deepseek_v3.model import Transformer
from simplefsdp.models.llama3.spec import cross_entropy
from simplefsdp.models.moe.spec import SPEC as MOE_SPEC
from simplefsdp.models.moe.spec import validate as moe_validate
from simplefsdp.models.spec import ModelSpec


def _init_weights(model: Any, buffer_device: Any = None) -> None:
    model.init_weights(buffer_device=buffer_device)


def _tensor_parallel(
    model: Any, tp_mesh: Any, *, sequence_parallel: bool = True, loss_parallel: bool = False
) -> None:
    from simplefsdp.models.deepseek_v3.tensor_parallel import apply_tensor_parallel

    apply_tensor_parallel(
        model, tp_mesh, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel
    )


def validate(config: DeepSeekV3Args, layout: Any, **inputs: Any) -> list[str]:
    """DeepSeek-V3 against the layout: the mixture-of-experts rules
    (sequence length, heads and hidden sizes vs tp, layers vs stages,
    experts vs ep, ep with tp refused); every head holds its own keys, so
    ``n_kv_heads`` is ``n_heads``.

    See :class:`~simplefsdp.models.spec.ModelSpec` for the arguments.
    """
    return moe_validate(config, layout, **inputs)


SPEC = ModelSpec(
    family="deepseek_v3",
    description="DeepSeek-V3 (multi-head latent attention, group-limited expert routing)",
    config_type=DeepSeekV3Args,
    flavors=DEEPSEEK_V3_CONFIGS,
    build=Transformer,
    init_weights=_init_weights,
    loss=cross_entropy,
    num_params=num_params,
    num_active_params=num_active_params,
    flops_per_token=flops_per_token,
    validate=validate,
    capabilities=frozenset({"tp", "pp", "ep", "cp", "float8", "hf"}),
    tensor_parallel=_tensor_parallel,
    pipeline_split=pipeline_split,
    fullgraph=False,
    plan_method="analytic",
    after_optimizer_step=MOE_SPEC.after_optimizer_step,
    discard_step_state=MOE_SPEC.discard_step_state,
    float8_skip_fqns=("router.gate",),
    hf_adapter=DEEPSEEK_V3_HF_ADAPTER,
)
