"""The Llama 3 family's :class:`~simplefsdp.models.spec.ModelSpec`."""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import torch.nn.functional as F

from simplefsdp.models.llama3.args import ModelArgs, flops_per_token, num_params
from simplefsdp.models.llama3.configs import LLAMA3_CONFIGS
from simplefsdp.models.llama3.model import Transformer
from simplefsdp.models.llama3.stages import pipeline_split
from simplefsdp.models.llama3.tensor_parallel import apply_tensor_parallel, tp_split_sizes
from simplefsdp.models.spec import ModelSpec

__all__ = ["SPEC", "cross_entropy"]


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The training loss: mean token cross-entropy of ``(B, T, V)`` logits, in fp32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _init_weights(model: Any, buffer_device: Any = None) -> None:
    model.init_weights(buffer_device=buffer_device)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def validate(config: ModelArgs, layout: Any) -> list[str]:
    """Llama 3 against the layout: heads and hidden sizes vs tp, layers vs stages."""
    errors = []
    tp = getattr(layout, "tp", 1)
    if tp > 1:
        sizes = tp_split_sizes(config)
        bad = {name: size for name, size in sizes.items() if size % tp}
        if bad:
            found = ", ".join(f"{name} {size}" for name, size in bad.items())
            valid = _divisors(math.gcd(*sizes.values()))
            errors.append(
                f"tp {tp} does not divide the {found} of the model; "
                f"valid tensor-parallel sizes for this model: {valid}"
            )
    if getattr(layout, "ep", 1) > 1:
        errors.append(
            f"ep {layout.ep}: expert parallelism needs a model with experts and this Llama 3 "
            "model has none; valid: 1, or a mixture-of-experts model (e.g. moe_debug)"
        )
    return errors


# torchtitan's published layouts (the defaults of ``simplefsdp plan``): local
# batch, sequence length and AC mode of its train configs
# (torchtitan/models/llama3/train_configs/llama3_{8b,70b,405b}.toml), TP degree
# and GPU count of the runs its docs/performance.md reports (8B on 8 GPUs, 70B
# on 64 with TP 8, 405B on 128 with TP 8).
REFERENCE_LAYOUTS = {
    "8B": {"gpus": 8, "tp": 1, "batch": 1, "seq": 8192, "ac": "selective"},
    "70B": {"gpus": 64, "tp": 8, "batch": 8, "seq": 8192, "ac": "full"},
    "405B": {"gpus": 128, "tp": 8, "batch": 2, "seq": 8192, "ac": "full"},
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
    capabilities=frozenset({"tp", "pp", "float8", "hf"}),
    tensor_parallel=functools.partial(apply_tensor_parallel),
    pipeline_split=pipeline_split,
    reference_layouts=REFERENCE_LAYOUTS,
)
