"""The GPT-OSS family's :class:`~simplefsdp.models.spec.ModelSpec`.

Composes with tensor parallelism (attention heads and their sinks split over
tp; the router replicated and the routed experts split over their hidden
dim, as for the ``moe`` family), pipeline stages (the shared decoder split), expert parallelism (the
``experts`` modules over ep; not together with tp), float8 attention
projections (the router gate and the stacked experts stay in high
precision) and Hugging Face checkpoints both ways.
"""

from __future__ import annotations

from typing import Any

from simplefsdp.models.common.decoder_spec import decoder_spec
from simplefsdp.models.common.validate import moe_decoder_validate
from simplefsdp.models.gpt_oss.args import (
    GptOssArgs,
    flops_per_token,
    num_active_params,
    num_params,
)
from simplefsdp.models.gpt_oss.configs import GPT_OSS_CONFIGS
from simplefsdp.models.gpt_oss.hf_adapter import GPT_OSS_HF_ADAPTER
from simplefsdp.models.gpt_oss.model import Transformer


def _tensor_parallel(
    model: Any, tp_mesh: Any, *, sequence_parallel: bool = True, loss_parallel: bool = False
) -> None:
    """The shared decoder plan, plus each attention's ``sinks`` sharded over
    heads (``Shard(0)``) like the rows of ``wq``."""
    from torch import nn
    from torch.distributed.tensor import Shard, distribute_tensor

    from simplefsdp.models.common.tensor_parallel import apply_decoder_tp

    apply_decoder_tp(
        model, tp_mesh, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel
    )
    for block in model.layers.values():
        attention = block.attention
        sinks = distribute_tensor(attention.sinks.data, tp_mesh, [Shard(0)])
        attention.sinks = nn.Parameter(sinks, requires_grad=attention.sinks.requires_grad)


def tp_split_sizes(config: GptOssArgs, *, loss_parallel: bool = False) -> dict[str, int]:
    """The sizes the TP plan splits over the TP ranks: heads (and with
    ``loss_parallel`` the vocabulary)."""
    sizes = {"n_heads": config.n_heads, "n_kv_heads": config.n_kv_heads}
    if loss_parallel:
        sizes["vocab_size"] = config.vocab_size
    return sizes


#: GPT-OSS against the layout: the decoder's rules, experts vs ep, and ep
#: with tp (refused); see :class:`~simplefsdp.models.spec.ModelSpec` for the
#: arguments.
validate = moe_decoder_validate(tp_split_sizes)

SPEC = decoder_spec(
    experts=True,
    family="gpt_oss",
    description="GPT-OSS mixture-of-experts decoder (attention sinks, sliding windows, YaRN)",
    config_type=GptOssArgs,
    flavors=GPT_OSS_CONFIGS,
    build=Transformer,
    num_params=num_params,
    num_active_params=num_active_params,
    flops_per_token=flops_per_token,
    validate=validate,
    capabilities=frozenset({"tp", "pp", "ep", "cp", "float8", "hf"}),
    tensor_parallel=_tensor_parallel,
    hf_adapter=GPT_OSS_HF_ADAPTER,
)
