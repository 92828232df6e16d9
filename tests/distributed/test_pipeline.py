"""Pipeline stages that are simplefsdp-sharded (and compiled), run by torch's own
schedules (``torch.distributed.pipelining``), against a single-process run on
the global batch: pp2 x dp2 and pp2 x tp2 on 4 CPU processes.

Every rank builds the same seeded model and splits it with
``simplefsdp.models.llama3.pipeline_split``; the reference trains the whole
model in the same process.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from simplefsdp.testing import run_distributed

STEPS, BATCH, SEQ, MICRO = 3, 8, 16, 4


def _loss(logits, target):
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


def _case(schedule_name: str, stages_per_rank: int, second: str, backend: str | None):
    """Train 3 steps on a ("pp", second) mesh; the largest parameter difference."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, schedules

    import simplefsdp
    from simplefsdp.engines import clip_grad_norm_
    from simplefsdp.models.llama3 import (
        Transformer,
        apply_tensor_parallel,
        get_config,
        pipeline_split,
        stage_ids_for_rank,
    )

    torch._dynamo.reset()
    torch.manual_seed(0)
    ref = Transformer(get_config("debug", dim=32, n_layers=4, n_heads=4, n_kv_heads=2))
    if second == "tp":  # pp2 x tp2, each stage also data_parallel on a 1-rank dp dim
        mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("pp", "dp", "tp"))
    else:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp_rank = mesh["pp"].get_local_rank()
    num_stages = 2 * stages_per_rank
    ids = stage_ids_for_rank(pp_rank, 2, stages_per_rank)
    modules = pipeline_split(ref, ids, num_stages)
    stages = []
    for stage_id, module in zip(ids, modules):
        if second == "tp":
            apply_tensor_parallel(module, mesh["tp"])  # sequence parallel on
        simplefsdp.data_parallel(module, mesh["dp"])
        if backend is not None:
            simplefsdp.compile(module, backend=backend)
        stages.append(
            PipelineStage(
                module, stage_id, num_stages, torch.device("cpu"), group=mesh["pp"].get_group()
            )
        )
    cls = getattr(schedules, schedule_name)
    schedule = cls(
        stages if stages_per_rank > 1 else stages[0], n_microbatches=MICRO, loss_fn=_loss
    )
    params = [p for m in modules for p in m.parameters()]
    opt = torch.optim.SGD(params, lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(1)
    dp = mesh[second].get_local_rank() if second == "dp" else 0
    rows = BATCH // 2 if second == "dp" else BATCH
    for _ in range(STEPS):
        tokens = torch.randint(0, ref.vocab_size, (BATCH, SEQ + 1), generator=g)
        mine = tokens[dp * rows : (dp + 1) * rows]
        if pp_rank == 0:
            schedule.step(mine[:, :-1], target=mine[:, 1:])
        else:
            schedule.step(target=mine[:, 1:])
        norm = clip_grad_norm_(params, 1.0)  # across stages (and meshes)
        opt.step()
        opt.zero_grad()
        _loss(ref(tokens[:, :-1]), tokens[:, 1:]).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        torch.testing.assert_close(norm, ref_norm, rtol=1e-4, atol=1e-6)
        ref_opt.step()
        ref_opt.zero_grad()
    expected = ref.state_dict()
    worst = 0.0
    for module in modules:
        for key, value in module.state_dict().items():
            full = value.full_tensor() if hasattr(value, "full_tensor") else value
            torch.testing.assert_close(full, expected[key], rtol=1e-4, atol=1e-5, msg=key)
            worst = max(worst, (full - expected[key]).abs().max().item())
    return worst


def _engine_case(schedule: str, engine: str, backend: str | None, accum: int, tp: int = 1):
    """pp2 x dp2 (or pp2 x tp2) through ``simplefsdp.engines.parallelize_pipeline``,
    ``accum`` pipeline steps per optimizer step; returns the reduce-scatters per step."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountReduceScatters(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += "reduce_scatter" in str(func)
            return func(*args, **(kwargs or {}))

    from simplefsdp.engines import (
        EngineSpec,
        PipelineSpec,
        build_mesh,
        clip_grad_norm_,
        parallelize_pipeline,
    )
    from simplefsdp.models.llama3 import (
        Transformer,
        apply_tensor_parallel,
        get_config,
        pipeline_split,
    )

    torch._dynamo.reset()
    torch.manual_seed(0)
    ref = Transformer(get_config("debug", dim=32, n_layers=4, n_heads=4, n_kv_heads=2))
    mesh = build_mesh(engine, "fully_shard", "cpu", 4, pp=2, tp=tp)
    assert mesh.mesh_dim_names == (("pp", "dp_shard", "tp") if tp > 1 else ("pp", "dp_shard"))
    spec = EngineSpec(engine, compile=backend is not None, backend=backend or "inductor", tp=tp)
    pipe = PipelineSpec(2, schedule, microbatches=MICRO)
    model = parallelize_pipeline(
        ref,
        spec,
        pipe,
        mesh,
        torch.device("cpu"),
        split_fn=pipeline_split,
        loss_fn=_loss,
        tp_fn=apply_tensor_parallel if tp > 1 else None,
    )
    params = list(model.module.parameters())
    opt = torch.optim.SGD(params, lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(1)
    dp = mesh["dp_shard"].get_local_rank()
    rows = BATCH // mesh["dp_shard"].size()
    reduce_scatters = []
    for _ in range(STEPS):
        comm = CountReduceScatters()
        with comm if backend is None else contextlib.nullcontext():
            for micro in range(accum):
                tokens = torch.randint(0, ref.vocab_size, (BATCH, SEQ + 1), generator=g)
                mine = tokens[dp * rows : (dp + 1) * rows]
                loss = model.step(
                    mine[:, :-1], mine[:, 1:], scale=1 / accum, sync=micro == accum - 1
                )
                assert (loss is None) == (not model.has_last)
                (_loss(ref(tokens[:, :-1]), tokens[:, 1:]) / accum).backward()
        if backend is None:
            reduce_scatters.append(comm.count)
        norm = clip_grad_norm_(params, 1.0)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        torch.testing.assert_close(norm, ref_norm, rtol=1e-4, atol=1e-6)
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    expected = ref.state_dict()
    got = model.module.state_dict()
    assert set(got) <= set(expected) and got, sorted(got)
    for key, value in got.items():
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        torch.testing.assert_close(full, expected[key], rtol=1e-4, atol=1e-5, msg=key)
    return reduce_scatters, len(params)


def _body(cases):
    return [_case(*case) for case in cases]


def _engine_body(cases):
    return [_engine_case(*case) for case in cases]


def test_pipeline_stages_match_single_process():
    cases = [
        ("ScheduleGPipe", 1, "dp", None),
        ("Schedule1F1B", 1, "dp", "aot_eager"),
        ("ScheduleInterleaved1F1B", 2, "dp", None),
        ("ScheduleGPipe", 1, "tp", None),
        ("Schedule1F1B", 1, "tp", None),
        ("ScheduleInterleaved1F1B", 2, "tp", None),
    ]
    results = run_distributed(_body, world_size=4, args=(cases,), timeout_s=600)
    assert len(results[0]) == len(cases)


def test_engine_pipeline_reduces_once_per_step():
    """``parallelize_pipeline`` (the path ``simplefsdp train --parallel.pp``
    takes): simplefsdp stages reduce each parameter once per optimizer step
    (not once per micro-batch or pipeline step), compiled or not; FSDP2 stages
    as torch's schedules drive them."""
    cases = [
        ("gpipe", "simplefsdp", None, 2),
        ("1f1b", "simplefsdp", "aot_eager", 1),
        ("1f1b", "fsdp2", None, 1),
        ("interleaved_1f1b", "simplefsdp", None, 2, 2),  # pp2 x tp2: TP-local sums
    ]
    results = run_distributed(_engine_body, world_size=4, args=(cases,), timeout_s=600)
    for rank_result in results:
        (rs_gpipe, n_params), *_ = rank_result
        # one reduce-scatter per parameter per optimizer step (2 pipeline
        # steps of 4 micro-batches each), not 8 per parameter
        assert rs_gpipe == [n_params] * STEPS, (rs_gpipe, n_params)
