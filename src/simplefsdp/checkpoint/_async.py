"""Checkpoints written in the background while training goes on.

Note: [Asynchronous checkpoints]
    ``checkpoint.async_mode`` picks how much of a save the training loop waits for:

    * ``none``: all of it (:func:`simplefsdp.checkpoint.save`).
    * ``async``: the copy of this rank's tensors to host memory; the files are
      written by ``torch.distributed.checkpoint.async_save`` in a background
      thread.
    * ``staged``: nothing but the start; the copy to host memory (pinned where
      CUDA is present) runs in a background thread too, and the optimizer step
      after the save waits for that copy (:meth:`PendingSave.wait_staged`),
      as it changes the tensors being copied.

    The background save runs its collectives on a process group of its own
    (gloo), so that they never interleave with the training's. Once every
    rank's files are written, the same background thread finishes the save
    exactly as a synchronous one does (manifest, verification, the atomic
    rename of [Atomic publish]): a process killed while the files are being
    written leaves only ``step-N.tmp``, which resuming skips for the previous
    checkpoint. One save is in flight at a time: a new save first waits for
    the previous one to commit. The trainer waits for the last one before it
    exits (:meth:`AsyncCheckpointWriter.close`).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn

from simplefsdp.checkpoint import _api
from simplefsdp.checkpoint._files import CheckpointError
from simplefsdp.checkpoint._state import model_device, rank_and_world, tensor_state

logger = logging.getLogger(__name__)


AsyncMode = Literal["none", "async", "staged"]
ASYNC_MODES: tuple[str, ...] = ("none", "async", "staged")


def _done_future() -> Future[None]:
    future: Future[None] = Future()
    future.set_result(None)
    return future


class PendingSave:
    """A save whose files are being written in the background.

    Attributes:
        path: the checkpoint folder it publishes once complete.
        step: its step.
        blocking_s: seconds the call that started it blocked training.
    """

    def __init__(
        self, path: Path, step: int, staged: Future[Any], committed: Future[Path], blocking_s: float
    ) -> None:
        self.path, self.step, self.blocking_s = path, step, blocking_s
        self._staged, self._committed = staged, committed

    def wait_staged(self) -> float:
        """Wait until the tensors are copied (the optimizer may change them
        after); the seconds waited."""
        if self._staged.done():
            return 0.0
        start = time.perf_counter()
        self._staged.result()
        return time.perf_counter() - start

    def done(self) -> bool:
        """Whether the save has finished (committed or failed)."""
        return self._committed.done()

    def wait(self) -> Path:
        """Wait until the checkpoint is published; its folder.

        Raises:
            CheckpointError: the background save failed (one line).
        """
        try:
            return self._committed.result()
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(f"the background save of {self.path} failed: {exc}") from exc


class AsyncCheckpointWriter:
    """Starts saves that finish in the background (Note: [Asynchronous checkpoints]).

    Collective to construct (it creates a gloo process group) and to use:
    every rank calls :meth:`save` with the same arguments, in the same order.

    Args:
        mode: ``"async"`` or ``"staged"``.
    """

    def __init__(self, mode: AsyncMode) -> None:
        if mode not in ("async", "staged"):
            raise ValueError(f"async checkpoint mode must be 'async' or 'staged', got {mode!r}")
        self.mode = mode
        distributed = dist.is_available() and dist.is_initialized()
        self.group = dist.new_group(backend="gloo") if distributed else None
        self._stager = None
        if mode == "staged":
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            cuda = torch.cuda.is_available()
            self._stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=cuda,
                    use_shared_memory=False,
                    use_async_staging=True,
                    use_non_blocking_copy=cuda,
                )
            )
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="simplefsdp-checkpoint")
        self.pending: PendingSave | None = None

    def save(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        path: str | os.PathLike[str],
        *,
        json_files: Mapping[str, Any],
        step: int,
        config_hash: str,
        after_commit: Callable[[Path], None] | None = None,
    ) -> PendingSave:
        """Start saving ``model`` and ``optimizer`` to ``path``; return at once.

        Waits first for the previous save to commit. ``after_commit(path)``
        runs in the background thread once the checkpoint is published (e.g.
        pruning older ones); it may use :attr:`group` for collectives.

        Returns:
            The :class:`PendingSave`; call :meth:`PendingSave.wait_staged`
            before the optimizer changes the parameters.
        """
        start = time.perf_counter()
        self.wait()
        final, tmp, files = _api.prepare_save(path, json_files=json_files)
        state, _ = tensor_state(model, optimizer, rng_device=model_device(model))
        writer = dcp.FileSystemWriter(str(tmp), sync_files=True)
        # no_dist only where needed: a keyword that older torch releases lack
        single = {"no_dist": True} if _api._no_dist() else {}
        with _api._single_process_ok():
            response = dcp.async_save(
                state,
                storage_writer=writer,
                process_group=self.group,
                async_stager=self._stager,
                **single,
            )
        if isinstance(response, Future):
            staged, upload = _done_future(), response
        else:  # AsyncSaveResponse: staging in the background
            staged, upload = response.staging_completion, response.upload_completion
        _api.write_json_files(tmp, files)
        fields = {"step": step, "world_size": rank_and_world()[1], "config_hash": config_hash}

        def commit() -> Path:
            upload.result()
            _api.commit_save(tmp, final, fields, group=self.group)
            if after_commit is not None:
                after_commit(final)
            return final

        committed = self._pool.submit(commit)
        self.pending = PendingSave(final, step, staged, committed, time.perf_counter() - start)
        return self.pending

    def wait_staged(self) -> float:
        """Wait for the pending save's copy of the tensors (if any); seconds waited."""
        return 0.0 if self.pending is None else self.pending.wait_staged()

    def wait(self) -> Path | None:
        """Wait for the pending save to commit; its folder (``None``: none pending).

        Raises:
            CheckpointError: it failed.
        """
        pending, self.pending = self.pending, None
        return None if pending is None else pending.wait()

    def close(self) -> Path | None:
        """Wait for the pending save, then release the threads; the last committed folder."""
        try:
            return self.wait()
        finally:
            self._pool.shutdown(wait=True)
            if self._stager is not None:
                self._stager.close()
