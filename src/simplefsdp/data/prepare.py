"""``simplefsdp data prepare``: a corpus tokenised once into memory-mapped token shards.

Example::

    simplefsdp data prepare --input corpus/ --out tokens/ --tokenizer byte --workers 8

reads the input like ``data.path`` does (text files, JSON Lines and Parquet
by ``--text-field``, folders recursively) or a Hugging Face ``datasets``
``Dataset.save_to_disk`` folder (its Arrow files, with ``pyarrow``), tokenises every file in a pool of
worker processes and writes, per input file ``i``, ``shards/{i:06d}.train.bin``
and ``shards/{i:06d}.val.bin`` (raw little-endian ``uint16`` ids, or ``uint32``
for vocabularies above 65536; every document followed by EOS; documents go to
validation by the same hash of their name as in memory) and then
``index.json``: the tokenizer's identity (with a digest of its definition),
the vocabulary size and largest id, the dtype, every shard's tokens,
documents, largest id and CRC-32, and the fingerprint of the training
stream. With ``--format chat`` each shard has a ``.mask`` file beside it
(one byte per token: 1 on the assistant's tokens; see :mod:`simplefsdp.data.chat`). ``--data.path tokens/``
then trains on it by memory map (see :class:`TokenShards`).

Note: [Prepared shards are complete or absent]
    A shard is written under a temporary name, fsynced and renamed, then its
    small ``.json`` record (tokens, documents, CRC-32, largest id, the
    tokenizer's digest) is written the same way; ``index.json`` is written
    last. Running the command again keeps the files whose record exists,
    names the same tokenizer and whose shards have the recorded size and
    checksum, so an interrupted run resumes and a damaged shard is built
    again; a shard without its record (the process died in between) is
    written again. A loader opens only a folder with ``index.json``, checks
    each shard's size against it and its checksum once in the background
    (see [Verified token data] in :mod:`simplefsdp.data.verify`).

The training stream of the shards is the concatenation of the train shards
in file order, which is exactly the stream :func:`build_corpus` builds in
memory from the same input, tokenizer and ``val_fraction``: a run may switch
between the two and resume (same fingerprint). If the hash leaves one split
empty, the last ``val_fraction`` of the stream is held out, as in memory.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import mmap
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .corpus import (
    DEFAULT_TEXT_FIELD,
    Document,
    TokenCorpus,
    _split_bucket,
    _token_stream,
    list_corpus_files,
    read_documents,
)
from .tokenizer import Tokenizer, load_tokenizer, tokenizer_digest
from .verify import DataError, ShardCheck, ShardVerifier, scan_shard

logger = logging.getLogger(__name__)

INDEX_NAME = "index.json"
FORMAT = "simplefsdp-tokens-v1"
#: ``--format``: ``text`` (documents) or ``chat`` (conversations with a loss mask).
FORMATS = ("text", "chat")


def tokenizer_id(tok: Tokenizer, spec: str, digest: str | None = None) -> dict[str, Any]:
    """What identifies a tokenizer in an index: its spec, a digest of its
    definition (:func:`tokenizer_digest`), vocabulary size, EOS and repr."""
    return {
        "spec": spec,
        "digest": digest if digest is not None else tokenizer_digest(spec),
        "vocab_size": int(tok.vocab_size),
        "eos_id": int(tok.eos_id),
        "repr": repr(tok),
    }


def _np_dtype(vocab_size: int) -> np.dtype:
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


def is_prepared(path: str | os.PathLike[str] | None) -> bool:
    """Whether ``path`` is a folder written by :func:`prepare` (holds ``index.json``)."""
    return path is not None and (Path(path) / INDEX_NAME).is_file()


def read_index(folder: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``index.json`` of a prepared folder.

    Raises:
        ValueError: it cannot be read or is not a simplefsdp token index.
    """
    path = Path(folder) / INDEX_NAME
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise ValueError(f"{path} is not a simplefsdp token index ({FORMAT})")
    return index


def prepare_command(index: dict[str, Any], folder: str | os.PathLike[str]) -> str:
    """The ``simplefsdp data prepare`` command that (re)builds ``folder``."""
    tok = index.get("tokenizer", {}).get("spec", "byte")
    words = ["simplefsdp data prepare", "--input", str(index.get("input", "INPUT")),
             "--out", str(folder), "--tokenizer", str(tok)]  # fmt: skip
    if index.get("data_format", "text") != "text":
        words += ["--format", str(index["data_format"])]
    default_field = "messages" if index.get("data_format") == "chat" else DEFAULT_TEXT_FIELD
    if index.get("text_field", default_field) != default_field:
        words += ["--text-field", str(index["text_field"])]
    if index.get("val_fraction", 0.05) != 0.05:
        words += ["--val-fraction", str(index["val_fraction"])]
    return " ".join(words)


# --------------------------------------------------------------------------- writing


def _write_atomic(path: Path, data: bytes | memoryview) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _record_ok(shards: Path, i: int, settings: dict[str, Any]) -> dict[str, Any] | None:
    """The record of input ``i`` when it and its shards are complete and intact:
    the same ``settings`` (tokenizer digest, format, field, validation fraction),
    every file of the recorded size and checksum.

    A shard that fails its checksum is logged (it is built again).
    """
    try:
        record = json.loads((shards / f"{i:06d}.json").read_text(encoding="utf-8"))
        if any(record.get(k) != v for k, v in settings.items()):
            return None
        fmt = settings["data_format"]
        for split in ("train", "val"):
            part = record[split]
            files = [(part["file"], part["checksum"])]
            if fmt == "chat":
                files.append((part["mask"], part["mask_checksum"]))
            for name, checksum in files:
                if (shards / name).stat().st_size != part[
                    "bytes" if name == part["file"] else "tokens"
                ]:
                    return None
                if scan_shard(shards / name)[0] != checksum:
                    logger.warning(
                        "%s is damaged (checksum differs); building it again", shards / name
                    )
                    return None
        return record
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _datasets_files(folder: Path) -> list[Path] | None:
    """The Arrow files of a Hugging Face ``datasets`` ``Dataset.save_to_disk`` folder.

    ``None`` when ``folder`` is not one (no ``state.json`` naming ``_data_files``).
    They are read with ``pyarrow`` (``datasets`` itself is not needed).

    Raises:
        ValueError: a ``DatasetDict`` folder (name one of its splits), a
            listed file is missing, or ``pyarrow`` is not installed.
    """
    if (folder / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in folder.iterdir() if (p / "state.json").is_file())
        raise ValueError(
            f"{folder} is a datasets DatasetDict; give one of its splits: "
            + ", ".join(str(folder / s) for s in splits)
        )
    state = folder / "state.json"
    if not state.is_file():
        return None
    try:
        names = [d["filename"] for d in json.loads(state.read_text())["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        raise ValueError(
            f"{folder} is a datasets folder; reading it needs pyarrow: pip install pyarrow"
        ) from None
    files = [folder / n for n in names]
    for f in files:
        if not f.is_file():
            raise ValueError(f"{f} (named by {state}) does not exist")
    return files


def _arrow_documents(path: Path, rel: str, field: str) -> list[Document]:
    """The documents of a ``datasets`` Arrow file's column ``field`` (one per row)."""
    import pyarrow as pa

    try:
        with pa.memory_map(str(path)) as source:
            table = pa.ipc.open_stream(source).read_all()
    except (OSError, pa.ArrowInvalid) as exc:
        raise ValueError(f"{path}: not a readable Arrow stream file ({exc})") from None
    if field not in table.column_names:
        raise ValueError(
            f"{path} has no column {field!r} (columns: {', '.join(table.column_names[:10])}); "
            "pass --text-field"
        )
    docs = []
    for row, value in enumerate(table.column(field).to_pylist()):
        if value is not None and not isinstance(value, str):
            raise ValueError(f"{path}: row {row} of column {field!r} is not text ({value!r:.40})")
        if value:
            docs.append(Document(f"{rel}:{row}", value))
    return docs


def _check_jsonl(path: Path) -> None:
    """A JSON Lines line that is not JSON is an error naming the file and line.

    (Training on the files directly skips such lines with a warning; a
    prepared corpus is meant to hold everything its input holds.)
    """
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, start=1):
            if line.strip():
                try:
                    json.loads(line)
                except ValueError as exc:
                    msg = getattr(exc, "msg", str(exc))
                    raise ValueError(f"{path}: line {lineno} is not JSON ({msg})") from None


def _documents(file: str, rel: str, field: str) -> list[Document]:
    """The documents of one input file (text, JSON Lines, Parquet or Arrow)."""
    if Path(file).suffix.lower() in (".jsonl", ".ndjson"):
        _check_jsonl(Path(file))
    if Path(file).suffix == ".arrow":
        return _arrow_documents(Path(file), rel, field)
    try:
        docs = read_documents(file, text_field=field, report=False)
    except ValueError as exc:
        if "contains no readable, non-empty text" in str(exc):
            return []
        raise
    base = Path(file).name
    return [Document(rel + d.name[len(base) :], d.text) for d in docs]


def _chat_stream(
    spec: str, eos_id: int, convs: list[tuple[str, list[dict[str, str]]]]
) -> tuple[np.ndarray, np.ndarray]:
    """Ids and loss mask of conversations, each followed by EOS (mask 0)."""
    from .chat import ChatRenderer

    renderer = ChatRenderer(spec)
    ids: list[int] = []
    mask: list[int] = []
    for name, messages in convs:
        i, m = renderer.render(messages, name)
        ids += [*i, eos_id]
        mask += [*m, 0]
    return np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=np.uint8)


def _prepare_file(job: tuple[Any, ...]) -> dict[str, Any]:
    """Worker: tokenise input ``i`` into its shards and write its record."""
    i, file, rel, spec, field, val_fraction, out, fmt, digest = job
    shards = Path(out) / "shards"
    settings = {"tokenizer": digest, "data_format": fmt, "text_field": field,
                "val_fraction": val_fraction}  # fmt: skip
    record = _record_ok(shards, i, settings)
    if record is not None:
        return {**record, "skipped": True}
    logging.getLogger("simplefsdp.data.corpus").setLevel(logging.WARNING)  # per-file notes
    tok = load_tokenizer(spec)
    np_dtype = _np_dtype(tok.vocab_size)
    if fmt == "chat":
        from .chat import read_conversations

        convs = read_conversations(Path(file), rel, field)
    else:
        docs = _documents(file, rel, field)
        dtype = torch.int32 if tok.vocab_size > 2**15 else torch.int16
    record = {"input": rel, **settings}
    for split in ("train", "val"):
        mask = None
        if fmt == "chat":
            chosen_c = [
                c for c in convs if (_split_bucket(c[0]) < val_fraction) == (split == "val")
            ]
            ids, mask = _chat_stream(spec, tok.eos_id, chosen_c)
            n_docs = len(chosen_c)
        else:
            chosen = [d for d in docs if (_split_bucket(d.name) < val_fraction) == (split == "val")]
            ids = _token_stream(tok, chosen, dtype).numpy()
            n_docs = len(chosen)
        largest = int(ids.max()) if ids.size else -1
        if largest >= tok.vocab_size:
            raise ValueError(
                f"{file}: tokenizer {spec!r} produced id {largest}, outside its vocabulary "
                f"of {tok.vocab_size}"
            )
        tokens = ids.astype(np_dtype)
        data = memoryview(tokens).cast("B")
        name = f"{i:06d}.{split}.bin"
        _write_atomic(shards / name, data)
        part = {
            "file": name,
            "tokens": int(tokens.size),
            "documents": n_docs,
            "bytes": len(data),
            "checksum": scan_shard(shards / name)[0],
            "max_id": largest,
        }
        if mask is not None:
            part["mask"] = f"{i:06d}.{split}.mask"
            _write_atomic(shards / part["mask"], memoryview(mask).cast("B"))
            part["mask_checksum"] = scan_shard(shards / part["mask"])[0]
            part["trained_tokens"] = int(mask.sum())
        record[split] = part
    _write_atomic(shards / f"{i:06d}.json", json.dumps(record).encode())
    return {**record, "skipped": False}


def prepare(
    inputs: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    tokenizer: str = "byte",
    text_field: str | None = None,
    val_fraction: float = 0.05,
    workers: int = 1,
    progress: bool = True,
    data_format: str = "text",
) -> dict[str, Any]:
    """Tokenise ``inputs`` into shards and an index in ``out`` (see the module docstring).

    Args:
        inputs: a text / JSON Lines / Parquet file or a folder of them.
        out: the output folder (created; an earlier run's complete shards
            whose checksums hold are kept, damaged ones built again).
        tokenizer: ``"byte"`` or a Hugging Face tokenizer path.
        text_field: JSON Lines field / Parquet column of the text
            (``"text"``), or of the messages with ``data_format="chat"``
            (``"messages"``).
        val_fraction: fraction of documents held out for validation.
        workers: tokenising processes.
        progress: show a progress line on standard error (on a terminal only).
        data_format: one of :data:`FORMATS`: ``"text"`` documents, or
            ``"chat"`` conversations rendered by the tokenizer's chat
            template, with a loss mask over the assistant's tokens
            (see :mod:`simplefsdp.data.chat`).

    Returns:
        The index written.

    Raises:
        ValueError: a file cannot be read (naming it), bad arguments.
        FileNotFoundError: ``inputs`` does not exist.
    """
    if data_format not in FORMATS:
        raise ValueError(f"invalid format {data_format!r}; valid: {list(FORMATS)}")
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"invalid val_fraction {val_fraction!r}; must be in [0, 1)")
    if workers < 1:
        raise ValueError(f"invalid workers {workers!r}; must be >= 1")
    if not Path(inputs).expanduser().exists():
        raise FileNotFoundError(
            f"input {str(inputs)!r} does not exist; give a text, JSON Lines or Parquet file "
            "or a folder of them"
        )
    if text_field is None:
        from .chat import DEFAULT_MESSAGES_FIELD

        text_field = DEFAULT_MESSAGES_FIELD if data_format == "chat" else DEFAULT_TEXT_FIELD
    tok = load_tokenizer(tokenizer)
    digest = tokenizer_digest(tokenizer)
    if data_format == "chat":
        from .chat import ChatRenderer

        ChatRenderer(tokenizer)  # one line now, not one per worker
    arrow = _datasets_files(Path(inputs))
    root, files = (Path(inputs), arrow) if arrow is not None else list_corpus_files(inputs)
    if not files:
        raise ValueError(f"{str(inputs)!r} holds no text, JSON Lines or Parquet files")
    folder = Path(out)
    (folder / "shards").mkdir(parents=True, exist_ok=True)
    (folder / INDEX_NAME).unlink(missing_ok=True)  # the index names complete shards only
    jobs = [
        (i, str(f), f.relative_to(root).as_posix(), tokenizer, text_field, val_fraction,
         str(out), data_format, digest)
        for i, f in enumerate(files)
    ]  # fmt: skip
    total_bytes = sum(f.stat().st_size for f in files)
    start = time.perf_counter()
    records: list[dict[str, Any]] = []
    bar = _progress(len(files), total_bytes, progress and sys.stderr.isatty())
    with ProcessPoolExecutor(max_workers=workers) as pool:
        for (_, file, *_rest), record in zip(jobs, pool.map(_prepare_file, jobs), strict=True):
            records.append(record)
            bar(Path(file).stat().st_size, record)
    bar(None, None)
    kept = sum(1 for r in records if r["skipped"])
    if kept:
        logger.info(
            "kept %d of %d files' shards from an earlier run (checksums hold)", kept, len(records)
        )
    meta = {"input": str(Path(inputs).expanduser().resolve()), "data_format": data_format}
    index = _write_index(folder, records, tok, tokenizer, text_field, val_fraction, digest, meta)
    elapsed = time.perf_counter() - start
    index_tokens = index["train"]["tokens"] + index["val"]["tokens"]
    logger.info(
        "prepared %d files (%d bytes) into %d tokens in %.1f s (%.0f tokens/s)",
        len(files),
        total_bytes,
        index_tokens,
        elapsed,
        index_tokens / max(elapsed, 1e-9),
    )
    return index


def _progress(files: int, total_bytes: int, enabled: bool):
    """A callable advancing a one-line progress display (``None`` closes it).

    Only for a terminal: a log file or a pipe gets no carriage returns.
    """
    done = {"files": 0, "bytes": 0, "tokens": 0, "t0": time.perf_counter()}

    def update(nbytes: int | None, record: dict[str, Any] | None) -> None:
        if not enabled:
            return
        if nbytes is None:
            sys.stderr.write("\n")
            return
        done["files"] += 1
        done["bytes"] += nbytes
        done["tokens"] += record["train"]["tokens"] + record["val"]["tokens"]  # type: ignore[index]
        elapsed = max(time.perf_counter() - done["t0"], 1e-9)
        sys.stderr.write(
            f"\rprepare: {done['files']}/{files} files, "
            f"{done['bytes'] / 2**20:.0f}/{total_bytes / 2**20:.0f} MiB, "
            f"{done['tokens'] / elapsed:,.0f} tokens/s"
        )
        sys.stderr.flush()

    return update


_SHARD_KEYS = ("file", "tokens", "documents", "checksum", "max_id", "mask", "mask_checksum",
               "trained_tokens")  # fmt: skip


def _write_index(
    folder: Path,
    records: list[dict[str, Any]],
    tok: Tokenizer,
    spec: str,
    field: str,
    val_fraction: float,
    digest: str,
    meta: dict[str, Any],
) -> dict[str, Any]:
    """Hash the training stream and write ``index.json`` (last)."""
    dtype = _np_dtype(tok.vocab_size)
    chat = meta["data_format"] == "chat"
    splits: dict[str, Any] = {}
    for split in ("train", "val"):
        parts = [r[split] for r in records if r[split]["tokens"]]
        splits[split] = {
            "shards": [{k: p[k] for k in _SHARD_KEYS if k in p} for p in parts],
            "tokens": sum(p["tokens"] for p in parts),
            "documents": sum(p["documents"] for p in parts),
        }
        if chat:
            splits[split]["trained_tokens"] = sum(p["trained_tokens"] for p in parts)
    max_id = max((p["max_id"] for r in records for p in (r["train"], r["val"])), default=-1)
    tail = 0
    if val_fraction > 0 and (not splits["train"]["tokens"] or not splits["val"]["tokens"]):
        source = "train" if splits["train"]["tokens"] else "val"
        total = splits[source]["tokens"]
        tail = max(1, round(total * val_fraction))
        splits["train"], splits["val"] = splits[source], {"shards": [], "tokens": 0}
    index = {
        "format": FORMAT,
        "data_format": meta["data_format"],
        "input": meta["input"],
        "tokenizer": tokenizer_id(tok, spec, digest),
        "vocab_size": int(tok.vocab_size),
        "max_id": int(max_id),
        "checksum": "crc32",
        "loss_mask": chat,
        "dtype": dtype.name,
        "text_field": field,
        "val_fraction": val_fraction,
        "val_tail_tokens": tail,
        "train": splits["train"],
        "val": splits["val"],
    }
    shards = TokenShards(folder, index["train"]["shards"], dtype)
    train = shards.view(0, shards.numel() - tail)
    index["train_fingerprint"] = train.compute_fingerprint()
    _write_atomic(folder / INDEX_NAME, (json.dumps(index, indent=1) + "\n").encode())
    return index


# --------------------------------------------------------------------------- reading


class TokenShards:
    """The concatenation of token shards, read by memory map.

    Only the pages a batch touches are read; opening costs one ``stat`` per
    shard (its size is checked against the index) whatever its size, and a
    shard's memory map is opened when a batch first needs it. Supports what the loader needs:
    :meth:`numel`, :meth:`gather` (an index tensor -> int64 tokens),
    :meth:`gather_mask` (the loss mask of chat data) and :meth:`view` (a sub-range).

    Args:
        folder: the prepared folder.
        shards: ``[{"file": ..., "tokens": n}, ...]`` in stream order (with
            ``"mask"``: the loss mask files of chat data).
        dtype: the numpy dtype of the shard files.
        vocab_size: :meth:`gather` refuses ids at or above it (a damaged
            shard: one line naming it); ``None``: not checked.
        fix: the command that rebuilds the folder, for the errors.

    Raises:
        ValueError: a shard is missing or has another size than recorded.
    """

    def __init__(
        self,
        folder: str | os.PathLike[str],
        shards: list[dict[str, Any]],
        dtype: np.dtype,
        *,
        vocab_size: int | None = None,
        fix: str = "run simplefsdp data prepare again",
    ) -> None:
        self.folder = Path(folder)
        self.dtype = dtype
        self.vocab_size = vocab_size
        self.fix = fix
        self.has_mask = bool(shards) and all("mask" in s for s in shards)
        self.paths = []
        self.mask_paths = []
        for shard in shards:
            path = self.folder / "shards" / shard["file"]
            _check_size(path, int(shard["tokens"]) * dtype.itemsize, fix)
            self.paths.append(path)
            if self.has_mask:
                mask = self.folder / "shards" / shard["mask"]
                _check_size(mask, int(shard["tokens"]), fix)
                self.mask_paths.append(mask)
        # Memory maps are opened on first use: start-up costs one stat per shard.
        self._arrays: dict[tuple[int, bool], np.memmap] = {}
        lengths = np.array([int(s["tokens"]) for s in shards], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        self.lo, self.hi = 0, int(self.starts[-1])
        self.fingerprint: dict[str, int] = {}

    def array(self, i: int, mask: bool = False) -> np.memmap:
        """The memory map of shard ``i`` (of its loss mask with ``mask``; opened on first use)."""
        if (i, mask) not in self._arrays:
            path, dtype = (self.mask_paths[i], np.uint8) if mask else (self.paths[i], self.dtype)
            array = np.memmap(path, dtype=dtype, mode="r")
            raw = getattr(array, "_mmap", None)
            if raw is not None and hasattr(mmap, "MADV_RANDOM"):
                # Sequences are read at random places: no read-ahead around each one.
                raw.madvise(mmap.MADV_RANDOM)
            self._arrays[(i, mask)] = array
        return self._arrays[(i, mask)]

    @property
    def arrays(self) -> list[np.memmap]:
        """Every shard's memory map (opens them all)."""
        return [self.array(i) for i in range(len(self.paths))]

    def numel(self) -> int:
        """Tokens in this (view of the) stream."""
        return self.hi - self.lo

    def view(self, lo: int, hi: int) -> TokenShards:
        """Tokens ``lo ... hi - 1`` of this stream, sharing the memory maps."""
        out = object.__new__(TokenShards)
        out.__dict__.update(self.__dict__)
        out.lo, out.hi = self.lo + lo, self.lo + hi
        out.fingerprint = {}
        return out

    def _gather(self, index: torch.Tensor, mask: bool) -> np.ndarray:
        flat = index.reshape(-1).numpy() + self.lo
        which = np.searchsorted(self.starts, flat, side="right") - 1
        out = np.empty(flat.size, dtype=np.uint8 if mask else np.int64)
        for s in np.unique(which):
            at = which == s
            values = self.array(int(s), mask)[flat[at] - self.starts[s]]
            if not mask and self.vocab_size is not None and values.size:
                largest = int(values.max())
                if largest >= self.vocab_size:
                    raise DataError(
                        f"token shard {self.paths[s]} holds token id {largest}, outside the "
                        f"vocabulary of {self.vocab_size}: the shard is damaged; {self.fix}"
                    )
            out[at] = values
        return out

    def gather(self, index: torch.Tensor) -> torch.Tensor:
        """Tokens at positions ``index`` (any shape) as an int64 tensor.

        Raises:
            DataError: an id at or above ``vocab_size`` (one line naming the shard).
        """
        return torch.from_numpy(self._gather(index, False)).reshape(index.shape)

    def gather_mask(self, index: torch.Tensor) -> torch.Tensor:
        """The loss mask at positions ``index`` as a bool tensor (True: trained on)."""
        return torch.from_numpy(self._gather(index, True).view(np.bool_)).reshape(index.shape)

    def compute_fingerprint(self, chunk: int = 1 << 24) -> dict[str, int]:
        """``data_fingerprint`` of the stream (reads it all, shard by shard: for :func:`prepare`)."""
        digest = hashlib.sha256()
        for i, first in enumerate(self.starts[:-1]):
            lo = max(self.lo - int(first), 0)
            hi = min(self.hi - int(first), int(self.starts[i + 1] - first))
            if hi <= lo:
                continue
            for pos in range(lo, hi, chunk):  # plain reads: no pages left mapped
                n = min(chunk, hi - pos)
                part = np.fromfile(self.paths[i], self.dtype, n, offset=pos * self.dtype.itemsize)
                digest.update(part.astype(np.int32).tobytes())
        return {
            "num_tokens": self.numel(),
            "data_hash": int.from_bytes(digest.digest()[:8], "big") >> 1,
        }


def _check_size(path: Path, want: int, fix: str) -> None:
    try:
        size = os.stat(path).st_size
    except OSError:
        raise ValueError(f"token shard {path} is missing: the folder is damaged; {fix}") from None
    if size != want:
        raise ValueError(
            f"token shard {path} has {size} bytes, index.json says {want}: the folder is "
            f"damaged; {fix}"
        )


def shard_checks(folder: str | os.PathLike[str], index: dict[str, Any]) -> list[ShardCheck]:
    """Every file of a prepared folder with its recorded checksum (for :class:`ShardVerifier`)."""
    dtype = np.dtype(index["dtype"])
    shards = Path(folder) / "shards"
    checks = []
    for split in ("train", "val"):
        for s in index[split]["shards"]:
            checks.append(ShardCheck(shards / s["file"], s.get("checksum"), dtype))
            if "mask" in s:
                checks.append(ShardCheck(shards / s["mask"], s.get("mask_checksum")))
    return checks


def check_tokenizer(index: dict[str, Any], folder: str | os.PathLike[str], spec: str) -> str | None:
    """Why tokenizer ``spec`` is not the one ``folder`` was prepared with, or ``None``.

    Compared by the digest of its definition (where it lies does not
    matter); an index without a digest by vocabulary size and EOS id.
    """
    theirs = index.get("tokenizer", {})
    try:
        digest = tokenizer_digest(spec)
    except ValueError as exc:
        return str(exc)
    if "digest" in theirs:
        if digest == theirs["digest"]:
            return None
        mine = f"{spec!r}"
    else:
        tok = load_tokenizer(spec)
        if int(tok.vocab_size) == theirs.get("vocab_size") and int(tok.eos_id) == theirs.get(
            "eos_id"
        ):
            return None
        mine = f"{spec!r} (vocab {tok.vocab_size})"
    return (
        f"data.tokenizer {mine} is not the tokenizer {folder} was prepared with "
        f"({theirs.get('spec')!r}, vocab {theirs.get('vocab_size')}); use --data.tokenizer "
        f"{theirs.get('spec')!r} or prepare the data again with this tokenizer"
    )


@dataclass
class PreparedData:
    """A prepared folder opened for training.

    Attributes:
        verifier: Verifies the shards' checksums in the background (started
            by :func:`load_prepared` with ``verify``), else ``None``.
    """

    corpus: TokenCorpus
    train: TokenShards
    val: TokenShards | None
    verifier: ShardVerifier | None = None


def load_prepared(
    folder: str | os.PathLike[str],
    tok: Tokenizer,
    spec: str,
    *,
    vocab_size: int | None = None,
    verify: tuple[int, int] | None = None,
) -> PreparedData:
    """Open a :func:`prepare` folder for ``tok`` (its identity must match the index).

    Args:
        folder: the prepared folder.
        tok: the tokenizer (the one the folder was prepared with).
        spec: how it was given (``data.tokenizer``).
        vocab_size: the model's vocabulary: every batch's ids are checked
            against it (default: the tokenizer's).
        verify: ``(i, n)``: verify every ``n``-th shard from the ``i``-th in
            a background thread (see [Verified token data]); ``None``: not.

    Raises:
        ValueError: not a prepared folder, another tokenizer (one line naming
            both), or a missing or truncated shard.
    """
    index = read_index(folder)
    problem = check_tokenizer(index, folder, spec)
    if problem is not None:
        raise ValueError(problem)
    vocab = int(vocab_size if vocab_size is not None else tok.vocab_size)
    fix = f"re-run {prepare_command(index, folder)} (it rebuilds damaged shards)"
    dtype = np.dtype(index["dtype"])
    train_all = TokenShards(folder, index["train"]["shards"], dtype, vocab_size=vocab, fix=fix)
    tail = int(index.get("val_tail_tokens", 0))
    train = train_all.view(0, train_all.numel() - tail)
    train.fingerprint = {k: int(v) for k, v in index["train_fingerprint"].items()}
    if tail:
        val: TokenShards | None = train_all.view(train_all.numel() - tail, train_all.numel())
        n_val_docs = 0
    else:
        val = (
            TokenShards(folder, index["val"]["shards"], dtype, vocab_size=vocab, fix=fix)
            if index["val"]["shards"]
            else None
        )
        n_val_docs = int(index["val"].get("documents", 0))
    verifier = None
    if verify is not None:
        i, n = verify
        checks = shard_checks(folder, index)[i::n]
        if "checksum" not in index:  # simplefsdp train's launcher said so once already
            logger.info(
                "%s was prepared without checksums: its shards are checked by their ids on "
                "first use; re-run %s to record checksums",
                folder,
                prepare_command(index, folder),
            )
        verifier = ShardVerifier(checks, vocab_size=vocab, fix=fix).start()
    corpus = TokenCorpus(
        train=torch.empty(0, dtype=torch.int32),  # the tokens stay in the shards
        val=torch.empty(0, dtype=torch.int32),
        vocab_size=tok.vocab_size,
        eos_id=tok.eos_id,
        num_train_docs=int(index["train"].get("documents", 0)),
        num_val_docs=n_val_docs,
        source=str(folder),
    )
    logger.info(
        "prepared tokens %s: %d train tokens (%d shards), %d val tokens, memory-mapped",
        folder,
        train.numel(),
        len(train.paths),
        0 if val is None else val.numel(),
    )
    return PreparedData(corpus, train, val, verifier)


def verify_folder(folder: str | os.PathLike[str]) -> tuple[int, str | None]:
    """Verify every shard of ``folder`` now: ``(files verified, problem or None)``."""
    index = read_index(folder)
    vocab = int(index.get("vocab_size", index["tokenizer"]["vocab_size"]))
    fix = f"re-run {prepare_command(index, folder)} (it rebuilds damaged shards)"
    for split in ("train", "val"):
        try:
            TokenShards(folder, index[split]["shards"], np.dtype(index["dtype"]), fix=fix)
        except ValueError as exc:
            return 0, str(exc)
    verifier = ShardVerifier(shard_checks(folder, index), vocab_size=vocab, fix=fix)
    verifier.run()
    return verifier.verified, verifier.error


# --------------------------------------------------------------------------- command

#: How the messages of the data package name the settings of ``simplefsdp train``,
#: and how ``simplefsdp data prepare`` spells them.
_CLI_WORDS = (("data.text_field", "--text-field"), ("data.path", "--input"))


def _cli_message(message: str) -> str:
    for train_word, cli_word in _CLI_WORDS:
        message = message.replace(train_word, cli_word)
    return message


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="simplefsdp data",
        description="Token data for simplefsdp train: tokenise a corpus once into "
        "memory-mapped token shards plus an index (prepare), or check a prepared folder's "
        "shards against their checksums (verify).",
        allow_abbrev=False,
    )
    sub = parser.add_subparsers(dest="command", metavar="<command>")
    prep = sub.add_parser(
        "prepare",
        help="tokenise a corpus into memory-mapped token shards plus an index",
        description="Tokenise a corpus once into memory-mapped token shards plus an index "
        "(with each shard's checksum and largest id). Run again on the same --out, it keeps "
        "the complete shards whose checksums hold and builds the rest.",
        allow_abbrev=False,
    )
    prep.add_argument("--input", required=True, help="a text/JSONL/Parquet file or a folder")
    prep.add_argument("--out", required=True, help="the output folder")
    prep.add_argument(
        "--tokenizer", default="byte", help="byte, or a tokenizer.json / Hugging Face folder"
    )
    prep.add_argument(
        "--format",
        choices=FORMATS,
        default="text",
        help="text: documents; chat: conversations ('messages': [{role, content}]) rendered "
        "by the --tokenizer folder's chat template, trained on the assistant's tokens only",
    )
    prep.add_argument(
        "--text-field",
        default=None,
        help="JSONL field / Parquet column (default: text; messages with --format chat)",
    )
    prep.add_argument("--val-fraction", type=float, default=0.05, help="held-out fraction")
    prep.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    prep.add_argument(
        "--no-progress", action="store_true", help="no progress line (shown on a terminal only)"
    )
    ver = sub.add_parser(
        "verify",
        help="check a prepared folder's shards against their checksums",
        description="Read every shard of a prepared folder and compare it with the checksum "
        "index.json records; verified shards are recorded, so simplefsdp train does not read "
        "them again.",
        allow_abbrev=False,
    )
    ver.add_argument("folder", help="a folder written by simplefsdp data prepare")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``simplefsdp data``; returns the exit code (2 for bad input)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = _build_parser()
    if not argv:
        parser.print_help(sys.stderr)
        return 2
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help: 0; a usage error: 2 (argparse printed it)
        return int(exc.code or 0)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.command == "verify":
        try:
            n, problem = verify_folder(args.folder)
        except ValueError as exc:
            problem, n = str(exc), 0
        if problem is not None:
            print(f"simplefsdp data verify: error: {problem}", file=sys.stderr)
            return 2
        print(f"verified {args.folder}: {n} files checked, all intact")
        return 0
    try:
        index = prepare(
            args.input,
            args.out,
            tokenizer=args.tokenizer,
            text_field=args.text_field,
            val_fraction=args.val_fraction,
            workers=args.workers,
            progress=not args.no_progress,
            data_format=args.format,
        )
    except (ValueError, FileNotFoundError, OSError) as exc:
        print(f"simplefsdp data prepare: error: {_cli_message(str(exc))}", file=sys.stderr)
        return 2
    trained = ""
    if index["loss_mask"]:
        trained = f" ({index['train']['trained_tokens']} train tokens are the assistant's)"
    print(
        f"wrote {args.out}: {index['train']['tokens']} train and {index['val']['tokens']} "
        f"val tokens ({index['dtype']}), {len(index['train']['shards'])} train shards{trained}"
    )
    return 0
