"""The DeepSeek-V3 tensor-parallel plan: the shared decoder plan with
multi-head latent attention's heads split (torchtitan's ``deepseek_v3`` plan).

The shared decoder's plan
(:func:`simplefsdp.models.common.tensor_parallel.decoder_plan`: embedding,
norms, dense feed-forward networks, MoE layers, output) with each block's
attention planned by :func:`latent_attention_plan`:

* the attention input is gathered from the sequence shards once and handed
  to the module as a plain (replicated) tensor, so the replicated parts
  (``wq_a``, ``q_norm``, ``wkv_a``, ``kv_norm``: the low-rank latents and
  the rotary key shared by all heads) run as ordinary modules;
* ``wq`` / ``wq_b`` and ``wkv_b`` are colwise (each rank computes its heads'
  queries, keys and values; their input gradients are all-reduced);
* ``wo`` is rowwise, its partial output reduce-scattered to the sequence
  shards (or all-reduced without sequence parallelism).

``n_heads`` must divide by the TP size (and the dense and shared-expert
hidden sizes, as in every decoder).
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
)
from torch.distributed.tensor.placement_types import Placement

from simplefsdp.models.common.tensor_parallel import apply_decoder_tp, decoder_plan


def latent_attention_plan(
    prefix: str, attention: nn.Module, seq: Placement, styles: Any = None
) -> dict[str, ParallelStyle]:
    """TP plan of one :class:`~.model.MultiHeadLatentAttention` at FQN ``prefix``
    whose input and output are in layout ``seq`` (see the module docstring);
    the ``attention`` entries of
    :func:`~simplefsdp.models.common.tensor_parallel.decoder_plan`. The
    projections keep torch's styles (``styles``, the float8 ones, are not
    used)."""
    plan: dict[str, ParallelStyle] = {
        prefix: PrepareModuleInput(
            input_layouts=(seq, None),
            desired_input_layouts=(Replicate(), None),
            use_local_output=True,
        )
    }
    query = ("wq",) if attention.q_lora_rank == 0 else ("wq_b",)
    for name in (*query, "wkv_b"):
        plan[f"{prefix}.{name}"] = ColwiseParallel()
    plan[f"{prefix}.wo"] = RowwiseParallel(output_layouts=seq)
    return plan


def deepseek_v3_plan(
    model: nn.Module, *, sequence_parallel: bool = True, loss_parallel: bool = False
) -> dict[str, ParallelStyle]:
    """The tensor-parallel plan of a DeepSeek-V3 model (or pipeline stage):
    FQN -> style, plain data for ``parallelize_module``. The shared
    decoder's plan (:func:`~simplefsdp.models.common.tensor_parallel.decoder_plan`)
    with :func:`latent_attention_plan` for each block's attention."""
    return decoder_plan(
        model,
        sequence_parallel=sequence_parallel,
        loss_parallel=loss_parallel,
        attention=latent_attention_plan,
    )


def apply_tensor_parallel(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    *,
    sequence_parallel: bool = True,
    loss_parallel: bool = False,
) -> nn.Module:
    """Shard a DeepSeek-V3 model over ``tp_mesh`` with :func:`deepseek_v3_plan`,
    in place: :func:`simplefsdp.models.common.tensor_parallel.apply_decoder_tp`
    (its checks included) with :func:`latent_attention_plan` for each block's
    attention.

    Raises:
        ValueError: a bad mesh, a parameter already a DTensor, a split size
            not divisible by the TP size, or a float8 tensorwise model with
            sequence parallelism on a CPU mesh (one line each).
    """
    return apply_decoder_tp(
        model,
        tp_mesh,
        sequence_parallel=sequence_parallel,
        loss_parallel=loss_parallel,
        attention=latent_attention_plan,
    )


def tp_split_sizes(config: Any, *, loss_parallel: bool = False) -> dict[str, int]:
    """The sizes the TP plan splits over the TP ranks: heads, the dense and
    shared-experts hidden sizes, and with ``loss_parallel`` the vocabulary."""
    from simplefsdp.models.moe.spec import tp_split_sizes as moe_sizes

    sizes = moe_sizes(config, loss_parallel=loss_parallel)
    sizes.pop("n_kv_heads", None)  # latent attention: every head has its keys
    return sizes
