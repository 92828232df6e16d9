"""What a model's ``data_parallel`` wrapping says about its process groups,
for the compiler backend (none of it communicates)."""

from __future__ import annotations

import torch.distributed as dist
import torch.nn as nn

from simplefsdp.compiler.patterns import ALL_DATA_PARALLEL, CollectiveGroups


def mesh_groups(model: nn.Module) -> list:
    """The process groups of the model's data-parallel mesh (and submeshes)."""
    from simplefsdp.frontend.data_parallel import get_data_parallel_state

    try:
        state = get_data_parallel_state(model)
    except ValueError:
        return []
    groups = [state.mesh.get_group(dim) for dim in range(state.mesh.ndim)]
    for spec in state.param_specs.values():
        if spec.shard_mesh is not None:
            groups.append(spec.shard_mesh.get_group())
            break
    return groups


def group_backends(groups: list) -> dict[str, str]:
    """Process-group name -> its backend string (``dist.get_backend``)."""
    backends = {}
    for group in groups:
        try:
            backends[group.group_name] = str(dist.get_backend(group))
        except (RuntimeError, ValueError, AttributeError):  # not a registered c10d group
            continue
    return backends


def tp_mesh_groups(model: nn.Module) -> list:
    """The process groups of the model's tensor-parallel mesh (none: 1-D)."""
    from simplefsdp.frontend.data_parallel import get_data_parallel_state

    try:
        tp_mesh = get_data_parallel_state(model).tp_mesh
    except ValueError:
        return []
    if tp_mesh is None:
        return []
    return [tp_mesh.get_group(dim) for dim in range(tp_mesh.ndim)]


def ep_mesh_groups(model: nn.Module) -> list:
    """The process groups of the expert-parallel mesh ``ExpertParallel``
    sharded ``model``'s experts over (none without experts)."""
    from simplefsdp.frontend.expert_parallel import EP_MESH_ATTR

    meshes = {}
    for module in model.modules():
        mesh = module.__dict__.get(EP_MESH_ATTR)
        if mesh is not None:
            meshes[id(mesh)] = mesh
    return [mesh.get_group(dim) for mesh in meshes.values() for dim in range(mesh.ndim)]


def collective_groups(model: nn.Module) -> CollectiveGroups:
    """Which process groups of ``model``'s graphs are data parallel (the
    mesh's dim groups and the hybrid submeshes' groups), which tensor
    parallel (the TP mesh's) and which expert parallel (the ep mesh's; Note:
    [All-to-alls of expert parallelism]). Not wrapped: every collective counts as data
    parallel (Note: [Data-parallel collectives only])."""
    from simplefsdp.frontend.data_parallel import get_data_parallel_state

    try:
        state = get_data_parallel_state(model)
    except ValueError:
        return ALL_DATA_PARALLEL
    meshes = [state.mesh]
    for spec in state.param_specs.values():
        meshes.extend(m for m in (spec.replicate_mesh, spec.shard_mesh) if m is not None)
        if spec.tp is not None:
            meshes.append(spec.tp.dp_mesh)
    dp = {m.get_group(dim).group_name for m in dict.fromkeys(meshes) for dim in range(m.ndim)}
    dp |= {g.group_name for g in state.reshard_groups.values()}  # Note: [Partial resharding]
    tp = {g.group_name for g in tp_mesh_groups(model)}
    ep = {g.group_name for g in ep_mesh_groups(model)}
    return CollectiveGroups(
        data_parallel=frozenset(dp),
        tensor_parallel=frozenset(tp - dp),
        expert_parallel=frozenset(ep - dp),
    )


def reshard_groups_of(model: nn.Module, reshard_after_forward: bool | int) -> dict:
    """The model's groups for ``reshard_after_forward=N`` (Note: [Partial resharding])."""
    from simplefsdp.frontend.data_parallel import get_data_parallel_state

    if isinstance(reshard_after_forward, bool):
        return {}
    try:
        state = get_data_parallel_state(model)
    except ValueError:
        state = None
    if state is None or state.reshard_after_forward != reshard_after_forward:
        raise ValueError(
            f"reshard_after_forward={reshard_after_forward} needs the model wrapped with "
            f"simplefsdp.data_parallel(..., reshard_after_forward={reshard_after_forward}), "
            "which makes the smaller groups"
        )
    return dict(state.reshard_groups)


def mesh_device_type(model: nn.Module) -> str | None:
    """The device type of the model's data-parallel mesh (``None``: not wrapped)."""
    from simplefsdp.frontend.data_parallel import get_data_parallel_state

    try:
        return get_data_parallel_state(model).mesh.device_type
    except ValueError:
        return None
