"""The DeepSeek-V3 family's :class:`~simplefsdp.models.spec.ModelSpec`.

Composes like the mixture-of-experts family: tensor parallelism (latent
attention's heads, dense feed-forward layers and shared experts split over
tp; the router and the routed experts replicated), pipeline stages, float8
for the dense linears (the router gate and the grouped routed experts stay
in high precision) and expert parallelism; expert and tensor parallelism
together are refused. Planned from its shapes (``plan_method="analytic"``).
"""

from __future__ import annotations

from simplefsdp.models.common.decoder_spec import decoder_spec
from simplefsdp.models.common.validate import moe_decoder_validate
from simplefsdp.models.deepseek_v3.args import (
    DeepSeekV3Args,
    flops_per_token,
    num_active_params,
    num_params,
)
from simplefsdp.models.deepseek_v3.configs import DEEPSEEK_V3_CONFIGS
from simplefsdp.models.deepseek_v3.hf_adapter import DEEPSEEK_V3_HF_ADAPTER
from simplefsdp.models.deepseek_v3.model import Transformer
from simplefsdp.models.deepseek_v3.tensor_parallel import apply_tensor_parallel
from simplefsdp.models.moe.spec import tp_split_sizes

#: DeepSeek-V3 against the layout: the mixture-of-experts family's rules
#: (sequence length, heads and hidden sizes vs tp, layers vs stages, experts
#: vs ep, ep with tp refused); every head holds its own keys, so
#: ``n_kv_heads`` is ``n_heads``. See :class:`~simplefsdp.models.spec.ModelSpec`
#: for the arguments.
validate = moe_decoder_validate(tp_split_sizes)

SPEC = decoder_spec(
    experts=True,
    family="deepseek_v3",
    description="DeepSeek-V3 (multi-head latent attention, group-limited expert routing)",
    config_type=DeepSeekV3Args,
    flavors=DEEPSEEK_V3_CONFIGS,
    build=Transformer,
    num_params=num_params,
    num_active_params=num_active_params,
    flops_per_token=flops_per_token,
    validate=validate,
    capabilities=frozenset({"tp", "pp", "ep", "cp", "float8", "hf"}),
    tensor_parallel=apply_tensor_parallel,
    hf_adapter=DEEPSEEK_V3_HF_ADAPTER,
)
