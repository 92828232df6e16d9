"""The Qwen3 mixture-of-experts family's :class:`~simplefsdp.models.spec.ModelSpec`
(``qwen3_moe``: Qwen3-30B-A3B, Qwen3-235B-A22B).

A family of its own next to the dense ``qwen3`` (:mod:`.spec`), sharing its
modules: what a spec declares differs between the two (expert parallelism,
planning from shapes rather than traces, graph breaks at the token counts,
the load metrics after each step, the Hugging Face ``model_type``).

Composes like the ``moe`` family: tensor parallelism (attention and dense
blocks split, the routed experts over their hidden dim, the router
replicated), pipeline
stages, expert parallelism (the ``experts`` modules over ep), float8 for the
attention and dense linears (router and grouped experts stay in high
precision) and Hugging Face weights (``model_type`` ``qwen3_moe``). Expert
and tensor parallelism together are refused.
"""

from __future__ import annotations

from simplefsdp.models.common.decoder_spec import decoder_spec
from simplefsdp.models.common.validate import moe_decoder_validate
from simplefsdp.models.qwen3.args import (
    Qwen3MoEArgs,
    flops_per_token,
    num_active_params,
    num_params,
)
from simplefsdp.models.qwen3.configs import QWEN3_MOE_CONFIGS
from simplefsdp.models.qwen3.hf_adapter import QWEN3_MOE_HF_ADAPTER
from simplefsdp.models.qwen3.model import Transformer
from simplefsdp.models.qwen3.spec import tp_split_sizes
from simplefsdp.models.qwen3.tensor_parallel import apply_tensor_parallel

#: Qwen3 MoE against the layout: the decoder's rules, experts vs ep, and ep
#: with tp (refused); see :class:`~simplefsdp.models.spec.ModelSpec` for the
#: arguments.
validate = moe_decoder_validate(tp_split_sizes)

SPEC = decoder_spec(
    experts=True,
    family="qwen3_moe",
    description="Qwen3 mixture-of-experts decoder (softmax top-k routing, no shared expert)",
    config_type=Qwen3MoEArgs,
    flavors=QWEN3_MOE_CONFIGS,
    build=Transformer,
    num_params=num_params,
    num_active_params=num_active_params,
    flops_per_token=flops_per_token,
    validate=validate,
    capabilities=frozenset({"tp", "pp", "ep", "cp", "float8", "hf"}),
    tensor_parallel=apply_tensor_parallel,
    hf_adapter=QWEN3_MOE_HF_ADAPTER,
)
