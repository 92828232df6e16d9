"""The Llama 3 family's :class:`~simplefsdp.models.spec.ModelSpec`."""

from __future__ import annotations

from simplefsdp.models.common.decoder_spec import (
    cross_entropy,  # noqa: F401 (re-exported)
    decoder_spec,
)
from simplefsdp.models.common.validate import dense_decoder_validate
from simplefsdp.models.llama3.args import ModelArgs, flops_per_token, num_params
from simplefsdp.models.llama3.configs import LLAMA3_CONFIGS
from simplefsdp.models.llama3.hf_adapter import LLAMA3_HF_ADAPTER
from simplefsdp.models.llama3.model import Transformer
from simplefsdp.models.llama3.tensor_parallel import apply_tensor_parallel, tp_split_sizes

#: Llama 3 against the layout: sequence vs ``max_seq_len``, heads and hidden
#: sizes vs tp, layers vs stages, no experts for ep (see
#: :class:`~simplefsdp.models.spec.ModelSpec` for the arguments).
validate = dense_decoder_validate(
    tp_split_sizes,
    unnamed="this Llama 3 model",
    with_experts="a mixture-of-experts model (e.g. moe_debug)",
)

# torchtitan's published layouts (the defaults of ``simplefsdp plan``): local
# batch, sequence length and AC mode of its train configs
# (torchtitan/models/llama3/train_configs/llama3_{8b,70b,405b}.toml), TP degree
# and GPU count of the runs its docs/performance.md reports (8B on 8 GPUs, 70B
# on 64 with TP 8, 405B on 128 with TP 8).
REFERENCE_LAYOUTS = {
    "llama3_8b": {"gpus": 8, "tp": 1, "batch": 1, "seq": 8192, "ac": "selective"},
    "llama3_70b": {"gpus": 64, "tp": 8, "batch": 8, "seq": 8192, "ac": "full"},
    "llama3_405b": {"gpus": 128, "tp": 8, "batch": 2, "seq": 8192, "ac": "full"},
}

SPEC = decoder_spec(
    family="llama3",
    description="Llama 3 / 3.1 dense decoder",
    config_type=ModelArgs,
    flavors=LLAMA3_CONFIGS,
    build=Transformer,
    num_params=num_params,
    flops_per_token=flops_per_token,
    validate=validate,
    capabilities=frozenset({"tp", "pp", "cp", "float8", "hf"}),
    tensor_parallel=apply_tensor_parallel,
    hf_adapter=LLAMA3_HF_ADAPTER,
    reference_layouts=REFERENCE_LAYOUTS,
)
