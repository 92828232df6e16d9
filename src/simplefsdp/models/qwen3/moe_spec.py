"""The Qwen3 mixture-of-experts family's :class:`~simplefsdp.models.spec.ModelSpec`
(``qwen3_moe``: Qwen3-30B-A3B, Qwen3-235B-A22B).

A family of its own next to the dense ``qwen3`` (:mod:`.spec`), sharing its
modules: what a spec declares differs between the two (expert parallelism,
planning from shapes rather than traces, graph breaks at the token counts,
the load metrics after each step, the Hugging Face ``model_type``).

Composes like the ``moe`` family: tensor parallelism (attention and dense
blocks split, router and routed experts replicated over tp), pipeline
stages, expert parallelism (the ``experts`` modules over ep), float8 for the
attention and dense linears (router and grouped experts stay in high
precision) and Hugging Face weights (``model_type`` ``qwen3_moe``). Expert
and tensor parallelism together are refused.
"""

from __future__ import annotations

from typing import Any

from simplefsdp.models.common.load_balance import after_optimizer_step, discard_step_state
from simplefsdp.models.common.stages import pipeline_split
from simplefsdp.models.common.validate import moe_decoder_errors
from simplefsdp.models.llama3.spec import cross_entropy
from simplefsdp.models.qwen3.args import (
    Qwen3MoEArgs,
    flops_per_token,
    num_active_params,
    num_params,
)
from simplefsdp.models.qwen3.configs import QWEN3_MOE_CONFIGS
from simplefsdp.models.qwen3.hf_adapter import QWEN3_MOE_HF_ADAPTER
from simplefsdp.models.qwen3.model import Transformer
from simplefsdp.models.qwen3.spec import init_weights, tensor_parallel, tp_split_sizes
from simplefsdp.models.spec import ModelSpec


def validate(
    config: Qwen3MoEArgs,
    layout: Any,
    *,
    loss_parallel: bool = False,
    build: bool = True,
    **inputs: Any,
) -> list[str]:
    """Qwen3 MoE against the layout: the decoder's rules, experts vs ep, and
    ep with tp (refused).

    See :class:`~simplefsdp.models.spec.ModelSpec` for the arguments.
    """
    tp_sizes = tp_split_sizes(config, loss_parallel=loss_parallel)
    return moe_decoder_errors(config, layout, tp_sizes=tp_sizes, **inputs)


SPEC = ModelSpec(
    family="qwen3_moe",
    description="Qwen3 mixture-of-experts decoder (softmax top-k routing, no shared expert)",
    config_type=Qwen3MoEArgs,
    flavors=QWEN3_MOE_CONFIGS,
    build=Transformer,
    init_weights=init_weights,
    loss=cross_entropy,
    num_params=num_params,
    num_active_params=num_active_params,
    flops_per_token=flops_per_token,
    validate=validate,
    capabilities=frozenset({"tp", "pp", "ep", "cp", "float8", "hf"}),
    tensor_parallel=tensor_parallel,
    pipeline_split=pipeline_split,
    fullgraph=False,
    plan_method="analytic",
    after_optimizer_step=after_optimizer_step,
    discard_step_state=discard_step_state,
    float8_skip_fqns=("router.gate",),
    hf_adapter=QWEN3_MOE_HF_ADAPTER,
)
