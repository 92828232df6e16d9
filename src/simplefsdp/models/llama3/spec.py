"""The Llama 3 family's :class:`~simplefsdp.models.spec.ModelSpec`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from simplefsdp.models.common.stages import pipeline_split
from simplefsdp.models.common.validate import decoder_errors, flag_names
from simplefsdp.models.llama3.args import ModelArgs, flops_per_token, num_params
from simplefsdp.models.llama3.configs import LLAMA3_CONFIGS
from simplefsdp.models.llama3.hf_adapter import LLAMA3_HF_ADAPTER
from simplefsdp.models.llama3.model import Transformer
from simplefsdp.models.llama3.tensor_parallel import tp_split_sizes
from simplefsdp.models.spec import ModelSpec


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The training loss: mean token cross-entropy of ``(B, T, V)`` logits, in fp32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _init_weights(model: Any, buffer_device: Any = None) -> None:
    model.init_weights(buffer_device=buffer_device)


def _tensor_parallel(
    model: Any, tp_mesh: Any, *, sequence_parallel: bool = True, loss_parallel: bool = False
) -> None:
    from simplefsdp.models.llama3.tensor_parallel import apply_tensor_parallel

    apply_tensor_parallel(
        model, tp_mesh, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel
    )


def validate(
    config: ModelArgs,
    layout: Any,
    *,
    seq_len: int | None = None,
    sequence_parallel: bool = False,
    loss_parallel: bool = False,
    build: bool = True,
    model_name: str | None = None,
    names: Mapping[str, str] | None = None,
) -> list[str]:
    """Llama 3 against the layout: sequence vs ``max_seq_len``, heads and
    hidden sizes vs tp, layers vs stages, no experts for ep.

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
        model = f"model {model_name!r}" if model_name else "this Llama 3 model"
        errors.append(
            f"{flag_names(names)['ep']} {ep}: expert parallelism needs a model with experts "
            f"and {model} has none; valid: 1, or a mixture-of-experts model (e.g. moe_debug)"
        )
    return errors


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

SPEC = ModelSpec(
    family="llama3",
    description="Llama 3 / 3.1 dense decoder",
    config_type=ModelArgs,
    flavors=LLAMA3_CONFIGS,
    build=Transformer,
    init_weights=_init_weights,
    loss=cross_entropy,
    num_params=num_params,
    flops_per_token=flops_per_token,
    validate=validate,
    capabilities=frozenset({"tp", "pp", "cp", "float8", "hf"}),
    tensor_parallel=_tensor_parallel,
    pipeline_split=pipeline_split,
    hf_adapter=LLAMA3_HF_ADAPTER,
    reference_layouts=REFERENCE_LAYOUTS,
)
