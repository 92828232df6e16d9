"""``simplefsdp plan --measure``: one rank of the target layout on this device.

Note: [Measured plan]
    The planned layout's rank 0 runs here: the model built by its family's
    ``ModelSpec.build`` on the meta device (with ``float8`` its linears
    converted as ``simplefsdp train --float8.enable`` converts them),
    parallelised by the one recipe of
    train and bench (``parallelize_model``: TP plan, activation
    checkpointing, the engine's data parallelism, compilation) over a
    *fake* process group of the layout's size, its weights initialised
    after sharding (each rank's shard only), one AdamW. The fake group's
    collectives return at once without moving data, so what is measured is
    this rank's compute and memory: the peak of the allocator (CUDA
    ``max_memory_allocated``, and the caching allocator's reserved peak
    beside the plan's, which predicts it; on CPU the peak RSS, a smoke
    test) over one
    training step (forward, backward, optimizer) after ``warmup`` steps
    (compilation, the optimizer's state), and the step's wall time. The
    plan prints them beside its prediction's peak memory and compute.
    Models planned from their shapes (routed experts) run the same way at
    ``--ep 1``: the experts sharded by FSDP over every rank, as the plan
    has them, the layout's selective AC (with ``recompute_experts``) and
    per-block groups. Not measured: pipeline stages (``--pp``), context
    parallelism (``--cp``) and expert parallelism (``--ep`` above 1, whose
    all-to-all needs the other ranks' tokens), which the command refuses
    with one line.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from simplefsdp.plan.trace import fake_process_group


@dataclass(frozen=True)
class Measured:
    """What one rank's step measured on this device.

    Attributes:
        device: where it ran (``cuda``, ``cpu``).
        peak_bytes: peak allocator memory over the step (CPU: peak RSS above
            the level before the model was built).
        step_s: wall time of the measured step (collectives skipped).
        memory_kind: what ``peak_bytes`` is (the probe's ``kind``).
        reserved_bytes: the CUDA caching allocator's reserved peak over the
            step (``max_memory_reserved``), what the plan's peak predicts;
            ``None`` on CPU.
    """

    device: str
    peak_bytes: int
    step_s: float
    memory_kind: str
    reserved_bytes: int | None = None


def measure_errors(layout: Any) -> list[str]:
    """What ``--measure`` cannot run of ``layout`` (one line each)."""
    errors = []
    for flag, value in (("--pp", layout.pp), ("--cp", layout.cp)):
        if value > 1:
            errors.append(f"--measure runs one rank without a pipeline or CP; got {flag} {value}")
    if getattr(layout, "ep", 1) > 1:
        errors.append(
            f"--measure runs one rank, whose experts' all-to-all needs the other ranks' "
            f"tokens; got --ep {layout.ep} (--ep 1 measures the experts sharded by FSDP)"
        )
    return errors


def measure_step(
    spec: Any,
    config: Any,
    layout: Any,
    device: torch.device | None = None,
    warmup: int = 1,
) -> Measured:
    """Run rank 0 of ``layout`` for ``warmup`` + 1 steps on ``device``
    (default: CUDA where present, else CPU) with the other ranks faked;
    Note: [Measured plan].

    Raises:
        ValueError: a layout ``--measure`` cannot run (``measure_errors``).
    """
    from simplefsdp.engines import EngineSpec, MemoryProbe, parallelize_model
    from simplefsdp.engines.recipe import RecipeOptions
    from simplefsdp.layout import Layout as Degrees

    errors = measure_errors(layout)
    if errors:
        raise ValueError(errors[0])
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    world = layout.gpus
    microbatches = layout.microbatches
    mb = layout.batch // microbatches
    probe = MemoryProbe(device)
    with fake_process_group(world):
        meshes = Degrees(tp=layout.tp).build(device.type, world)
        with torch.device("meta"):
            model = spec.build(config)
        if getattr(layout, "float8", False):
            # as simplefsdp train --float8.enable converts it (tensorwise)
            from simplefsdp import convert_linears_to_float8

            convert_linears_to_float8(
                model, "tensorwise", ",".join(("output", *spec.float8_skip_fqns))
            )
        bf16 = layout.dtype == "bf16"
        engine = EngineSpec(
            layout.engine,
            param_dtype="bfloat16" if bf16 else None,
            reduce_dtype=torch.float32 if bf16 else None,
            reshard_after_forward=layout.reshard_after_forward,
            compile=layout.compiled,
            backend="inductor" if device.type == "cuda" else "aot_eager",
            bucketing=layout.bucketing,
            activation_checkpoint=layout.ac,
            recompute_experts=getattr(layout, "recompute_experts", False),  # ExpertLayout's
            tp=layout.tp,
            check_ranks=False,
        )
        options = RecipeOptions(loss_parallel=layout.loss_parallel and layout.tp > 1)
        parallel = parallelize_model(model, spec, meshes, engine, device, options)
        optimizer = torch.optim.AdamW(parallel.module.parameters(), lr=1e-5, foreach=True)
        tokens = torch.randint(0, config.vocab_size, (mb, layout.seq + 1), device=device)
        inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        step_s = 0.0
        for i in range(warmup + 1):
            if i == warmup:
                probe.reset()
                start = time.perf_counter()
            for _ in range(microbatches):
                parallel.step(inputs, targets, scale=1.0 / microbatches)
            optimizer.step()
            parallel.after_optimizer_step()
            optimizer.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        step_s = time.perf_counter() - start
        peak = probe.peak_bytes() or 0
        reserved = torch.cuda.max_memory_reserved(device) if device.type == "cuda" else None
    return Measured(device.type, int(peak), step_s, probe.kind, reserved)


def format_measured(measured: Measured, pred: Any) -> str:
    """Lines of ``measured`` beside the prediction ``pred``."""
    gib = 2**30
    compute = pred.time["compute"] + pred.time["optimizer"]
    # The probe reads allocated bytes: against the plan's less what the
    # caching allocator holds cached (Note: [Plan model]).
    allocated = pred.peak_bytes - pred.memory.get("cached", 0.0)
    err_mem = 100 * (allocated / measured.peak_bytes - 1) if measured.peak_bytes else 0.0
    err_t = 100 * (compute / measured.step_s - 1) if measured.step_s else 0.0
    lines = [
        f"measured on this {measured.device} (rank 0, other ranks faked, collectives skipped):",
        f"  peak memory           {measured.peak_bytes / gib:8.2f} GiB  predicted "
        f"{allocated / gib:.2f} GiB ({err_mem:+.1f}%; {measured.memory_kind})",
    ]
    if measured.reserved_bytes and "cached" in pred.memory:
        err_r = 100 * (pred.peak_bytes / measured.reserved_bytes - 1)
        lines.append(
            f"  reserved peak         {measured.reserved_bytes / gib:8.2f} GiB  predicted "
            f"{pred.peak_bytes / gib:.2f} GiB ({err_r:+.1f}%; the caching allocator's)"
        )
    lines.append(
        f"  step compute          {measured.step_s:8.3f} s    predicted {compute:.3f} s "
        f"(compute + optimizer, {err_t:+.1f}%)"
    )
    return "\n".join(lines)
