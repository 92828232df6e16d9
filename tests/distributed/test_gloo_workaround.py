"""The gloo all-gather workaround (Note: [Gloo all-gather workaround],
docs/crashes.md): CPU functional all-gathers go through ``_allgather_base``
with unchanged results; ``run_distributed`` (gloo) and ``data_parallel``
install it."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.profiler import profile

import simplefsdp
from simplefsdp import _compat
from simplefsdp.testing import run_distributed


def _body() -> dict:
    installed_before = _compat._workaround_lib is not None
    simplefsdp.data_parallel(torch.nn.Linear(12, 25), init_device_mesh("cpu", (2,)))
    rank, name = dist.get_rank(), dist.group.WORLD.group_name
    ops = torch.ops._c10d_functional
    results = []
    with profile() as prof:
        for shape in [(13,), (6, 25), (1, 3, 2)]:
            x = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape) + rank
            out = ops.all_gather_into_tensor.default(x, 2, name)
            ops.wait_tensor.default(out)
            expected = torch.cat([x - rank, x - rank + 1])
            results.append(torch.equal(out, expected) and out.shape == expected.shape)
    names = {event.name for event in prof.events()}
    return {
        "installed_before": installed_before,
        "installed": _compat._workaround_lib is not None,
        "results": results,
        "allgather_base": any("_allgather_base" in n for n in names),
        "coalesced": any("allgather_into_tensor_coalesced" in n for n in names),
    }


def test_functional_all_gather_takes_allgather_base_on_gloo() -> None:
    for out in run_distributed(_body, 2):
        assert out["installed_before"]  # run_distributed installs it for gloo ranks
        assert out["installed"]
        assert out["results"] == [True, True, True]
        assert out["allgather_base"] and not out["coalesced"]


def test_opt_out(monkeypatch) -> None:
    monkeypatch.setattr(_compat, "_workaround_lib", None)
    monkeypatch.setenv(_compat.GLOO_ALL_GATHER_WORKAROUND_ENV_VAR, "0")
    assert _compat.install_gloo_all_gather_workaround() is False
    assert _compat._workaround_lib is None
