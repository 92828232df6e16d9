"""The one-line check of a checkpoint's metadata against the state being
loaded, when each rank loads part of the model (pipeline stages)."""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)

from simplefsdp.checkpoint._metadata_check import state_mismatches


def _metadata(shapes: dict[str, list[int]]) -> Metadata:
    entries = {
        key: TensorStorageMetadata(
            TensorProperties(dtype=torch.float32),
            torch.Size(shape),
            [ChunkStorageMetadata(torch.Size([0] * len(shape)), torch.Size(shape))],
        )
        for key, shape in shapes.items()
    }
    return Metadata(state_dict_metadata=entries)


def test_a_stage_loads_its_blocks_and_the_others_count_as_loaded() -> None:
    metadata = _metadata({"model.layers.0.w": [4], "model.layers.1.w": [4]})
    stage0 = {"model": {"layers.0.w": torch.zeros(4)}}
    # Alone, the other stage's block is an entry nothing loads.
    assert state_mismatches(metadata, stage0) == [
        "model tensor 'layers.1.w' is in the checkpoint but not here"
    ]
    # With every rank's keys (what load gathers), it is loaded by another rank.
    every_rank = {"model.layers.0.w", "model.layers.1.w"}
    assert state_mismatches(metadata, stage0, loaded_keys=every_rank) == []
    # An entry no rank holds is still reported, and so is a shape mismatch.
    assert state_mismatches(metadata, stage0, loaded_keys={"model.layers.0.w"}) != []
    wrong = {"model": {"layers.0.w": torch.zeros(5)}}
    assert (
        "has shape [4] in the checkpoint but [5] here"
        in state_mismatches(metadata, wrong, loaded_keys=every_rank)[0]
    )
