"""Checksums of token shards and their verification, once, off the training path.

``simplefsdp data prepare`` records per shard a CRC-32 of its bytes and its
largest token id (see [Verified token data]). :class:`ShardVerifier` checks
the shards of a prepared folder in a background thread while training runs;
a shard that checks out is recorded in ``verified/`` so that later runs do
not read it again.

Note: [Verified token data]
    Three checks guard a prepared folder, from cheapest to dearest. Before
    any process starts, ``simplefsdp train`` compares ``index.json``'s
    tokenizer digest with the given tokenizer's and its largest id with the
    model's vocabulary, and stats every shard (size). While training, every
    batch's ids are compared with the vocabulary as they are gathered (an
    ``int`` compare of the batch: a damaged id is one line naming the shard,
    never an ``IndexError`` in the embedding). And once per shard, a
    background thread reads it whole and compares its CRC-32 with the
    index's (damage that stays inside the vocabulary); the result is kept
    in ``verified/<shard>.json`` with the shard's size and modification
    time, so a shard changed afterwards is read again. A folder prepared
    before checksums were recorded is verified the same way on first use,
    by its largest id only, and its checksum recorded then.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

#: Sub-folder of a prepared folder recording the shards already verified.
VERIFIED_DIR = "verified"
_CHUNK_BYTES = 1 << 24


class DataError(ValueError):
    """Damaged or unfit token data found while training (one line with the fix)."""


def scan_shard(path: str | os.PathLike[str], dtype: np.dtype | None = None) -> tuple[str, int]:
    """``(checksum, largest id)`` of a shard, read once in 16 MiB chunks.

    ``checksum`` is ``"crc32:<8 hex digits>"`` of the file's bytes; the
    largest id is ``-1`` without ``dtype`` or for an empty file.
    """
    crc, largest = 0, -1
    with open(path, "rb") as f:
        while True:
            chunk = f.read(_CHUNK_BYTES)
            if not chunk:
                break
            crc = zlib.crc32(chunk, crc)
            if dtype is not None:
                largest = max(largest, int(np.frombuffer(chunk, dtype=dtype).max(initial=0)))
    return f"crc32:{crc:08x}", largest


def shard_checksum(path: str | os.PathLike[str]) -> str:
    """``"crc32:<8 hex digits>"`` of the file ``path`` (see :func:`scan_shard`)."""
    return scan_shard(path)[0]


@dataclass(frozen=True)
class ShardCheck:
    """One file of a prepared folder to verify.

    Attributes:
        path: The shard (token ids or loss mask).
        checksum: The recorded checksum (``None``: a folder prepared before
            checksums; then only the ids are checked).
        dtype: The id dtype (``None`` for a loss mask).
    """

    path: Path
    checksum: str | None
    dtype: np.dtype | None = None


def _marker(path: Path) -> Path:
    return path.parent.parent / VERIFIED_DIR / (path.name + ".json")


def _stat_key(path: Path) -> dict[str, int]:
    st = os.stat(path)
    return {"size": int(st.st_size), "mtime_ns": int(st.st_mtime_ns)}


def is_verified(check: ShardCheck) -> bool:
    """Whether ``check.path`` was verified and has not changed since."""
    try:
        seen = json.loads(_marker(check.path).read_text(encoding="utf-8"))
        same = seen["stat"] == _stat_key(check.path)
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return same and (check.checksum is None or seen.get("checksum") == check.checksum)


def record_verified(check: ShardCheck, checksum: str) -> None:
    """Note that ``check.path`` has ``checksum`` (best effort: a read-only folder is fine)."""
    marker = _marker(check.path)
    try:
        marker.parent.mkdir(exist_ok=True)
        tmp = marker.with_name(f"{marker.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(json.dumps({"checksum": checksum, "stat": _stat_key(check.path)}))
        os.replace(tmp, marker)
    except OSError as exc:
        logger.debug("cannot record the verification of %s: %s", check.path, exc)


class ShardVerifier:
    """Verify shards in a background thread; :meth:`check` raises what it found.

    Args:
        checks: The files to verify (those already verified are skipped).
        vocab_size: Ids must be below it (checked on files without a checksum).
        fix: The command that rebuilds the folder, named in the error.
    """

    def __init__(self, checks: Sequence[ShardCheck], *, vocab_size: int, fix: str) -> None:
        self.checks = list(checks)
        self.vocab_size = vocab_size
        self.fix = fix
        self.error: str | None = None
        self.verified = 0
        self._thread: threading.Thread | None = None

    def start(self) -> ShardVerifier:
        """Start the thread (a daemon: it never delays the process's exit)."""
        self._thread = threading.Thread(target=self._run, name="simplefsdp-verify", daemon=True)
        self._thread.start()
        return self

    def run(self) -> None:
        """Verify every file now (the thread's body); stops at the first damaged one."""
        for check in self.checks:
            if is_verified(check):
                continue
            problem = self.verify_one(check)
            if problem is not None:
                self.error = problem
                return
            self.verified += 1

    def _run(self) -> None:
        self.run()
        if self.verified and self.error is None:
            logger.info("verified %d token shard files (checksums recorded)", self.verified)

    def verify_one(self, check: ShardCheck) -> str | None:
        """The one-line problem of ``check.path``, or ``None`` (then recorded as verified)."""
        try:
            checksum, largest = scan_shard(check.path, check.dtype)
        except OSError as exc:
            return f"token shard {check.path} cannot be read ({exc}); {self.fix}"
        if check.checksum is not None and checksum != check.checksum:
            return (
                f"token shard {check.path} is damaged (checksum {checksum}, index.json "
                f"records {check.checksum}); {self.fix}"
            )
        if check.checksum is None and largest >= self.vocab_size:
            return (
                f"token shard {check.path} holds token id {largest}, outside the vocabulary "
                f"of {self.vocab_size}; {self.fix}"
            )
        record_verified(check, checksum)
        return None

    def check(self) -> None:
        """Raise :class:`DataError` if the thread found a damaged shard (never waits)."""
        if self.error is not None:
            raise DataError(self.error)

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the thread, then :meth:`check`."""
        if self._thread is not None:
            self._thread.join(timeout)
        self.check()
