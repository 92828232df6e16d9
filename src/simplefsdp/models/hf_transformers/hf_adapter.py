"""The ``transformers`` family's Hugging Face adapter: names and tensors are the folder's own.

The model is ``transformers``' own class (see Note: [The wrapper shares the
model's children] in :mod:`.model`), so every name and tensor maps to
itself and ``config.json`` is written back as it was read (``architectures``
included; ``torch_dtype`` follows the exported tensors). Tied weights (an
output projection sharing the embedding's parameter) are read once, from
whichever name the checkpoint holds.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from simplefsdp.models.common.hf_adapter import HFAdapter
from simplefsdp.models.hf_transformers.config import TransformersConfig, config_from_hf

_LAYER = re.compile(r"\.layers\.(\d+)\.")


class TransformersHFAdapter(HFAdapter):
    """Identity conversion between our ``transformers`` models and their
    folders (see :class:`~simplefsdp.models.common.hf_adapter.HFAdapter`):
    it reads any ``model_type`` no other family reads, and ties nothing by
    name (tied parameters are one parameter of the model).
    """

    any_model_type: bool = True
    tied: Mapping[str, str] = MappingProxyType({})

    def to_hf_name(self, name: str) -> str:
        """Our name is the Hugging Face name."""
        return name

    def from_hf_name(self, name: str) -> str:
        """The Hugging Face name is ours."""
        return name

    def config_from_hf(
        self,
        config: Mapping[str, Any],
        source: str = "config.json",
        *,
        trust_remote_code: bool = False,
        code_folder: str | None = None,
    ) -> TransformersConfig:
        """Our :class:`TransformersConfig` of a ``config.json`` (see
        :func:`~simplefsdp.models.hf_transformers.config.config_from_hf`)."""
        return config_from_hf(
            config, source, trust_remote_code=trust_remote_code, code_folder=code_folder
        )

    def config_to_hf(
        self, args: TransformersConfig, dtype: torch.dtype = torch.float32
    ) -> dict[str, Any]:
        """The ``config.json`` read, with ``torch_dtype`` the exported tensors'
        and ``max_position_embeddings`` (under the model's own key for it) at
        least the trained ``max_seq_len``."""
        out = dict(args.hf_config)
        out["torch_dtype"] = str(dtype).removeprefix("torch.")
        key = args.key("max_position_embeddings")
        if key in out:
            out[key] = max(int(out[key] or 0), args.max_seq_len)
        return out

    def config_differences(self, ours: TransformersConfig, theirs: TransformersConfig) -> list[str]:
        """``key=ours vs theirs`` per differing architecture key of ``config.json``."""
        return ours.differences(theirs)

    def hf_files(self, args: TransformersConfig) -> list[Path]:
        """Files an export copies besides the weights: the Python files of a
        folder with its own modeling code (``auto_map``), which its
        ``config.json`` names."""
        if args.code_folder is None:
            return []
        return sorted(Path(args.code_folder).glob("*.py"))

    def hf_sort_key(self, hf_name: str) -> tuple[int, str]:
        """Order in the written shards: layer by layer, the rest first."""
        match = _LAYER.search(hf_name)
        return (int(match.group(1)) + 1 if match else 0), hf_name


#: The adapter object of the ``transformers`` family's spec.
TRANSFORMERS_HF_ADAPTER = TransformersHFAdapter()
