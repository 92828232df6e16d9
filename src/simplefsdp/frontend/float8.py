"""Float8 all-gathers for torchao float8 training weights.

Note: [Float8 all-gather]
    ``torchao.float8.convert_to_float8_training`` with
    ``Float8LinearConfig(enable_fsdp_float8_all_gather=True)`` (tensorwise
    dynamic scaling) stores each converted ``Float8Linear`` weight as a
    ``WeightWithDynamicFloat8CastTensor``. FSDP2 finds that subclass's
    ``fsdp_pre_all_gather``/``fsdp_post_all_gather`` hooks and gathers the
    weight in float8; our parametrization reads parameters through DTensor
    instead, so it recognises the subclass here and does the same in the
    traced read, where the compiler sees every step:

    1. amax of this rank's shard, all-reduced with MAX over the
       data-parallel mesh (the whole tensor's amax);
    2. the scale from that amax (torchao's ``amax_to_scale``), and the shard
       cast to float8 with it (torchao's ``hp_tensor_and_scale_to_float8``:
       saturated cast, gradient passed through unchanged);
    3. the float8 shard all-gathered as a DTensor ``Shard -> Replicate``
       redistribute (torchao implements the all-gather of its
       ``Float8TrainingTensor`` by gathering the float8 data), whose backward
       reduce-scatters the high-precision weight gradient as for any other
       parameter (in ``reduce_dtype``).

    The result is a ``Float8TrainingTensor`` with the whole tensor's scale
    and ``param_dtype`` as its original dtype, which ``Float8Linear``'s
    matmul consumes as an already-cast weight, as it does FSDP2's. The cast
    reads the stored (fp32) shard, as FSDP2's pre-all-gather hook does. The
    float8 data, the scale and hence the matmul are the same as when the
    high-precision weight is gathered first and cast by the matmul (amax,
    scale and a per-element cast do not depend on where the tensor is split).

    Weights that take this path: tensorwise-scaled ``Float8Linear`` weights on
    a 1-D ``fully_shard`` mesh whose dim 0 divides evenly among the ranks,
    read outside ``no_sync``. Others (``replicate``, ``hybrid_shard``,
    tensor-parallel 2-D weights, uneven shards, reads that accumulate
    unreduced gradients) gather in ``param_dtype`` as before and the matmul
    casts them: same numerics, high-precision bytes. Rowwise recipes never
    wrap the weight (torchao gathers those in bf16 under FSDP2 too).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor, Shard

from simplefsdp.policies import float8_converts

# The functional collectives under their torch >= 2.12 names (same signatures).
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
_reduce_scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor
_WEIGHT_CLASS_NAME = "WeightWithDynamicFloat8CastTensor"


def convert_linears_to_float8(
    model: torch.nn.Module, recipe: str = "tensorwise", filter_fqns: str = "output"
) -> torch.nn.Module:
    """torchao's ``convert_to_float8_training`` of ``model`` with ``recipe``
    (``"tensorwise"``: dynamic tensorwise scaling with float8 all-gathers, Note:
    [Float8 all-gather]; ``"rowwise"``: torchao's rowwise recipe, gathered in
    ``param_dtype`` as under FSDP2), skipping modules whose name contains one
    of the comma-separated ``filter_fqns`` and layers whose dims are not
    multiples of 16 (torchtitan's filter). Works on a meta-device model; call
    it before :func:`simplefsdp.data_parallel`.

    Raises:
        ValueError: torchao is not installed (one line naming the extra), or
            an unknown ``recipe``.
    """
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as e:
        raise ValueError('float8 training needs torchao: pip install -e ".[float8]"') from e
    if recipe == "tensorwise":
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    elif recipe == "rowwise":
        config = Float8LinearConfig.from_recipe_name(recipe)
    else:
        raise ValueError(f"float8 recipe: invalid value {recipe!r}; valid: 'tensorwise', 'rowwise'")
    skipped = [name.strip() for name in filter_fqns.split(",") if name.strip()]

    def keep(module: torch.nn.Module, fqn: str) -> bool:
        return float8_converts(fqn, module, skipped)

    return convert_to_float8_training(model, config=config, module_filter_fn=keep)


def is_float8_weight(param: torch.Tensor) -> bool:
    """Whether ``param`` (a stored DTensor or a plain tensor) holds a torchao
    float8-all-gather weight (``WeightWithDynamicFloat8CastTensor``)."""
    local = param._local_tensor if isinstance(param, DTensor) else param
    return type(local).__name__ == _WEIGHT_CLASS_NAME


def float8_gather_applies(param: DTensor, spec) -> bool:
    """Whether ``param`` (with ``ParamSpec`` ``spec``) is gathered in float8:
    see Note: [Float8 all-gather] for which weights."""
    if spec.tp is not None or spec.shard_mesh is not None:
        return False
    if not is_float8_weight(param):
        return False
    placements = spec.placements
    if len(placements) != 1 or not isinstance(placements[0], Shard) or placements[0].dim != 0:
        return False
    return param.shape[0] % param.device_mesh.size() == 0


class _Float8AllGather(torch.autograd.Function):
    """Forward: cast the shard to float8 with ``scale`` and all-gather its
    bytes. Returns ``(anchor, data)``: ``data`` the gathered float8 tensor (no
    gradient), ``anchor`` a zero-storage high-precision tensor of the gathered
    shape that carries the weight gradient. Backward: reduce-scatter the
    gradient arriving at ``anchor``."""

    @staticmethod
    def forward(ctx, local, scale, mesh, float8_dtype, orig_dtype, reduce):
        from torchao.float8.float8_utils import to_fp8_saturated

        ctx.mesh, ctx.reduce, ctx.local_dtype = mesh, reduce, local.dtype
        bits = to_fp8_saturated(local.to(torch.float32) * scale, float8_dtype)
        # Float8 travels as its bytes: gloo has no float8 type (NCCL moves the
        # same bytes either way).
        gathered = _all_gather(bits.view(torch.uint8), 0, (mesh, 0))
        data = funcol.wait_tensor(gathered).view(float8_dtype)
        anchor = local.new_zeros((), dtype=orig_dtype).expand(data.shape)
        ctx.mark_non_differentiable(data)
        return anchor, data

    @staticmethod
    def backward(ctx, grad, _):
        reduce_dtype, reduce_op = ctx.reduce
        grad = grad.to(reduce_dtype or grad.dtype).contiguous()
        # The reduce op of every other parameter's reduce-scatter (DTensor's
        # Partial): the compiler buckets them together.
        shard = funcol.wait_tensor(_reduce_scatter(grad, reduce_op, 0, (ctx.mesh, 0)))
        return shard.to(ctx.local_dtype), None, None, None, None, None


class _AsFloat8Weight(torch.autograd.Function):
    """The gathered float8 ``data`` and its ``scale`` as torchao's
    ``Float8TrainingTensor`` weight; the gradient passes to ``anchor``."""

    @staticmethod
    def forward(ctx, anchor, data, scale, mm_config):
        from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole

        return Float8TrainingTensor(
            data, scale, anchor.dtype, mm_config, gemm_input_role=GemmInputRole.WEIGHT
        )

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None, None


def float8_gather(param: DTensor, spec) -> torch.Tensor:
    """The gathered ``Float8TrainingTensor`` for ``param``: Note: [Float8 all-gather].

    Args:
        param: the stored sharded DTensor (``Shard(0)`` on a 1-D mesh) whose
            local tensor is a ``WeightWithDynamicFloat8CastTensor``.
        spec: its ``ParamSpec`` (``param_dtype``, ``reduce_dtype`` and
            ``grad_placements`` are honoured).
    """
    from torchao.float8.float8_utils import amax_to_scale

    wrapper = param._local_tensor
    float8_dtype = wrapper._dtype
    mesh = param.device_mesh
    local = param.to_local()
    with torch.no_grad():
        amax = torch.linalg.vector_norm(local, ord=float("inf")).to(torch.float32)
        amax = funcol.wait_tensor(funcol.all_reduce(amax, "max", (mesh, 0)))
        scale = amax_to_scale(amax, float8_dtype)
    orig_dtype = spec.param_dtype or local.dtype
    reduce = (spec.reduce_dtype, spec.grad_placements[0].reduce_op)
    anchor, data = _Float8AllGather.apply(local, scale, mesh, float8_dtype, orig_dtype, reduce)
    return _AsFloat8Weight.apply(anchor, data, scale, wrapper._linear_mm_config)


def plain_float8_weights(tree: Any) -> Any:
    """``tree`` (a state dict, nested dicts/lists) with every torchao
    float8-all-gather weight (and optimizer state shaped like one) replaced by
    its plain high-precision tensor, sharing storage.

    Checkpoints then hold plain tensors that load into float8 and
    high-precision models alike (and need no torchao to read).
    """
    if isinstance(tree, dict):
        return {key: plain_float8_weights(value) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(plain_float8_weights(value) for value in tree)
    if isinstance(tree, DTensor) and is_float8_weight(tree):
        return DTensor.from_local(
            tree._local_tensor._tensor,
            tree.device_mesh,
            tree.placements,
            run_check=False,
            shape=tree.shape,
            stride=tree.stride(),
        )
    if isinstance(tree, torch.Tensor) and is_float8_weight(tree):
        return tree._tensor
    return tree
