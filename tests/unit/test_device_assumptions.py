"""The unit tests pass when CUDA is visible (issue: a GPU machine failed 9 of
them, the fake-process-group mesh on ``cuda`` while the model was on CPU).

Runs the other unit tests in a child pytest with CUDA made to look visible
(``pretend_cuda.py``); no GPU is needed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pretend_cuda import ENV_VAR


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get(ENV_VAR) == "1", reason="already the child run")
def test_unit_tests_pass_with_cuda_visible() -> None:
    here = Path(__file__).resolve().parent
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", str(here)],
        env={**os.environ, ENV_VAR: "1"},
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
