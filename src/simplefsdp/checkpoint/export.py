"""``simplefsdp export``: a checkpoint's full (unsharded) weights in one safetensors file.

``--format hf`` writes a Hugging Face folder instead (``config.json``,
sharded safetensors and ``model.safetensors.index.json``, loadable with
``transformers``' ``from_pretrained``) for a family with a Hugging Face
adapter: see :mod:`simplefsdp.checkpoint.hf`.

Example::

    simplefsdp export --checkpoint outputs/debug --out model.safetensors

(the newest run's newest complete checkpoint; see :mod:`simplefsdp.train.export_cli`
for what ``--checkpoint`` takes) writes ``model.safetensors`` (every model tensor under its plain state-dict
name, e.g. ``layers.0.attention.wq.weight``, full shape) and
``model.config.json`` (the model's family, flavor and configuration, the
training job config and the step), both with the mode a new file gets (``0o666 & ~umask``). The
checkpoint is read in this single process with ``torch.distributed.checkpoint``
(``no_dist=True``): no process group, GPU or original world size is needed, and
only the model's tensors are read (not the optimizer state). Loading the result
back (``examples/load_exported_model.py`` also generates text)::

    from safetensors.torch import load_file
    config = json.load(open("model.config.json"))
    spec, model_config = model_from_record(config)  # simplefsdp.models.record
    model = spec.build(model_config)
    model.load_state_dict(load_file("model.safetensors"))
"""

from __future__ import annotations

import argparse
import os
import re
import stat
import warnings
from pathlib import Path
from typing import Any

import torch

from simplefsdp.checkpoint import (
    CONFIG_NAME,
    DamagedCheckpointError,
    SafeFileSystemReader,
    TensorOnlyLoadPlanner,
    fsync_dir,
    read_json,
    read_manifest,
    resume_checkpoint,
    scan_checkpoints,
    step_dir_name,
    verify_checkpoint,
    write_json_atomic,
)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_MODEL_PREFIX = "model."
_STEP_DIR = re.compile(r"^step-(\d+)$")


def _require_safetensors() -> Any:
    try:
        import safetensors.torch
    except ImportError as exc:
        raise RuntimeError(
            "simplefsdp export needs the 'safetensors' package: pip install safetensors"
        ) from exc
    return safetensors.torch


def model_args_from_config(config: dict[str, Any]) -> Any:
    """The model configuration a checkpoint's (or an export's) config JSON
    records (build it with the family's spec: :func:`model_from_record`)."""
    from simplefsdp.models.record import model_from_record

    return model_from_record(config)[1]


def resolve_checkpoint(path: str | os.PathLike[str]) -> Path:
    """A complete checkpoint folder: ``path`` itself, or the latest one inside it.

    Every file is checked (size and sha256); a damaged checkpoint is refused,
    never passed over (see [Damaged checkpoints] in ``simplefsdp.checkpoint.steps``).

    Raises:
        ValueError: ``path`` is neither a complete checkpoint nor a folder
            holding one, or the checkpoint is damaged (naming the file and
            the previous good checkpoint).
    """
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"checkpoint {str(path)!r} does not exist or is not a folder")
    match = _STEP_DIR.match(folder.name)
    if match is not None or read_manifest(folder) is not None:
        problem = verify_checkpoint(folder, check_hashes=True)
        if problem is not None:
            step = int(match.group(1)) if match is not None else None
            raise _damaged(folder.parent, step, problem)
        return folder
    try:
        info = resume_checkpoint(folder)
    except DamagedCheckpointError as exc:
        raise _damaged(folder, exc.step, exc.problem) from None
    if info is None:
        raise ValueError(
            f"{str(path)!r} holds no complete checkpoint (a step-N folder with a valid "
            "manifest.json); give a checkpoint folder or the checkpoint.folder of a run"
        )
    problem = verify_checkpoint(info.path, check_hashes=True)
    if problem is not None:
        raise _damaged(folder, info.step, problem)
    return info.path


def _damaged(folder: Path, step: int | None, problem: str) -> ValueError:
    """The one-line export error for the damaged checkpoint ``step`` of ``folder``."""
    if step is None:
        return ValueError(f"checkpoint is damaged: {problem}")
    previous = scan_checkpoints(folder).previous_good(step)
    fallback = (
        "there is no earlier complete checkpoint"
        if previous is None
        else f"the previous good checkpoint is step {previous}: export it with "
        f"--checkpoint {folder / step_dir_name(previous)}"
    )
    return ValueError(
        f"checkpoint {folder / step_dir_name(step)} is damaged: {problem}; {fallback}"
    )


def load_full_model_state(folder: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Read the full, unsharded model tensors of a DCP checkpoint in this process.

    Returns:
        ``{name: tensor}`` with plain state-dict names and full shapes, on CPU.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    # Restricted unpickling of .metadata, tensors only: see [Loading never runs checkpoint code].
    reader = SafeFileSystemReader(str(folder))
    metadata = reader.read_metadata().state_dict_metadata
    model: dict[str, torch.Tensor] = {}
    for key, meta in metadata.items():
        if key.startswith(_MODEL_PREFIX) and isinstance(meta, TensorStorageMetadata):
            model[key[len(_MODEL_PREFIX) :]] = torch.empty(meta.size, dtype=meta.properties.dtype)
    if not model:
        raise ValueError(f"checkpoint {str(folder)!r} holds no model tensors")
    with warnings.catch_warnings():
        # Loading without a process group is the intent here, not an accident.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(
            {"model": model}, storage_reader=reader, planner=TensorOnlyLoadPlanner(), no_dist=True
        )
    return model


def export_checkpoint(
    checkpoint: str | os.PathLike[str], out: str | os.PathLike[str], *, dtype: str | None = None
) -> tuple[Path, Path]:
    """Write the full weights of ``checkpoint`` to ``out`` and its config next to it.

    Args:
        checkpoint: a checkpoint folder or a run's checkpoint folder (latest).
        out: the ``.safetensors`` file to write (atomically).
        dtype: cast floating-point tensors to ``float32``/``bfloat16``/``float16``
            (``None``: keep the training dtype).

    Returns:
        ``(weights_path, config_path)``.

    Raises:
        ValueError: bad checkpoint or dtype.
        RuntimeError: ``safetensors`` is not installed.
    """
    st = _require_safetensors()
    if dtype is not None and dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; valid: {', '.join(_DTYPES)}")
    folder = resolve_checkpoint(checkpoint)
    tensors = load_full_model_state(folder)
    if dtype is not None:
        tensors = {
            k: v.to(_DTYPES[dtype]) if v.is_floating_point() else v for k, v in tensors.items()
        }
    config = read_json(folder / CONFIG_NAME)
    manifest = read_manifest(folder) or {}
    out_path = Path(out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(out_path.name + ".tmp")
    mode = _new_file_mode(tmp)
    meta = {"format": "pt", "step": str(manifest.get("step")), "source": str(folder)}
    try:
        st.save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=meta)
        os.chmod(tmp, mode)  # safetensors writes through its own 0600 temporary file
        with open(tmp, "rb+") as f:  # on disk before the rename publishes it
            os.fsync(f.fileno())
        os.replace(tmp, out_path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(out_path.parent)
    config_path = out_path.with_name(out_path.stem + ".config.json")
    write_json_atomic(config_path, {**config, "step": manifest.get("step"), "source": str(folder)})
    os.chmod(config_path, mode)
    return out_path, config_path


def _new_file_mode(path: Path) -> int:
    """The mode ``open(path, "w")`` gives a new file: ``0o666 & ~umask``.

    Found by creating ``path`` (removed first, so its old mode does not count),
    which reads the umask without setting it (``os.umask`` would change it for
    every thread of the process for a moment).
    """
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        return stat.S_IMODE(os.fstat(fd).st_mode)
    finally:
        os.close(fd)


def build_parser() -> argparse.ArgumentParser:
    """The arguments of ``simplefsdp export``."""
    parser = argparse.ArgumentParser(
        prog="simplefsdp export",
        description="Write a checkpoint's full (unsharded) model weights to one safetensors file.",
        allow_abbrev=False,
    )
    parser.add_argument(
        "--checkpoint",
        required=True,
        help="a folder of runs (metrics.output_dir: the newest run), a run folder, a run's "
        "checkpoint folder (its newest complete checkpoint) or a step-N folder",
    )
    parser.add_argument(
        "--out",
        required=True,
        help="output .safetensors file (--format hf: the folder to write)",
    )
    parser.add_argument(
        "--format",
        choices=("simplefsdp", "hf"),
        default="simplefsdp",
        help="simplefsdp: our names in one file (default); hf: a Hugging Face Llama "
        "folder (config.json, sharded safetensors and the index) for "
        "LlamaForCausalLM.from_pretrained",
    )
    parser.add_argument(
        "--max-shard-size",
        default="5GB",
        help="--format hf: the largest safetensors shard, e.g. 5GB or 500MB (default 5GB)",
    )
    parser.add_argument(
        "--dtype", choices=sorted(_DTYPES), default=None, help="cast floating-point weights"
    )
    return parser
