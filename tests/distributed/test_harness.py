"""simplefsdp.testing.run_distributed: crash reports and crash retries."""

from __future__ import annotations

import ctypes
import os
import sys
import time

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


def _raise_on_rank_1_then_crash_rank_0(marker_dir: str) -> None:
    """Rank 1 raises; rank 0 crashes a second later (a crash that follows)."""
    _attempt(marker_dir)
    flag = os.path.join(marker_dir, "raised")
    if dist.get_rank() == 1:
        open(flag, "w").close()
        raise ValueError("bad value on rank 1")
    while not os.path.exists(flag):
        time.sleep(0.05)
    time.sleep(1.0)
    ctypes.string_at(0)


def _hang_on_rank_1() -> None:
    if dist.get_rank() == 1:
        time.sleep(600)


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
    # faulthandler's stack, innermost frame first (the line that crashed).
    stack = message[message.index("Fatal Python error: Segmentation fault") :]
    assert 0 < stack.index("in string_at") < stack.index("in _crash_on_first_attempt")
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


def test_crash_after_an_exception_is_not_retried(tmp_path) -> None:
    with pytest.raises(RuntimeError, match="bad value on rank 1") as info:
        run_distributed(
            _raise_on_rank_1_then_crash_rank_0, 2, args=(str(tmp_path),), crash_retries=1
        )
    assert not isinstance(info.value, RankCrashed)
    assert "rank 0 died with exit code -11 (SIGSEGV)" in str(info.value)
    assert (tmp_path / "rank0").read_text() == "x"


def test_hang_is_reported_with_the_hung_rank_stack() -> None:
    with pytest.raises(TimeoutError, match=r"ranks \[1\] did not finish") as info:
        run_distributed(_hang_on_rank_1, 2, timeout_s=8, crash_retries=1)
    assert "in _hang_on_rank_1" in str(info.value)
