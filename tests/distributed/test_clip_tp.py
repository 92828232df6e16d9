"""simplefsdp.engines.clip.clip_grad_norm_: the exact global norm over mixed meshes.

A small MLP (a LayerNorm, a column-wise and a row-wise linear, an untouched
head; uneven dims) under tensor parallelism then data parallelism on a
(dp 2, tp 2) mesh holds gradients on the 2-D mesh (``_StridedShard``,
``Shard``, ``Replicate`` on tp) and on the 1-D dp mesh (one copy per TP
rank). The norm (2 and inf) and the clipped gradients must match those of a
single-process reference trained on the global batch; the same for torch
FSDP2 + TP, for ``hybrid_shard`` on 4 ranks (gradients ``Replicate`` on one
mesh dim) and for purely data-parallel models on 2 ranks, against
``torch.nn.utils.clip_grad_norm_``.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from simplefsdp.testing import run_distributed

BATCH = 4
MAX_NORM = 0.05  # far below the norms here: clipping does scale
NORM_TYPES = (2.0, math.inf)


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.w1 = nn.Linear(8, 10)  # tp: 5 rows each, then dp: 3 and 2 (uneven)
        self.w2 = nn.Linear(10, 8)
        self.head = nn.Linear(8, 3)  # not in the TP plan; dp: 2 and 1 rows
        # One element: dp rank 1's shard is empty, where torch's own
        # clip_grad_norm_ fails for the inf norm (_foreach_norm of an empty tensor).
        self.gain = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.w2(torch.relu(self.w1(self.norm(x))))) * self.gain


def _reference() -> MLP:
    torch.manual_seed(0)
    model = MLP()
    # Non-trivial LayerNorm parameters, so their gradients are not symmetric.
    with torch.no_grad():
        model.norm.weight.uniform_(0.5, 1.5)
        model.norm.bias.uniform_(-0.5, 0.5)
    return model


def _batch() -> torch.Tensor:
    return torch.randn(BATCH, 8, generator=torch.Generator().manual_seed(1))


def _backward(model: nn.Module, rows: slice) -> None:
    model(_batch()[rows]).pow(2).mean().backward()


def _full(grad: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return grad.full_tensor() if isinstance(grad, DTensor) else grad


def _check(model: nn.Module, rows: slice, where: str) -> dict[str, float]:
    """Norms and clipped gradients of ``model`` (on ``rows``) vs. the reference."""
    from simplefsdp.engines.clip import clip_grad_norm_

    ref = _reference()
    _backward(ref, slice(0, BATCH))
    ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
    _backward(model, rows)
    norms = {}
    for norm_type in NORM_TYPES:
        got = clip_grad_norm_(model.parameters(), 0.0, norm_type)
        want = torch.nn.utils.get_total_norm(list(ref_grads.values()), norm_type)
        assert type(got) is torch.Tensor and got.dim() == 0, (where, type(got))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7, msg=f"{where} {norm_type}")
        norms[str(norm_type)] = got.item()
    for name, p in model.named_parameters():  # max_norm=0 did not touch them
        torch.testing.assert_close(_full(p.grad), ref_grads[name], rtol=1e-5, atol=1e-7)
    for norm_type in NORM_TYPES:
        clipped = {n: g.clone() for n, g in ref_grads.items()}
        ref_params = [nn.Parameter(torch.empty_like(g)) for g in clipped.values()]
        for p, g in zip(ref_params, clipped.values()):
            p.grad = g
        want = torch.nn.utils.clip_grad_norm_(ref_params, MAX_NORM, norm_type)
        saved = {n: p.grad.clone() for n, p in model.named_parameters()}
        got = clip_grad_norm_(list(model.parameters()), MAX_NORM, norm_type)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
        for name, p in model.named_parameters():
            torch.testing.assert_close(
                _full(p.grad), clipped[name], rtol=1e-5, atol=1e-7, msg=f"{where} {name}"
            )
            p.grad = saved[name]  # unclipped again for the next norm type
    return norms


def _tp_body(engines: list[str]) -> dict:
    return {engine: _tp_engine(engine) for engine in engines}


def _tp_engine(engine: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from simplefsdp.engines.clip import clip_grad_norm_

    model = _reference()
    if engine == "hybrid_shard":  # no TP: (Replicate, Shard) on a 2-D dp mesh
        import simplefsdp

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        simplefsdp.data_parallel(model, mesh, mode="hybrid_shard")
        rank = dist.get_rank()
        return {"norms": _check(model, slice(rank, rank + 1), engine)}
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    if engine == "simplefsdp":
        import simplefsdp

        simplefsdp.data_parallel(model, mesh["dp"])
    else:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=mesh["dp"])
    meshes = {p.device_mesh.ndim for p in model.parameters() if isinstance(p, DTensor)}
    assert meshes == {1, 2}, meshes  # gradients on both meshes: the case this is for
    dp = mesh["dp"].get_local_rank()
    rows = slice(dp * BATCH // 2, (dp + 1) * BATCH // 2)
    out = {"norms": _check(model, rows, engine)}

    # A rank without gradients still joins the all-reduce: no hang, and every
    # rank gets the same (smaller) norm.
    model.zero_grad(set_to_none=True)
    assert clip_grad_norm_(model.parameters(), 1.0).item() == 0.0
    _backward(model, rows)
    if dist.get_rank() == 3:
        model.zero_grad(set_to_none=True)
    out["partial"] = clip_grad_norm_(model.parameters(), 0.0).item()
    return out


def test_norm_and_clip_match_reference_on_dp2_tp2():
    engines = ["simplefsdp", "fsdp2", "hybrid_shard"]  # one launch: start-up dominates
    ranks = run_distributed(_tp_body, 4, args=(engines,))
    for engine in engines:
        assert all(r[engine]["norms"] == ranks[0][engine]["norms"] for r in ranks), engine
        if engine == "hybrid_shard":
            continue
        assert len({r[engine]["partial"] for r in ranks}) == 1, engine
        assert 0 < ranks[0][engine]["partial"] < ranks[0][engine]["norms"]["2.0"], engine


def _dp_body(modes: list[str]) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    import simplefsdp

    rank = dist.get_rank()
    rows = slice(rank * BATCH // 2, (rank + 1) * BATCH // 2)
    out = {}
    for mode in modes:
        model = simplefsdp.data_parallel(_reference(), init_device_mesh("cpu", (2,)), mode=mode)
        out[mode] = _check(model, rows, mode)
    return out


def test_norm_and_clip_match_torch_on_dp2():
    ranks = run_distributed(_dp_body, 2, args=(["fully_shard", "replicate"],))
    assert ranks[0] == ranks[1]


def test_bad_arguments_name_the_value():
    from simplefsdp.engines.clip import clip_grad_norm_

    param = nn.Parameter(torch.ones(3))
    param.grad = torch.ones(3)
    with pytest.raises(ValueError, match="max_norm must be >= 0.*-1.0"):
        clip_grad_norm_([param], -1.0)
    for bad in (0, -2.0, float("-inf"), float("nan"), "two"):
        with pytest.raises(ValueError, match="unsupported norm_type"):
            clip_grad_norm_([param], 1.0, bad)
    assert torch.equal(param.grad, torch.ones(3))
    assert clip_grad_norm_([], 1.0).item() == 0.0
