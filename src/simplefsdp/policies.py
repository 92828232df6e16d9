"""User-facing policies and modes, validated once at construction."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

import torch

from simplefsdp.parallel_dims import DATA_PARALLEL_MODES as DATA_PARALLEL_MODES
from simplefsdp.parallel_dims import DataParallelMode as DataParallelMode

GradReduceOp = Literal["avg", "sum"]
"""How gradients are combined across data-parallel ranks: DDP's mean, or the sum."""

GRAD_REDUCE_OPS: tuple[str, ...] = get_args(GradReduceOp)

# Mesh dimensionality each mode needs.
MESH_NDIM_FOR_MODE: dict[str, int] = {"replicate": 1, "fully_shard": 1, "hybrid_shard": 2}


def _check_float_dtype(field: str, value: object) -> None:
    if value is None:
        return
    if not isinstance(value, torch.dtype):
        raise TypeError(
            f"MixedPrecisionPolicy.{field} must be a torch.dtype or None, got {value!r} "
            f"({type(value).__name__}); e.g. torch.bfloat16"
        )
    if not value.is_floating_point:
        raise ValueError(
            f"MixedPrecisionPolicy.{field} must be a floating-point dtype, got {value}; "
            "valid choices include torch.float32, torch.bfloat16, torch.float16"
        )


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes for parameter communication/compute, gradient reduction and outputs.

    Stored (master) parameters and optimizer states always keep their original
    dtype; this policy only changes what is communicated and computed.

    Args:
        param_dtype: dtype the stored shard is cast to *before* the all-gather, so
            communication and forward/backward compute run in it. ``None`` keeps
            the parameter's own dtype.
        reduce_dtype: dtype the gradient is reduced in (reduce-scatter /
            all-reduce). The reduced gradient is cast back to the parameter's
            dtype. ``None`` reduces in ``param_dtype`` (or the parameter's dtype
            when ``param_dtype`` is ``None``), as FSDP2 does.
        output_dtype: if set, floating-point tensors returned by the wrapped
            module's ``forward`` are cast to it.
        cast_forward_inputs: if ``True`` (default) and ``param_dtype`` is set,
            floating-point tensors passed to the wrapped module's ``forward`` are
            cast to ``param_dtype`` so that the first layer sees matching dtypes.

    Raises:
        TypeError: a dtype field is not a ``torch.dtype``.
        ValueError: a dtype field is not floating point.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for field in ("param_dtype", "reduce_dtype", "output_dtype"):
            _check_float_dtype(field, getattr(self, field))
        if not isinstance(self.cast_forward_inputs, bool):
            raise TypeError(
                f"MixedPrecisionPolicy.cast_forward_inputs must be a bool, got "
                f"{self.cast_forward_inputs!r}"
            )


def float8_converts(fqn: str, linear: torch.nn.Linear, filter_fqns: Sequence[str]) -> bool:
    """Whether float8 training converts the linear layer ``linear`` named
    ``fqn``: torchtitan's filter, which
    :func:`simplefsdp.convert_linears_to_float8` applies and ``simplefsdp
    plan`` plans. Its name holds none of ``filter_fqns`` (a fragment
    anywhere in the name: ``"output"``, ``"router.gate"``) and both its
    dims are multiples of 16 (``torch._scaled_mm``'s requirement)."""
    if any(name in fqn for name in filter_fqns):
        return False
    return linear.in_features % 16 == 0 and linear.out_features % 16 == 0
