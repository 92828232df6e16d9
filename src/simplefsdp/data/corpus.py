"""Documents and the tokenised corpus.

:func:`read_documents` reads a text file, a folder of text files, or by default
the embedded corpus: this Python's own standard-library ``.py`` sources (the
first ~8 MB in sorted path order). JSON Lines files (``.jsonl``, ``.ndjson``)
and Parquet files (``.parquet``, with ``pyarrow``) are read by a text field
(``text`` unless told otherwise), one document per record; see [Reading text]. :func:`build_corpus` tokenises the documents
into one stream (an EOS token after every document) and splits it into
train/validation by document, using a fixed hash of each document's path, so
adding files never moves the others between splits. Tokens are kept in memory
as ``int16`` (or ``int32`` for vocabularies over 32768); nothing is cached on
disk.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import logging
import os
import sysconfig
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from .tokenizer import ByteTokenizer, Tokenizer, load_tokenizer

logger = logging.getLogger(__name__)


#: Bytes read from the stdlib corpus when no explicit cap is given.
DEFAULT_STDLIB_MAX_BYTES = 8_000_000
#: The field of a JSON Lines record / the column of a Parquet file holding the text.
DEFAULT_TEXT_FIELD = "text"


@dataclass(frozen=True)
class Document:
    """One text document.

    Attributes:
        name: Stable id: the path relative to the corpus root, ``/``-separated
            (the file name for a single-file corpus). It decides the split.
        text: The decoded text.
    """

    name: str
    text: str


_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "node_modules"})
_TEXT_SUFFIXES = frozenset(
    {
        ".txt", ".md", ".rst", ".py", ".pyi", ".json", ".jsonl", ".csv", ".tsv", ".toml",
        ".yaml", ".yml", ".ini", ".cfg", ".html", ".htm", ".xml", ".tex", ".c", ".h",
        ".cc", ".cpp", ".hpp", ".cu", ".rs", ".go", ".java", ".js", ".ts", ".sh", ".sql",
    }
)  # fmt: skip
_BINARY_SUFFIXES = frozenset(
    {
        ".pyc", ".pyo", ".so", ".dll", ".dylib", ".o", ".a", ".exe", ".bin", ".pt", ".pth",
        ".safetensors", ".npy", ".npz", ".pkl", ".gz", ".bz2", ".xz", ".zst", ".zip", ".tar",
        ".png", ".jpg", ".jpeg", ".gif", ".bmp", ".ico", ".pdf", ".wav", ".mp3", ".mp4",
        ".whl", ".db", ".sqlite", ".arrow",
    }
)  # fmt: skip
_JSONL_SUFFIXES = frozenset({".jsonl", ".ndjson"})
_PARQUET_SUFFIXES = frozenset({".parquet"})
#: A text file with more than this fraction of its bytes undecodable or control
#: characters is refused (see [Reading text]).
MAX_NON_TEXT_FRACTION = 0.25
_CONTROL_CHARS = [chr(c) for c in range(32) if chr(c) not in "\t\n\r\f\v"] + ["\x7f"]

# Note: [Reading text]
#     A text file is decoded as UTF-8; undecodable bytes become U+FFFD and
#     are counted, and the total is reported once per corpus (file count and
#     an example file). A file whose bytes are mostly not text (more than
#     MAX_NON_TEXT_FRACTION undecodable or control characters, e.g. a binary
#     file given as data.path) is refused with one line naming it rather than
#     trained on. A JSON Lines file gives one document per line: the string
#     field ``text_field`` of each object; a Parquet file one per row of the
#     column ``text_field`` (needs pyarrow, else one line saying so). Records
#     without that field are counted and reported once per file; a file where
#     none has it is refused with one line naming the fields it has.


def stdlib_dir() -> Path:
    """Folder of this Python's standard library (``sysconfig`` ``stdlib`` path)."""
    return Path(sysconfig.get_paths()["stdlib"])


def _looks_like_text(path: Path) -> bool:
    """Whether ``path`` should be read as text (by suffix, else no NUL in its first 8 KiB)."""
    suffix = path.suffix.lower()
    if suffix in _TEXT_SUFFIXES or suffix in _PARQUET_SUFFIXES:
        return True
    if suffix in _BINARY_SUFFIXES:
        return False
    try:
        with path.open("rb") as fh:
            return b"\x00" not in fh.read(8192)
    except OSError:
        return False


def _walk_files(root: Path, accept: Callable[[Path], bool]) -> list[Path]:
    """Files under ``root`` accepted by ``accept(path)``, sorted by relative posix path.

    Hidden entries and :data:`_SKIP_DIRS` are skipped; symlinked folders are not followed.
    """
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS and not d.startswith(".")]
        for fname in filenames:
            if fname.startswith("."):
                continue
            full = Path(dirpath) / fname
            if full.is_file() and accept(full):
                found.append((full.relative_to(root).as_posix(), full))
    found.sort(key=lambda item: item[0])
    return [p for _, p in found]


def list_corpus_files(path: str | os.PathLike[str] | None = None) -> tuple[Path, list[Path]]:
    """The root and the deterministic, sorted file list of a corpus.

    Args:
        path: ``None`` for the stdlib ``.py`` sources (``site-packages`` is
            skipped), a text file, or a folder searched recursively for text
            files (known text suffixes, or no NUL byte in the first 8 KiB).

    Returns:
        ``(root, files)``; document names are the file paths relative to ``root``.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: ``path`` is neither a file nor a folder.
    """
    if path is None:
        root = stdlib_dir()
        return root, _walk_files(root, lambda p: p.suffix == ".py")
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(
            f"data path {str(path)!r} does not exist (give a text file, a folder of text "
            "files, or leave data.path unset for the embedded stdlib corpus)"
        )
    if p.is_file():
        return p.parent, [p]
    if p.is_dir():
        return p, _walk_files(p, _looks_like_text)
    raise ValueError(f"data path {str(path)!r} is neither a file nor a folder")


_decode_state = threading.local()


def _count_undecodable(err: UnicodeError) -> tuple[str, int]:
    """Codec error handler: count the undecodable bytes, replace them with U+FFFD."""
    assert isinstance(err, UnicodeDecodeError)
    _decode_state.bad += err.end - err.start
    return "\ufffd", err.end


codecs.register_error("simplefsdp.count", _count_undecodable)


def _decode(raw: bytes) -> tuple[str, int]:
    """``(text, undecodable bytes)`` of UTF-8 ``raw``; each bad sequence becomes U+FFFD."""
    try:
        return raw.decode("utf-8"), 0
    except UnicodeDecodeError:
        pass
    _decode_state.bad = 0
    text = raw.decode("utf-8", errors="simplefsdp.count")
    return text, _decode_state.bad


def _non_text_fraction(raw: bytes, text: str, bad: int) -> float:
    """Fraction of ``raw``'s bytes that are undecodable or control characters."""
    controls = sum(text.count(c) for c in _CONTROL_CHARS)
    return (bad + controls) / max(1, len(raw))


def _not_text_error(path: Path, fraction: float) -> ValueError:
    return ValueError(
        f"data file {str(path)!r} is mostly not text ({fraction:.0%} of its bytes are not "
        "UTF-8 text); remove it from data.path, or give text, JSON Lines or Parquet files"
    )


def sniff_data_file(path: str | os.PathLike[str], *, head_bytes: int = 65536) -> str | None:
    """Why ``path`` cannot be training data, judged cheaply, or ``None``.

    A text file's first ``head_bytes`` must be mostly text; a Parquet file
    needs ``pyarrow``. Reading the file (:func:`read_documents`) checks all of it.
    """
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix in _PARQUET_SUFFIXES:
        return _parquet_problem(p)
    try:
        with p.open("rb") as fh:
            head = fh.read(head_bytes)
    except OSError as exc:
        return f"data file {str(p)!r} cannot be read: {exc}"
    if len(head) == head_bytes:  # a character may be cut at the end
        head = head[:-4]
    text, bad = _decode(head)
    fraction = _non_text_fraction(head, text, bad)
    return str(_not_text_error(p, fraction)) if fraction > MAX_NON_TEXT_FRACTION else None


def _parquet_problem(path: Path) -> str | None:
    try:
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        return (
            f"data file {str(path)!r} is Parquet, which needs the 'pyarrow' package: "
            "pip install pyarrow (or convert it to JSON Lines)"
        )
    return None


def _missing_field_error(path: Path, field: str, seen: list[str]) -> ValueError:
    return ValueError(
        f"data file {str(path)!r} has no string field {field!r} in any record (fields: "
        f"{seen}); set data.text_field to the field that holds the text"
    )


def _jsonl_documents(path: Path, name: str, raw: bytes, field: str) -> tuple[list[Document], int]:
    """The documents of a JSON Lines file and the number of lines without ``field``."""
    text, _ = _decode(raw)
    docs: list[Document] = []
    skipped = 0
    seen: list[str] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        value = record.get(field) if isinstance(record, dict) else None
        if isinstance(value, str):
            if value:
                docs.append(Document(f"{name}:{lineno}", value))
            continue
        skipped += 1
        if not seen and isinstance(record, dict):
            seen = sorted(record)[:10]
    if not docs and skipped:
        if not seen:
            raise ValueError(
                f"data file {str(path)!r} has no line with a JSON object; JSON Lines files "
                "(.jsonl) hold one JSON object per line"
            )
        raise _missing_field_error(path, field, seen)
    return docs, skipped


def _parquet_documents(path: Path, name: str, field: str) -> tuple[list[Document], int]:
    """The documents of a Parquet file's column ``field`` and the rows without text."""
    problem = _parquet_problem(path)
    if problem is not None:
        raise ValueError(problem)
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(path)
        if field not in schema.names:
            raise _missing_field_error(path, field, list(schema.names)[:10])
        column = pq.read_table(path, columns=[field]).column(field).to_pylist()
    except (OSError, ValueError) as exc:
        if isinstance(exc, ValueError) and "has no string field" in str(exc):
            raise
        raise ValueError(f"data file {str(path)!r} is not a readable Parquet file: {exc}") from None
    docs = [Document(f"{name}:{i}", v) for i, v in enumerate(column) if isinstance(v, str) and v]
    skipped = sum(1 for v in column if not isinstance(v, str))
    if not docs and skipped:
        raise _missing_field_error(path, field, [f"{field} (not strings)"])
    return docs, skipped


def read_documents(
    path: str | os.PathLike[str] | None = None,
    *,
    max_bytes: int | None = None,
    text_field: str = DEFAULT_TEXT_FIELD,
    report: bool = True,
) -> list[Document]:
    """Read the documents of a corpus, in sorted path order.

    Text files are decoded as UTF-8, undecodable bytes replaced by U+FFFD and
    counted; JSON Lines and Parquet files give one document per record's
    ``text_field`` (see [Reading text]). Empty files are skipped.

    Args:
        path: See :func:`list_corpus_files`.
        max_bytes: Stop after the file that brings the total to at least this
            many bytes. ``None``: :data:`DEFAULT_STDLIB_MAX_BYTES` for the
            stdlib corpus, unlimited for a user path.
        text_field: The JSON Lines field / Parquet column holding the text.
        report: Log the undecodable bytes and skipped records (once).

    Returns:
        The documents.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: ``max_bytes`` is not positive, there is no readable text,
            a file is mostly not text, a JSON Lines / Parquet file has no
            ``text_field``, or Parquet without ``pyarrow``; one line naming the file.
    """
    if max_bytes is None and path is None:
        max_bytes = DEFAULT_STDLIB_MAX_BYTES
    if max_bytes is not None and max_bytes <= 0:
        raise ValueError(f"invalid max_bytes {max_bytes!r}; must be > 0 or None")
    root, files = list_corpus_files(path)
    docs: list[Document] = []
    total = 0
    bad_bytes, bad_files = 0, []
    for f in files:
        if max_bytes is not None and total >= max_bytes:
            logger.info(
                "corpus capped at %d bytes (%d of %d files)", max_bytes, len(docs), len(files)
            )
            break
        name = f.relative_to(root).as_posix()
        suffix = f.suffix.lower()
        if suffix in _PARQUET_SUFFIXES:
            records, skipped = _parquet_documents(f, name, text_field)
            total += f.stat().st_size
            docs.extend(records)
            if skipped and report:
                n = skipped + len(records)
                logger.warning(
                    "%s: %d of %d rows have no text in %r (skipped)", f, skipped, n, text_field
                )
            continue
        try:
            raw = f.read_bytes()
        except OSError as exc:
            logger.warning("skipping unreadable file %s: %s", f, exc)
            continue
        if not raw:
            continue
        total += len(raw)
        if suffix in _JSONL_SUFFIXES:
            records, skipped = _jsonl_documents(f, name, raw, text_field)
            docs.extend(records)
            if skipped and report:
                logger.warning(
                    "%s: %d of %d lines have no string field %r (skipped)",
                    f,
                    skipped,
                    skipped + len(records),
                    text_field,
                )
            continue
        text, bad = _decode(raw)
        if bad or "\x00" in text:
            fraction = _non_text_fraction(raw, text, bad)
            if fraction > MAX_NON_TEXT_FRACTION:
                raise _not_text_error(f, fraction)
            if bad:
                bad_bytes, bad_files = bad_bytes + bad, [*bad_files, f]
        docs.append(Document(name, text))
    where = "the stdlib corpus" if path is None else repr(str(path))
    if bad_bytes and report:
        logger.warning(
            "%d bytes that are not UTF-8 in %d file(s) (first: %s) were replaced by U+FFFD",
            bad_bytes,
            len(bad_files),
            bad_files[0],
        )
    if not docs:
        raise ValueError(f"data path {where} contains no readable, non-empty text files")
    logger.info("read %d documents (%d bytes) from %s", len(docs), total, where)
    return docs


def token_dtype(vocab_size: int) -> torch.dtype:
    """Smallest signed integer dtype holding ids below ``vocab_size`` (int16 or int32)."""
    if vocab_size <= 2**15:
        return torch.int16
    if vocab_size <= 2**31:
        return torch.int32
    raise ValueError(f"vocab_size {vocab_size} is too large (max {2**31})")


def _split_bucket(name: str) -> float:
    """Deterministic value in [0, 1) from a document name (sha256-based)."""
    digest = hashlib.sha256(name.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


@dataclass
class TokenCorpus:
    """A tokenised corpus split into training and validation streams.

    Attributes:
        train: 1-D integer tensor of training tokens (``int16`` or ``int32``).
        val: 1-D integer tensor of validation tokens (may be empty).
        vocab_size: The tokenizer's vocabulary size.
        eos_id: The document separator id (one after every document).
        num_train_docs: Documents in ``train``.
        num_val_docs: Documents in ``val`` (0 when the tail fallback was used).
        source: Human-readable description of the corpus.
    """

    train: torch.Tensor
    val: torch.Tensor
    vocab_size: int
    eos_id: int
    num_train_docs: int
    num_val_docs: int
    source: str


def _token_stream(tok: Tokenizer, docs: list[Document], dtype: torch.dtype) -> torch.Tensor:
    """One 1-D stream of ``docs``, each encoded and followed by the EOS id."""
    if not docs:
        return torch.empty(0, dtype=dtype)
    if isinstance(tok, ByteTokenizer):
        # Vectorised: all bytes at once, EOS slots left free between documents.
        raws = [d.text.encode("utf-8", errors="replace") for d in docs]
        lengths = torch.tensor([len(r) + 1 for r in raws], dtype=torch.int64)
        eos_pos = torch.cumsum(lengths, 0) - 1
        out = torch.empty(int(lengths.sum()), dtype=dtype)
        is_byte = torch.ones(out.numel(), dtype=torch.bool)
        is_byte[eos_pos] = False
        joined = bytearray(b"".join(raws))
        if joined:
            out[is_byte] = torch.frombuffer(joined, dtype=torch.uint8).to(dtype)
        out[eos_pos] = tok.EOS_ID
        return out
    ids: list[int] = []
    for d in docs:
        ids.extend(tok.encode(d.text))
        ids.append(tok.eos_id)
    return torch.tensor(ids, dtype=dtype)


def build_corpus(
    path: str | os.PathLike[str] | None = None,
    tokenizer: str | Tokenizer = "byte",
    *,
    val_fraction: float = 0.05,
    max_bytes: int | None = None,
    text_field: str = DEFAULT_TEXT_FIELD,
    report: bool = True,
) -> TokenCorpus:
    """Read, tokenise and split a corpus.

    Every document is encoded and followed by EOS. A document goes to the
    validation split when the sha256-based value of its name is below
    ``val_fraction``, so the split of a file never depends on the other files.
    If that leaves one split empty although ``0 < val_fraction`` (e.g. a
    single-file corpus), the last ``val_fraction`` of the whole token stream is
    held out instead.

    Args:
        path: See :func:`list_corpus_files` (``None``: the stdlib corpus).
        tokenizer: A tokenizer or a spec for :func:`load_tokenizer`.
        val_fraction: Held-out fraction, in [0, 1).
        max_bytes: See :func:`read_documents`.
        text_field: See :func:`read_documents`.
        report: See :func:`read_documents`.

    Returns:
        The corpus.

    Raises:
        ValueError: ``val_fraction`` outside [0, 1), bad tokenizer, no text.
        FileNotFoundError: ``path`` does not exist.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"invalid val_fraction {val_fraction!r}; must be in [0, 1)")
    tok = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
    docs = read_documents(path, max_bytes=max_bytes, text_field=text_field, report=report)
    dtype = token_dtype(tok.vocab_size)
    train_docs: list[Document] = []
    val_docs: list[Document] = []
    for doc in docs:
        (val_docs if _split_bucket(doc.name) < val_fraction else train_docs).append(doc)
    if val_fraction > 0 and (not train_docs or not val_docs):
        stream = _token_stream(tok, docs, dtype)
        n_val = max(1, round(stream.numel() * val_fraction))
        train, val = stream[:-n_val].clone(), stream[-n_val:].clone()
        n_train_docs, n_val_docs = len(docs), 0
        logger.info(
            "document split left a split empty (%d documents); holding out the last %d tokens",
            len(docs),
            n_val,
        )
    else:
        train = _token_stream(tok, train_docs, dtype)
        val = _token_stream(tok, val_docs, dtype)
        n_train_docs, n_val_docs = len(train_docs), len(val_docs)
    source = "stdlib:" + str(stdlib_dir()) if path is None else str(path)
    logger.info(
        "corpus %s: %d train tokens (%d docs), %d val tokens (%d docs), vocab %d",
        source,
        train.numel(),
        n_train_docs,
        val.numel(),
        n_val_docs,
        tok.vocab_size,
    )
    return TokenCorpus(train, val, tok.vocab_size, tok.eos_id, n_train_docs, n_val_docs, source)


def data_fingerprint(tokens: torch.Tensor) -> dict[str, int]:
    """Identify a token stream: ``{"num_tokens": n, "data_hash": h}`` (plain ints).

    ``h`` is a 63-bit prefix of the sha256 of the token values (as int32), so it
    does not depend on the storage dtype.
    """
    flat = tokens.reshape(-1).to(torch.int32).contiguous()
    digest = hashlib.sha256(memoryview(flat.numpy()).cast("B")).digest()
    return {"num_tokens": int(flat.numel()), "data_hash": int.from_bytes(digest[:8], "big") >> 1}
