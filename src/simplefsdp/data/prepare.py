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
``index.json``: the tokenizer's identity, the dtype, every shard's tokens and
documents, and the fingerprint of the training stream. ``--data.path tokens/``
then trains on it by memory map (see :class:`TokenShards`).

Note: [Prepared shards are complete or absent]
    A shard is written under a temporary name, fsynced and renamed, then its
    small ``.json`` record (tokens, documents, sha256) is written the same
    way; ``index.json`` is written last. Running the command again skips the
    files whose record exists and whose shard has the recorded size, so an
    interrupted run resumes, and a shard without its record (the process
    died in between) is written again. A loader opens only a folder with
    ``index.json`` and checks each shard's size against it.

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
from .tokenizer import Tokenizer, load_tokenizer

__all__ = ["INDEX_NAME", "TokenShards", "is_prepared", "load_prepared", "prepare", "tokenizer_id"]

logger = logging.getLogger(__name__)

INDEX_NAME = "index.json"
FORMAT = "simplefsdp-tokens-v1"


def tokenizer_id(tok: Tokenizer, spec: str) -> dict[str, Any]:
    """What identifies a tokenizer in an index: its spec, vocabulary size, EOS and repr."""
    return {
        "spec": spec,
        "vocab_size": int(tok.vocab_size),
        "eos_id": int(tok.eos_id),
        "repr": repr(tok),
    }


def _np_dtype(vocab_size: int) -> np.dtype:
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


def is_prepared(path: str | os.PathLike[str] | None) -> bool:
    """Whether ``path`` is a folder written by :func:`prepare` (holds ``index.json``)."""
    return path is not None and (Path(path) / INDEX_NAME).is_file()


# --------------------------------------------------------------------------- writing


def _write_atomic(path: Path, data: bytes | memoryview) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _record_ok(shards: Path, i: int) -> dict[str, Any] | None:
    """The record of input ``i`` when it and both its shards are complete."""
    try:
        record = json.loads((shards / f"{i:06d}.json").read_text(encoding="utf-8"))
        for split in ("train", "val"):
            part = record[split]
            if (shards / part["file"]).stat().st_size != part["bytes"]:
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


def _prepare_file(job: tuple[int, str, str, str, str, float, str]) -> dict[str, Any]:
    """Worker: tokenise input ``i`` into its two shards and write its record."""
    i, file, rel, spec, field, val_fraction, out = job
    shards = Path(out) / "shards"
    record = _record_ok(shards, i)
    if record is not None:
        return {**record, "skipped": True}
    logging.getLogger("simplefsdp.data.corpus").setLevel(logging.WARNING)  # per-file notes
    tok = load_tokenizer(spec)
    if Path(file).suffix.lower() in (".jsonl", ".ndjson"):
        _check_jsonl(Path(file))
    if Path(file).suffix == ".arrow":
        docs = _arrow_documents(Path(file), rel, field)
    else:
        try:
            docs = read_documents(file, text_field=field, report=False)
        except ValueError as exc:
            if "contains no readable, non-empty text" in str(exc):
                docs = []
            else:
                raise
        base = Path(file).name
        docs = [Document(rel + d.name[len(base) :], d.text) for d in docs]
    dtype = torch.int32 if tok.vocab_size > 2**15 else torch.int16
    np_dtype = _np_dtype(tok.vocab_size)
    record = {"input": rel}
    for split in ("train", "val"):
        chosen = [d for d in docs if (_split_bucket(d.name) < val_fraction) == (split == "val")]
        tokens = _token_stream(tok, chosen, dtype).numpy().astype(np_dtype)
        data = memoryview(tokens).cast("B")
        name = f"{i:06d}.{split}.bin"
        _write_atomic(shards / name, data)
        record[split] = {
            "file": name,
            "tokens": int(tokens.size),
            "documents": len(chosen),
            "bytes": len(data),
        }
    _write_atomic(shards / f"{i:06d}.json", json.dumps(record).encode())
    return {**record, "skipped": False}


def prepare(
    inputs: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    tokenizer: str = "byte",
    text_field: str = DEFAULT_TEXT_FIELD,
    val_fraction: float = 0.05,
    workers: int = 1,
    progress: bool = True,
) -> dict[str, Any]:
    """Tokenise ``inputs`` into shards and an index in ``out`` (see the module docstring).

    Args:
        inputs: a text / JSON Lines / Parquet file or a folder of them.
        out: the output folder (created; an earlier, interrupted run's
            complete shards are kept).
        tokenizer: ``"byte"`` or a Hugging Face tokenizer path.
        text_field: JSON Lines field / Parquet column of the text.
        val_fraction: fraction of documents held out for validation.
        workers: tokenising processes.
        progress: show a progress bar on standard error.

    Returns:
        The index written.

    Raises:
        ValueError: a file cannot be read (naming it), bad arguments.
        FileNotFoundError: ``inputs`` does not exist.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"invalid val_fraction {val_fraction!r}; must be in [0, 1)")
    if workers < 1:
        raise ValueError(f"invalid workers {workers!r}; must be >= 1")
    tok = load_tokenizer(tokenizer)
    arrow = _datasets_files(Path(inputs))
    root, files = (Path(inputs), arrow) if arrow is not None else list_corpus_files(inputs)
    if not files:
        raise ValueError(f"{str(inputs)!r} holds no text, JSON Lines or Parquet files")
    folder = Path(out)
    (folder / "shards").mkdir(parents=True, exist_ok=True)
    (folder / INDEX_NAME).unlink(missing_ok=True)  # the index names complete shards only
    jobs = [
        (i, str(f), f.relative_to(root).as_posix(), tokenizer, text_field, val_fraction, str(out))
        for i, f in enumerate(files)
    ]
    total_bytes = sum(f.stat().st_size for f in files)
    start = time.perf_counter()
    records: list[dict[str, Any]] = []
    bar = _progress(len(files), total_bytes, progress)
    with ProcessPoolExecutor(max_workers=workers) as pool:
        for (_, file, *_rest), record in zip(jobs, pool.map(_prepare_file, jobs), strict=True):
            records.append(record)
            bar(Path(file).stat().st_size, record)
    bar(None, None)
    index = _write_index(folder, records, tok, tokenizer, text_field, val_fraction)
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
    """A callable advancing a one-line progress display (``None`` closes it)."""
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


def _write_index(
    folder: Path,
    records: list[dict[str, Any]],
    tok: Tokenizer,
    spec: str,
    field: str,
    val_fraction: float,
) -> dict[str, Any]:
    """Hash the training stream and write ``index.json`` (last)."""
    dtype = _np_dtype(tok.vocab_size)
    splits: dict[str, Any] = {}
    for split in ("train", "val"):
        parts = [r[split] for r in records if r[split]["tokens"]]
        splits[split] = {
            "shards": [{k: p[k] for k in ("file", "tokens", "documents")} for p in parts],
            "tokens": sum(p["tokens"] for p in parts),
            "documents": sum(p["documents"] for p in parts),
        }
    tail = 0
    if val_fraction > 0 and (not splits["train"]["tokens"] or not splits["val"]["tokens"]):
        source = "train" if splits["train"]["tokens"] else "val"
        total = splits[source]["tokens"]
        tail = max(1, round(total * val_fraction))
        splits["train"], splits["val"] = splits[source], {"shards": [], "tokens": 0}
    index = {
        "format": FORMAT,
        "tokenizer": tokenizer_id(tok, spec),
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
    :meth:`numel`, :meth:`gather` (an index tensor -> int64 tokens) and
    :meth:`view` (a sub-range).

    Args:
        folder: the prepared folder.
        shards: ``[{"file": ..., "tokens": n}, ...]`` in stream order.
        dtype: the numpy dtype of the shard files.

    Raises:
        ValueError: a shard is missing or has another size than recorded.
    """

    def __init__(
        self, folder: str | os.PathLike[str], shards: list[dict[str, Any]], dtype: np.dtype
    ) -> None:
        self.folder = Path(folder)
        self.dtype = dtype
        self.paths = []
        for shard in shards:
            path = self.folder / "shards" / shard["file"]
            want = int(shard["tokens"]) * dtype.itemsize
            try:
                size = os.stat(path).st_size
            except OSError:
                size = -1
            if size != want:
                raise ValueError(
                    f"shard {path} has {size} bytes, the index says {want}: the folder is "
                    "damaged; run simplefsdp data prepare again"
                )
            self.paths.append(path)
        # Memory maps are opened on first use: start-up costs one stat per shard.
        self._arrays: dict[int, np.memmap] = {}
        lengths = np.array([int(s["tokens"]) for s in shards], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        self.lo, self.hi = 0, int(self.starts[-1])
        self.fingerprint: dict[str, int] = {}

    def array(self, i: int) -> np.memmap:
        """The memory map of shard ``i`` (opened on first use)."""
        if i not in self._arrays:
            array = np.memmap(self.paths[i], dtype=self.dtype, mode="r")
            raw = getattr(array, "_mmap", None)
            if raw is not None and hasattr(mmap, "MADV_RANDOM"):
                # Sequences are read at random places: no read-ahead around each one.
                raw.madvise(mmap.MADV_RANDOM)
            self._arrays[i] = array
        return self._arrays[i]

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

    def gather(self, index: torch.Tensor) -> torch.Tensor:
        """Tokens at positions ``index`` (any shape) as an int64 tensor."""
        flat = index.reshape(-1).numpy() + self.lo
        which = np.searchsorted(self.starts, flat, side="right") - 1
        out = np.empty(flat.size, dtype=np.int64)
        for s in np.unique(which):
            mask = which == s
            out[mask] = self.array(int(s))[flat[mask] - self.starts[s]]
        return torch.from_numpy(out).reshape(index.shape)

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


@dataclass
class PreparedData:
    """A prepared folder opened for training."""

    corpus: TokenCorpus
    train: TokenShards
    val: TokenShards | None


def load_prepared(folder: str | os.PathLike[str], tok: Tokenizer, spec: str) -> PreparedData:
    """Open a :func:`prepare` folder for ``tok`` (its identity must match the index).

    Raises:
        ValueError: not a prepared folder, another tokenizer (one line naming
            both), or a damaged shard.
    """
    path = Path(folder) / INDEX_NAME
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise ValueError(f"{path} is not a simplefsdp token index ({FORMAT})")
    mine, theirs = tokenizer_id(tok, spec), index["tokenizer"]
    keys = ("vocab_size", "eos_id", "repr")
    if any(mine[k] != theirs.get(k) for k in keys):
        raise ValueError(
            f"data.tokenizer {spec!r} ({mine['repr']}, vocab {mine['vocab_size']}) is not the "
            f"tokenizer {folder} was prepared with ({theirs.get('spec')!r}, {theirs.get('repr')}, "
            f"vocab {theirs.get('vocab_size')}); use --data.tokenizer {theirs.get('spec')!r} "
            "or prepare the data again"
        )
    dtype = np.dtype(index["dtype"])
    train_all = TokenShards(folder, index["train"]["shards"], dtype)
    tail = int(index.get("val_tail_tokens", 0))
    train = train_all.view(0, train_all.numel() - tail)
    train.fingerprint = {k: int(v) for k, v in index["train_fingerprint"].items()}
    if tail:
        val: TokenShards | None = train_all.view(train_all.numel() - tail, train_all.numel())
        n_val_docs = 0
    else:
        val = TokenShards(folder, index["val"]["shards"], dtype) if index["val"]["shards"] else None
        n_val_docs = int(index["val"].get("documents", 0))
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
    return PreparedData(corpus, train, val)


# --------------------------------------------------------------------------- command


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="simplefsdp data prepare",
        description="Tokenise a corpus once into memory-mapped token shards plus an index.",
        allow_abbrev=False,
    )
    parser.add_argument("--input", required=True, help="a text/JSONL/Parquet file or a folder")
    parser.add_argument("--out", required=True, help="the output folder")
    parser.add_argument("--tokenizer", default="byte", help="byte, or a tokenizer.json / folder")
    parser.add_argument("--text-field", default=DEFAULT_TEXT_FIELD, help="JSONL/Parquet field")
    parser.add_argument("--val-fraction", type=float, default=0.05, help="held-out fraction")
    parser.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    parser.add_argument("--no-progress", action="store_true", help="no progress display")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``simplefsdp data``; returns the exit code (2 for bad input)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] != "prepare":
        print("usage: simplefsdp data prepare --input PATH --out DIR [...]", file=sys.stderr)
        return 2
    args = _build_parser().parse_args(argv[1:])
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        index = prepare(
            args.input,
            args.out,
            tokenizer=args.tokenizer,
            text_field=args.text_field,
            val_fraction=args.val_fraction,
            workers=args.workers,
            progress=not args.no_progress,
        )
    except (ValueError, FileNotFoundError, OSError) as exc:
        print(f"simplefsdp data prepare: error: {exc}", file=sys.stderr)
        return 2
    print(
        f"wrote {args.out}: {index['train']['tokens']} train and {index['val']['tokens']} "
        f"val tokens ({index['dtype']}), {len(index['train']['shards'])} train shards"
    )
    return 0
