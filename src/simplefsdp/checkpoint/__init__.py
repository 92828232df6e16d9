"""Distributed checkpoints you can trust: atomic, verified, resharding, pickle-free.

Usable with or without the trainer::

    import simplefsdp.checkpoint as ckpt

    ckpt.save(model, optimizer, "ckpt/step-100", extra_state={"step": 100})
    extra = ckpt.load(model, optimizer, "ckpt/step-100")   # any world size / mode
    manifest = ckpt.verify("ckpt/step-100")                # raises CheckpointError

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

from simplefsdp.checkpoint._api import EXTRA_STATE_NAME, load, save, verify
from simplefsdp.checkpoint._files import MANIFEST_NAME, CheckpointError, read_manifest
from simplefsdp.checkpoint._safe_reader import SafeFileSystemReader, TensorOnlyLoadPlanner

__all__ = [
    "EXTRA_STATE_NAME",
    "MANIFEST_NAME",
    "CheckpointError",
    "SafeFileSystemReader",
    "TensorOnlyLoadPlanner",
    "load",
    "read_manifest",
    "save",
    "verify",
]
