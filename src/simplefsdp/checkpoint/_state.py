"""The tensors a checkpoint holds: model, optimizer state, per-rank RNG states.

Note: [State dicts without all-gathers]
    ``get_state_dict``/``set_state_dict`` resolve every parameter name with
    ``getattr(module, name)``. On a ``simplefsdp.data_parallel`` model that
    read goes through the parametrization, i.e. an all-gather of the full
    parameter per name (and a hang if a peer died). Both calls therefore run
    under ``simplefsdp.disable_parametrization()``, where the read returns the
    stored shard (a DTensor); other engines (torch FSDP2, DDP, plain modules)
    are unaffected by it. The state dicts use plain parameter names, so a
    checkpoint of a simplefsdp model and one of the same model under FSDP2
    hold the same keys.

Note: [Tensor-only optimizer state]
    The optimizer's ``state`` (``exp_avg``, ``exp_avg_sq``, ``step``, ... per
    parameter name) is all tensors and is handed to DCP; its
    ``param_groups`` (hyper-parameters, parameter names) are not: they come
    from the code that builds the optimizer, and DCP would pickle them (see
    [Loading never runs checkpoint code]).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from simplefsdp.frontend import disable_parametrization
from simplefsdp.frontend.float8 import plain_float8_weights


def rank_and_world() -> tuple[int, int]:
    """``(rank, world_size)`` of the default process group, ``(0, 1)`` without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def rng_key(rank: int) -> str:
    """Key of ``rank``'s RNG states under the checkpoint's ``rng`` section."""
    return f"rank{rank}"


def model_device(model: nn.Module) -> torch.device:
    """The device of ``model``'s first parameter or buffer (CPU if it has none)."""
    for tensor in (*model.parameters(), *model.buffers()):
        return tensor.device
    return torch.device("cpu")


def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    """This process's CPU RNG state, and the CUDA one of ``device`` if it is a GPU."""
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    """Restore an :func:`rng_state` (CPU always, CUDA when saved and on a GPU)."""
    torch.set_rng_state(state["cpu"].cpu())
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)


def tensor_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    rng_device: torch.device | None,
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """``(dcp_state, full_optimizer_state_dict)``; ``dcp_state`` holds tensors only.

    ``dcp_state`` is ``{"model": ..., "optim": {"state": ...}, "rng": {"rankR": ...}}``
    (``optim`` only with an optimizer, ``rng`` only with ``rng_device``). The
    model and optimizer entries are this rank's shards (DTensors for sharded
    models), read without communication (see [State dicts without all-gathers]).
    """
    with disable_parametrization():
        if optimizer is None:
            model_sd, optim_sd = get_model_state_dict(model), None
        else:
            model_sd, optim_sd = get_state_dict(model, optimizer)
    # torchao float8 weights are saved as their plain tensors (Note: [Float8 all-gather]).
    state: dict[str, Any] = {"model": plain_float8_weights(model_sd)}
    if optim_sd is not None:
        # see [Tensor-only optimizer state]
        state["optim"] = {"state": plain_float8_weights(optim_sd["state"])}
    if rng_device is not None:
        state["rng"] = {rng_key(rank_and_world()[0]): rng_state(rng_device)}
    return state, optim_sd


def apply_tensor_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    state: dict[str, Any],
    optim_sd: dict[str, Any] | None,
) -> None:
    """Copy loaded ``state`` (from :func:`tensor_state`, filled by ``dcp.load``) into place."""
    with disable_parametrization():  # see [State dicts without all-gathers]
        if optimizer is None or optim_sd is None:
            set_model_state_dict(model, state["model"])
            return
        optim_sd["state"] = state["optim"]["state"]
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=optim_sd)
