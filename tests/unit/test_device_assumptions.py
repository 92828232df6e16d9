"""The unit tests pass when CUDA is visible (issue: a GPU machine failed 9 of
them, the fake-process-group mesh on ``cuda`` while the model was on CPU).

Runs the other unit tests in a child pytest with CUDA made to look visible
(``pretend_cuda.py``); no GPU is needed. The child starts beside the first
unit test (root conftest), so it overlaps the unit tests on the second core,
and this test, moved last, waits for it.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from pretend_cuda import (
    ENV_VAR,
    UNIT_RUN_TIMEOUT_S,
    start_cuda_visible_unit_run,
    stop_cuda_visible_unit_run,
)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get(ENV_VAR) == "1", reason="already the child run")
def test_unit_tests_pass_with_cuda_visible() -> None:
    # Started beside the first unit test by the root conftest (or here, when
    # this test runs alone); this test runs last and waits for it.
    child = start_cuda_visible_unit_run(str(Path(__file__).resolve().parent))
    left = UNIT_RUN_TIMEOUT_S - (time.monotonic() - child["started"])
    try:
        rc = child["proc"].wait(timeout=max(left, 60.0))
    except subprocess.TimeoutExpired:
        rc = None
    output = Path(child["log"]).read_text(errors="replace")
    stop_cuda_visible_unit_run()
    assert rc == 0, f"exit code {rc}:\n" + output[-6000:]
