"""The engine layer: every engine trains the same model to the same losses.

Each data-parallel engine (simplefsdp uncompiled, simplefsdp with the eager
executor, torch FSDP2, DDP) runs 3 optimizer steps of 2 accumulated
micro-batches on 2 ranks, each rank on its half of the global batch; the
reference is the plain model trained in one process on the global batch.
``replica`` trains each rank's own copy on the rank's half only.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from simplefsdp.testing import run_distributed

STEPS, ACCUM, BATCH, SEQ = 3, 2, 4, 16


def _model():
    from simplefsdp.models.llama3 import Transformer, get_config

    torch.manual_seed(0)
    return Transformer(get_config("debug", dim=32, n_layers=2, n_heads=4, n_kv_heads=2))


def _batches(vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (BATCH, SEQ + 1), generator=g) for _ in range(STEPS * ACCUM)]


def _loss(forward, tokens: torch.Tensor) -> torch.Tensor:
    logits = forward(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())


def _train(parallel, batches, rows: slice) -> list[float]:
    from simplefsdp.engines import clip_grad_norm_

    params = [p for p in parallel.module.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(params, lr=1e-2)
    losses = []
    for step in range(STEPS):
        total = 0.0
        for micro in range(ACCUM):
            tokens = batches[step * ACCUM + micro][rows]
            with parallel.grad_sync(micro == ACCUM - 1):
                loss = _loss(parallel.forward, tokens) / ACCUM
                loss.backward()
            total += loss.item()
        clip_grad_norm_(params, 1.0)
        optim.step()
        optim.zero_grad(set_to_none=True)
        losses.append(total)
    return losses


def _engines_body(engines: list[str]) -> dict:
    from simplefsdp.engines import EngineSpec, build_mesh, parallelize

    rank, world = dist.get_rank(), dist.get_world_size()
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    batches = _batches(_model().vocab_size)
    out = {}
    for engine in engines:
        mesh = build_mesh(engine, "fully_shard", "cpu", world)
        parallel = parallelize(_model(), EngineSpec(engine), mesh, torch.device("cpu"))
        losses = _train(parallel, batches, rows)
        # The global mean of the ranks' losses (each rank saw half the batch).
        mean = torch.tensor(losses)
        dist.all_reduce(mean)
        out[engine] = {"global": (mean / world).tolist(), "local": losses}
        if engine == "fsdp2":
            out["fsdp2_groups"] = _fsdp2_groups(parallel, batches[0][rows])
    return out


def _fsdp2_groups(parallel, tokens: torch.Tensor) -> dict:
    """The fsdp2 engine's FSDP modules, and which of them a forward leaves
    gathered (its parameters plain tensors, not sharded DTensors)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    model = parallel.module
    groups = sorted(name for name, m in model.named_modules() if isinstance(m, FSDPModule))
    loss = _loss(parallel.forward, tokens)
    gathered = sorted(
        name
        for name in groups
        if name and not isinstance(next(model.get_submodule(name).parameters()), DTensor)
    )
    loss.backward()
    return {"groups": groups, "gathered_after_forward": gathered}


def _reference(rows: slice) -> list[float]:
    from simplefsdp.engines import ParallelModel

    model = _model()
    return _train(ParallelModel(model, model, "replica", None), _batches(model.vocab_size), rows)


@pytest.mark.parametrize(
    "engines",
    [["simplefsdp", "simplefsdp_eager"], ["fsdp2", "ddp", "replica"]],
    ids=["simplefsdp", "peers"],
)
def test_every_engine_matches_a_single_process_run(engines):
    ranks = run_distributed(_engines_body, 2, args=(engines,))
    full = _reference(slice(0, BATCH))
    for engine in engines:
        if engine == "replica":
            # No gradient sync: rank r trains on its half, as one process would.
            for r in range(2):
                half = _reference(slice(r * BATCH // 2, (r + 1) * BATCH // 2))
                assert ranks[r][engine]["local"] == pytest.approx(half, rel=1e-5), r
            continue
        assert ranks[0][engine]["global"] == pytest.approx(full, rel=1e-5), engine
    if "fsdp2" in engines:
        # torchtitan's groups: the embedding apart, resharded after forward
        # like the blocks; the final norm and output one group, kept
        groups = ranks[0]["fsdp2_groups"]
        assert groups["groups"] == ["", "layers.0", "layers.1", "norm", "output", "tok_embeddings"]
        assert groups["gathered_after_forward"] == ["norm", "output"]


def test_engine_spec_rejects_bad_values():
    from simplefsdp.engines import EngineSpec

    with pytest.raises(ValueError, match=r"unknown engine 'fsdp'; valid: simplefsdp, "):
        EngineSpec("fsdp")
    with pytest.raises(ValueError, match=r"unknown dtype 'bf16'; valid: float32, bfloat16"):
        EngineSpec(param_dtype="bf16")
    with pytest.raises(ValueError, match=r"valid choices with torch's own Inductor passes"):
        EngineSpec("fsdp2", torch_passes=True)


def _check_ranks_body() -> list[bool]:
    from simplefsdp.engines import EngineSpec, build_mesh, parallelize
    from simplefsdp.frontend.data_parallel import get_data_parallel_state

    mesh = build_mesh("simplefsdp", "fully_shard", "cpu", dist.get_world_size())
    out = []
    for flag in (True, False):
        spec = EngineSpec("simplefsdp_eager", check_ranks=flag)
        parallel = parallelize(_model(), spec, mesh, torch.device("cpu"))
        out.append(get_data_parallel_state(parallel.module).check_ranks)
    return out


def test_check_ranks_reaches_data_parallel():
    assert run_distributed(_check_ranks_body, 2)[0] == [True, False]


def _meta_body() -> str:
    from simplefsdp.engines import EngineSpec, build_mesh, parallelize

    with torch.device("meta"):
        model = _model()
    mesh = build_mesh("simplefsdp", "fully_shard", "cpu", dist.get_world_size())
    try:
        parallelize(model, EngineSpec(), mesh, torch.device("cpu"))
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_meta_model_without_init_fn_is_refused():
    assert "pass init_fn" in run_distributed(_meta_body, 2)[0]
