"""Hugging Face Llama checkpoints in and out.

A Hugging Face Llama checkpoint is a folder with ``config.json`` and the
weights in ``model.safetensors`` or in shards ``model-0000i-of-0000n.safetensors``
listed by ``model.safetensors.index.json``. This module converts in both
directions:

* :func:`model_args_from_hf_config` / :func:`hf_config_from_model_args`: the
  ``config.json`` of a ``LlamaForCausalLM`` and our
  :class:`~simplefsdp.models.llama3.ModelArgs`;
* :func:`load_hf_weights`: fills a (possibly sharded, DTensor) model from such
  a folder; each rank reads only the parts of the tensors its shards hold
  (``safe_open(...).get_slice``), never a whole file;
* :func:`save_hf_checkpoint`: writes full tensors (from
  ``simplefsdp export --format hf``) as ``config.json``, shards and the index,
  loadable with ``LlamaForCausalLM.from_pretrained``.

Note: [Hugging Face names and the q/k layout]
    Names map one to one (``model.layers.{i}.self_attn.q_proj.weight`` is our
    ``layers.{i}.attention.wq.weight``, ``mlp.gate_proj``/``down_proj``/``up_proj``
    are ``feed_forward.w1``/``w2``/``w3``, ``input_layernorm`` and
    ``post_attention_layernorm`` are ``attention_norm`` and ``ffn_norm``,
    ``model.embed_tokens``, ``model.norm`` and ``lm_head`` are
    ``tok_embeddings``, ``norm`` and ``output``). Our rotary embedding rotates
    adjacent channel pairs ``(2i, 2i + 1)`` of each head (Meta's layout);
    Hugging Face's rotates channel ``i`` with ``i + head_dim / 2``. The rows of
    ``wq`` and ``wk`` are therefore permuted within each head: our row
    ``2i + j`` of a head is Hugging Face's row ``j * head_dim / 2 + i``. The
    permutation stays inside a head, so a shard that covers part of the heads
    reads only the heads it overlaps. A checkpoint with tied embeddings
    (``tie_word_embeddings``, or no ``lm_head.weight``) fills ``output`` from
    the embedding; exports are untied (our model has its own ``output``).
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = [
    "HFCheckpoint",
    "export_hf_checkpoint",
    "from_hf_name",
    "hf_config_from_model_args",
    "load_hf_weights",
    "model_args_differences",
    "model_args_from_hf_config",
    "save_hf_checkpoint",
    "to_hf_name",
]

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

_LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_FROM_LAYER = {v: k for k, v in _LAYER_NAMES.items()}
_FROM_TOP = {v: k for k, v in _TOP_NAMES.items()}
_OURS_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")

# (multiple_of, ffn_dim_multiplier) pairs of published Llama models, tried first
# so that a converted config reads like the original one.
_FFN_CANDIDATES = ((1024, 1.3), (4096, 1.3), (256, None), (1024, None), (256, 1.3), (1024, 1.5))


def to_hf_name(name: str) -> str:
    """Our state-dict name -> the Hugging Face ``LlamaForCausalLM`` name.

    Raises:
        ValueError: ``name`` is not a Llama 3 parameter name.
    """
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    match = _OURS_LAYER.match(name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
    raise ValueError(f"no Hugging Face name for parameter {name!r}")


def from_hf_name(name: str) -> str:
    """A Hugging Face ``LlamaForCausalLM`` name -> our state-dict name.

    Raises:
        ValueError: ``name`` is not a Llama parameter name.
    """
    if name in _FROM_TOP:
        return _FROM_TOP[name]
    match = _HF_LAYER.match(name)
    if match and match.group(2) in _FROM_LAYER:
        return f"layers.{match.group(1)}.{_FROM_LAYER[match.group(2)]}"
    raise ValueError(f"unknown Hugging Face Llama tensor {name!r}")


def _heads_of(name: str, args: Any) -> int | None:
    """Number of heads whose rows are permuted in tensor ``name`` (ours), or None."""
    if name.endswith("attention.wq.weight"):
        return args.n_heads
    if name.endswith("attention.wk.weight"):
        return args.n_kv_heads
    return None


def _hf_rows_to_ours(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of whole heads in Hugging Face's rotary layout -> ours (see the note)."""
    rows, cols = w.shape
    half = rows // n_heads // 2
    return w.reshape(n_heads, 2, half, cols).transpose(1, 2).reshape(rows, cols)


def _our_rows_to_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of whole heads in our rotary layout -> Hugging Face's (see the note)."""
    rows, cols = w.shape
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, cols).transpose(1, 2).reshape(rows, cols)


# --------------------------------------------------------------------------- config


def _ffn_args(dim: int, intermediate: int) -> tuple[int, float | None]:
    """``(multiple_of, ffn_dim_multiplier)`` giving the hidden size ``intermediate``."""
    from simplefsdp.models.llama3 import ffn_hidden_dim

    for multiple_of, multiplier in _FFN_CANDIDATES:
        if ffn_hidden_dim(dim, multiple_of, multiplier) == intermediate:
            return multiple_of, multiplier
    base = int(2 * (4 * dim) / 3)
    # multiple_of == intermediate rounds any hidden size in (0, intermediate] up to it.
    multiplier = None if base <= intermediate else intermediate / base
    if ffn_hidden_dim(dim, intermediate, multiplier) != intermediate:  # pragma: no cover
        raise ValueError(f"cannot express intermediate_size={intermediate} for dim={dim}")
    return intermediate, multiplier


def model_args_from_hf_config(config: Mapping[str, Any], source: str = CONFIG_FILE) -> Any:
    """Our ``ModelArgs`` from the ``config.json`` of a Hugging Face Llama model.

    Args:
        config: the parsed ``config.json``.
        source: the file's name, for error messages.

    Returns:
        A :class:`~simplefsdp.models.llama3.ModelArgs`; ``max_seq_len`` is
        ``max_position_embeddings``.

    Raises:
        ValueError: not a Llama model, or one with a feature our model lacks
            (biases, another activation, a head size other than
            ``hidden_size / num_attention_heads``, an unknown rope type); the
            message names the key and its value.
    """
    from simplefsdp.models.llama3 import ModelArgs, RopeScaling

    def get(key: str, default: Any = None) -> Any:
        return config.get(key, default)

    model_type = get("model_type", "llama")
    if model_type != "llama":
        raise ValueError(f"{source}: model_type {model_type!r} is not supported (only 'llama')")
    for key in ("attention_bias", "mlp_bias"):
        if get(key, False):
            raise ValueError(f"{source}: {key}=true is not supported (the model has no biases)")
    act = get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{source}: hidden_act {act!r} is not supported (only 'silu')")
    missing = [
        k
        for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
        if k not in config
    ]
    if missing:
        raise ValueError(f"{source}: missing key(s) {', '.join(missing)}")
    dim, n_heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    head_dim = get("head_dim")
    if head_dim is not None and n_heads and int(head_dim) * n_heads != dim:
        raise ValueError(
            f"{source}: head_dim {head_dim} is not hidden_size/num_attention_heads "
            f"({dim}/{n_heads}); such models are not supported"
        )
    rope = dict(get("rope_parameters") or {})
    scaling_cfg = get("rope_scaling") or (rope if rope.get("rope_type") == "llama3" else None)
    theta = get("rope_theta", rope.get("rope_theta", 10000.0))
    rope_type = (scaling_cfg or rope).get("rope_type", (scaling_cfg or rope).get("type"))
    scaling = None
    if scaling_cfg:
        if rope_type != "llama3":
            raise ValueError(
                f"{source}: rope_scaling type {rope_type!r} is not supported "
                "(only 'llama3' or none)"
            )
        scaling = RopeScaling(
            factor=float(scaling_cfg["factor"]),
            low_freq_factor=float(scaling_cfg["low_freq_factor"]),
            high_freq_factor=float(scaling_cfg["high_freq_factor"]),
            original_max_position_embeddings=int(scaling_cfg["original_max_position_embeddings"]),
        )
    elif rope_type not in (None, "default"):
        raise ValueError(f"{source}: rope type {rope_type!r} is not supported")
    intermediate = int(get("intermediate_size", 0)) or None
    multiple_of, multiplier = (256, None) if intermediate is None else _ffn_args(dim, intermediate)
    return ModelArgs(
        dim=dim,
        n_layers=int(config["num_hidden_layers"]),
        n_heads=n_heads,
        n_kv_heads=int(get("num_key_value_heads") or n_heads),
        vocab_size=int(config["vocab_size"]),
        multiple_of=multiple_of,
        ffn_dim_multiplier=multiplier,
        norm_eps=float(get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        rope_scaling=scaling,
        max_seq_len=int(get("max_position_embeddings", 2048)),
    )


def hf_config_from_model_args(args: Any, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The ``config.json`` of a ``LlamaForCausalLM`` equal to our model with ``args``.

    Args:
        args: our :class:`~simplefsdp.models.llama3.ModelArgs`.
        dtype: the dtype the weights are stored in.
    """
    scaling = args.rope_scaling
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "max_position_embeddings": args.max_seq_len,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": None
        if scaling is None
        else {
            "rope_type": "llama3",
            "factor": scaling.factor,
            "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_position_embeddings,
        },
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "use_cache": True,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def model_args_differences(ours: Any, theirs: Any) -> list[str]:
    """``field=ours vs theirs`` for each architecture field in which two ModelArgs differ.

    ``max_seq_len`` is left out: it sizes the rotary table only.
    """
    fields = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "norm_eps", "rope_theta")
    out = [
        f"{f}={getattr(ours, f)!r} vs {getattr(theirs, f)!r}"
        for f in fields
        if getattr(ours, f) != getattr(theirs, f)
    ]
    if ours.ffn_hidden_dim != theirs.ffn_hidden_dim:
        out.append(f"ffn_hidden_dim={ours.ffn_hidden_dim} vs {theirs.ffn_hidden_dim}")
    if ours.rope_scaling != theirs.rope_scaling:
        out.append(f"rope_scaling={ours.rope_scaling!r} vs {theirs.rope_scaling!r}")
    return out


# --------------------------------------------------------------------------- reading


class HFCheckpoint:
    """A Hugging Face Llama checkpoint folder, read tensor by tensor and slice by slice.

    Args:
        folder: holds ``config.json`` and ``model.safetensors`` or
            ``model.safetensors.index.json`` with its shards.

    Raises:
        ValueError: the folder, ``config.json``, the index or a shard it
            names is missing or unreadable (one line naming the file).
    """

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise ValueError(f"Hugging Face checkpoint {str(folder)!r} is not a folder")
        self.config = _read_json(self.folder / CONFIG_FILE)
        self.args = model_args_from_hf_config(self.config, str(self.folder / CONFIG_FILE))
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
        self.tied = bool(self.config.get("tie_word_embeddings", False)) or (
            "lm_head.weight" not in self.weight_map
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

    def _slice(self, hf_name: str, region: tuple[slice, ...] | None) -> torch.Tensor:
        file = self.weight_map.get(hf_name)
        if file is None:
            raise ValueError(f"{self.folder} has no tensor {hf_name!r}")
        handle = self._open(file)
        if region is None:
            return handle.get_tensor(hf_name)
        return handle.get_slice(hf_name)[region]

    def hf_shape(self, hf_name: str) -> list[int]:
        """The stored shape of tensor ``hf_name``."""
        handle = self._open(self.weight_map[hf_name])
        return list(handle.get_slice(hf_name).get_shape())

    def read(
        self, name: str, offsets: Iterable[int] | None = None, sizes: Iterable[int] | None = None
    ) -> torch.Tensor:
        """The region ``offsets``/``sizes`` (whole tensor when None) of our tensor ``name``.

        Only that region is read from the file (for ``wq``/``wk``: the whole
        heads it overlaps, see [Hugging Face names and the q/k layout]).

        Raises:
            ValueError: the checkpoint lacks the tensor, or its shape is not
                the one ``config.json`` implies.
        """
        hf_name = to_hf_name(name)
        if name == "output.weight" and self.tied:
            hf_name = "model.embed_tokens.weight"
        shape = self.hf_shape(hf_name) if hf_name in self.weight_map else None
        if shape is None:
            raise ValueError(f"{self.folder} has no tensor {hf_name!r}")
        offsets = [0] * len(shape) if offsets is None else list(offsets)
        sizes = list(shape) if sizes is None else list(sizes)
        if any(o + s > d for o, s, d in zip(offsets, sizes, shape, strict=True)):
            raise ValueError(
                f"{hf_name}: shape {shape} does not hold the region offsets={offsets} "
                f"sizes={sizes} the model needs (does config.json match the weights?)"
            )
        heads = _heads_of(name, self.args)
        if heads is None or len(shape) != 2:
            region = tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))
            return self._slice(hf_name, region)
        head_dim = shape[0] // heads
        first, last = offsets[0] // head_dim, -(-(offsets[0] + sizes[0]) // head_dim)
        rows = slice(first * head_dim, last * head_dim)
        block = self._slice(hf_name, (rows, slice(offsets[1], offsets[1] + sizes[1])))
        block = _hf_rows_to_ours(block, last - first)
        start = offsets[0] - first * head_dim
        return block[start : start + sizes[0]]

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
    model: nn.Module | Iterable[nn.Module], folder: str | os.PathLike[str] | HFCheckpoint
) -> int:
    """Copy the weights of a Hugging Face checkpoint into ``model`` in place.

    Works on plain modules, on ``simplefsdp`` / FSDP2 / tensor-parallel models
    whose parameters are DTensors (each rank reads the region its shard
    holds) and on pipeline stages (a list of modules; a stage reads only its
    layers). No collective is called.

    Args:
        model: the model, or the modules of this rank's pipeline stages.
        folder: the checkpoint folder (or an open :class:`HFCheckpoint`).

    Returns:
        The number of elements read.

    Raises:
        ValueError: a tensor is missing or its shape does not fit the model.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from simplefsdp.frontend import disable_parametrization

    ckpt = folder if isinstance(folder, HFCheckpoint) else HFCheckpoint(folder)
    modules = [model] if isinstance(model, nn.Module) else list(model)
    read = 0
    try:
        for module in modules:
            with disable_parametrization(), torch.no_grad():
                state = get_model_state_dict(module)
                for name, tensor in state.items():
                    local, offsets, sizes = _local_region(tensor)
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
    """Write our full state dict as a Hugging Face Llama checkpoint folder.

    ``config.json``, ``model-0000i-of-0000n.safetensors`` (each at most
    ``max_shard_size`` unless one tensor is larger) and
    ``model.safetensors.index.json``. Each file is written under a temporary
    name and renamed; the index, written last, names only complete shards.

    Args:
        state: our full (unsharded) tensors by our names.
        args: the model's ``ModelArgs``.
        out: the folder to write (created; files of an earlier export in it
            are replaced).
        max_shard_size: bytes, or a size like ``"5GB"``.
        metadata: extra string metadata stored in every shard.

    Returns:
        The files written.

    Raises:
        ValueError: a tensor name is not a Llama 3 name, or a bad size.
    """
    import safetensors.torch as st

    limit = _parse_size(max_shard_size)
    hf: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        heads = _heads_of(name, args)
        value = tensor if heads is None else _our_rows_to_hf(tensor, heads)
        hf[to_hf_name(name)] = value.contiguous()
    dtypes = {t.dtype for t in hf.values() if t.is_floating_point()}
    dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(hf, key=_hf_order):
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
    config_path = folder / CONFIG_FILE
    _write_json(config_path, hf_config_from_model_args(args, dtype), mode)
    index_path = folder / INDEX_FILE
    _write_json(index_path, {"metadata": {"total_size": total}, "weight_map": weight_map}, mode)
    return [config_path, *written, index_path]


def _hf_order(name: str) -> tuple[int, str]:
    """Sort key: embeddings, then layer by layer, then the final norm and head."""
    match = _HF_LAYER.match(name)
    if match:
        return int(match.group(1)) + 1, match.group(2)
    return (0 if "embed_tokens" in name else 1 << 30), name


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
    """``simplefsdp export --format hf``: a checkpoint as a Hugging Face Llama folder.

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
    if hasattr(args, "num_experts"):
        raise ValueError(
            f"checkpoint {str(folder)!r} holds a mixture-of-experts model; --format hf writes "
            "Llama models only: export it with --format simplefsdp (the default)"
        )
    tensors = load_full_model_state(folder)
    if dtype is not None:
        cast = _DTYPES[dtype]
        tensors = {k: v.to(cast) if v.is_floating_point() else v for k, v in tensors.items()}
    step = (read_manifest(folder) or {}).get("step")
    meta = {"step": str(step), "source": str(folder)}
    return save_hf_checkpoint(tensors, args, out, max_shard_size=max_shard_size, metadata=meta)
