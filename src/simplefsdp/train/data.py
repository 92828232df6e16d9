"""Token data pipeline for ``simplefsdp train``.

The pipeline has four small pieces:

* **Tokenizers** - :class:`ByteTokenizer` (UTF-8 bytes plus 4 special tokens,
  no dependencies) and :func:`load_tokenizer`, which also opens local Hugging
  Face tokenizers when ``tokenizers`` or ``transformers`` is installed.
* **Documents** - :func:`read_documents` reads a text file, a folder of text
  files, or by default the embedded corpus: this Python's own standard-library
  ``.py`` sources (the first ~8 MB in sorted path order).
* **Corpus** - :func:`build_corpus` tokenises the documents into one stream
  (an EOS token after every document) and splits it into train/validation by
  document, using a fixed hash of each document's path, so adding files never
  moves the others between splits. Tokens are kept in memory as ``int16`` (or
  ``int32`` for vocabularies over 32768); nothing is cached on disk.
* **Loading** - :class:`DistributedTokenLoader` cuts the training stream into
  windows of ``seq_len + 1`` tokens (consecutive windows share one boundary
  token, so window ``i`` starts at token ``i * seq_len``), shuffles them with a
  seeded permutation per epoch and hands each rank its slice of every global
  batch. Its state is a handful of plain ints, and concatenating the rank
  slices in rank order gives the same global batch for every world size with
  the same ``world_size * batch_size``.
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import operator
import os
import sysconfig
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from simplefsdp.train.config import DataConfig

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_STDLIB_MAX_BYTES",
    "Tokenizer",
    "ByteTokenizer",
    "HFTokenizer",
    "load_tokenizer",
    "Document",
    "stdlib_dir",
    "list_corpus_files",
    "read_documents",
    "token_dtype",
    "TokenCorpus",
    "build_corpus",
    "data_fingerprint",
    "DistributedTokenLoader",
    "iter_val_batches",
    "DataBundle",
    "build_data",
]

#: Bytes read from the stdlib corpus when no explicit cap is given.
DEFAULT_STDLIB_MAX_BYTES = 8_000_000

Batch = tuple[torch.Tensor, torch.Tensor]


# --------------------------------------------------------------------------- tokenizers


class Tokenizer(Protocol):
    """What the pipeline needs from a tokenizer."""

    vocab_size: int
    bos_id: int | None
    eos_id: int
    pad_id: int | None

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added)."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` (special tokens dropped)."""
        ...


class ByteTokenizer:
    """UTF-8 byte tokenizer: ids 0-255 are bytes, then BOS, EOS, PAD and one spare.

    Attributes:
        vocab_size: 260.
        bos_id: 256.
        eos_id: 257.
        pad_id: 258.
        spare_id: 259 (reserved, never produced by :meth:`encode`).
    """

    BOS_ID = 256
    EOS_ID = 257
    PAD_ID = 258
    SPARE_ID = 259
    VOCAB_SIZE = 260

    vocab_size: int = VOCAB_SIZE
    bos_id: int = BOS_ID
    eos_id: int = EOS_ID
    pad_id: int = PAD_ID
    spare_id: int = SPARE_ID

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        """Encode ``text`` as its UTF-8 bytes, optionally framed by BOS / EOS.

        Args:
            text: The text.
            bos: Prepend the BOS id.
            eos: Append the EOS id.

        Returns:
            The token ids.
        """
        ids = list(text.encode("utf-8", errors="replace"))
        if bos:
            ids.insert(0, self.BOS_ID)
        if eos:
            ids.append(self.EOS_ID)
        return ids

    def encode_to_tensor(self, text: str, *, eos: bool = False) -> torch.Tensor:
        """Fast path of :meth:`encode` returning a 1-D ``int16`` tensor."""
        raw = bytearray(text.encode("utf-8", errors="replace"))
        if raw:
            out = torch.frombuffer(raw, dtype=torch.uint8).to(torch.int16)
        else:
            out = torch.empty(0, dtype=torch.int16)
        if eos:
            out = torch.cat([out, torch.tensor([self.EOS_ID], dtype=torch.int16)])
        return out

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        """Decode ids back to text; special ids are dropped, bad UTF-8 is replaced.

        Raises:
            ValueError: an id outside ``[0, vocab_size)``.
        """
        if isinstance(ids, torch.Tensor):
            ids = ids.reshape(-1).tolist()
        out = bytearray()
        for i in ids:
            i = int(i)
            if 0 <= i < 256:
                out.append(i)
            elif not 256 <= i < self.VOCAB_SIZE:
                raise ValueError(
                    f"token id {i} is outside the byte tokenizer vocabulary [0, {self.VOCAB_SIZE})"
                )
        return out.decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=260)"


_EOS_CANDIDATES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "<|eot_id|>")
_BOS_CANDIDATES = ("<|begin_of_text|>", "<s>", "<bos>")
_PAD_CANDIDATES = ("<pad>", "<|pad|>", "<|finetune_right_pad_id|>")


class HFTokenizer:
    """Adapter giving a ``tokenizers.Tokenizer`` or a ``transformers`` tokenizer the
    :class:`Tokenizer` interface.

    Args:
        backend: The loaded tokenizer object.
        kind: ``"tokenizers"`` or ``"transformers"``.
        path: Where it was loaded from (for messages).

    Raises:
        ValueError: no end-of-text token can be identified.
    """

    def __init__(self, backend: Any, *, kind: str, path: str) -> None:
        if kind not in ("tokenizers", "transformers"):
            raise ValueError(
                f"invalid tokenizer kind {kind!r}; valid: ['tokenizers', 'transformers']"
            )
        self.backend = backend
        self.kind = kind
        self.path = path
        if kind == "tokenizers":
            self.vocab_size = int(backend.get_vocab_size(with_added_tokens=True))
            self.eos_id = self._lookup(_EOS_CANDIDATES)  # type: ignore[assignment]
            self.bos_id = self._lookup(_BOS_CANDIDATES)
            self.pad_id = self._lookup(_PAD_CANDIDATES)
        else:
            self.vocab_size = len(backend)
            self.eos_id = backend.eos_token_id
            self.bos_id = backend.bos_token_id
            self.pad_id = backend.pad_token_id
        if self.eos_id is None:
            raise ValueError(
                f"tokenizer {path!r}: cannot identify an end-of-text token "
                f"(looked for {list(_EOS_CANDIDATES)})"
            )
        self.eos_id = int(self.eos_id)

    def _lookup(self, candidates: tuple[str, ...]) -> int | None:
        """First candidate token string that exists in the vocabulary."""
        for tok in candidates:
            idx = self.backend.token_to_id(tok)
            if idx is not None:
                return int(idx)
        return None

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added)."""
        if self.kind == "tokenizers":
            return list(self.backend.encode(text, add_special_tokens=False).ids)
        return list(self.backend.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        """Text of ``ids`` with special tokens skipped."""
        if isinstance(ids, torch.Tensor):
            ids = ids.reshape(-1).tolist()
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=True)

    def __repr__(self) -> str:
        return f"HFTokenizer({self.path!r}, kind={self.kind!r}, vocab_size={self.vocab_size})"


def _optional_import(name: str) -> Any | None:
    """Import ``name`` or return ``None`` when it is not installed."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def load_tokenizer(spec: str) -> Tokenizer:
    """Open a tokenizer.

    Args:
        spec: ``"byte"`` for :class:`ByteTokenizer`, or a path to a local
            ``tokenizer.json`` file or a Hugging Face tokenizer folder. Files and
            folders with a ``tokenizer.json`` are opened with the ``tokenizers``
            package when installed, otherwise with ``transformers``
            (``local_files_only=True``; nothing is downloaded).

    Returns:
        The tokenizer.

    Raises:
        ValueError: the path does not exist, or neither ``tokenizers`` nor
            ``transformers`` can open it.
    """
    if spec == "byte":
        return ByteTokenizer()
    path = Path(spec).expanduser()
    if not path.exists():
        raise ValueError(
            f"tokenizer {spec!r}: path does not exist; use 'byte' or the path of a local "
            "tokenizer.json file or Hugging Face tokenizer folder"
        )
    tokenizers_mod = _optional_import("tokenizers")
    transformers_mod = _optional_import("transformers")
    json_file = path if path.is_file() else path / "tokenizer.json"
    if tokenizers_mod is not None and json_file.is_file():
        backend = tokenizers_mod.Tokenizer.from_file(str(json_file))
        tok: Tokenizer = HFTokenizer(backend, kind="tokenizers", path=str(path))
    elif transformers_mod is not None:
        if path.is_file():
            backend = transformers_mod.PreTrainedTokenizerFast(tokenizer_file=str(path))
        else:
            backend = transformers_mod.AutoTokenizer.from_pretrained(
                str(path), local_files_only=True
            )
        tok = HFTokenizer(backend, kind="transformers", path=str(path))
    elif tokenizers_mod is None:
        raise ValueError(
            f"tokenizer {spec!r}: loading a tokenizer file or folder needs the 'tokenizers' "
            "or 'transformers' package (pip install tokenizers); or use tokenizer 'byte'"
        )
    else:
        raise ValueError(
            f"tokenizer {spec!r}: folder has no tokenizer.json; loading it needs the "
            "'transformers' package (pip install transformers)"
        )
    logger.info("loaded tokenizer %r", tok)
    return tok


# --------------------------------------------------------------------------- documents


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
        ".whl", ".db", ".sqlite", ".parquet", ".arrow",
    }
)  # fmt: skip


def stdlib_dir() -> Path:
    """Folder of this Python's standard library (``sysconfig`` ``stdlib`` path)."""
    return Path(sysconfig.get_paths()["stdlib"])


def _looks_like_text(path: Path) -> bool:
    """Whether ``path`` should be read as text (by suffix, else no NUL in its first 8 KiB)."""
    suffix = path.suffix.lower()
    if suffix in _TEXT_SUFFIXES:
        return True
    if suffix in _BINARY_SUFFIXES:
        return False
    try:
        with path.open("rb") as fh:
            return b"\x00" not in fh.read(8192)
    except OSError:
        return False


def _walk_files(root: Path, accept: Any) -> list[Path]:
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


def read_documents(
    path: str | os.PathLike[str] | None = None, *, max_bytes: int | None = None
) -> list[Document]:
    """Read the documents of a corpus, in sorted path order.

    Files are decoded as UTF-8 with ``errors="replace"``; empty files are skipped.

    Args:
        path: See :func:`list_corpus_files`.
        max_bytes: Stop after the file that brings the total to at least this
            many bytes. ``None``: :data:`DEFAULT_STDLIB_MAX_BYTES` for the
            stdlib corpus, unlimited for a user path.

    Returns:
        The documents.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: ``max_bytes`` is not positive, or there is no readable text.
    """
    if max_bytes is None and path is None:
        max_bytes = DEFAULT_STDLIB_MAX_BYTES
    if max_bytes is not None and max_bytes <= 0:
        raise ValueError(f"invalid max_bytes {max_bytes!r}; must be > 0 or None")
    root, files = list_corpus_files(path)
    docs: list[Document] = []
    total = 0
    for f in files:
        if max_bytes is not None and total >= max_bytes:
            logger.info(
                "corpus capped at %d bytes (%d of %d files)", max_bytes, len(docs), len(files)
            )
            break
        try:
            raw = f.read_bytes()
        except OSError as exc:
            logger.warning("skipping unreadable file %s: %s", f, exc)
            continue
        if not raw:
            continue
        total += len(raw)
        docs.append(Document(f.relative_to(root).as_posix(), raw.decode("utf-8", errors="replace")))
    where = "the stdlib corpus" if path is None else repr(str(path))
    if not docs:
        raise ValueError(f"data path {where} contains no readable, non-empty text files")
    logger.info("read %d documents (%d bytes) from %s", len(docs), total, where)
    return docs


# --------------------------------------------------------------------------- corpus


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

    Returns:
        The corpus.

    Raises:
        ValueError: ``val_fraction`` outside [0, 1), bad tokenizer, no text.
        FileNotFoundError: ``path`` does not exist.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"invalid val_fraction {val_fraction!r}; must be in [0, 1)")
    tok = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
    docs = read_documents(path, max_bytes=max_bytes)
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


# --------------------------------------------------------------------------- loading


def _gather_windows(tokens: torch.Tensor, window_ids: torch.Tensor, seq_len: int) -> Batch:
    """``(inputs, targets)`` int64 tensors for the windows ``window_ids``."""
    starts = window_ids.to(torch.int64) * seq_len
    index = starts[:, None] + torch.arange(seq_len + 1, dtype=torch.int64)[None, :]
    windows = tokens[index].to(torch.int64)
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


def _check_loader_args(seq_len: int, batch_size: int, rank: int, world_size: int) -> None:
    """Raise ``ValueError`` for non-positive sizes or a rank outside the world."""
    if seq_len <= 0:
        raise ValueError(f"invalid seq_len {seq_len!r}; must be > 0")
    if batch_size <= 0:
        raise ValueError(f"invalid batch_size {batch_size!r}; must be > 0")
    if world_size <= 0:
        raise ValueError(f"invalid world_size {world_size!r}; must be > 0")
    if not 0 <= rank < world_size:
        raise ValueError(f"invalid rank {rank!r}; must be in [0, {world_size})")


def _check_tokens(tokens: torch.Tensor, what: str) -> torch.Tensor:
    """Validate a 1-D integer token tensor and return it contiguous."""
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1:
        raise ValueError(f"{what} must be a 1-D tensor of token ids")
    if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
        raise ValueError(f"{what} must be an integer tensor, got {tokens.dtype}")
    return tokens.contiguous()


def iter_val_batches(
    tokens: torch.Tensor,
    *,
    seq_len: int,
    batch_size: int,
    num_batches: int | None = None,
    rank: int = 0,
    world_size: int = 1,
    global_batch: bool = False,
) -> Iterator[Batch]:
    """Deterministic, unshuffled batches over a validation stream.

    Global batch ``k`` holds windows ``k * G ... (k + 1) * G - 1`` with
    ``G = world_size * batch_size``; rank ``r`` gets rows ``r * batch_size``
    to ``(r + 1) * batch_size - 1`` (or all of them with ``global_batch``).
    Only full global batches are produced, so every rank gets the same number
    of batches; the iterator is empty when the stream is shorter than one.

    Args:
        tokens: 1-D token stream.
        seq_len: Sequence length.
        batch_size: Per-rank batch size.
        num_batches: At most this many batches (``None``: all).
        rank: This rank.
        world_size: Number of ranks.
        global_batch: Yield the whole global batch instead of the rank slice.

    Yields:
        ``(inputs, targets)`` int64 tensors of shape ``(batch_size, seq_len)``.
    """
    _check_loader_args(seq_len, batch_size, rank, world_size)
    tokens = _check_tokens(tokens, "validation tokens")
    g = world_size * batch_size
    n_windows = max(0, (tokens.numel() - 1) // seq_len)
    total = n_windows // g
    if num_batches is not None:
        total = min(total, max(0, num_batches))
    if total == 0 and (num_batches is None or num_batches > 0):
        logger.warning(
            "validation split (%d tokens) is too small for one global batch of %d x %d tokens",
            tokens.numel(),
            g,
            seq_len + 1,
        )
    lo, hi = (0, g) if global_batch else (rank * batch_size, (rank + 1) * batch_size)
    for k in range(total):
        ids = torch.arange(k * g + lo, k * g + hi, dtype=torch.int64)
        yield _gather_windows(tokens, ids, seq_len)


class DistributedTokenLoader:
    """Resumable, deterministic loader of ``(inputs, targets)`` batches for one rank.

    The training stream is cut into ``num_windows = (num_tokens - 1) // seq_len``
    windows of ``seq_len + 1`` tokens. Every epoch visits the windows in the
    order of ``torch.randperm(num_windows)`` drawn from a ``torch.Generator``
    seeded with ``seed + epoch``; each global step takes the next
    ``G = world_size * batch_size`` of them and rank ``r`` gets rows
    ``r * batch_size ... (r + 1) * batch_size - 1``. An epoch ends when fewer
    than ``G`` windows remain (those are skipped) and iteration wraps to the
    next epoch, so the iterator is infinite.

    The state (:meth:`state_dict`) is the position in windows, so it does not
    depend on the world size: a run may resume with another world size.

    Args:
        tokens: 1-D training token stream (e.g. ``TokenCorpus.train``).
        seq_len: Sequence length.
        batch_size: Per-rank micro-batch size.
        rank: This rank.
        world_size: Number of data-parallel ranks.
        seed: Data-order seed.
        global_batch: Yield the whole global batch (``G`` rows) instead of this
            rank's slice, e.g. for single-process reference runs.
        val_tokens: Optional validation stream for :meth:`val_batches`.

    Raises:
        ValueError: bad sizes or rank, or fewer windows than one global batch.
    """

    STATE_KEYS = ("epoch", "position", "seed", "seq_len", "num_tokens", "data_hash")

    def __init__(
        self,
        tokens: torch.Tensor,
        *,
        seq_len: int,
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        global_batch: bool = False,
        val_tokens: torch.Tensor | None = None,
    ) -> None:
        _check_loader_args(seq_len, batch_size, rank, world_size)
        self.tokens = _check_tokens(tokens, "tokens")
        self.val_tokens = None if val_tokens is None else _check_tokens(val_tokens, "val_tokens")
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = int(seed)
        self.global_batch = global_batch
        self.global_batch_size = world_size * batch_size
        self.num_windows = max(0, (self.tokens.numel() - 1) // seq_len)
        if self.num_windows < self.global_batch_size:
            raise ValueError(
                f"training split has {self.tokens.numel()} tokens = {self.num_windows} windows of "
                f"seq_len + 1 = {seq_len + 1} tokens, fewer than one global batch of "
                f"world_size * batch_size = {self.global_batch_size} windows; use more data or a "
                "smaller seq_len / batch_size"
            )
        self.steps_per_epoch = self.num_windows // self.global_batch_size
        self.fingerprint = data_fingerprint(self.tokens)
        self.epoch = 0
        self.position = 0
        self._perm_epoch = -1
        self._perm = torch.empty(0, dtype=torch.int64)

    # -- order ---------------------------------------------------------------

    def _permutation(self, epoch: int) -> torch.Tensor:
        """Window order of ``epoch`` (cached for the current epoch)."""
        if epoch != self._perm_epoch:
            gen = torch.Generator()
            gen.manual_seed(self.seed + epoch)
            self._perm = torch.randperm(self.num_windows, generator=gen)
            self._perm_epoch = epoch
        return self._perm

    def _batch(self, epoch: int, position: int, global_batch: bool) -> Batch:
        """The batch of the ``G`` windows starting at ``position`` in ``epoch``'s order."""
        ids = self._permutation(epoch)[position : position + self.global_batch_size]
        if not global_batch:
            ids = ids[self.rank * self.batch_size : (self.rank + 1) * self.batch_size]
        return _gather_windows(self.tokens, ids, self.seq_len)

    # -- iteration -----------------------------------------------------------

    def __iter__(self) -> DistributedTokenLoader:
        """The loader is its own (infinite) iterator."""
        return self

    def __next__(self) -> Batch:
        """Next ``(inputs, targets)``, advancing the state (wraps to the next epoch)."""
        if self.position + self.global_batch_size > self.num_windows:
            self.epoch += 1
            self.position = 0
            logger.debug("data loader starts epoch %d", self.epoch)
        batch = self._batch(self.epoch, self.position, self.global_batch)
        self.position += self.global_batch_size
        return batch

    def batch_at(self, step: int, *, global_batch: bool | None = None) -> Batch:
        """The batch of global step ``step`` of a fresh loader, without changing the state.

        ``step`` counts from 0 over all epochs; ``loader.batch_at(s)`` equals the
        ``s``-th ``next(loader)`` of a freshly constructed loader.

        Args:
            step: Global step (>= 0).
            global_batch: Whole global batch (default: the constructor's choice).
        """
        if step < 0:
            raise ValueError(f"invalid step {step!r}; must be >= 0")
        epoch, k = divmod(step, self.steps_per_epoch)
        full = self.global_batch if global_batch is None else global_batch
        return self._batch(epoch, k * self.global_batch_size, full)

    def val_batches(self, n: int | None = None) -> Iterator[Batch]:
        """Validation batches for this rank, see :func:`iter_val_batches`.

        Args:
            n: At most this many batches (``None``: the whole split).

        Raises:
            ValueError: the loader has no validation tokens.
        """
        if self.val_tokens is None:
            raise ValueError("this loader has no validation tokens (pass val_tokens=...)")
        return iter_val_batches(
            self.val_tokens,
            seq_len=self.seq_len,
            batch_size=self.batch_size,
            num_batches=n,
            rank=self.rank,
            world_size=self.world_size,
            global_batch=self.global_batch,
        )

    # -- state ---------------------------------------------------------------

    def state_dict(self) -> dict[str, int]:
        """Resumable state: plain ints only (safe for any checkpoint format).

        Keys: ``epoch``, ``position`` (windows consumed in the epoch), ``seed``,
        and the data fingerprint ``seq_len``, ``num_tokens``, ``data_hash``.
        """
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "num_tokens": self.fingerprint["num_tokens"],
            "data_hash": self.fingerprint["data_hash"],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`; the next batch is the one the saved loader
        would have produced next. The saved ``seed`` replaces the constructor's.

        Raises:
            ValueError: missing keys, non-integer values, a fingerprint
                (``seq_len``, ``num_tokens``, ``data_hash``) that differs from
                this loader's data, or an out-of-range position.
        """
        missing = [k for k in self.STATE_KEYS if k not in state]
        if missing:
            raise ValueError(
                f"data loader state is missing keys {missing}; expected {list(self.STATE_KEYS)}"
            )
        try:
            values = {k: operator.index(state[k]) for k in self.STATE_KEYS}
        except TypeError as exc:
            raise ValueError(f"data loader state values must be ints: {exc}") from exc
        mine = {"seq_len": self.seq_len, **self.fingerprint}
        diffs = [f"{k}: saved {values[k]}, current {mine[k]}" for k in mine if values[k] != mine[k]]
        if diffs:
            raise ValueError(
                "data loader state does not match this data (different corpus, tokenizer "
                "or seq_len): " + "; ".join(diffs)
            )
        if values["epoch"] < 0 or not 0 <= values["position"] <= self.num_windows:
            raise ValueError(
                f"data loader state out of range: epoch {values['epoch']}, position "
                f"{values['position']} (must be in [0, {self.num_windows}])"
            )
        if values["seed"] != self.seed:
            logger.info("data loader: using the saved seed %d (was %d)", values["seed"], self.seed)
        self.seed = values["seed"]
        self._perm_epoch = -1
        self.epoch = values["epoch"]
        self.position = values["position"]


# --------------------------------------------------------------------------- glue


@dataclass
class DataBundle:
    """What :func:`build_data` returns.

    Attributes:
        tokenizer: The tokenizer.
        corpus: The tokenised corpus.
        loader: The training loader for this rank (with the validation split).
    """

    tokenizer: Tokenizer
    corpus: TokenCorpus
    loader: DistributedTokenLoader


def build_data(
    cfg: DataConfig,
    *,
    rank: int = 0,
    world_size: int = 1,
    seed: int = 0,
    global_batch: bool = False,
) -> DataBundle:
    """Build tokenizer, corpus and loader from the ``[data]`` config section.

    Every rank builds the same corpus independently (it is deterministic), so
    no communication is needed.

    Args:
        cfg: The data section of a job config.
        rank: This rank.
        world_size: Number of data-parallel ranks.
        seed: Data-order seed (usually ``training.seed``).
        global_batch: See :class:`DistributedTokenLoader`.
    """
    tok = load_tokenizer(cfg.tokenizer)
    corpus = build_corpus(cfg.path, tok, val_fraction=cfg.val_fraction, max_bytes=cfg.max_bytes)
    if cfg.num_workers:
        logger.debug("data.num_workers=%d ignored: the token loader is in-memory", cfg.num_workers)
    loader = DistributedTokenLoader(
        corpus.train,
        seq_len=cfg.seq_len,
        batch_size=cfg.batch_size,
        rank=rank,
        world_size=world_size,
        seed=seed,
        global_batch=global_batch,
        val_tokens=corpus.val,
    )
    return DataBundle(tok, corpus, loader)
