"""Hugging Face checkpoints in and out: generic sliced safetensors I/O.

A Hugging Face checkpoint is a folder with ``config.json`` and the weights in
``model.safetensors`` or in shards ``model-0000i-of-0000n.safetensors`` listed
by ``model.safetensors.index.json``. What is a family's (tensor names, layout
permutations, ``config.json`` fields) is its adapter's,
``ModelSpec.hf_adapter`` (a family's ``hf_adapter.py``); the family is
found from ``config.json``'s ``model_type`` and ``architectures`` when
reading (any other causal LM is ``transformers``' own) and from the
configuration's type when writing. This module:

* :func:`hf_family_of` / :func:`hf_model_of_folder`: the family that reads a
  folder (Note: [Which family reads a folder]) and its configuration;
* :func:`model_args_from_hf_config` / :func:`hf_config_from_model_args`: a
  ``config.json`` and our configuration, through the adapter;
* :func:`load_hf_weights`: fills a (possibly sharded, DTensor) model from such
  a folder; each rank reads only the parts of the tensors its shards hold
  (``safe_open(...).get_slice``), never a whole file;
* :func:`save_hf_checkpoint`: writes full tensors (from
  ``simplefsdp export --format hf``) as ``config.json``, shards and the index,
  loadable with ``transformers``' ``from_pretrained``.

A checkpoint whose output projection is tied to the embedding
(``tie_word_embeddings``, or no output tensor) fills ours from the tensor the
adapter's ``tied`` names; exports are untied.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_FLOAT8_DTYPES = tuple(
    getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, name)
)


def _native_families() -> list[Any]:
    """The specs of the families whose adapter reads named ``model_type`` values."""
    from simplefsdp.models.registry import family_names, get_spec

    specs = [get_spec(family) for family in family_names()]
    return [s for s in specs if s.hf_adapter is not None and s.hf_adapter.model_types]


def _any_model_type_family() -> Any | None:
    """The spec of the family that reads any other causal LM (its adapter's
    ``any_model_type``), or ``None``."""
    from simplefsdp.models.registry import family_names, get_spec

    for family in family_names():
        adapter = get_spec(family).hf_adapter
        if adapter is not None and getattr(adapter, "any_model_type", False):
            return get_spec(family)
    return None


def _architectures_of(adapter: Any) -> set[str]:
    """The ``architectures`` names a native adapter reads: its own
    ``architectures`` where it declares them, else the causal-LM classes
    ``transformers`` has for its ``model_types``."""
    declared = getattr(adapter, "architectures", None)
    if declared is not None:
        return set(declared)
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:  # pragma: no cover - transformers is optional
        return set()
    return {MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(t) for t in adapter.model_types} - {None}


def hf_family_of(config: Mapping[str, Any], source: str = CONFIG_FILE) -> Any:
    """The :class:`~simplefsdp.models.spec.ModelSpec` of the family that reads a
    Hugging Face ``config.json``.

    Note: [Which family reads a folder]
        The native family whose adapter lists the ``model_type``; else the
        one whose architectures (its adapter's ``architectures``, or the
        causal-LM class ``transformers`` has for each of its model types)
        hold ``architectures[0]``; else the family whose adapter reads any
        ``model_type`` (``any_model_type``: ``transformers``' own modeling
        code). A ``config.json`` without ``model_type`` and ``architectures``
        is the only native family's, when there is one.

    Raises:
        ValueError: no family reads it (one line with the valid model types).
    """
    model_type = config.get("model_type")
    native = _native_families()
    for spec in native:
        if model_type in spec.hf_adapter.model_types:
            return spec
    architectures = config.get("architectures") or []
    if architectures and isinstance(architectures, list):
        for spec in native:
            if architectures[0] in _architectures_of(spec.hf_adapter):
                return spec
    if model_type is None and not architectures and native:
        return native[0]  # an old config.json without model_type: Llama's
    fallback = _any_model_type_family()
    if fallback is not None and model_type is not None:
        return fallback
    valid = [t for spec in native for t in spec.hf_adapter.model_types]
    raise ValueError(
        f"{source}: model_type {model_type!r} is not supported; valid: "
        f"{', '.join(repr(t) for t in valid)}"
        + (" or any causal LM of transformers" if fallback is not None else "")
    )


def _adapter_of_hf_config(config: Mapping[str, Any], source: str) -> Any:
    """The Hugging Face adapter of the family that reads ``config`` (see
    Note: [Which family reads a folder])."""
    return hf_family_of(config, source).hf_adapter


def read_hf_config(folder: str | os.PathLike[str]) -> dict[str, Any]:
    """The parsed ``config.json`` of a Hugging Face folder.

    Raises:
        ValueError: missing or unreadable (one line naming the file).
    """
    return _read_json(Path(folder) / CONFIG_FILE)


def hf_model_of_folder(
    folder: str | os.PathLike[str], *, trust_remote_code: bool = False
) -> tuple[Any, Any]:
    """``(spec, config)`` of the model a Hugging Face folder holds: the family
    that reads its ``config.json`` (Note: [Which family reads a folder]) and
    that family's configuration built from it.

    Args:
        folder: holds ``config.json``.
        trust_remote_code: the folder's own modeling code (``auto_map``) may
            run (only the family reading any ``model_type`` runs such code).

    Raises:
        ValueError: an unreadable ``config.json``, no family reading it, or
            a feature the family lacks (one line).
    """
    config = read_hf_config(folder)
    source = str(Path(folder) / CONFIG_FILE)
    spec = hf_family_of(config, source)
    adapter = spec.hf_adapter
    if getattr(adapter, "any_model_type", False):
        code_folder = os.path.abspath(folder)  # recorded: see [Code from a model folder]
        return spec, adapter.config_from_hf(
            config, source, trust_remote_code=trust_remote_code, code_folder=code_folder
        )
    if config.get("model_type") not in adapter.model_types:
        # picked by its architectures: read as the family's own model type
        config = {**config, "model_type": adapter.model_types[0]}
    return spec, adapter.config_from_hf(config, source)


def hf_adapter_for(args: Any) -> Any:
    """The Hugging Face adapter (``ModelSpec.hf_adapter``) of the family of
    configuration ``args``.

    Raises:
        ValueError: the family has no Hugging Face format (one line).
    """
    from simplefsdp.models.registry import spec_for_config

    spec = spec_for_config(args)
    if spec.hf_adapter is None:
        raise ValueError(
            f"the {spec.family!r} model family has no Hugging Face format (no adapter); "
            "export it with --format simplefsdp (the default)"
        )
    return spec.hf_adapter


def model_args_from_hf_config(config: Mapping[str, Any], source: str = CONFIG_FILE) -> Any:
    """Our model configuration from a Hugging Face ``config.json``, by the
    adapter of the family whose ``model_type`` it is.

    Raises:
        ValueError: an unsupported ``model_type`` or feature (one line naming
            the key and its value).
    """
    return _adapter_of_hf_config(config, source).config_from_hf(config, source)


def hf_config_from_model_args(args: Any, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The Hugging Face ``config.json`` of our model with configuration ``args``."""
    return hf_adapter_for(args).config_to_hf(args, dtype)


def model_args_differences(ours: Any, theirs: Any) -> list[str]:
    """``field=ours vs theirs`` for each architecture field in which two
    configurations of one family differ."""
    return hf_adapter_for(ours).config_differences(ours, theirs)


# --------------------------------------------------------------------------- reading


class HFCheckpoint:
    """A Hugging Face checkpoint folder, read tensor by tensor and slice by slice.

    Args:
        folder: holds ``config.json`` and ``model.safetensors`` or
            ``model.safetensors.index.json`` with its shards.
        args: the configuration of the model it fills (default: the one
            :func:`hf_model_of_folder` reads, without the folder's own code).

    Raises:
        ValueError: the folder, ``config.json``, the index or a shard it
            names is missing or unreadable (one line naming the file).
    """

    def __init__(self, folder: str | os.PathLike[str], *, args: Any = None) -> None:
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise ValueError(f"Hugging Face checkpoint {str(folder)!r} is not a folder")
        self.config = _read_json(self.folder / CONFIG_FILE)
        if args is None:
            spec, args = hf_model_of_folder(self.folder)
            self.adapter = spec.hf_adapter
        else:
            self.adapter = hf_adapter_for(args)
        self.args = args
        index = self.folder / INDEX_FILE
        if index.is_file():
            weight_map = _read_json(index).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ValueError(f"{index}: no weight_map")
            self.weight_map: dict[str, str] = {str(k): str(v) for k, v in weight_map.items()}
        elif (self.folder / SINGLE_FILE).is_file():
            names = _safetensors_keys(self.folder / SINGLE_FILE)
            self.weight_map = dict.fromkeys(names, SINGLE_FILE)
        else:
            raise ValueError(
                f"{self.folder} has neither {INDEX_FILE} nor {SINGLE_FILE} "
                "(only safetensors checkpoints are read)"
            )
        for file in sorted(set(self.weight_map.values())):
            if not (self.folder / file).is_file():
                raise ValueError(f"{self.folder / file} (named by {INDEX_FILE}) does not exist")
        self.tied = bool(self.config.get("tie_word_embeddings", False)) or any(
            self.adapter.to_hf_name(ours) not in self.weight_map for ours in self.adapter.tied
        )
        self._handles: dict[str, Any] = {}

    def _open(self, file: str) -> Any:
        from safetensors import safe_open

        if file not in self._handles:
            try:
                self._handles[file] = safe_open(str(self.folder / file), framework="pt")
            except Exception as exc:  # safetensors raises its own error types
                raise ValueError(f"cannot read {self.folder / file}: {exc}") from None
        return self._handles[file]

    def has(self, hf_name: str) -> bool:
        """The checkpoint holds tensor ``hf_name``."""
        return hf_name in self.weight_map

    def holds(self, name: str) -> bool:
        """The checkpoint holds what fills our tensor ``name`` (always true for
        an adapter that assembles tensors itself, ``read_region``)."""
        if hasattr(self.adapter, "read_region"):
            return True
        return self.has(self.adapter.to_hf_name(name)) or (self.tied and name in self.adapter.tied)

    def hf_shape(self, hf_name: str) -> list[int]:
        """The stored shape of tensor ``hf_name``.

        Raises:
            ValueError: the checkpoint has no such tensor.
        """
        file = self.weight_map.get(hf_name)
        if file is None:
            raise ValueError(f"{self.folder} has no tensor {hf_name!r}")
        return list(self._open(file).get_slice(hf_name).get_shape())

    def read_hf(
        self,
        hf_name: str,
        offsets: Iterable[int] | None = None,
        sizes: Iterable[int] | None = None,
    ) -> torch.Tensor:
        """The region ``offsets``/``sizes`` (whole tensor when None) of the
        stored tensor ``hf_name``, reading only that region from its file.

        A float8 weight stored with block scales (``<name>_scale_inv``, as
        in DeepSeek-V3's published checkpoints; block size from
        ``quantization_config.weight_block_size``, default 128 x 128) is
        returned dequantized in float32: each block times its scale.

        Raises:
            ValueError: no such tensor, or a region outside its shape.
        """
        shape = self.hf_shape(hf_name)
        offsets = [0] * len(shape) if offsets is None else list(offsets)
        sizes = list(shape) if sizes is None else list(sizes)
        if len(offsets) != len(shape) or any(
            o < 0 or o + n > d for o, n, d in zip(offsets, sizes, shape, strict=True)
        ):
            raise ValueError(
                f"{hf_name}: shape {shape} does not hold the region offsets={offsets} "
                f"sizes={sizes} the model needs (does config.json match the weights?)"
            )
        region = tuple(slice(o, o + n) for o, n in zip(offsets, sizes, strict=True))
        handle = self._open(self.weight_map[hf_name])
        data = handle.get_slice(hf_name)[region]
        scale_name = f"{hf_name}_scale_inv"
        if data.dtype in _FLOAT8_DTYPES and scale_name in self.weight_map:
            data = self._dequantize(data, scale_name, offsets, sizes)
        return data

    def _dequantize(
        self, data: torch.Tensor, scale_name: str, offsets: list[int], sizes: list[int]
    ) -> torch.Tensor:
        """Block-scaled float8 ``data`` (a region of a weight) -> float32."""
        quant = self.config.get("quantization_config") or {}
        block = list(quant.get("weight_block_size") or [128] * data.dim())
        if len(block) != data.dim():
            raise ValueError(
                f"{self.folder / CONFIG_FILE}: quantization_config.weight_block_size "
                f"{block} does not fit the {data.dim()}-d tensor {scale_name[:-10]!r}"
            )
        first = [o // b for o, b in zip(offsets, block, strict=True)]
        last = [-(-(o + n) // b) for o, n, b in zip(offsets, sizes, block, strict=True)]
        scale = self.read_hf(scale_name, first, [b - a for a, b in zip(first, last, strict=True)])
        scale = scale.float()
        for dim, (b, o, f, n) in enumerate(zip(block, offsets, first, sizes, strict=True)):
            scale = scale.repeat_interleave(b, dim=dim).narrow(dim, o - f * b, n)
        return data.float() * scale

    def read(
        self, name: str, offsets: Iterable[int] | None = None, sizes: Iterable[int] | None = None
    ) -> torch.Tensor:
        """The region ``offsets``/``sizes`` (whole tensor when None) of our tensor ``name``.

        Only the region the family's adapter names is read from the file
        (for example whole heads where the layouts differ within a head).
        An adapter with a ``read_region(name, offsets, sizes, args,
        checkpoint)`` method assembles the region itself from any number of
        stored tensors (through :meth:`read_hf`, :meth:`hf_shape` and
        :meth:`has`; e.g. one expert tensor of ours from one tensor per
        expert); ``offsets``/``sizes`` are then always given.

        Raises:
            ValueError: the checkpoint lacks the tensor, or its shape is not
                the one ``config.json`` implies.
        """
        if hasattr(self.adapter, "read_region"):
            if offsets is None or sizes is None:
                raise ValueError(f"{name}: the region to read must be given")
            return self.adapter.read_region(name, list(offsets), list(sizes), self.args, self)
        hf_name = self.adapter.to_hf_name(name)
        if self.tied and name in self.adapter.tied:
            hf_name = self.adapter.tied[name]
        shape = self.hf_shape(hf_name)
        offsets = [0] * len(shape) if offsets is None else list(offsets)
        sizes = list(shape) if sizes is None else list(sizes)
        if len(offsets) != len(shape) or any(
            o + n > d for o, n, d in zip(offsets, sizes, shape, strict=True)
        ):
            raise ValueError(
                f"{hf_name}: shape {shape} does not hold the region offsets={offsets} "
                f"sizes={sizes} the model needs (does config.json match the weights?)"
            )
        hf_offsets, hf_sizes, convert = self.adapter.hf_region(name, offsets, sizes, self.args)
        return convert(self.read_hf(hf_name, hf_offsets, hf_sizes))

    def close(self) -> None:
        """Release the open files."""
        self._handles.clear()


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{path} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def _safetensors_keys(path: Path) -> list[str]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return list(f.keys())
    except Exception as exc:  # safetensors raises its own error types
        raise ValueError(f"cannot read {path}: {exc}") from None


def _local_region(tensor: torch.Tensor) -> tuple[torch.Tensor, list[int], list[int]]:
    """``(local tensor, global offsets, sizes)`` of this rank's part of ``tensor``."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return tensor, [0] * tensor.dim(), list(tensor.shape)
    chunks = tensor.__create_chunk_list__()  # the region DCP would save for this rank
    if len(chunks) != 1:  # pragma: no cover - one local shard per rank in DTensor
        raise ValueError(f"a DTensor with {len(chunks)} local chunks is not supported")
    return tensor.to_local(), list(chunks[0].offsets), list(chunks[0].sizes)


def load_hf_weights(
    model: nn.Module | Iterable[nn.Module],
    folder: str | os.PathLike[str] | HFCheckpoint,
    *,
    args: Any = None,
) -> int:
    """Copy the weights of a Hugging Face checkpoint into ``model`` in place.

    Works on plain modules, on ``simplefsdp`` / FSDP2 / tensor-parallel models
    whose parameters are DTensors (each rank reads the region its shard
    holds) and on pipeline stages (a list of modules; a stage reads only its
    layers). No collective is called. A parameter the model ties under
    several names (an output projection sharing the embedding) is read once,
    from a name the checkpoint holds.

    Args:
        model: the model, or the modules of this rank's pipeline stages.
        folder: the checkpoint folder (or an open :class:`HFCheckpoint`).
        args: the model's configuration (default: the folder's, see
            :class:`HFCheckpoint`).

    Returns:
        The number of elements read.

    Raises:
        ValueError: a tensor is missing or its shape does not fit the model.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from simplefsdp.frontend import disable_parametrization

    ckpt = folder if isinstance(folder, HFCheckpoint) else HFCheckpoint(folder, args=args)
    modules = [model] if isinstance(model, nn.Module) else list(model)
    read = 0
    try:
        for module in modules:
            with disable_parametrization(), torch.no_grad():
                state = get_model_state_dict(module)
                for name in _names_to_read(state, ckpt):
                    local, offsets, sizes = _local_region(state[name])
                    if local.numel() == 0:
                        continue
                    data = ckpt.read(name, offsets, sizes)
                    target = local
                    for dim, size in enumerate(sizes):  # a padded local shard
                        if target.shape[dim] != size:
                            target = target.narrow(dim, 0, size)
                    target.copy_(data.to(target.dtype))
                    read += data.numel()
                # The state-dict entries may be copies: write them back.
                _set_model_state(module, state)
    finally:
        ckpt.close()
    return read


def _names_to_read(state: Mapping[str, Any], ckpt: HFCheckpoint) -> list[str]:
    """The state-dict names to read: one per tensor, where several names share
    one (tied parameters), the first the checkpoint holds."""
    groups: dict[tuple[int, tuple[int, ...]], list[str]] = {}
    for name, tensor in state.items():
        local = _local_region(tensor)[0]
        key = (local.data_ptr(), tuple(local.shape)) if local.numel() else (id(tensor), ())
        groups.setdefault(key, []).append(name)
    order = {name: i for i, name in enumerate(state)}
    names = []
    for group in groups.values():
        held = [n for n in group if ckpt.holds(n)]
        names.append((held or group)[0])
    return sorted(names, key=order.__getitem__)


def _set_model_state(module: nn.Module, state: dict[str, Any]) -> None:
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    from simplefsdp.frontend import disable_parametrization

    with disable_parametrization():
        set_model_state_dict(module, state)


# --------------------------------------------------------------------------- writing


def _parse_size(text: str | int) -> int:
    """``"5GB"``, ``"500MB"``, ``"2GiB"`` or a byte count -> bytes."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", text, re.IGNORECASE)
    if not match:
        raise ValueError(f"shard size {text!r} is not a size like 5GB, 500MB or 1000000")
    unit = (match.group(2) or "B").upper()
    base = 1024 if "I" in unit else 1000
    power = {"B": 0, "K": 1, "M": 2, "G": 3, "T": 4}[unit[0]]
    size = int(float(match.group(1)) * base**power)
    if size <= 0:
        raise ValueError(f"shard size {text!r} must be positive")
    return size


def save_hf_checkpoint(
    state: Mapping[str, torch.Tensor],
    args: Any,
    out: str | os.PathLike[str],
    *,
    max_shard_size: str | int = "5GB",
    metadata: Mapping[str, str] | None = None,
) -> list[Path]:
    """Write our full state dict as a Hugging Face checkpoint folder (through
    the adapter of ``args``'s family).

    ``config.json``, ``model-0000i-of-0000n.safetensors`` (each at most
    ``max_shard_size`` unless one tensor is larger),
    ``model.safetensors.index.json`` and the files the adapter's optional
    ``hf_files(args)`` names (a model's own code). Each file is written under a temporary
    name and renamed; the index, written last, names only complete shards.

    Args:
        state: our full (unsharded) tensors by our names.
        args: the model's configuration.
        out: the folder to write (created; files of an earlier export in it
            are replaced).
        max_shard_size: bytes, or a size like ``"5GB"``.
        metadata: extra string metadata stored in every shard.

    Returns:
        The files written.

    Raises:
        ValueError: the family has no adapter, a tensor name it cannot
            convert, or a bad size.
    """
    import safetensors.torch as st

    limit = _parse_size(max_shard_size)
    adapter = hf_adapter_for(args)
    hf: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        converted = adapter.to_hf(name, tensor, args)
        # one (name, tensor) pair, or a list of them (e.g. one per expert)
        pairs = [converted] if isinstance(converted, tuple) else list(converted)
        for hf_name, value in pairs:
            hf[hf_name] = value.contiguous()
    dtypes = {t.dtype for t in hf.values() if t.is_floating_point()}
    dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(hf, key=adapter.hf_sort_key):
        nbytes = hf[name].numel() * hf[name].element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][name] = hf[name]
        size += nbytes
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("model-*-of-*.safetensors"):  # an earlier export's shards
        old.unlink()
    (folder / SINGLE_FILE).unlink(missing_ok=True)
    (folder / INDEX_FILE).unlink(missing_ok=True)
    mode = _file_mode(folder)
    written: list[Path] = []
    weight_map: dict[str, str] = {}
    total = 0
    meta = {"format": "pt", **(metadata or {})}
    for i, shard in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        path = folder / file
        tmp = path.with_name(path.name + ".tmp")
        st.save_file(shard, str(tmp), metadata=meta)
        _publish(tmp, path, mode)
        written.append(path)
        for name, tensor in shard.items():
            weight_map[name] = file
            total += tensor.numel() * tensor.element_size()
    for source in getattr(adapter, "hf_files", lambda _args: [])(args):
        # e.g. the modeling code a config.json's auto_map names
        path = folder / Path(source).name
        tmp = path.with_name(path.name + ".tmp")
        shutil.copyfile(source, tmp)
        _publish(tmp, path, mode)
        written.append(path)
    config_path = folder / CONFIG_FILE
    _write_json(config_path, adapter.config_to_hf(args, dtype), mode)
    index_path = folder / INDEX_FILE
    _write_json(index_path, {"metadata": {"total_size": total}, "weight_map": weight_map}, mode)
    return [config_path, *written, index_path]


def _write_json(path: Path, data: Any, mode: int) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    _publish(tmp, path, mode)


def _publish(tmp: Path, path: Path, mode: int) -> None:
    """fsync ``tmp``, give it ``mode`` and rename it to ``path``."""
    try:
        os.chmod(tmp, mode)  # safetensors writes through its own 0600 temporary file
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _file_mode(folder: Path) -> int:
    """The mode a new file in ``folder`` gets (``0o666 & ~umask``)."""
    from simplefsdp.checkpoint.export import _new_file_mode

    probe = folder / ".mode-probe"
    try:
        return _new_file_mode(probe)
    finally:
        probe.unlink(missing_ok=True)


def export_hf_checkpoint(
    checkpoint: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    dtype: str | None = None,
    max_shard_size: str | int = "5GB",
) -> list[Path]:
    """``simplefsdp export --format hf``: a checkpoint as a Hugging Face folder.

    Args:
        checkpoint: a checkpoint folder or a run's checkpoint folder (latest).
        out: the folder to write (see :func:`save_hf_checkpoint`).
        dtype: cast floating-point tensors to ``float32``/``bfloat16``/``float16``.
        max_shard_size: the largest shard, e.g. ``"5GB"``.

    Returns:
        The files written.

    Raises:
        ValueError: bad checkpoint, dtype or size.
    """
    from simplefsdp.checkpoint import CONFIG_NAME, read_json, read_manifest
    from simplefsdp.checkpoint.export import (
        _DTYPES,
        load_full_model_state,
        model_args_from_config,
        resolve_checkpoint,
    )

    if dtype is not None and dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; valid: {', '.join(_DTYPES)}")
    _parse_size(max_shard_size)  # a bad size fails before the checkpoint is read
    folder = resolve_checkpoint(checkpoint)
    args = model_args_from_config(read_json(folder / CONFIG_NAME))
    try:
        hf_adapter_for(args)
    except ValueError as exc:
        raise ValueError(f"checkpoint {str(folder)!r}: {exc}") from None
    tensors = load_full_model_state(folder)
    if dtype is not None:
        cast = _DTYPES[dtype]
        tensors = {k: v.to(cast) if v.is_floating_point() else v for k, v in tensors.items()}
    step = (read_manifest(folder) or {}).get("step")
    meta = {"step": str(step), "source": str(folder)}
    return save_hf_checkpoint(tensors, args, out, max_shard_size=max_shard_size, metadata=meta)
