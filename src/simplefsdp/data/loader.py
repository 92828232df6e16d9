"""The distributed token loader and :func:`build_data`.

:class:`DistributedTokenLoader` cuts the training stream into windows of
``seq_len + 1`` tokens (consecutive windows share one boundary token, so window
``i`` starts at token ``i * seq_len``), shuffles them with a seeded permutation
per epoch and hands each rank its slice of every global batch. Its state is a
handful of plain ints, and concatenating the rank slices in rank order gives
the same global batch for every world size with the same
``world_size * batch_size``.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .corpus import DEFAULT_TEXT_FIELD, TokenCorpus, build_corpus, data_fingerprint
from .prepare import TokenShards, is_prepared, load_prepared
from .tokenizer import Tokenizer, load_tokenizer
from .verify import ShardVerifier

logger = logging.getLogger(__name__)


#: ``(inputs, targets)``, two int64 tensors of shape ``(batch, seq_len)``.
Batch = tuple[torch.Tensor, torch.Tensor]


#: Target id that the loss leaves out (``F.cross_entropy``'s default ``ignore_index``).
IGNORE_INDEX = -100


def _gather_windows(
    tokens: torch.Tensor, window_ids: torch.Tensor, seq_len: int, mask_after: int | None = None
) -> Batch:
    """``(inputs, targets)`` int64 tensors for the windows ``window_ids``; targets whose
    input is ``mask_after`` (the EOS id) are :data:`IGNORE_INDEX`, and so are the
    targets outside the loss mask of token shards that have one (chat data)."""
    starts = window_ids.to(torch.int64) * seq_len
    index = starts[:, None] + torch.arange(seq_len + 1, dtype=torch.int64)[None, :]
    windows = (tokens.gather(index) if isinstance(tokens, TokenShards) else tokens[index]).to(
        torch.int64
    )
    inputs, targets = windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
    if mask_after is not None:
        targets[inputs == mask_after] = IGNORE_INDEX
    if isinstance(tokens, TokenShards) and tokens.has_mask:
        targets[~tokens.gather_mask(index[:, 1:])] = IGNORE_INDEX
    return inputs, targets


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
    """Validate a 1-D integer token tensor and return it contiguous (shards as they are)."""
    if isinstance(tokens, TokenShards):
        return tokens
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
    warn: bool = True,
    mask_after: int | None = None,
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
        warn: Log a warning (with the fix) when the stream is shorter than
            one global batch.
        mask_after: See :class:`DistributedTokenLoader`.

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
    if warn and total == 0 and (num_batches is None or num_batches > 0):
        logger.warning(
            "validation split (%d tokens) is too small for one global batch of %d x %d tokens, "
            "so there is no validation loss; raise data.val_fraction or data.max_bytes, lower "
            "data.batch_size or data.seq_len, or set metrics.val_interval 0",
            tokens.numel(),
            g,
            seq_len + 1,
        )
    lo, hi = (0, g) if global_batch else (rank * batch_size, (rank + 1) * batch_size)
    for k in range(total):
        ids = torch.arange(k * g + lo, k * g + hi, dtype=torch.int64)
        yield _gather_windows(tokens, ids, seq_len, mask_after)


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
        mask_after: Targets whose input token is this id (the EOS id) are
            :data:`IGNORE_INDEX`, left out of the loss (document boundaries).
        verifier: Verifies the token shards in the background; each batch
            raises :class:`~simplefsdp.data.verify.DataError` once it has
            found a damaged one.

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
        mask_after: int | None = None,
        verifier: ShardVerifier | None = None,
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
        self.mask_after = mask_after
        self.verifier = verifier
        #: Whether targets outside the assistant's turns are left out (chat data).
        self.has_loss_mask = isinstance(self.tokens, TokenShards) and self.tokens.has_mask
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
        self.fingerprint = (
            self.tokens.fingerprint
            if isinstance(self.tokens, TokenShards)
            else data_fingerprint(self.tokens)
        )
        self.epoch = 0
        self.position = 0
        self._perm_epoch = -1
        self._perm = torch.empty(0, dtype=torch.int64)
        self._val_warned = False
        # Read-ahead (token shards): the next batch is gathered in a background
        # thread while the caller uses this one; see __next__.
        self.read_ahead = isinstance(self.tokens, TokenShards)
        self._ahead: tuple[tuple[int, int], Future[Batch]] | None = None
        self._pool: ThreadPoolExecutor | None = None

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
        return self._windows(self._permutation(epoch), position, global_batch)

    def _windows(self, perm: torch.Tensor, position: int, global_batch: bool) -> Batch:
        """The batch of the ``G`` windows starting at ``position`` in the order ``perm``."""
        ids = perm[position : position + self.global_batch_size]
        if not global_batch:
            ids = ids[self.rank * self.batch_size : (self.rank + 1) * self.batch_size]
        return _gather_windows(self.tokens, ids, self.seq_len, self.mask_after)

    # -- iteration -----------------------------------------------------------

    def __iter__(self) -> DistributedTokenLoader:
        """The loader is its own (infinite) iterator."""
        return self

    def __next__(self) -> Batch:
        """Next ``(inputs, targets)``, advancing the state (wraps to the next epoch).

        Raises:
            DataError: a damaged token shard (one line naming it and the fix).
        """
        if self.verifier is not None:
            self.verifier.check()
        if self.position + self.global_batch_size > self.num_windows:
            self.epoch += 1
            self.position = 0
            logger.debug("data loader starts epoch %d", self.epoch)
        key = (self.epoch, self.position)
        if self._ahead is not None and self._ahead[0] == key:
            batch = self._ahead[1].result()
        else:
            batch = self._batch(self.epoch, self.position, self.global_batch)
        self._ahead = None
        self.position += self.global_batch_size
        if self.read_ahead:
            self._start_read_ahead()
        return batch

    def _start_read_ahead(self) -> None:
        """Gather the batch after the current position in a background thread."""
        epoch, position = self.epoch, self.position
        if position + self.global_batch_size > self.num_windows:
            epoch, position = epoch + 1, 0
        perm = self._permutation(epoch)  # here, not in the thread: it is cached state
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="simplefsdp-data")
        future = self._pool.submit(self._windows, perm, position, self.global_batch)
        self._ahead = ((epoch, position), future)

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
        warn = not self._val_warned and self.rank == 0  # once per run
        self._val_warned = True
        return iter_val_batches(
            self.val_tokens,
            seq_len=self.seq_len,
            batch_size=self.batch_size,
            num_batches=n,
            rank=self.rank,
            world_size=self.world_size,
            global_batch=self.global_batch,
            warn=warn,
            mask_after=self.mask_after,
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
        self._ahead = None  # read ahead for the old position
        self.epoch = values["epoch"]
        self.position = values["position"]


class DataSpec(Protocol):
    """What :func:`build_data` reads: the ``[data]`` section of a job config.

    ``simplefsdp.train.config.DataConfig`` satisfies it; the data package does
    not import the train package.
    """

    path: str | None
    seq_len: int
    batch_size: int
    val_fraction: float
    tokenizer: str
    max_bytes: int | None
    text_field: str
    mask_document_boundaries: bool


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
    cfg: DataSpec,
    *,
    rank: int = 0,
    world_size: int = 1,
    seed: int = 0,
    global_batch: bool = False,
    report: bool = True,
    vocab_size: int | None = None,
    verify: tuple[int, int] | None = None,
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
        report: Log what reading the data found (undecodable bytes, skipped
            records); one rank of a job is enough.
        vocab_size: The model's vocabulary (default: the tokenizer's); token
            shards' ids are checked against it batch by batch.
        verify: ``(i, n)``: verify every ``n``-th token shard from the
            ``i``-th in the background (e.g. this node's local rank and
            ranks per node, so that each node checks its own copy);
            ``None``: no verification.
    """
    tok = load_tokenizer(cfg.tokenizer)
    mask_after = tok.eos_id if getattr(cfg, "mask_document_boundaries", False) else None
    if is_prepared(cfg.path):  # token shards of simplefsdp data prepare, memory-mapped
        prepared = load_prepared(cfg.path, tok, cfg.tokenizer, vocab_size=vocab_size, verify=verify)
        corpus, train, val = prepared.corpus, prepared.train, prepared.val
        verifier = prepared.verifier
    else:
        corpus = build_corpus(
            cfg.path,
            tok,
            val_fraction=cfg.val_fraction,
            max_bytes=cfg.max_bytes,
            text_field=getattr(cfg, "text_field", DEFAULT_TEXT_FIELD),
            report=report,
        )
        train, val = corpus.train, corpus.val
        verifier = None
    loader = DistributedTokenLoader(
        train,
        seq_len=cfg.seq_len,
        batch_size=cfg.batch_size,
        rank=rank,
        world_size=world_size,
        seed=seed,
        global_batch=global_batch,
        val_tokens=val,
        mask_after=mask_after,
        verifier=verifier,
    )
    return DataBundle(tok, corpus, loader)
