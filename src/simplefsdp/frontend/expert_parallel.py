"""Expert parallelism: a torch ``ParallelStyle`` for an experts module.

Note: [Expert parallelism]
``parallelize_module(experts, ep_mesh, ExpertParallel())`` shards every
parameter of ``experts`` on its dim 0 (the experts dim) over the 1-D
``ep_mesh``: each rank holds ``num_experts / ep`` consecutive experts, as
DTensors ``Shard(0)``. The module's forward must take ``(tokens sorted by
expert (R, D), num_tokens_per_expert (E,))`` and use the local tensors of its
parameters (``.to_local()``), the convention of torchtitan's
``GroupedExperts`` (and of :class:`simplefsdp.models.common.moe.GroupedExperts`).

Around that forward the style

1. exchanges the per-expert token counts with an all-to-all, so each rank
   learns how many tokens every other rank sends to each of its experts;
2. dispatches the tokens (already sorted by expert, hence by owner rank) with
   an all-to-all with uneven splits (autograd-capable: its backward is the
   reverse all-to-all), then reorders them from (source rank, expert) to
   (expert, source rank) order so each local expert's tokens are contiguous;
3. calls the module on its local experts;
4. undoes the reorder and combines the outputs back to the ranks the tokens
   came from with the reverse all-to-all.

Gradients: an expert's weight gradient sums the contributions of the tokens
of every rank of its EP group. Data parallelism averages gradients over
ranks (``reduce_op="avg"``), so with ``grad_reduce="avg"`` (default) the
style divides the expert-weight gradient by ``ep`` (and only it: the token
gradient is unchanged), which makes expert gradients, once averaged over the
data-parallel ranks holding the same experts, equal to the gradient of the
mean loss over all data-parallel ranks, like the dense parameters'.
``grad_reduce="sum"`` leaves them summed (pair it with ``reduce_op="sum"``).

The split sizes are data-dependent: they are read to the host
(``.tolist()``) and the expert computation sees a token count that changes
step to step and differs between ranks (Note: [Expert parallelism under
torch.compile]).

Note: [Expert parallelism under torch.compile]
    Compiled, the host read would be a graph break, and what follows it
    would be traced with this step's split sizes and token counts as inputs:
    Dynamo guards on their values (``sum(output_splits) == 953``) and on the
    tokens' sizes, and recompiles the frames after the break whenever they
    change. Each rank recompiles on its own data, so one rank reaches
    ``torch._dynamo.config.recompile_limit`` first and runs that frame
    uncompiled: its expert-weight all-gathers no longer pair with the other
    ranks' compiled ones (``RankDivergenceError``, or a collective
    mismatch). So the style's forward (counts exchange, dispatch, the local
    experts, combine) is ``torch.compiler.disable``d: no data-dependent size
    ever reaches a traced frame, the graphs before and after it have the
    sizes of the rank's batch alone (``(B*T*top_k, D)``), and nothing
    recompiles per step. The expert weights are then read eagerly, one
    all-gather per parameter in module order on every rank (each recorded
    for Note: [Same gathers on every rank]); the dense layers, the router and
    the shared experts stay compiled and bucketed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

logger = logging.getLogger(__name__)


#: Set on an experts module by ``ExpertParallel``: its ep mesh. ``data_parallel``
#: shards that module's parameters over its ``expert_mesh`` instead of ``mesh``.
EP_MESH_ATTR = "_simplefsdp_ep_mesh"

GRAD_REDUCES = ("avg", "sum")


def check_expert_parallel_layout(num_experts: int, ep: int, dp: int | None = None) -> None:
    """Validate an expert-parallel layout; raise one line naming what is wrong.

    Args:
        num_experts: routed experts per MoE layer.
        ep: expert-parallel degree.
        dp: data-parallel ranks the EP groups are carved from (``None``: not
            checked). EP borrows from data parallelism: ``ep`` must divide it.

    Raises:
        ValueError: ``ep`` not a positive int, ``num_experts`` not divisible
            by ``ep``, or ``ep`` not dividing ``dp``.
    """
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise ValueError(f"ep must be an int >= 1, got {ep!r}")
    if num_experts % ep:
        valid = [d for d in range(1, num_experts + 1) if num_experts % d == 0]
        raise ValueError(
            f"num_experts={num_experts} is not divisible by ep={ep}; valid ep: "
            f"{', '.join(map(str, valid))}"
        )
    if dp is not None and dp % ep:
        valid = [d for d in range(1, dp + 1) if dp % d == 0 and num_experts % d == 0]
        raise ValueError(
            f"ep={ep} does not divide the {dp} data-parallel ranks; expert parallelism "
            f"splits them into groups of ep: valid ep: {', '.join(map(str, valid))}"
        )


class _ScaleGrad(torch.autograd.Function):
    """Identity in forward; multiplies the gradient by ``scale`` in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


def _expert_major_index(received: torch.Tensor, total: int) -> torch.Tensor:
    """Index turning (source rank, expert) order into (expert, source rank) order.

    ``received``: ``(ep, e)`` token counts; ``total`` their sum. Row ``i`` of
    the result is the position, in the received buffer, of the ``i``-th token
    in expert-major order.
    """
    sizes = received.reshape(-1)  # (ep*e,) rank-major
    starts = torch.cumsum(sizes, 0) - sizes  # (ep*e,) start of each block in the buffer
    sizes_em = received.t().reshape(-1)  # (e*ep,) expert-major
    starts_em = starts.view_as(received).t().reshape(-1)
    offsets_em = torch.cumsum(sizes_em, 0) - sizes_em  # where each block goes
    shift = torch.repeat_interleave(starts_em - offsets_em, sizes_em, output_size=total)
    return shift + torch.arange(total, device=received.device)


class ExpertParallel(ParallelStyle):
    """Shard an experts module's experts over a 1-D mesh and route tokens to them.

    Use with ``torch.distributed.tensor.parallel.parallelize_module`` on each
    experts module (see Note: [Expert parallelism] in this file)::

        parallelize_module(moe.experts, mesh["ep"], ExpertParallel())

    Args:
        grad_reduce: ``"avg"`` (default) divides expert-weight gradients by
            ``ep`` to match data-parallel averaging; ``"sum"`` does not.

    Raises:
        ValueError: (when applied) a 1-D mesh is not given, a parameter's dim
            0 is not divisible by the mesh size (``num_experts`` not
            divisible by ``ep``), or the module has no parameters.
    """

    def __init__(self, *, grad_reduce: str = "avg") -> None:
        super().__init__()
        if grad_reduce not in GRAD_REDUCES:
            raise ValueError(f"grad_reduce must be one of {GRAD_REDUCES}, got {grad_reduce!r}")
        self.grad_reduce = grad_reduce

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if device_mesh.ndim != 1:
            raise ValueError(
                f"ExpertParallel needs a 1-D expert-parallel mesh, got a {device_mesh.ndim}-D "
                f"mesh {tuple(device_mesh.shape)}; pass mesh['ep']"
            )
        ep = device_mesh.size()
        params = list(module.named_parameters(recurse=False))
        if not params:
            raise ValueError(f"{type(module).__name__} has no parameters to shard over experts")
        for name, param in params:
            num_experts = param.shape[0] if param.ndim else 0
            if param.ndim == 0 or num_experts % ep:
                raise ValueError(
                    f"{type(module).__name__}.{name} has shape {tuple(param.shape)}: its dim 0 "
                    f"(num_experts={num_experts}) is not divisible by ep={ep}"
                )
            if isinstance(param, DTensor):
                raise ValueError(
                    f"{type(module).__name__}.{name} is already a DTensor; apply ExpertParallel "
                    "before data_parallel and any other parallelism of the experts"
                )
            src = None if param.device.type == "meta" else 0
            tensor = param.detach()
            if src is not None and tensor.device.type != device_mesh.device_type:
                tensor = tensor.to(device_mesh.device_type)
            sharded = distribute_tensor(tensor, device_mesh, [Shard(0)], src_data_rank=src)
            module.register_parameter(name, nn.Parameter(sharded, param.requires_grad))
        inner_forward = module.forward
        grad_scale = 1.0 / ep if self.grad_reduce == "avg" else 1.0
        group = device_mesh.get_group()

        # Note: [Expert parallelism under torch.compile]
        @torch.compiler.disable
        def forward(tokens: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
            return _dispatch_compute_combine(
                inner_forward, tokens, num_tokens_per_expert, group, ep, grad_scale
            )

        module.forward = forward
        module.__dict__[EP_MESH_ATTR] = device_mesh
        logger.debug("ExpertParallel: %s over ep=%d", type(module).__name__, ep)
        return module


def _dispatch_compute_combine(
    inner_forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    tokens: torch.Tensor,
    num_tokens_per_expert: torch.Tensor,
    group,
    ep: int,
    grad_scale: float,
) -> torch.Tensor:
    """Dispatch ``tokens`` (sorted by expert) to their experts' ranks, run the
    local experts, and combine the outputs back in the input order."""
    import torch.distributed._functional_collectives as funcol

    counts = num_tokens_per_expert.to(torch.int64)
    if counts.numel() % ep:
        raise ValueError(
            f"num_tokens_per_expert has {counts.numel()} entries, not divisible by ep={ep}"
        )
    received = funcol.all_to_all_single(counts, None, None, group)  # (ep * e,)
    received = received.view(ep, -1)  # (ep, e): row r = from rank r
    input_splits = counts.view(ep, -1).sum(1).tolist()  # tokens sent to each rank
    output_splits = received.sum(1).tolist()  # tokens received from each rank
    total = sum(output_splits)
    dispatched = funcol.all_to_all_single_autograd(
        tokens.contiguous(), output_splits, input_splits, group
    )  # (total, D), (source rank, expert) order
    index = _expert_major_index(received, total)  # (total,)
    routed = dispatched[index]  # (total, D), (expert, source rank) order
    if grad_scale != 1.0:
        routed = _ScaleGrad.apply(routed, 1.0 / grad_scale)
    out = inner_forward(routed, received.sum(0))  # (total, D)
    if grad_scale != 1.0:
        out = _ScaleGrad.apply(out, grad_scale)
    restored = torch.empty_like(out).index_copy(0, index, out)  # (source rank, expert) order
    return funcol.all_to_all_single_autograd(restored, input_splits, output_splits, group)


def build_expert_parallel_mesh(
    device_type: str, dp: int, ep: int, num_experts: int
) -> tuple[DeviceMesh, DeviceMesh]:
    """The ``(dp_shard_mod_ep, ep)`` mesh over ``dp`` ranks and its flattening: a
    convenience over ``simplefsdp.layout.Layout(dp_shard=dp, ep=ep).build()``.

    Consecutive ranks form an EP group (they exchange tokens by all-to-all);
    rank ``r`` holds experts ``(r % ep) * E / ep`` onwards.

    Args:
        device_type: ``"cpu"`` (gloo) or ``"cuda"``.
        dp: data-parallel ranks (the world size without other parallelism).
        ep: expert-parallel degree; must divide ``dp`` and ``num_experts``.
        num_experts: routed experts per MoE layer.

    Returns:
        ``(mesh, dp_mesh)``: the layout's world mesh (``mesh["ep"]``,
        ``mesh["dp_shard_mod_ep"]``) and its FSDP mesh over all its ranks.

    Raises:
        ValueError: a bad layout (see :func:`check_expert_parallel_layout`),
            checked before any process group is made.
    """
    from simplefsdp.layout import Layout

    check_expert_parallel_layout(num_experts, ep, dp)
    if ep == 1:
        raise ValueError("ep=1 needs no expert-parallel mesh; use Layout(dp_shard=dp).build()")
    meshes = Layout(dp_shard=dp, ep=ep).build(device_type, dp)
    return meshes.world, meshes.fsdp


def apply_expert_parallel(
    model: nn.Module,
    ep_mesh: DeviceMesh,
    is_experts: Callable[[str, nn.Module], bool] | None = None,
) -> list[str]:
    """Apply :class:`ExpertParallel` to every experts module of ``model``.

    Args:
        model: the model, before ``data_parallel``.
        ep_mesh: the 1-D expert-parallel mesh.
        is_experts: ``(name, module) -> bool`` choosing the experts modules;
            default: submodules registered under the name ``experts`` (as in
            ``layers.1.moe.experts``).

    Returns:
        The names of the modules it applied to.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    def default(name: str, _module: nn.Module) -> bool:
        return name.rsplit(".", 1)[-1] == "experts"

    chosen = [
        (name, module)
        for name, module in model.named_modules()
        if name and (is_experts or default)(name, module)
    ]
    for _, module in chosen:
        parallelize_module(module, ep_mesh, ExpertParallel())
    return [name for name, _ in chosen]


def expert_parallel_params(
    module: nn.Module, expert_mesh: DeviceMesh | None, mode: str
) -> tuple[dict[int, DeviceMesh], DeviceMesh | None]:
    """The parameters ``ExpertParallel`` sharded in ``module`` (``id`` -> ep
    mesh) and their ep mesh, checked against ``data_parallel``'s
    ``expert_mesh`` and ``mode`` (Note: [Expert parallelism]).

    Raises:
        ValueError: experts without ``expert_mesh`` or the reverse, more than
            one ep mesh, ``hybrid_shard`` or a 2-D ``expert_mesh``, or meshes
            that are not differently named slices of one mesh.
    """
    from simplefsdp._compat import slices_of_one_mesh

    found: dict[int, DeviceMesh] = {}
    for sub in module.modules():
        ep_mesh = sub.__dict__.get(EP_MESH_ATTR)
        if ep_mesh is not None:
            found.update({id(p): ep_mesh for p in sub.parameters(recurse=False)})
    if not found:
        if expert_mesh is not None:
            raise ValueError(
                f"expert_mesh was given but {type(module).__name__} has no experts sharded by "
                "ExpertParallel; apply parallelize_module(experts, mesh['ep'], "
                "ExpertParallel()) first, or leave expert_mesh out"
            )
        return found, None
    meshes = set(found.values())
    if len(meshes) > 1:
        raise ValueError("ExpertParallel was applied on different meshes; use one ep mesh")
    (ep_mesh,) = meshes
    if expert_mesh is None:
        raise ValueError(
            f"{type(module).__name__} holds experts sharded by ExpertParallel; pass "
            "expert_mesh=mesh['dp_shard_mod_ep'] (the data-parallel ranks that hold the same "
            "experts) to data_parallel"
        )
    if mode == "hybrid_shard" or expert_mesh.ndim != 1:
        raise ValueError(
            f"expert_mesh must be a 1-D mesh with mode 'fully_shard' or 'replicate', got a "
            f"{expert_mesh.ndim}-D mesh with mode {mode!r}"
        )
    shared = set(expert_mesh.mesh_dim_names or ()) & set(ep_mesh.mesh_dim_names or ())
    if not slices_of_one_mesh(expert_mesh, ep_mesh) or shared:
        raise ValueError(
            f"expert_mesh {expert_mesh.mesh_dim_names} and the ep mesh "
            f"{ep_mesh.mesh_dim_names} must be differently named slices of one mesh, e.g. "
            "init_device_mesh(..., (dp_shard_mod_ep, ep), mesh_dim_names=('dp_shard_mod_ep', "
            "'ep'))"
        )
    return found, ep_mesh
