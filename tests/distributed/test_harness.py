"""simplefsdp.testing.run_distributed: crash reports and crash retries."""

from __future__ import annotations

import ctypes
import os
import sys

import pytest
import torch.distributed as dist

from simplefsdp.testing import RankCrashed, run_distributed


def _attempt(marker_dir: str) -> int:
    """Count this call's attempt (per rank) in files under ``marker_dir``."""
    path = os.path.join(marker_dir, f"rank{dist.get_rank()}")
    with open(path, "a") as f:
        f.write("x")
    with open(path) as f:
        return len(f.read())


def _crash_on_first_attempt(marker_dir: str) -> int:
    attempt = _attempt(marker_dir)
    print(f"rank {dist.get_rank()} attempt {attempt}", file=sys.stderr, flush=True)
    if attempt == 1 and dist.get_rank() == 1:
        ctypes.string_at(0)  # SIGSEGV
    dist.barrier()
    return attempt


def _raise_on_rank_1(marker_dir: str) -> None:
    _attempt(marker_dir)
    if dist.get_rank() == 1:
        raise ValueError("bad value on rank 1")
    dist.barrier()


def test_crash_is_reported_with_signal_and_stack(tmp_path) -> None:
    with pytest.raises(RankCrashed) as info:
        run_distributed(_crash_on_first_attempt, 2, args=(str(tmp_path),), crash_retries=0)
    message = str(info.value)
    # The crashed rank comes first, with its signal and faulthandler's stack.
    assert message.index("rank 1 died with exit code -11 (SIGSEGV)") < message.find("rank 0 ---")
    assert "Fatal Python error: Segmentation fault" in message
    assert "_crash_on_first_attempt" in message
    assert "rank 1 attempt 1" in message  # the tail of the rank's own stderr


def test_crash_is_retried_and_warned(tmp_path) -> None:
    with pytest.warns(RuntimeWarning, match="a rank crashed; retrying"):
        result = run_distributed(_crash_on_first_attempt, 2, args=(str(tmp_path),), crash_retries=1)
    assert result == [2, 2]


def test_exceptions_are_never_retried(tmp_path) -> None:
    with pytest.raises(RuntimeError, match="bad value on rank 1") as info:
        run_distributed(_raise_on_rank_1, 2, args=(str(tmp_path),), crash_retries=3)
    assert not isinstance(info.value, RankCrashed)
    assert (tmp_path / "rank1").read_text() == "x"


@pytest.mark.parametrize("value", [-1, 1.5, True])
def test_bad_crash_retries_is_refused(value) -> None:
    with pytest.raises(ValueError, match="crash_retries must be an int >= 0"):
        run_distributed(_raise_on_rank_1, 2, crash_retries=value)
