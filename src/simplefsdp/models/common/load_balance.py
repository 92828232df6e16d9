"""Load balancing and expert-load metrics for :class:`~simplefsdp.models.common.moe.MoE` layers.

The auxiliary-loss-free balancing of DeepSeek-V3 keeps a per-expert routing
bias that is raised for under-loaded experts and lowered for over-loaded ones
after every optimizer step: ``bias += rate * sign(mean(load) - load)``
(centred to mean zero). The load is the count of tokens routed to each
expert since the last update, summed over all data-parallel ranks so every
rank applies the same update and the buffers stay replicated.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .moe import MoE


@dataclass(frozen=True)
class ExpertLoad:
    """Tokens routed to each expert of one MoE layer since the last update.

    Attributes:
        name: the layer's module name, e.g. ``"layers.1.moe"``.
        tokens_per_expert: global token counts, one per expert.
    """

    name: str
    tokens_per_expert: tuple[float, ...]

    @property
    def imbalance(self) -> float:
        """``max / mean`` of the counts (1.0 is perfectly balanced; 0 tokens gives 0.0)."""
        total = sum(self.tokens_per_expert)
        if total == 0:
            return 0.0
        return max(self.tokens_per_expert) * len(self.tokens_per_expert) / total


def _moe_layers(model: nn.Module) -> list[tuple[str, MoE]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, MoE)]


_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _global_counts(
    model: nn.Module, layers: list[tuple[str, MoE]], process_group
) -> list[torch.Tensor]:
    """Each layer's counts, summed over ``process_group``.

    Note: [Counts of pipeline stages]: ranks of different pipeline stages hold
    different MoE layers (or none), yet all of them must join the same
    all-reduces: a first, tiny one agrees on the table's shape (the largest
    layer index and expert count, ``MAX``), then each rank writes its layers'
    counts into the rows of their layer index of an ``(n_layers,
    num_experts)`` table, zeros elsewhere, and one all-reduce sums it; each
    rank reads back the rows of its own layers.
    """
    import torch.distributed as dist

    distributed = (
        dist.is_available() and dist.is_initialized() and dist.get_world_size(process_group) > 1
    )
    if not distributed:
        return [m.tokens_per_expert.detach().float() for _, m in layers]
    matches = [_LAYER_INDEX.search(name) for name, _ in layers]
    if not all(matches):  # not a decoder's layers: every rank holds the same ones
        stacked = torch.stack([m.tokens_per_expert.detach().float() for _, m in layers])
        dist.all_reduce(stacked, group=process_group)  # (L, E)
        return list(stacked.unbind(0))
    index = [int(match.group(1)) for match in matches]
    tensors = itertools.chain(model.buffers(), model.parameters())
    device = next(tensors, torch.empty(0)).device
    shape = torch.tensor(
        [max(index, default=-1) + 1, max((m.num_experts for _, m in layers), default=0)],
        device=device,
    )
    dist.all_reduce(shape, op=dist.ReduceOp.MAX, group=process_group)
    table = torch.zeros(*shape.tolist(), device=device)  # (n_layers, E)
    for i, (_, moe) in zip(index, layers, strict=True):
        table[i] = moe.tokens_per_expert.detach().float()
    dist.all_reduce(table, group=process_group)
    return [table[i] for i in index]


@torch.no_grad()
def update_expert_bias(model: nn.Module, process_group=None) -> list[ExpertLoad]:
    """Update every MoE layer's routing bias from its load, then reset the counts.

    Call after each optimizer step (after all gradient-accumulation
    micro-batches). Layers with ``load_balance`` other than ``"bias"`` only
    report their load and reset their counts.

    Args:
        model: a module containing :class:`~simplefsdp.models.common.moe.MoE` layers (wrapped or not).
        process_group: the group whose token counts are summed (all
            data-parallel ranks); ``None`` is the default group when
            ``torch.distributed`` is initialised, else no reduction.

    Returns:
        The load each layer had, for metrics.
    """
    layers = _moe_layers(model)
    loads = []
    for (name, moe), counts in zip(
        layers, _global_counts(model, layers, process_group), strict=True
    ):
        loads.append(ExpertLoad(name, tuple(counts.tolist())))
        if moe.expert_bias is not None:
            delta = moe.bias_update_rate * torch.sign(counts.mean() - counts)
            moe.expert_bias.add_((delta - delta.mean()).to(moe.expert_bias))
        moe.tokens_per_expert.zero_()
    return loads


def expert_load(model: nn.Module, process_group=None) -> list[ExpertLoad]:
    """The load of each MoE layer since the last reset, without changing anything.

    Args:
        model: a module containing :class:`~simplefsdp.models.common.moe.MoE` layers.
        process_group: as in :func:`update_expert_bias`.
    """
    layers = _moe_layers(model)
    counts = _global_counts(model, layers, process_group)
    return [
        ExpertLoad(name, tuple(c.tolist())) for (name, _), c in zip(layers, counts, strict=True)
    ]


def expert_load_metrics(loads: Sequence[ExpertLoad]) -> dict[str, Any]:
    """The metrics of one step's expert loads (one ``ExpertLoad`` per MoE layer).

    Returns:
        ``moe_imbalance``: the largest ``max / mean`` tokens per expert over
        the layers (1.0: balanced), and ``moe_layers``: per layer name,
        ``tokens_per_expert`` (a list) and its ``imbalance``.
    """
    layers = {
        load.name: {
            "tokens_per_expert": [int(c) for c in load.tokens_per_expert],
            "imbalance": round(load.imbalance, 4),
        }
        for load in loads
    }
    worst = max((entry["imbalance"] for entry in layers.values()), default=None)
    return {"moe_imbalance": worst, "moe_layers": layers}


def after_optimizer_step(model: nn.Module, *, process_group=None) -> dict[str, Any]:
    """The ``ModelSpec.after_optimizer_step`` of a family with
    :class:`~simplefsdp.models.common.moe.MoE` layers: the routing-bias update
    (:func:`update_expert_bias`) and the expert-load metrics it returns."""
    loads = update_expert_bias(model, process_group)
    return expert_load_metrics(loads) if loads else {}


def discard_step_state(model: nn.Module) -> None:
    """The ``ModelSpec.discard_step_state`` of a family with MoE layers: forget
    the tokens routed since the last optimizer step (e.g. a validation pass)."""
    for _, layer in _moe_layers(model):
        layer.tokens_per_expert.zero_()
