"""Expert parallelism plus data parallelism for :class:`~.model.Transformer`.

The torch-side composition (like :mod:`simplefsdp.models.llama3.tensor_parallel`
for tensor parallelism): build the ``(dp_shard_mod_ep, ep)`` mesh, apply
:class:`simplefsdp.frontend.expert_parallel.ExpertParallel` to every
:class:`~.model.GroupedExperts`, then ``data_parallel`` with the dense
parameters over all data-parallel ranks and the experts over the ranks that
hold the same experts.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .model import MoE

__all__ = ["apply_expert_parallel", "build_expert_parallel_mesh", "parallelize_moe"]


def build_expert_parallel_mesh(
    device_type: str, dp: int, ep: int, num_experts: int
) -> tuple[DeviceMesh, DeviceMesh]:
    """The ``(dp_shard_mod_ep, ep)`` mesh over ``dp`` ranks and its flattening.

    Rank ``r`` is in EP group ``r // ep`` (consecutive ranks share tokens by
    all-to-all) and holds experts ``(r % ep) * E / ep ..``.

    Args:
        device_type: ``"cpu"`` (gloo) or ``"cuda"``.
        dp: data-parallel ranks (the world size without other parallelism).
        ep: expert-parallel degree; must divide ``dp`` and ``num_experts``.
        num_experts: routed experts per MoE layer.

    Returns:
        ``(mesh, dp_mesh)``: the 2-D mesh (``mesh["ep"]``,
        ``mesh["dp_shard_mod_ep"]``) and the 1-D mesh ``"dp"`` over all ranks.

    Raises:
        ValueError: a bad layout (see ``check_expert_parallel_layout``).
    """
    from simplefsdp.frontend.expert_parallel import check_expert_parallel_layout

    check_expert_parallel_layout(num_experts, ep, dp)
    mesh = init_device_mesh(device_type, (dp // ep, ep), mesh_dim_names=("dp_shard_mod_ep", "ep"))
    dp_mesh = mesh[("dp_shard_mod_ep", "ep")]._flatten("dp")
    return mesh, dp_mesh


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh) -> nn.Module:
    """Apply ``ExpertParallel`` to the experts of every :class:`~.model.MoE` in ``model``.

    Args:
        model: a module with MoE layers (before ``data_parallel``).
        ep_mesh: the 1-D expert-parallel mesh.

    Returns:
        ``model``, modified in place.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    from simplefsdp.frontend.expert_parallel import ExpertParallel

    for module in model.modules():
        if isinstance(module, MoE):
            parallelize_module(module.experts, ep_mesh, ExpertParallel())
    return model


def parallelize_moe(
    model: nn.Module, mesh: DeviceMesh, dp_mesh: DeviceMesh, **data_parallel_kwargs: Any
) -> nn.Module:
    """Expert parallelism over ``mesh["ep"]``, then ``data_parallel`` on two meshes.

    Args:
        model: the MoE model (may be on the meta device).
        mesh, dp_mesh: from :func:`build_expert_parallel_mesh`.
        **data_parallel_kwargs: passed to ``simplefsdp.data_parallel``
            (``mode``, ``mp_policy``, ``reshard_after_forward``, ...).

    Returns:
        ``model``, wrapped in place.
    """
    import simplefsdp

    apply_expert_parallel(model, mesh["ep"])
    return simplefsdp.data_parallel(
        model, dp_mesh, expert_mesh=mesh["dp_shard_mod_ep"], **data_parallel_kwargs
    )
