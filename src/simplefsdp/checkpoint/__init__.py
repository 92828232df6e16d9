"""Distributed checkpoints you can trust: atomic, verified, resharding, pickle-free.

Usable with or without the trainer::

    import simplefsdp.checkpoint as ckpt

    ckpt.save(model, optimizer, "ckpt/step-100", extra_state={"step": 100})
    extra = ckpt.load(model, optimizer, "ckpt/step-100")   # any world size / mode
    manifest = ckpt.verify("ckpt/step-100")                # raises CheckpointError

A run's ``step-N`` folders (what the trainer writes): :class:`Checkpointer`
saves and loads them, keeps the last ``keep_last``; :func:`latest_checkpoint`,
:func:`list_checkpoints` and :func:`prune_checkpoints` find and remove them
(see :mod:`simplefsdp.checkpoint.steps`); with ``async_mode="async"`` or
``"staged"`` its saves finish in the background (Note: [Asynchronous
checkpoints] in :mod:`simplefsdp.checkpoint._async`). ``simplefsdp export`` writes a
checkpoint's full weights to a safetensors file
(:mod:`simplefsdp.checkpoint.export`). Test-only fault hooks are in
:mod:`simplefsdp._faults`.

Note: [Checkpoint folder]
    A checkpoint is a folder holding torch.distributed.checkpoint (DCP) files
    (``.metadata`` and one or more ``*.distcp`` shards per rank: the model,
    the optimizer's state tensors and each rank's RNG states, under plain
    parameter names, as ``get_state_dict`` of torch FSDP2 names them), JSON
    files for everything that is not a tensor, and ``manifest.json``, written
    last: step, world size, config hash and every file's size and SHA-256.
    See [Atomic publish] for how it appears atomically and [Loading never runs
    checkpoint code] for why loading cannot execute code from it.
"""

from simplefsdp.checkpoint._api import EXTRA_STATE_NAME, barrier, load, save, verify
from simplefsdp.checkpoint._async import ASYNC_MODES, AsyncCheckpointWriter, PendingSave
from simplefsdp.checkpoint._files import (
    MANIFEST_NAME,
    CheckpointError,
    build_manifest,
    fsync_dir,
    read_json,
    read_manifest,
    write_json_atomic,
)
from simplefsdp.checkpoint._safe_reader import SafeFileSystemReader, TensorOnlyLoadPlanner
from simplefsdp.checkpoint.steps import (
    CONFIG_NAME,
    TRAINER_STATE_NAME,
    Checkpointer,
    CheckpointInfo,
    CheckpointScan,
    DamagedCheckpointError,
    damaged_checkpoint_error,
    latest_checkpoint,
    list_checkpoints,
    prune_checkpoints,
    resume_checkpoint,
    scan_checkpoints,
    step_dir_name,
    verify_checkpoint,
)

# isort: split
# export imports the names above from this package
from simplefsdp.checkpoint.export import model_args_from_config

__all__ = [
    "CheckpointError",
    "load",
    "model_args_from_config",
    "save",
    "verify",
]
