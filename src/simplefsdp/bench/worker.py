"""One benchmark configuration on one rank: ``python -m simplefsdp.bench.worker``.

Started by ``simplefsdp bench`` under ``torch.distributed.run`` (one process
per rank, exactly as ``simplefsdp train`` starts its workers), or by hand::

    torchrun --standalone --nproc-per-node 2 -m simplefsdp.bench.worker \\
        --config fsdp2 --spec spec.json --out results/

Each rank writes ``OUT/<config>.rank<r>.json`` with its raw measurements; the
runner merges the ranks. The step is the same for every configuration:
forward, float32 cross-entropy, backward, AdamW step (constant learning rate,
no weight decay), on this rank's slice of the same seeded global batches.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from simplefsdp._exit import exit_quickly
from simplefsdp.bench.configs import (
    COMM_ONLY,
    CONFIGS,
    CP_CONFIGS,
    FLOAT8_CONFIGS,
    PHASE_SUFFIX,
    TEST_CONFIGS,
    BenchConfig,
    BenchSpec,
    Workload,
)
from simplefsdp.bench.measure import (
    fsdp_unit_numels,
    phase_peaks,
    profile_collectives,
    run_comm_only,
    state_bytes,
    timed,
)
from simplefsdp.bucket_plan import repeated_blocks
from simplefsdp.engines import (
    MemoryProbe,
    ParallelModel,
    PipelinedModel,
    PipelineSpec,
    get_engine,
    init_distributed,
    lower_mmap_threshold,
    pick_device,
    teardown_process_group,
)
from simplefsdp.layout import Layout, Meshes

logger = logging.getLogger(__name__)

_phase_file: Path | None = None  # set on rank 0 by main()


def _phase(text: str) -> None:
    """Tell the bench runner what this configuration is doing now (rank 0)."""
    if _phase_file is None:
        return
    tmp = _phase_file.with_name(_phase_file.name + ".tmp")
    with contextlib.suppress(OSError):
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, _phase_file)


def _steps(count: int) -> str:
    return f"{count} step" + ("" if count == 1 else "s")


Batch = tuple[torch.Tensor, torch.Tensor]


def lookup_config(name: str) -> BenchConfig:
    """The configuration called ``name`` (public, test-only or comm-only).

    Raises:
        ValueError: unknown name.
    """
    if name == COMM_ONLY.name:
        return COMM_ONLY
    config = (
        CONFIGS.get(name)
        or FLOAT8_CONFIGS.get(name)
        or CP_CONFIGS.get(name)
        or TEST_CONFIGS.get(name)
    )
    if config is None:
        raise ValueError(f"unknown configuration {name!r}; valid: {', '.join(CONFIGS)}")
    return config


def build_model(workload: Workload, seed: int, *, float8: bool = False) -> nn.Module:
    """The workload's model (Llama 3, or a mixture of experts) on the CPU,
    initialised under ``seed``.

    ``float8``: its linear layers converted as ``simplefsdp train
    --float8.enable true`` converts them (tensorwise scaling, float8
    all-gathers, the output layer left out), after the initialisation, so
    the float8 model starts from the same weights as the others.
    """
    from simplefsdp.models.registry import resolve_flavor

    overrides = dict(workload.model_overrides)
    model_spec, config = resolve_flavor(workload.model, **overrides)
    if workload.seq_len > config.max_seq_len:
        config = config.replace(max_seq_len=workload.seq_len)
    torch.manual_seed(seed)
    model = model_spec.build(config)
    if float8:
        from simplefsdp.frontend.float8 import convert_linears_to_float8

        convert_linears_to_float8(
            model, filter_fqns=",".join(["output", *model_spec.float8_skip_fqns])
        )
    return model


def _has_experts(flavor: str) -> bool:
    """The flavor's family has expert parallelism (a mixture of experts)."""
    from simplefsdp.models.registry import spec_of

    return spec_of(flavor).supports("ep")


def build_batches(spec: BenchSpec, rank: int, world_size: int, count: int) -> list[Batch]:
    """This rank's slices of the first ``count`` seeded global batches."""
    from simplefsdp.data import DistributedTokenLoader, build_corpus

    workload = spec.workload
    corpus = build_corpus(None, "byte", val_fraction=0.0, max_bytes=spec.data_max_bytes)
    loader = DistributedTokenLoader(
        corpus.train,
        seq_len=workload.seq_len,
        batch_size=workload.batch_size,
        rank=rank,
        world_size=world_size,
        seed=spec.seed,
    )
    return [next(loader) for _ in range(count)]


def _forward_backward(
    parallel: ParallelModel | PipelinedModel,
    batch: list[Batch],
    device: torch.device,
    torch_cp: Meshes | None = None,
) -> float | None:
    """Forward and backward of ``batch``'s accumulation batches (the mean loss;
    ``None`` on a pipeline rank without the last stage); gradients are
    reduced on the last one only. ``torch_cp``: the meshes, to run each
    batch under torch's context parallelism."""
    total = None
    for i, (inputs, targets) in enumerate(batch):
        inputs, targets = inputs.to(device, non_blocking=True), targets.to(device)
        kw = {"scale": 1 / len(batch), "sync": i == len(batch) - 1}
        if torch_cp is not None:
            loss = _torch_cp_step(parallel, torch_cp, inputs.clone(), targets.clone(), **kw)
        else:
            loss = parallel.step(inputs, targets, **kw)
        if loss is not None:
            total = (total or 0.0) + float(loss.item())
    return total


def _optimizer_step(
    optimizer: torch.optim.Optimizer, after: Callable[[], None] | None = None
) -> None:
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if after is not None:
        after()


def _train_step(
    forward_backward: Callable[[list[Batch]], float | None],
    optimizer: torch.optim.Optimizer,
    batch: list[Batch],
    after: Callable[[], None] | None = None,
) -> float | None:
    """One optimizer step over ``batch``'s accumulation batches (the mean
    loss); ``after`` runs after the optimizer (the engine's
    :meth:`~simplefsdp.engines.ParallelModel.after_optimizer_step`, a MoE's
    routing update)."""
    loss = forward_backward(batch)
    _optimizer_step(optimizer, after)
    return loss


def _parallelize(
    config: BenchConfig, spec: BenchSpec, model: nn.Module, mesh: Meshes, device
) -> ParallelModel | PipelinedModel:
    """The one recipe of ``simplefsdp train`` with the workload model's spec
    (sequence parallel on, loss parallel off), or for a mixture of experts
    Note: [Bench MoE recipes]."""
    from simplefsdp.engines import RecipeOptions, parallelize_model
    from simplefsdp.models.registry import spec_of

    if _has_experts(spec.workload.model):
        from simplefsdp.bench.moe import parallelize_moe

        return parallelize_moe(
            config, model, spec_of(spec.workload.model), mesh, device, spec.param_dtype
        )
    pipeline = None
    if spec.pp > 1:
        pipeline = PipelineSpec(
            spec.pp, spec.pp_schedule, microbatches=spec.microbatches or spec.pp
        )
    parallel = parallelize_model(
        model,
        spec_of(spec.workload.model),
        mesh,
        config.engine_spec(spec.tp, spec.param_dtype),
        device,
        RecipeOptions(
            pipeline, sequence_parallel=True, measure_times=True, cp_backend=spec.cp_backend
        ),
    )
    if config.torch_cp:
        parallel.sequence = None  # torch's context parallelism splits the batch instead
        module = parallel.module
        module.freqs_cis = module.freqs_cis[: spec.workload.seq_len].clone()
    return parallel


def _torch_cp_step(
    parallel: ParallelModel, mesh: Meshes, inputs: torch.Tensor, targets: torch.Tensor, **kw: Any
) -> torch.Tensor:
    """One step under torch's context parallelism: it shards the batch and the
    rotary table (head-tail) in place and runs SDPA's context-parallel handler."""
    from torch.distributed.tensor.experimental import context_parallel

    freqs = parallel.module.freqs_cis
    with context_parallel(
        mesh.cp,
        buffers=[inputs, targets, freqs],
        buffer_seq_dims=[1, 1, 0],
        no_restore_buffers={inputs, targets},
    ):
        return parallel.step(inputs, targets, **kw)


def _run_training(
    config: BenchConfig,
    spec: BenchSpec,
    mesh: Meshes,
    device: torch.device,
    batches: list[list[Batch]],
) -> dict:
    """Warm-up and measured steps, then one counted step; this rank's raw result.

    ``batches``: per step, its accumulation batches (``spec.grad_accum``).
    """
    workload = spec.workload
    probe = MemoryProbe(device)
    model = build_model(workload, spec.seed, float8=config.float8)
    num_params = sum(p.numel() for p in model.parameters())
    parallel = _parallelize(config, spec, model, mesh, device)
    del model  # pipeline stages are copies
    # foreach, as the trainer and torchtitan: one DTensor dispatch per op over
    # all parameters, not one per parameter (torch's CPU default).
    optimizer = torch.optim.AdamW(
        parallel.module.parameters(),
        lr=workload.lr * config.lr_scale,
        weight_decay=0.0,
        foreach=True,
    )
    pipe = parallel if isinstance(parallel, PipelinedModel) else None  # for its bubble times
    forward_backward = functools.partial(
        _forward_backward, parallel, device=device, torch_cp=mesh if config.torch_cp else None
    )
    after = parallel.after_optimizer_step  # FSDP2's float8 scales
    from simplefsdp.models.registry import spec_of

    model_after = spec_of(workload.model).after_optimizer_step  # a MoE's routing update
    if model_after is not None:

        def after() -> None:
            parallel.after_optimizer_step()
            model_after(parallel.module)

    step_fn = functools.partial(_train_step, forward_backward, optimizer, after=after)
    warmup_s, step_s, losses, bubbles = [], [], [], []
    state: int | None = None
    measure_start: int | None = None
    # What warm-up leaves resident beyond the optimizer state it creates:
    # Note: [Warm-up residency].
    state_before, level_before = state_bytes(parallel.module, optimizer), probe.level_bytes()
    dist.barrier()
    with parallel.compile_context():
        for i in range(workload.warmup + workload.steps):
            if i == 0:
                _phase(
                    "compiling (the first warm-up step)"
                    if config.compiled
                    else f"warming up ({_steps(workload.warmup)})"
                )
            elif i == 1 and config.compiled and workload.warmup > 1:
                _phase(f"warming up ({_steps(workload.warmup - 1)} more)")
            if i == workload.warmup:
                _phase(f"measuring {_steps(workload.steps)}")
                state = state_bytes(parallel.module, optimizer)
                probe.reset()
                measure_start = probe.start_bytes  # phase_peaks resets the probe again
            seconds, loss = timed(lambda i=i: step_fn(batch=batches[i]), device)
            (warmup_s if i < workload.warmup else step_s).append(seconds)
            losses.append(loss)
            if pipe is not None and i >= workload.warmup:
                bubbles.append(pipe.times.bubble_fraction)
        peak = probe.peak_bytes()
        # One more step, unmeasured, for where the peak is: Note: [Peak by phase].
        phases = phase_peaks(
            probe,
            {
                "forward_backward": lambda: forward_backward(batches[-1]),
                "optimizer": lambda: _optimizer_step(optimizer, after),
            },
        )
        profiled, profiled_bytes = profile_collectives(lambda: step_fn(batch=batches[-1]))
    # With accumulation or a pipeline a step runs compiled graphs a different
    # number of times, and a pipeline reduces outside them (reduce_accumulated):
    # only the profiler counts per step.
    per_step_graphs = spec.grad_accum == 1 and spec.pp == 1
    summary = parallel.collective_summary() if config.compiled and per_step_graphs else None
    return {
        "bubble_fractions": bubbles or None,
        "warmup_times_s": warmup_s,
        "step_times_s": step_s,
        "losses": losses,
        "peak_mem_bytes": peak,
        "mem_at_measure_start_bytes": measure_start,
        "mem_before_warmup_bytes": level_before,
        "state_mem_before_warmup_bytes": state_before,
        "phase_peak_mem_bytes": phases,
        "state_mem_bytes": state,
        "mem_baseline_bytes": probe.baseline_bytes,
        "mem_method": probe.kind + ("" if probe.reset_ok else " (peak reset unavailable)"),
        "collectives": summary["counts"] if summary else profiled,
        "collectives_source": "comm_report" if summary else "profiler",
        "collectives_profiled": profiled,
        "collective_bytes_profiled": profiled_bytes,
        "collective_bytes": summary.get("bytes") if summary else profiled_bytes,
        "predicted": summary["predicted"] if summary else None,
        "predicted_step_time_s": summary["predicted_step_time_s"] if summary else None,
        "predicted_peak_mem_bytes": summary["predicted_peak_mem_bytes"] if summary else None,
        "num_params": num_params,
        "notes": parallel.notes,
    }


def _run_comm_only(spec: BenchSpec, device: torch.device) -> dict:
    with torch.device("meta"):
        model = build_model(spec.workload, spec.seed)
    units = fsdp_unit_numels(model, repeated_blocks(model))
    return run_comm_only(
        units, steps=spec.workload.steps, warmup=spec.workload.warmup, device=device
    )


def _import_engine_code() -> None:
    """Import every configuration's library code before the memory baseline.

    Code is resident once per process whichever engine runs, so no
    configuration is charged for the modules it happens to import first:
    torch's compiler (Inductor), and simplefsdp's frontend, compiler passes
    and eager executor, which ``simplefsdp.engines`` loads lazily (FSDP2's
    and DDP's modules are imported with it). simplefsdp's modules alone are
    about 1.2 MiB of RSS (imported in a fresh process).
    """
    import torch._inductor.compile_fx  # noqa: F401

    import simplefsdp.compiler.backend  # noqa: F401
    import simplefsdp.compiler.entry_points  # noqa: F401
    import simplefsdp.eager_executor.api  # noqa: F401
    import simplefsdp.engines.recipe  # noqa: F401
    import simplefsdp.frontend.accumulation  # noqa: F401
    import simplefsdp.frontend.data_parallel  # noqa: F401


def run(config: BenchConfig, spec: BenchSpec) -> dict:
    """Run ``config`` on this rank (process group from torchrun's environment)."""
    device = pick_device()
    rank, world_size = init_distributed(device, datetime.timedelta(seconds=spec.timeout_s))
    layout = Layout(
        tp=spec.tp,
        pp=spec.pp,
        ep=spec.ep if _has_experts(spec.workload.model) else 1,
        cp=spec.cp,
    )
    mesh = layout.build(device.type, world_size)
    result = {
        "config": config.name,
        "rank": rank,
        "world_size": world_size,
        "tp": spec.tp,
        "pp": spec.pp,
        "ep": spec.ep,
        "cp": spec.cp,
        "cp_backend": spec.cp_backend,
        "grad_accum": spec.grad_accum,
        "numerics": config.numerics(spec.param_dtype),
        "device": str(device),
    }
    try:
        if not get_engine(config.engine, bench=True).trains:
            result.update(_run_comm_only(spec, device))
        else:
            _import_engine_code()

            workload = spec.workload
            # The ranks of a tensor-parallel, context-parallel group and of a
            # pipeline read the same batches.
            dp_rank, dp_size = mesh.batch_rank, mesh.batch_size
            count = (workload.warmup + workload.steps + 1) * spec.grad_accum
            flat = build_batches(spec, dp_rank, dp_size, count)
            accum = spec.grad_accum
            batches = [flat[i : i + accum] for i in range(0, count, accum)]
            result.update(_run_training(config, spec, mesh, device, batches))
        dist.barrier()
    finally:
        with contextlib.suppress(Exception):
            teardown_process_group()  # the models are gone: Note: [Process group teardown]
    return result


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m simplefsdp.bench.worker",
        description="Run one simplefsdp bench configuration on this rank (under torchrun).",
    )
    parser.add_argument("--config", required=True, help="configuration name")
    parser.add_argument("--spec", required=True, type=Path, help="BenchSpec JSON file")
    parser.add_argument("--out", required=True, type=Path, help="folder for the result files")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Worker entry point; returns the exit code (0 on success)."""
    if not torch.cuda.is_available():
        # CPU peak RSS needs it before any large allocation: see Note:
        # [Benchmark memory]. On GPU the allocator's stats are used instead.
        lower_mmap_threshold()
    args = _parse_args(argv)
    config = lookup_config(args.config)
    spec = BenchSpec.from_json(args.spec.read_text())
    logging.basicConfig(
        level=logging.INFO if os.environ.get("RANK", "0") == "0" else logging.WARNING,
        format=f"[rank{os.environ.get('RANK', '0')}] %(name)s: %(message)s",
    )
    global _phase_file
    if os.environ.get("RANK", "0") == "0":
        args.out.mkdir(parents=True, exist_ok=True)
        _phase_file = args.out / f"{config.name}{PHASE_SUFFIX}"
    result = run(config, spec)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{config.name}.rank{result['rank']}.json"
    path.write_text(json.dumps(result, indent=1))
    logger.info("%s: wrote %s", config.name, path)
    return 0


if __name__ == "__main__":
    exit_quickly(main())
