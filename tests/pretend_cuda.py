"""Make a CPU-only torch look as if CUDA were visible, for the unit tests.

``SIMPLEFSDP_TEST_PRETEND_CUDA=1 python -m pytest tests/unit`` runs the unit
tests with ``torch.cuda.is_available()`` true and one device, so code and
tests that pick a device from it while their tensors live on the CPU fail
here as they would on a GPU machine ("Torch not compiled with CUDA enabled"
at the first CUDA tensor). Dynamo saves and restores the CUDA RNG state
around every compiled frame when CUDA is available; that state is faked.
This finds device assumptions, nothing else: NCCL, CUDA memory and kernels
still need a GPU.
"""

from __future__ import annotations

import torch

ENV_VAR = "SIMPLEFSDP_TEST_PRETEND_CUDA"


def pretend_cuda_visible() -> None:
    import torch.cuda.random as cuda_random

    state = torch.zeros(16, dtype=torch.uint8)

    def get_rng_state(device="cuda"):
        return state.clone()

    def set_rng_state(new_state, device="cuda"):
        return None

    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
    for module in (torch.cuda, cuda_random):
        module.get_rng_state = get_rng_state
        module.set_rng_state = set_rng_state
    torch.cuda.get_rng_state_all = lambda: [state.clone()]
    torch.cuda.set_rng_state_all = lambda states: None


# The unit tests rerun with CUDA visible, in a child pytest. The root
# conftest starts it beside the first unit test of a run that selected
# tests/unit/test_device_assumptions.py (the unit tests run in one process on
# one core, so the child takes the other), and that test waits for it.
_CHILD: dict = {}
UNIT_RUN_TIMEOUT_S = 1200.0


def start_cuda_visible_unit_run(unit_dir: str) -> dict:
    """Start ``pytest unit_dir`` with CUDA made visible, once; its output goes
    to a temporary file. Returns ``{"proc", "log", "started"}``."""
    import os
    import subprocess
    import sys
    import tempfile
    import time

    if not _CHILD:
        fd, log = tempfile.mkstemp(prefix="simplefsdp-cuda-visible-", suffix=".log")
        cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", unit_dir]
        proc = subprocess.Popen(
            cmd, env={**os.environ, ENV_VAR: "1"}, stdout=fd, stderr=subprocess.STDOUT
        )
        os.close(fd)
        _CHILD.update(proc=proc, log=log, started=time.monotonic())
    return _CHILD


def stop_cuda_visible_unit_run() -> None:
    """Kill the child run if it is still going (the parent run stopped early)."""
    import os

    if _CHILD and _CHILD["proc"].poll() is None:
        _CHILD["proc"].kill()
        _CHILD["proc"].wait()
    if _CHILD and os.path.exists(_CHILD["log"]):
        os.unlink(_CHILD["log"])
    _CHILD.clear()
