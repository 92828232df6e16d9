"""Token data pipeline, used by ``simplefsdp train`` and ``simplefsdp bench``.

The pipeline has four small modules:

* :mod:`~simplefsdp.data.tokenizer` - :class:`ByteTokenizer` (UTF-8 bytes plus
  4 special tokens, no dependencies) and :func:`load_tokenizer`, which also
  opens local Hugging Face tokenizers when ``tokenizers`` or ``transformers``
  is installed.
* :mod:`~simplefsdp.data.corpus` - :func:`read_documents` reads a text file, a
  folder of text files, or by default this Python's own standard-library
  sources; :func:`build_corpus` tokenises them into train/validation streams
  split by a fixed hash of each document's path.
* :mod:`~simplefsdp.data.loader` - :class:`DistributedTokenLoader`, a
  resumable, deterministic loader that hands each rank its slice of every
  global batch, and :func:`build_data`, which builds all three from the
  ``[data]`` section of a job config.
* :mod:`~simplefsdp.data.prepare` - ``simplefsdp data prepare``: a corpus
  tokenised once into memory-mapped token shards plus an index, which
  :func:`build_data` opens when ``data.path`` is such a folder; with
  ``--format chat`` conversations rendered by a chat template
  (:mod:`~simplefsdp.data.chat`) with a loss mask over the assistant's tokens.
* :mod:`~simplefsdp.data.verify` - each shard's checksum, verified once in a
  background thread while training runs.

This package imports nothing else of simplefsdp.
"""

from . import corpus, loader, tokenizer
from .corpus import (
    DEFAULT_STDLIB_MAX_BYTES,
    DEFAULT_TEXT_FIELD,
    Document,
    TokenCorpus,
    build_corpus,
    data_fingerprint,
    list_corpus_files,
    read_documents,
    sniff_data_file,
    stdlib_dir,
    token_dtype,
)
from .loader import (
    IGNORE_INDEX,
    Batch,
    DataBundle,
    DataSpec,
    DistributedTokenLoader,
    build_data,
    iter_val_batches,
)
from .tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    load_tokenizer,
    tokenizer_digest,
)
from .verify import DataError

__all__ = ["DistributedTokenLoader", "build_corpus", "load_tokenizer"]
