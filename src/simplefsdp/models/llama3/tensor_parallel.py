"""Tensor-parallel (TP) plan of the Llama 3 :class:`~.model.Transformer`.

The plan is the shared decoder's (:mod:`simplefsdp.models.common.tensor_parallel`,
whose docstring says what each entry does): attention and the SwiGLU
feed-forward network split Megatron-style, norms sequence-parallel, the
embedding and the output split over the vocabulary.

Example::

    mesh = init_device_mesh("cuda", (tp,))
    model = apply_tensor_parallel(Transformer(args), mesh, loss_parallel=True)
    with loss_parallel_context(True):
        logits = model(tokens[:, :-1])                   # DTensor, Shard(-1)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle

from simplefsdp.models.common.tensor_parallel import (  # noqa: F401 (re-exported for the llama3 package)
    apply_decoder_tp,
    decoder_plan,
    loss_parallel_context,
)


def tp_split_sizes(model_args: Any, *, loss_parallel: bool = False) -> dict[str, int]:
    """The sizes of a Llama 3 configuration that its TP plan splits over the TP ranks.

    Each must divide by ``tp``.

    Args:
        model_args: a :class:`~.args.ModelArgs`.
        loss_parallel: the output projection is split over the vocabulary.
    """
    sizes = {
        "n_heads": model_args.n_heads,
        "n_kv_heads": model_args.n_kv_heads,
        "feed-forward hidden dim": model_args.ffn_hidden_dim,
    }
    if loss_parallel:
        sizes["vocab_size"] = model_args.vocab_size
    return sizes


def llama3_tp_plan(
    model: nn.Module, *, sequence_parallel: bool = True, loss_parallel: bool = False
) -> dict[str, ParallelStyle]:
    """The tensor-parallel plan of a Llama 3 ``Transformer``: FQN -> style.

    Plain data (see :func:`simplefsdp.models.common.tensor_parallel.decoder_plan`);
    pass it to ``parallelize_module(model, tp_mesh, plan)`` or use
    :func:`apply_tensor_parallel`.

    Args:
        model: The (unsharded) ``Transformer`` or one of its pipeline stages.
        sequence_parallel: Shard activations outside attention / feed-forward
            on the sequence dim.
        loss_parallel: Leave the logits sharded on the vocabulary dim.
    """
    return decoder_plan(model, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)


def apply_tensor_parallel(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    *,
    sequence_parallel: bool = True,
    loss_parallel: bool = False,
) -> nn.Module:
    """Shard a Llama 3 ``Transformer`` over ``tp_mesh`` with :func:`llama3_tp_plan`.

    See :func:`simplefsdp.models.common.tensor_parallel.apply_decoder_tp`
    for the arguments, the run-time sequence-length check and the errors.

    Returns:
        ``model``, parallelized in place.
    """
    return apply_decoder_tp(
        model, tp_mesh, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel
    )
