"""Reading DCP checkpoints without executing code from them.

Note: [Loading never runs checkpoint code]
    ``torch.distributed.checkpoint`` stores two kinds of data: tensors, read
    with ``torch.load(weights_only=True)``, and "bytes" items (any picklable
    object) read with ``torch.load(weights_only=False)``; its index
    ``.metadata`` is read with a plain ``pickle.load``. A crafted checkpoint
    could therefore run code through either. We close both doors:

    * :class:`SafeFileSystemReader` unpickles ``.metadata`` with an unpickler
      that only resolves DCP's own metadata dataclasses, ``torch.Size``,
      dtypes, layouts and paths; anything else is refused.
    * :class:`TensorOnlyLoadPlanner` refuses every bytes item, and
      :func:`simplefsdp.checkpoint.load` checks before reading that every
      entry it loads is a tensor in the metadata.

    What we write holds tensors only (non-tensor state goes to JSON files), so
    nothing we need is lost.
"""

from __future__ import annotations

import io
import pathlib
import pickle
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata

from simplefsdp.checkpoint._files import CheckpointError

METADATA_NAME = ".metadata"

# Classes defined in this module may be rebuilt from ``.metadata``: plain
# dataclasses and enums holding sizes, offsets, dtypes and names.
_DCP_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_SAFE_GLOBALS: dict[tuple[str, str], Any] = {
    ("torch", "Size"): torch.Size,
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): None,  # private: looked up
    ("torch.serialization", "_get_layout"): None,  # private: looked up when met
    ("collections", "OrderedDict"): OrderedDict,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    # checkpoint_id paths; Python 3.13 pickles them from pathlib._local.
    **{
        (module, name): getattr(pathlib, name)
        for module in ("pathlib", "pathlib._local")
        for name in ("Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")
    },
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP ``.metadata`` only; every other global raises ``UnpicklingError``."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _SAFE_GLOBALS:
            return _SAFE_GLOBALS[(module, name)] or super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == _DCP_METADATA_MODULE:
            obj = super().find_class(module, name)
            if isinstance(obj, type) and obj.__module__ == module:
                return obj
        raise pickle.UnpicklingError(f"global '{module}.{name}' is not allowed in DCP metadata")


def read_metadata_safely(path: Path) -> Metadata:
    """Unpickle the DCP metadata file ``path`` with the restricted unpickler.

    Raises:
        CheckpointError: the file is missing, truncated, or refers to anything
            but DCP metadata (see [Loading never runs checkpoint code]).
    """
    try:
        with Path(path).open("rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing (not a DCP checkpoint)") from None
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise CheckpointError(f"{path} is not valid DCP metadata ({reason})") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path} is not DCP metadata (got {type(metadata).__name__})")
    return metadata


class SafeFileSystemReader(dcp.FileSystemReader):
    """A ``FileSystemReader`` whose ``.metadata`` is read by a restricted unpickler.

    A drop-in for ``torch.distributed.checkpoint.FileSystemReader`` (tensor
    data is read by DCP with ``weights_only=True`` as before).
    """

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checkpoint's metadata, see :func:`read_metadata_safely`."""
        rank = kwargs.get("rank")
        name = METADATA_NAME if rank is None else f"__{rank}{METADATA_NAME}"
        metadata = read_metadata_safely(Path(self.path) / name)
        # What the base class does after unpickling: tag the load.
        storage_meta = getattr(metadata, "storage_meta", None)
        if storage_meta is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            storage_meta = metadata.storage_meta = StorageMeta()
        storage_meta.load_id = getattr(self, "load_id", None)
        return metadata


class TensorOnlyLoadPlanner(DefaultLoadPlanner):
    """A ``DefaultLoadPlanner`` that refuses non-tensor (pickled) items."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        """Refuse: bytes items are unpickled with ``weights_only=False``."""
        raise CheckpointError(
            f"checkpoint entry {read_item.dest_index.fqn!r} is a pickled object, not a tensor; "
            "refusing to unpickle it"
        )
