"""The dense Qwen3 family's :class:`~simplefsdp.models.spec.ModelSpec`.

Composes like Llama 3: tensor parallelism (heads and the feed-forward
network split; the QK-norms see their rank's heads, see
:mod:`.tensor_parallel`), pipeline stages (the shared decoder split), float8
linears and Hugging Face weights in and out (``model_type`` ``qwen3``).
The mixture-of-experts models are the ``qwen3_moe`` family
(:mod:`.moe_spec`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from simplefsdp.models.common.stages import pipeline_split
from simplefsdp.models.common.validate import decoder_errors, flag_names
from simplefsdp.models.llama3.spec import cross_entropy
from simplefsdp.models.qwen3.args import Qwen3Args, flops_per_token, num_params
from simplefsdp.models.qwen3.configs import QWEN3_CONFIGS
from simplefsdp.models.qwen3.hf_adapter import QWEN3_HF_ADAPTER
from simplefsdp.models.qwen3.model import Transformer
from simplefsdp.models.spec import ModelSpec


def init_weights(model: Any, buffer_device: Any = None) -> None:
    """Initialise a built Qwen3 model (or pipeline stage) in place."""
    model.init_weights(buffer_device=buffer_device)


def tensor_parallel(
    model: Any, tp_mesh: Any, *, sequence_parallel: bool = True, loss_parallel: bool = False
) -> None:
    """Apply Qwen3's TP plan in place (see :mod:`.tensor_parallel`)."""
    from simplefsdp.models.qwen3.tensor_parallel import apply_tensor_parallel

    apply_tensor_parallel(
        model, tp_mesh, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel
    )


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


def validate(
    config: Qwen3Args,
    layout: Any,
    *,
    seq_len: int | None = None,
    sequence_parallel: bool = False,
    loss_parallel: bool = False,
    build: bool = True,
    model_name: str | None = None,
    names: Mapping[str, str] | None = None,
) -> list[str]:
    """Dense Qwen3 against the layout: sequence vs ``max_seq_len``, heads and
    hidden size vs tp, layers vs stages, no experts for ep.

    See :class:`~simplefsdp.models.spec.ModelSpec` for the arguments.
    """
    errors = decoder_errors(
        config,
        layout,
        tp_sizes=tp_split_sizes(config, loss_parallel=loss_parallel),
        seq_len=seq_len,
        sequence_parallel=sequence_parallel,
        model_name=model_name,
        names=names,
    )
    ep = getattr(layout, "ep", 1)
    if ep > 1:
        model = f"model {model_name!r}" if model_name else "this dense Qwen3 model"
        errors.append(
            f"{flag_names(names)['ep']} {ep}: expert parallelism needs a model with experts "
            f"and {model} has none; valid: 1, or a Qwen3 MoE model (e.g. qwen3_30b_a3b)"
        )
    return errors


SPEC = ModelSpec(
    family="qwen3",
    description="Qwen3 dense decoder (QK-norm, explicit head size)",
    config_type=Qwen3Args,
    flavors=QWEN3_CONFIGS,
    build=Transformer,
    init_weights=init_weights,
    loss=cross_entropy,
    num_params=num_params,
    flops_per_token=flops_per_token,
    validate=validate,
    capabilities=frozenset({"tp", "pp", "cp", "float8", "hf"}),
    tensor_parallel=tensor_parallel,
    pipeline_split=pipeline_split,
    hf_adapter=QWEN3_HF_ADAPTER,
)
