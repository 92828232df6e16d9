"""Tokenizers of the data pipeline.

:class:`ByteTokenizer` (UTF-8 bytes plus 4 special tokens, no dependencies) and
:func:`load_tokenizer`, which also opens local Hugging Face tokenizers when
``tokenizers`` or ``transformers`` is installed.
"""

from __future__ import annotations

import hashlib
import importlib
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

logger = logging.getLogger(__name__)


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


#: The files of a Hugging Face tokenizer folder that define its tokens (and
#: its chat template); :func:`tokenizer_digest` hashes those present.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)


def tokenizer_digest(spec: str) -> str:
    """A hash of a tokenizer's definition, independent of where it lies.

    ``"byte"`` has a fixed digest; a ``tokenizer.json`` file is hashed whole;
    a folder by the :data:`TOKENIZER_FILES` it holds (name and bytes). Two
    copies of a tokenizer in different places have the same digest; a
    changed vocabulary, merge list or chat template gives another.

    Raises:
        ValueError: the path does not exist, or a folder holds none of
            :data:`TOKENIZER_FILES`.
    """
    digest = hashlib.sha256()
    if spec == "byte":
        digest.update(b"simplefsdp-byte-tokenizer-260")
        return "sha256:" + digest.hexdigest()
    path = Path(spec).expanduser()
    if path.is_file():
        digest.update(path.read_bytes())
    elif path.is_dir():
        found = [name for name in TOKENIZER_FILES if (path / name).is_file()]
        if not found:
            raise ValueError(
                f"tokenizer {spec!r}: folder holds none of the tokenizer files "
                f"({', '.join(TOKENIZER_FILES[:3])}, ...)"
            )
        for name in found:
            digest.update(name.encode() + b"\0" + (path / name).read_bytes() + b"\0")
    else:
        raise ValueError(
            f"tokenizer {spec!r}: path does not exist; use 'byte' or the path of a local "
            "tokenizer.json file or Hugging Face tokenizer folder"
        )
    return "sha256:" + digest.hexdigest()
