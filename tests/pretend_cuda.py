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
