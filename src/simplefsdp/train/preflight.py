"""The inputs of a job, checked by ``simplefsdp train`` before any process starts.

:func:`check_inputs` looks at everything a run reads besides its own
checkpoints: ``data.path`` (text files, or a prepared token folder: its
index, tokenizer, largest id and shard sizes), ``data.tokenizer``,
``checkpoint.init_from_hf`` (``config.json`` readable by a model family and
agreeing with ``model.*``, safetensors present)
and whether the data's token ids fit the model's vocabulary. It collects
every problem, so that one run of the command names them all, one line each.
Nothing here reads a whole shard; shard checksums are verified while training
runs (see [Verified token data] in :mod:`simplefsdp.data.verify`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from simplefsdp.train.config import JobConfig

logger = logging.getLogger(__name__)


class InputErrors(ValueError):
    """Everything wrong with a job's inputs; ``errors`` holds one line each."""

    def __init__(self, errors: list[str]) -> None:
        super().__init__("\n".join(errors))
        self.errors = list(errors)


def _one_line(exc: BaseException) -> str:
    return "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())


def _tokenizer(spec: str) -> tuple[Any | None, str | None]:
    """``(tokenizer, None)`` or ``(None, problem)``."""
    if spec != "byte" and not Path(spec).expanduser().exists():
        return None, (
            f"data.tokenizer {spec!r} does not exist; use 'byte' or the path of a local "
            "tokenizer.json file or Hugging Face tokenizer folder"
        )
    from simplefsdp.data import load_tokenizer

    try:
        return load_tokenizer(spec), None
    except ValueError as exc:
        return None, f"data.tokenizer {spec!r}: {_one_line(exc)}"
    except Exception as exc:  # a tokenizers / transformers parse error
        return None, f"data.tokenizer {spec!r} cannot be loaded: {_one_line(exc)}"


def _hf_vocab(job: JobConfig, tok: Any | None, errors: list[str]) -> int | None:
    """The vocabulary of ``checkpoint.init_from_hf`` (problems go to ``errors``)."""
    folder = job.checkpoint.init_from_hf
    if folder is None:
        return None
    from simplefsdp.checkpoint.hf import CONFIG_FILE, HFCheckpoint
    from simplefsdp.train.parallelism import hf_model

    try:
        # the family the folder picks, checked against model.*; then its weights' files
        args = hf_model(job)[1]
        HFCheckpoint(folder, args=args).close()
    except ValueError as exc:
        errors.append(f"checkpoint.init_from_hf {folder!r}: {_one_line(exc)}")
        return None
    source = str(Path(folder) / CONFIG_FILE)
    m = job.model
    if tok is not None and tok.vocab_size > args.vocab_size:
        errors.append(
            f"the tokenizer's {tok.vocab_size} tokens do not fit the vocab_size "
            f"{args.vocab_size} of {source}; use the checkpoint's tokenizer (data.tokenizer)"
        )
    seq_len = job.data.seq_len
    max_seq = m.max_seq_len if m.max_seq_len is not None else args.max_seq_len
    if seq_len > max_seq:
        errors.append(
            f"data.seq_len {seq_len} exceeds max_position_embeddings {args.max_seq_len} of "
            f"{source}; lower data.seq_len or raise model.max_seq_len"
        )
    return int(args.vocab_size)


def _vocab_fix(job: JobConfig, largest: int, tok: Any | None) -> str:
    """How to make ids up to ``largest`` fit the model."""
    if job.checkpoint.init_from_hf is not None:
        return "train on data prepared with the checkpoint's tokenizer"
    if job.model.vocab_size is not None:
        own = f", or leave it out (the tokenizer's {tok.vocab_size})" if tok is not None else ""
        return f"use --model.vocab_size {largest + 1} or more{own}"
    return "prepare the data with this model's tokenizer"


def _prepared_problems(
    job: JobConfig, path: str, tok: Any | None, vocab: int | None, notes: list[str]
) -> list[str]:
    """A prepared token folder: its index, tokenizer, largest id and shard sizes."""
    import numpy as np

    from simplefsdp.data.prepare import (
        TokenShards,
        check_tokenizer,
        prepare_command,
        read_index,
    )

    try:
        index = read_index(path)
    except ValueError as exc:
        return [f"data.path {path!r}: {_one_line(exc)}"]
    errors = []
    if tok is not None:
        problem = check_tokenizer(index, path, job.data.tokenizer)
        if problem is not None:
            errors.append(problem)
    largest = index.get("max_id")
    what = "model.vocab_size" if job.model.vocab_size is not None else "the model's vocabulary"
    if job.checkpoint.init_from_hf is not None:
        what = f"the vocabulary of {job.checkpoint.init_from_hf}"
    if largest is None:
        notes.append(
            f"{path} was prepared without its largest token id and checksums; its shards "
            f"are checked on first use (re-run {prepare_command(index, path)} to check them "
            "before a run starts)"
        )
    elif vocab is not None and int(largest) >= vocab:
        errors.append(
            f"data.path {path!r} holds token ids up to {largest}, which do not fit {what} "
            f"({vocab} ids: 0 to {vocab - 1}); {_vocab_fix(job, int(largest), tok)}"
        )
    fix = f"re-run {prepare_command(index, path)} (it rebuilds damaged shards)"
    try:
        for split in ("train", "val"):
            TokenShards(path, index[split]["shards"], np.dtype(index["dtype"]), fix=fix)
    except (ValueError, KeyError, TypeError) as exc:
        errors.append(_one_line(exc))
    return errors


def _data_files_problem(path: str) -> str | None:
    """``data.path`` must hold at least one non-empty text file, and none that is
    mostly binary (judged by its head) or Parquet without pyarrow."""
    from simplefsdp.data import list_corpus_files, sniff_data_file

    try:
        _, files = list_corpus_files(path)
    except (FileNotFoundError, ValueError) as exc:
        return f"data.path {path!r}: {_one_line(exc)}"
    for f in files:
        problem = sniff_data_file(f)
        if problem is not None:
            return problem
    if not any(f.stat().st_size > 0 for f in files):
        what = "is empty" if Path(path).is_file() else "holds no non-empty text file"
        return (
            f"data.path {path!r} {what}; give a text file or a folder of text files with "
            "some text, or leave data.path unset for the embedded stdlib corpus"
        )
    return None


def input_problems(job: JobConfig) -> tuple[list[str], list[str]]:
    """``(errors, notes)`` about the job's inputs, one line each (see the module docstring)."""
    from simplefsdp.data.prepare import is_prepared

    errors: list[str] = []
    notes: list[str] = []
    tok, problem = _tokenizer(job.data.tokenizer)
    if problem is not None:
        errors.append(problem)
    hf_vocab = _hf_vocab(job, tok, errors)
    m = job.model
    if job.checkpoint.init_from_hf is not None:  # None when its folder is unreadable
        vocab = hf_vocab
    else:
        vocab = m.vocab_size or (tok.vocab_size if tok is not None else None)
    path = job.data.path
    if path is not None and not Path(path).expanduser().exists():
        errors.append(
            f"data.path {path!r} does not exist; give a text file, a folder of text files, "
            "a folder written by simplefsdp data prepare, or leave data.path unset for the "
            "embedded stdlib corpus"
        )
    elif is_prepared(path):
        assert path is not None
        errors += _prepared_problems(job, path, tok, vocab, notes)
    else:
        if path is not None:
            problem = _data_files_problem(path)
            if problem is not None:
                errors.append(problem)
        if tok is not None and m.vocab_size is not None and tok.vocab_size > m.vocab_size:
            errors.append(
                f"data.tokenizer {job.data.tokenizer!r} has {tok.vocab_size} tokens, which do "
                f"not fit model.vocab_size {m.vocab_size}; use --model.vocab_size "
                f"{tok.vocab_size} or more, or leave it out"
            )
    return errors, notes


def check_inputs(job: JobConfig) -> list[str]:
    """Check the job's inputs; return the notes (one line each) for the user.

    Raises:
        InputErrors: one line per problem, all of them.
    """
    errors, notes = input_problems(job)
    if errors:
        raise InputErrors(errors)
    return notes
