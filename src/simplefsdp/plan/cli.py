"""``simplefsdp plan``: predict per-GPU memory and throughput of a training job.

Examples::

    simplefsdp plan --model llama3_8b                 # its published layout: 8 GPUs
    simplefsdp plan --model llama3_70b                # 64 GPUs, TP 8, full AC
    simplefsdp plan --model llama3_8b --gpus 8 --hardware h100 --batch 2 --seq 8192
    simplefsdp plan --model llama3_405b --gpus 512 --tp 8 --pp 8 --microbatches 8 \\
        --batch 32 --ac full --out plans/405b
    simplefsdp plan --model llama3_8b --gpus 8 --sweep
    simplefsdp plan --model llama3_8b --gpus 8 --batch 2 --float8
    simplefsdp plan --model deepseek_v3_16b --gpus 8 --ep 2 --batch 1 --seq 4096
    simplefsdp plan --calibrate --out profiles/   # measure this machine (gloo, CPU)

Runs in one process on this machine. ``--model`` names a flavor of the model
registry (``simplefsdp.models.registry``); the family's ``ModelSpec`` says how
it is planned (``plan_method``): traced on the meta device with a fake process
group of the target size (see ``simplefsdp.plan.trace``), or, for
expert-parallel models, from the config's shapes (``simplefsdp.plan.analytic``).
Both give one :class:`~simplefsdp.plan.prediction.Prediction`, formatted here.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from simplefsdp._exit import exit_quickly
from simplefsdp.models.registry import PLAN_DEFAULT_FLAVOR
from simplefsdp.plan.hardware import get_profile, profile_names

GiB = 2**30
#: ``--model`` when none is given: a registry flavor name (Llama 3 8B).
DEFAULT_MODEL = PLAN_DEFAULT_FLAVOR

#: The flags each plan method (``ModelSpec.plan_method``) plans beyond
#: ``--model``, ``--config``, ``--hardware``, ``--gpus``, ``--batch``,
#: ``--seq``, ``--ac``, ``--engine``, ``--no-reshard``, ``--json`` and
#: ``--out``; a flag given for a model whose method does not plan it is an error.
METHOD_FLAGS = {
    "trace": (
        "--tp",
        "--pp",
        "--pp-schedule",
        "--stages-per-rank",
        "--cp",
        "--cp-backend",
        "--microbatches",
        "--dtype",
        "--loss-parallel",
        "--async-tp",
        "--fused-loss",
        "--expandable-segments",
        "--fsdp2-root",
        "--float8",
        "--bucketing",
        "--sweep",
        "--measure",
    ),
    "analytic": (
        "--pp",
        "--microbatches",
        "--pp-schedule",
        "--stages-per-rank",
        "--cp",
        "--cp-backend",
        "--ep",
        "--expert-imbalance",
        "--recompute-experts",
        "--fused-loss",
        "--expandable-segments",
        "--fsdp2-root",
        "--float8",
        "--sweep",
        "--measure",
    ),
}
# A flag's value that asks for something (not the default), by flag.
_GIVEN = {
    "--tp": lambda ns: ns.tp not in (None, 1),
    "--pp": lambda ns: ns.pp != 1,
    "--pp-schedule": lambda ns: ns.pp_schedule != "1f1b",
    "--stages-per-rank": lambda ns: ns.stages_per_rank is not None,
    "--cp": lambda ns: ns.cp != 1,
    "--cp-backend": lambda ns: ns.cp_backend != "allgather",
    "--microbatches": lambda ns: ns.microbatches not in (None, 1),
    "--dtype": lambda ns: ns.dtype != "bf16",
    "--loss-parallel": lambda ns: ns.loss_parallel,
    "--async-tp": lambda ns: ns.async_tp,
    "--fused-loss": lambda ns: ns.fused_loss,
    "--expandable-segments": lambda ns: ns.expandable_segments,
    "--fsdp2-root": lambda ns: ns.fsdp2_root != "split",
    "--float8": lambda ns: ns.float8,
    "--bucketing": lambda ns: ns.bucketing != "auto",
    "--sweep": lambda ns: ns.sweep,
    "--measure": lambda ns: ns.measure,
    "--ep": lambda ns: ns.ep not in (None, 1),
    "--expert-imbalance": lambda ns: ns.expert_imbalance != 1.0,
    "--recompute-experts": lambda ns: ns.recompute_experts,
}
# The ModelSpec capability a flag needs, and what it is in words.
_CAPABILITY = {
    "--tp": ("tp", "tensor parallelism"),
    "--pp": ("pp", "pipeline parallelism"),
    "--float8": ("float8", "float8 training"),
    "--ep": ("ep", "expert parallelism (routed experts)"),
}


def generic_defaults(spec: Any, config: Any, usable_bytes: float | None = None) -> dict:
    """``--gpus``, ``--tp``, ``--batch``, ``--seq`` and ``--ac`` of a model
    without a published layout: 8 GPUs, selective AC, and for traced plans
    batch 2 of at most 8192 tokens; for analytic plans batch 1 of at most
    4096 (the model's ``max_seq_len`` where shorter).

    Given the GPU's ``usable_bytes``, the GPUs are doubled from 8 until the
    sharded fp32 state (16 bytes per parameter) takes at most half of it,
    and analytic plans also get ``ep``: the smallest degree (dividing the
    experts and the GPUs) whose gathered block of local experts (bf16,
    three blocks in flight) takes at most an eighth of it.
    """
    gpus = 8
    if usable_bytes:
        while 16 * spec.num_params(config) / gpus > usable_bytes / 2:
            gpus *= 2
    if spec.plan_method == "analytic":
        seq = min(config.max_seq_len, 4096)
        values = {"gpus": gpus, "tp": 1, "batch": 1, "seq": seq, "ac": "selective", "ep": 1}
        if usable_bytes and getattr(config, "n_moe_layers", 0):
            from simplefsdp.plan.analytic import expert_params

            per_expert = expert_params(config) / config.n_moe_layers / config.num_experts
            ep = 1
            while (
                6 * per_expert * config.num_experts / ep > usable_bytes / 8
                and config.num_experts % (2 * ep) == 0
                and gpus % (2 * ep) == 0
            ):
                ep *= 2
            values["ep"] = ep
        return values
    seq = min(config.max_seq_len, 8192)
    return {"gpus": gpus, "tp": 1, "batch": 2, "seq": seq, "ac": "selective"}


def reference_layout(spec: Any, config: Any) -> dict | None:
    """The published layout of ``config`` (``spec.reference_layouts`` of the
    flavor it equals), or ``None``."""
    for flavor, values in spec.reference_layouts.items():
        if spec.flavors.get(flavor) == config:
            return dict(values)
    return None


def resolve_model(ns: argparse.Namespace) -> tuple[Any, Any]:
    """``(spec, config)`` from ``--model`` (a flavor name of the registry, or
    a Hugging Face model folder: the family that reads its ``config.json``
    and that configuration, as ``simplefsdp train --checkpoint.init_from_hf``
    builds it) or ``--config`` (a JSON file of the config's fields,
    optionally with ``"base"``: the flavor or model folder it overrides,
    default ``--model``)."""
    from simplefsdp.models.registry import resolve_flavor

    if ns.config is None and Path(ns.model).is_dir():
        from simplefsdp.checkpoint.hf import hf_model_of_folder

        spec, config = hf_model_of_folder(ns.model)
        reads = spec.data_dependent_reads
        if spec.plan_method == "trace" and reads is not None and reads(config):
            # transformers' own mixture-of-experts code: its token routing does
            # not trace on the meta device
            raise ValueError(
                f"--model {ns.model!r} trains through {spec.family!r} (model_type "
                f"{getattr(config, 'model_type', '?')!r}) with routed experts, which "
                "simplefsdp plan does not predict; valid: a dense model, a folder a "
                "native family reads (docs/models/index.md), or a flavor"
            )
        return spec, config
    if ns.config is None:
        return resolve_flavor(ns.model)
    try:
        data = json.loads(Path(ns.config).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read --config {ns.config!r}: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(
            f"--config {ns.config!r} must hold a JSON object of the model config's fields, "
            f"got a {type(data).__name__}"
        )
    base = data.pop("base", ns.model)
    if Path(base).is_dir():
        # a model folder's config with the file's fields replaced
        spec, config = resolve_model(argparse.Namespace(model=base, config=None))
        unknown = sorted(set(data) - {f.name for f in dataclasses.fields(config)})
        if unknown:
            raise ValueError(
                f"--config {ns.config!r}: {', '.join(unknown)} not a field of {base!r}'s "
                f"config; valid: {', '.join(f.name for f in dataclasses.fields(config))}"
            )
        return spec, dataclasses.replace(config, **data)
    return resolve_flavor(base, **data)


def check_flags(ns: argparse.Namespace, spec: Any) -> None:
    """One-line ``ValueError`` for a flag the model cannot compose with (a
    missing capability of its spec) or its plan method does not plan."""
    name = ns.config or ns.model
    for flag, (capability, words) in _CAPABILITY.items():
        if _GIVEN[flag](ns) and not spec.supports(capability):
            have = ", ".join(sorted(spec.capabilities)) or "none"
            raise ValueError(
                f"{flag} needs a model with {words}; {name!r} ({spec.description}) has not "
                f"(it composes with: {have})"
            )
    planned = METHOD_FLAGS[spec.plan_method]
    for flag, given in _GIVEN.items():
        if given(ns) and flag not in planned:
            raise ValueError(
                f"{flag} is not planned for {name!r} (plan method {spec.plan_method!r}, "
                f"docs/scale.md); valid: --gpus, --batch, --seq, --ac, --engine, "
                f"--no-reshard, --hardware, {', '.join(planned)}"
            )


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="simplefsdp plan",
        description="Predict per-GPU peak memory, step time, tokens/s and MFU of a training "
        "job from its traced graphs, or, for expert-parallel models, from their shapes, "
        "without GPUs.",
    )
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"a flavor of a model family (default {DEFAULT_MODEL}; "
        "simplefsdp train --help lists them) or a Hugging Face model folder",
    )
    p.add_argument(
        "--config",
        help="JSON file of the model config's fields (optional key 'base': the flavor "
        'or model folder they override, default --model), e.g. {"max_seq_len": 131072}',
    )
    p.add_argument(
        "--gpus",
        type=int,
        default=None,
        help="default: the flavor's published layout's where it has one (docs/scale.md), else 8",
    )
    p.add_argument(
        "--hardware", default="h100", help=f"{', '.join(profile_names())} or a .json profile"
    )
    p.add_argument(
        "--batch",
        type=int,
        default=None,
        help="per data-parallel rank, per step (default: the published layout's local batch, "
        "else 2, or 1 for models planned from their shapes; lowered to the largest that fits)",
    )
    p.add_argument(
        "--seq",
        type=int,
        default=None,
        help="sequence length (default 8192; models planned from their shapes: their "
        "max_seq_len, at most 4096)",
    )
    p.add_argument(
        "--ac",
        default=None,
        help="none, selective, full (default: the published layout's, else selective)",
    )
    p.add_argument(
        "--tp",
        type=int,
        default=None,
        help="tensor-parallel degree (default: the published layout's, else 1)",
    )
    p.add_argument("--pp", type=int, default=1)
    p.add_argument(
        "--cp",
        type=int,
        default=1,
        help="context-parallel degree: each rank holds 1/cp of every sequence, FSDP shards "
        "over dp x cp, keys and values all-gathered per attention (default 1)",
    )
    p.add_argument(
        "--cp-backend",
        default="allgather",
        help="how attention reaches the other CP ranks' keys: allgather (simplefsdp train's "
        "--parallel.cp_backend default: SDPA with a boolean mask), ulysses (simplefsdp's "
        "all-to-alls to head shards, the whole sequence masked) or torch (torch's "
        "context_parallel, a ring of flash-attention blocks, as torchtitan and simplefsdp "
        "bench's fsdp2-torch-cp run it) (default allgather)",
    )
    p.add_argument(
        "--ep",
        type=int,
        default=None,
        help="expert-parallel degree of a model with routed experts (default 1): each rank "
        "holds num_experts / ep experts, sharded over the dp / ep ranks holding the same ones",
    )
    p.add_argument(
        "--expert-imbalance",
        type=float,
        default=1.0,
        help="with experts: routed tokens of the most loaded EP rank over the mean "
        "(default 1.0: balanced)",
    )
    p.add_argument(
        "--recompute-experts",
        action="store_true",
        help="with --ac selective: the experts' grouped matmuls recomputed in backward, not "
        "saved (simplefsdp train --activation_checkpoint.recompute_experts true; "
        "torchtitan's op list)",
    )
    p.add_argument(
        "--microbatches",
        type=int,
        default=None,
        help="per step: 1F1B microbatches with --pp (default pp), else gradient "
        "accumulation (default 1); --batch is split among them",
    )
    p.add_argument(
        "--pp-schedule",
        default="1f1b",
        help="with --pp: gpipe, 1f1b (default) or interleaved_1f1b (simplefsdp train "
        "--parallel.pp_schedule)",
    )
    p.add_argument(
        "--stages-per-rank",
        type=int,
        default=None,
        help="with --pp-schedule interleaved_1f1b: pipeline stages each rank holds (default 2)",
    )
    p.add_argument("--engine", default="simplefsdp", help="simplefsdp (compiled) or fsdp2")
    p.add_argument(
        "--compile",
        action="store_true",
        help="with --engine fsdp2: each block compiled in place (simplefsdp train "
        "--parallel.engine fsdp2 --compile.enable true; torchtitan's FSDP + torch.compile)",
    )
    p.add_argument("--dtype", default="bf16", help="bf16 (mixed precision, default) or fp32")
    p.add_argument(
        "--loss-parallel",
        action="store_true",
        help="with --tp: the logits stay sharded over the vocabulary for the loss "
        "(simplefsdp train --parallel.loss_parallel true; torchtitan's default)",
    )
    p.add_argument(
        "--async-tp",
        action="store_true",
        help="with --tp: TP's all-gathers and reduce-scatters overlapped with their matmuls "
        "(torchtitan's enable_async_tensor_parallel, compiled); simplefsdp train runs them whole",
    )
    p.add_argument(
        "--fused-loss",
        action="store_true",
        help="the loss compiled with Inductor: fp32 upcast, log-softmax and NLL fused, "
        "their fp32 tensors never held (torchtitan compiles it with compile on since 2025)",
    )
    p.add_argument(
        "--expandable-segments",
        action="store_true",
        help="the CUDA caching allocator with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
        "(torchtitan's run_train.sh sets it): its cached memory simulated so",
    )
    p.add_argument(
        "--fsdp2-root",
        default="split",
        choices=("split", "whole"),  # simplefsdp.plan.layout.FSDP2_ROOTS (imports torch)
        help="with --engine fsdp2: the embedding resharded after forward apart from the final "
        "norm and output (split: the fsdp2 engine's and torchtitan's since 2025-07), or one "
        "root group kept gathered through backward (whole: torchtitan's before)",
    )
    p.add_argument(
        "--float8",
        action="store_true",
        help="torchao float8 training (tensorwise, float8 all-gather) of every linear "
        "but the output layer: float8 matmuls at the profile's float8 peak",
    )
    p.add_argument("--bucketing", default="auto", help="auto, per_block, none")
    p.add_argument(
        "--no-reshard", action="store_true", help="keep gathered parameters after forward"
    )
    p.add_argument("--sweep", action="store_true", help="rank layouts and options")
    p.add_argument(
        "--measure",
        action="store_true",
        help="also run rank 0 of the layout on this machine's GPU (CPU: a smoke test) with a "
        "fake process group for the other ranks, and print its peak memory and step time "
        "beside the prediction",
    )
    p.add_argument("--out", help="directory for plan.json and plan.png")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument(
        "--calibrate",
        action="store_true",
        help="measure this machine (2 gloo processes on CPU) and write a profile JSON",
    )
    p.add_argument(
        "--calibrate-rounds",
        type=int,
        default=3,
        help="with --calibrate: rounds of measurements; the profile takes each "
        "quantity's median over them (default 3)",
    )
    return p


def plan_defaults(
    ns: argparse.Namespace, spec: Any, config: Any, usable_bytes: float | None = None
) -> tuple[dict, set[str]]:
    """The values of ``--gpus``, ``--tp``, ``--batch``, ``--seq`` and ``--ac``
    (and ``--ep`` for analytic plans): those given, the rest from the
    flavor's published layout where it has one (:func:`reference_layout`;
    not for ``--config``), else :func:`generic_defaults` for a GPU of
    ``usable_bytes``. Returns the values and the names of those taken as
    defaults.

    A default TP degree that does not divide the GPUs given is lowered to the
    largest power of two that does; a default batch that the microbatches
    (``--microbatches``, else ``--pp``) do not divide is raised to their
    next multiple.
    """
    preset = None if ns.config is not None else reference_layout(spec, config)
    if preset is None:
        preset = generic_defaults(spec, config, usable_bytes)
    values, defaulted = {}, set()
    for name, default in preset.items():
        given = getattr(ns, name, None)
        values[name] = default if given is None else given
        if given is None:
            defaulted.add(name)
    if "ep" in defaulted and values["gpus"] % values["ep"]:
        values["ep"] = 1
    if "tp" in defaulted and values["gpus"] >= 1:
        while values["tp"] > 1 and values["gpus"] % values["tp"]:
            values["tp"] //= 2
    micro = getattr(ns, "microbatches", None) or max(getattr(ns, "pp", 1) or 1, 1)
    if "batch" in defaulted and micro > 1 and values["batch"] % micro:
        # a pipeline's (or accumulation's) microbatches split the batch
        values["batch"] = -(-values["batch"] // micro) * micro
    return values, defaulted


def make_layout(ns: argparse.Namespace, spec: Any, values: dict):
    """The layout of the plan method of ``spec`` from the flags and ``values``
    (:func:`plan_defaults`)."""
    if spec.plan_method == "analytic":
        from simplefsdp.plan.analytic import ExpertLayout

        return ExpertLayout(
            gpus=values["gpus"],
            batch=values["batch"],
            seq=values["seq"],
            ep=ns.ep if ns.ep is not None else values.get("ep", 1),
            ac=values["ac"],
            engine=ns.engine,
            reshard_after_forward=not ns.no_reshard,
            imbalance=ns.expert_imbalance,
            cp=ns.cp,
            cp_backend=ns.cp_backend,
            recompute_experts=ns.recompute_experts,
            fused_loss=ns.fused_loss,
            expandable_segments=ns.expandable_segments,
            fsdp2_root=ns.fsdp2_root,
            float8=ns.float8,
            pp=ns.pp,
            microbatches=ns.microbatches if ns.microbatches is not None else max(ns.pp, 1),
            pp_schedule=ns.pp_schedule,
            stages_per_rank=ns.stages_per_rank,
        )
    from simplefsdp.plan.predict import Layout

    return Layout(
        gpus=values["gpus"],
        batch=values["batch"],
        seq=values["seq"],
        tp=values["tp"],
        pp=ns.pp,
        cp=ns.cp,
        cp_backend=ns.cp_backend,
        ac=values["ac"],
        microbatches=ns.microbatches if ns.microbatches is not None else max(ns.pp, 1),
        reshard_after_forward=not ns.no_reshard,
        bucketing=ns.bucketing,
        engine=ns.engine,
        dtype=ns.dtype,
        float8=ns.float8,
        loss_parallel=ns.loss_parallel,
        fused_loss=ns.fused_loss,
        compile=ns.compile,
        async_tp=ns.async_tp,
        pp_schedule=ns.pp_schedule,
        stages_per_rank=ns.stages_per_rank,
        fsdp2_root=ns.fsdp2_root,
        expandable_segments=ns.expandable_segments,
    )


def validate_layout(spec: Any, config: Any, layout: Any) -> None:
    """One-line ``ValueError`` for a bad ``layout`` of ``config``, by the
    plan method of ``spec``."""
    if spec.plan_method == "analytic":
        from simplefsdp.plan.analytic import validate_analytic

        validate_analytic(spec, config, layout)
    else:
        from simplefsdp.plan.layout import validate

        validate(config, layout)


def format_prediction(pred) -> str:
    """A terminal table of one prediction."""
    lines = [
        f"{pred.layout.describe()}  batch={pred.layout.batch}x{pred.layout.seq}  "
        f"engine={pred.layout.engine}  hardware={pred.hardware}",
        f"  peak memory / GPU     {pred.peak_bytes / GiB:8.1f} GiB  "
        f"(usable {pred.usable_bytes / GiB:.1f} GiB){'' if pred.fits else '  DOES NOT FIT'}",
    ]
    for name, value in pred.memory.items():
        if name == "accumulated" and not value:
            continue  # one microbatch per step: no gradient sums
        lines.append(f"    {name:<20}{value / GiB:8.2f} GiB")
    if pred.params is not None:
        lines.insert(
            1,
            f"  parameters            {pred.params['total'] / 1e9:8.2f} B total, "
            f"{pred.params['activated'] / 1e9:.2f} B activated per token",
        )
    lines.append(f"  step time             {pred.step_s:8.3f} s")
    for name in ("compute", "exposed_comm", "bubble", "optimizer"):
        lines.append(f"    {name:<20}{pred.time[name]:8.3f} s")
        if name == "compute" and pred.time["copies"]:
            lines.append(f"      {'of which copies':<18}{pred.time['copies']:8.3f} s")
        if name == "compute" and pred.time["hooks"]:
            lines.append(f"      {'of which hooks':<18}{pred.time['hooks']:8.3f} s")
    if "ep_comm_total" in pred.time:
        lines.append(
            f"    (all DP comm {pred.time['dp_comm_total']:.3f} s, EP all-to-all "
            f"{pred.time['ep_comm_total']:.3f} s, exposed)"
        )
    else:
        lines.append(
            f"    (all DP comm {pred.time['dp_comm_total']:.3f} s, TP comm "
            f"{pred.time['tp_comm_total']:.3f} s)"
        )
    lines += [
        f"  tokens/s/GPU          {pred.tokens_per_s_per_gpu:8.0f}",
        f"  MFU                   {100 * pred.mfu:8.1f} %",
    ]
    if pred.buckets is not None:  # None: per-block groups, no bucket plan
        lines.append(
            f"  bucket plan           {len(pred.buckets)} buckets"
            + (f"; first: {len(pred.buckets[0])} params" if pred.buckets else "")
            + (f"; {len(pred.kept)} params kept gathered for backward" if pred.kept else "")
        )
    lines += [f"  note: {n}" for n in pred.notes]
    return "\n".join(lines)


def why_loses(pred, best) -> str:
    """Why ``pred`` ranks below ``best``: the step-time part that grew most.

    Layouts of one sweep can do different work per step (TP 8 on 8 GPUs
    runs one data-parallel batch, FSDP on 8 runs eight), so each part is
    compared per token per GPU and reported at the best's tokens per step:
    what the loser would spend on the best's step.
    """
    if not pred.fits:
        return f"out of memory ({pred.peak_bytes / GiB:.1f} > {pred.usable_bytes / GiB:.1f} GiB)"
    if pred is best:
        return "best"
    if pred.tokens_per_s_per_gpu >= best.tokens_per_s_per_gpu * (1 - 1e-9):
        return "tie with the best"
    # tokens per GPU per step: the work each layout's step does
    scale = (best.tokens_per_s_per_gpu * best.step_s) / (pred.tokens_per_s_per_gpu * pred.step_s)
    t = {k: v * scale for k, v in pred.time.items()}
    b = best.time
    reasons = {
        "exposed communication": t["exposed_comm"] - b["exposed_comm"],
        "pipeline bubble": t["bubble"] - b["bubble"],
        "recomputation / compute": (t["compute"] - t["copies"] - t["hooks"])
        - (b["compute"] - b["copies"] - b["hooks"]),
        "copies around collectives": t["copies"] - b["copies"],
        "eager FSDP2's hooks": t["hooks"] - b["hooks"],
        "optimizer": t["optimizer"] - b["optimizer"],
    }
    name, extra = max(reasons.items(), key=lambda kv: kv[1])
    same_work = abs(scale - 1.0) < 1e-9
    unit = "per step" if same_work else "at the best's step size"
    if extra <= 0:
        slower = pred.step_s * scale - best.step_s
        return f"slower overall (+{_seconds(slower)} {unit})"
    return f"{name} (+{_seconds(extra)} {unit})"


def _seconds(value: float) -> str:
    return f"{value:.3f} s" if value >= 0.1 else f"{1e3 * value:.3g} ms"


def format_sweep(preds) -> str:
    ranked = sorted(preds, key=lambda p: (not p.fits, -p.tokens_per_s_per_gpu))
    best = ranked[0] if ranked and ranked[0].fits else None
    width = max([44, *(len(p.layout.describe()) for p in ranked)])
    header = (
        f"{'#':>3} {'layout':<{width}} {'peak GiB':>9} {'step s':>9} {'tok/s/GPU':>10} "
        f"{'MFU%':>6}  why"
    )
    lines = [header]
    for i, p in enumerate(ranked, 1):
        reason = why_loses(p, best) if best is not None else why_loses(p, p)
        lines.append(
            f"{i:>3} {p.layout.describe():<{width}} {p.peak_bytes / GiB:>9.3g} {p.step_s:>9.4g} "
            f"{p.tokens_per_s_per_gpu:>10.0f} {100 * p.mfu:>6.1f}  {reason}"
        )
    return "\n".join(lines)


def sweep_pipelines(base) -> list[tuple[int, str, int | None, int]]:
    """``(pp, schedule, stages_per_rank, microbatches)`` the sweeps try
    around ``base``: no pipeline (one microbatch), and at ``base.pp`` (if
    above 1) 1F1B, interleaved 1F1B and the schedule given, each with
    ``pp`` and ``2 * pp`` microbatches (``base``'s stages per rank for
    its own schedule)."""
    found = [(1, "1f1b", None, 1)]
    if base.pp > 1:
        for schedule in sorted({base.pp_schedule, "1f1b", "interleaved_1f1b"}):
            stages = base.stages_per_rank if schedule == base.pp_schedule else None
            found += [(base.pp, schedule, stages, m) for m in sorted({base.pp, 2 * base.pp})]
    return found


def sweep_layouts(args, base, gpus_per_node: int = 8) -> list:
    """Layouts and options around ``base``: AC modes, bucketing, reshard
    policy, TP degree (``base.tp`` and every power of two up to a node,
    ``gpus_per_node``: TP's collectives are on every layer's critical path,
    so it stays on the intra-node link), PP degree (1 and ``base.pp``) and
    its schedule (1F1B, interleaved 1F1B and the one given), microbatches
    (``pp`` and ``2 * pp``); ``--async-tp`` wherever TP is on.
    Invalid ones (a degree that does not divide the GPUs or the model's
    heads) are left out."""
    from simplefsdp.plan.predict import validate

    tps = {1, base.tp}
    degree = 2
    while degree <= min(gpus_per_node, base.gpus):
        tps.add(degree)
        degree *= 2
    tps = sorted(tps)
    layouts = []
    for tp in tps:
        for pp, schedule, stages, m in sweep_pipelines(base):
            for ac in ("none", "selective", "full"):
                for reshard in (True, False):
                    for bucketing in ("auto", "per_block"):
                        layout = dataclasses.replace(
                            base,
                            tp=tp,
                            pp=pp,
                            microbatches=m,
                            ac=ac,
                            reshard_after_forward=reshard,
                            bucketing=bucketing,
                            async_tp=base.async_tp and tp > 1,
                            pp_schedule=schedule,
                            stages_per_rank=stages,
                        )
                        try:
                            validate(args, layout)
                        except ValueError:
                            continue
                        if layout.fsdp == 1 and (bucketing != "auto" or not reshard):
                            continue  # nothing to gather: these options do not apply
                        layouts.append(layout)
    return layouts


def sweep_expert_layouts(spec: Any, config: Any, base) -> list:
    """Layouts and options around ``base`` (an ``ExpertLayout``) for a model
    planned from its shapes: every EP degree that divides both the experts
    and the GPUs (a multiple of ``base.cp``), AC modes (selective with and
    without recomputing the experts), reshard policy and the pipelines of
    :func:`sweep_pipelines`; the GPUs, batch, sequence, CP degree, engine
    and imbalance are ``base``'s. Invalid ones are left out."""
    from simplefsdp.plan.analytic import validate_analytic

    eps = expert_degrees(config, base)
    modes = (("none", False), ("selective", False), ("selective", True), ("full", False))
    layouts = []
    for pp, schedule, stages, m in sweep_pipelines(base):
        for ep in eps:
            for ac, recompute in modes:
                for reshard in (True, False):
                    layout = dataclasses.replace(
                        base, ep=ep, ac=ac, recompute_experts=recompute,
                        reshard_after_forward=reshard, pp=pp, microbatches=m,
                        pp_schedule=schedule, stages_per_rank=stages,
                    )  # fmt: skip
                    if layout.fsdp == 1 and not reshard:
                        continue  # nothing to gather: the option does not apply
                    try:
                        validate_analytic(spec, config, layout)
                    except ValueError:
                        continue
                    layouts.append(layout)
    return layouts


def expert_degrees(config: Any, base) -> list[int]:
    """The EP degrees ``base`` (an ``ExpertLayout``) may take: those dividing
    both the experts and the GPUs, a multiple of ``base.cp`` above 1."""
    return [
        ep
        for ep in range(1, base.gpus + 1)
        if base.gpus % ep == 0 and config.num_experts % ep == 0 and (ep == 1 or ep % base.cp == 0)
    ]


def fastest_default_ep(spec: Any, config: Any, base, defaulted, hw, predict_fn):
    """The prediction of ``base`` (an ``ExpertLayout`` whose EP degree is a
    generic default) at the EP degree that is fastest among those that fit:
    every degree dividing the experts and the GPUs (a multiple of
    ``base.cp``), each with the other defaults (``defaulted``) lowered where
    it does not fit as :func:`fit_defaults` lowers them, the rest of
    ``base`` as it is. ``None`` where none fits (the default stays, and what
    would fit is listed as for any layout)."""
    from simplefsdp.plan.analytic import validate_analytic

    best = None
    for ep in expert_degrees(config, base):
        layout = dataclasses.replace(base, ep=ep)
        try:
            validate_analytic(spec, config, layout)
        except ValueError:
            continue
        pred = fit_defaults(config, predict_fn(config, layout, hw), defaulted, hw, predict_fn)
        if pred.fits and (best is None or pred.tokens_per_s_per_gpu > best.tokens_per_s_per_gpu):
            best = pred
    return best


def sweep_predictions(args, layouts, hw, predict_fn) -> tuple[list, list[dict]]:
    """Predict the sweep's ``layouts`` with ``predict_fn(args, layout, hw)``
    (``simplefsdp.plan.predict.predict``); returns ``(predictions, skipped)``.

    Layouts that share TP, PP, microbatches, EP and the pipeline's schedule
    are predicted with full AC
    and resharding after forward first, the least memory any of them can
    need (less AC saves more activations, keeping parameters gathered holds
    more).
    When none of those fits, the group's other options cannot either, and
    they are not predicted: each is in ``skipped`` (``layout``, ``reason``)
    instead. A 405B sweep on 512 GPUs otherwise spends most of its time on
    layouts without pipeline parallelism that need terabytes.
    """
    groups: dict[tuple, list] = {}
    for layout in layouts:
        key = tuple(
            getattr(layout, k, 1) for k in ("tp", "pp", "microbatches", "ep", "pp_schedule")
        )
        groups.setdefault(key, []).append(layout)
    preds, skipped = [], []
    for group in groups.values():
        leanest = [lay for lay in group if lay.ac == "full" and lay.reshard_after_forward]
        rest = [lay for lay in group if lay not in leanest]
        first = [predict_fn(args, lay, hw) for lay in leanest]
        preds.extend(first)
        if first and not any(p.fits for p in first):
            need = min(p.peak_bytes for p in first)
            reason = (
                f"not predicted: full AC with resharding already needs {need / GiB:.1f} "
                f"> {first[0].usable_bytes / GiB:.1f} GiB"
            )
            skipped.extend({"layout": lay.describe(), "reason": reason} for lay in rest)
            continue
        preds.extend(predict_fn(args, lay, hw) for lay in rest)
    return preds, skipped


def format_skipped(skipped: list[dict]) -> str:
    """One line per reason: how many options it skipped, and which."""
    by_reason: dict[str, list[str]] = {}
    for item in skipped:
        by_reason.setdefault(item["reason"], []).append(item["layout"])
    lines = []
    for reason, names in by_reason.items():
        shown = names[0] + (", ..." if len(names) > 1 else "")
        lines.append(f"    {len(names)} more out of memory, {reason}: {shown}")
    return "\n".join(lines)


def largest_fitting_batch(pred) -> int:
    """About the largest per-rank batch that fits: activations and temporaries
    scale with the batch, the rest does not."""
    per_batch = (pred.memory["activations"] + pred.memory["temporary"]) / pred.layout.batch
    fixed = pred.peak_bytes - per_batch * pred.layout.batch
    room = pred.usable_bytes - fixed
    step = pred.layout.microbatches
    if room <= 0 or per_batch <= 0:
        return 0
    return int(room // per_batch) // step * step


def fit_default_batch(args, pred, hw, predict_fn, tries: int = 4):
    """``pred`` if it fits, else the prediction at the largest smaller batch
    (a multiple of the microbatches) that fits, ``None`` where none does
    within ``tries`` predictions. Each try starts from the last one's
    ``largest_fitting_batch`` (an estimate), one step lower where that
    would not lower the batch."""
    current = pred
    for _ in range(tries):
        if current.fits:
            return current
        step = current.layout.microbatches
        batch = min(largest_fitting_batch(current), current.layout.batch - step) // step * step
        if batch < step:
            return None
        current = predict_fn(args, dataclasses.replace(current.layout, batch=batch), hw)
    return current if current.fits else None


def with_ac(layout, ac: str):
    """``layout`` with AC mode ``ac``; recomputing the experts (a choice
    within selective AC) dropped for any other."""
    changes: dict[str, Any] = {"ac": ac}
    if ac != "selective" and getattr(layout, "recompute_experts", False):
        changes["recompute_experts"] = False
    return dataclasses.replace(layout, **changes)


def fit_defaults(args, pred, defaulted, hw, predict_fn):
    """``pred`` if it fits, else the prediction of what fits with the
    defaults the user left out (``defaulted``, names of values not given)
    lowered: the batch (to about the largest that fits), else, with the AC
    mode left out too, full AC at the default batch or the largest that
    fits with it. What was lowered is noted; ``pred`` where nothing fits."""
    if pred.fits:
        return pred

    def need(what: str, default, fitted) -> str:
        return (
            f"{what} {getattr(fitted.layout, what[2:])}: the default {default} is predicted "
            f"to need {pred.peak_bytes / GiB:.1f} GiB of {pred.usable_bytes / GiB:.1f} GiB usable"
        )

    base = pred.layout
    if "batch" in defaulted:
        fitted = fit_default_batch(args, pred, hw, predict_fn)
        if fitted is not None:
            fitted.notes.append(need("--batch", base.batch, fitted))
            return fitted
    if "ac" not in defaulted or "batch" not in defaulted or base.ac == "full":
        return pred  # a batch given is planned as given, at the AC given or not
    # No batch fits at the default AC: full AC, its batch lowered where needed.
    leaner = predict_fn(args, with_ac(base, "full"), hw)
    if not leaner.fits:
        leaner = fit_default_batch(args, leaner, hw, predict_fn) or leaner
    if not leaner.fits:
        return pred
    leaner.notes.append(need("--ac", base.ac, leaner))
    if leaner.layout.batch != base.batch:
        leaner.notes.append(need("--batch", base.batch, leaner))
    return leaner


def _candidate_changes(
    spec: Any, config: Any, pred, gpus_per_node: int
) -> list[list[tuple[str, object]]]:
    """Single changes to a layout that does not fit, as ladders: each ladder
    is tried in order until one fits (the cheapest of its kind). Only
    changes away from what was given: a leaner AC mode, resharding after
    forward, bf16, a larger TP degree within a node, a larger EP degree, a
    deeper pipeline, more GPUs (when the sharded state is what overflows);
    each only where the model composes with it and its plan method plans
    it."""
    from simplefsdp.plan.layout import AC_MODES

    layout = pred.layout
    replace = dataclasses.replace
    planned = METHOD_FLAGS[spec.plan_method]
    ladders: list[list[tuple[str, object]]] = []
    for ac in AC_MODES[AC_MODES.index(layout.ac) + 1 :]:
        ladders.append([(f"--ac {ac}", with_ac(layout, ac))])
    if not layout.reshard_after_forward:
        ladders.append([("no --no-reshard", replace(layout, reshard_after_forward=True))])
    if "--dtype" in planned and layout.dtype != "bf16":
        ladders.append([("--dtype bf16", replace(layout, dtype="bf16"))])
    if "--tp" in planned and spec.supports("tp"):
        tps, tp = [], layout.tp * 2
        while tp <= gpus_per_node:
            tps.append((f"--tp {tp}", replace(layout, tp=tp)))
            tp *= 2
        ladders.append(tps)
    if "--ep" in planned and spec.supports("ep"):
        # fewer local experts: their gathered blocks, gradients and (under a
        # pipeline or accumulation) gradient sums shrink with them
        eps, ep = [], layout.ep * 2
        while ep <= layout.fsdp:
            eps.append((f"--ep {ep}", replace(layout, ep=ep)))
            ep *= 2
        ladders.append(eps)
    if "--pp" in planned and spec.supports("pp"):
        pp = max(layout.pp, 1) * 2
        micro = max(layout.microbatches, pp)
        ladders.append(
            [(f"--pp {pp} --microbatches {micro}", replace(layout, pp=pp, microbatches=micro))]
        )
    # More GPUs shard the parameters, gradients and optimizer state further;
    # the rest per GPU stays. Worth trying where that alone can fit.
    state = sum(pred.memory[k] for k in ("parameters", "gradients", "optimizer"))
    rest = pred.peak_bytes - state
    if rest < pred.usable_bytes and state > 0:
        factor = 2
        while state / factor + rest > pred.usable_bytes:
            factor *= 2
        gpus = [layout.gpus * factor, layout.gpus * factor * 2]
        ladders.append([(f"--gpus {g}", replace(layout, gpus=g)) for g in gpus])
    valid = []
    for ladder in ladders:
        kept = []
        for text, candidate in ladder:
            try:
                validate_layout(spec, config, candidate)
            except ValueError:
                continue
            kept.append((text, candidate))
        if kept:
            valid.append(kept)
    return valid


def fitting_changes(
    spec: Any, config: Any, pred, hw, predict_fn
) -> tuple[list[tuple[str, object]], list[str]]:
    """Single changes to ``pred``'s layout that fit, fastest first, each with
    its prediction; and the kinds of change tried (``--ac``, ``--tp``, ...).

    Each candidate (``_candidate_changes``) is predicted, not estimated;
    none repeats a value given (a leaner AC mode than the one given, a larger
    TP degree, ...).
    """
    found, tried = [], []
    for ladder in _candidate_changes(spec, config, pred, hw.gpus_per_node):
        tried.append(ladder[0][0].split()[0] if ladder[0][0].startswith("--") else ladder[0][0])
        for text, layout in ladder:
            candidate = predict_fn(config, layout, hw)
            if candidate.fits:
                found.append((text, candidate))
                break
    found.sort(key=lambda item: -item[1].tokens_per_s_per_gpu)
    return found, list(dict.fromkeys(tried))


def format_changes(found, tried: list[str]) -> str:
    """``changes that fit: --ac full (61.2 GiB, 5,912 tokens/s/GPU); ...``."""
    if not found:
        return "no single change of " + ", ".join(tried) + " fits" if tried else ""
    parts = [
        f"{text} ({p.peak_bytes / GiB:.1f} GiB, {p.tokens_per_s_per_gpu:,.0f} tokens/s/GPU)"
        for text, p in found
    ]
    return "changes that fit, fastest first: " + "; ".join(parts)


def write_png(preds, path: Path) -> bool:
    """Memory and step-time breakdown per option; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    labels = [p.layout.describe() for p in preds]
    fig, axes = plt.subplots(1, 2, figsize=(14, 0.5 * len(preds) + 2), squeeze=False)
    for ax, parts, key, unit, scale in (
        (axes[0][0], list(preds[0].memory), "memory", "GiB", GiB),
        (axes[0][1], ["compute", "exposed_comm", "bubble", "optimizer"], "time", "s", 1.0),
    ):
        left = [0.0] * len(preds)
        for part in parts:
            values = [getattr(p, key)[part] / scale for p in preds]
            ax.barh(labels, values, left=left, label=part)
            left = [a + b for a, b in zip(left, values)]
        if key == "memory":
            ax.axvline(preds[0].usable_bytes / GiB, color="k", ls="--", lw=1, label="usable")
        ax.set_xlabel(f"{key} per GPU ({unit})")
        ax.legend(fontsize=7)
        ax.invert_yaxis()
    axes[0][1].set_yticklabels([])
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def _result(args: Any, hw: Any, elapsed: float, preds: list) -> dict:
    """The ``--json`` record of a plan: the model, the hardware and the predictions."""
    return {
        "model": dataclasses.asdict(args),
        "hardware": hw.to_dict(),
        "planning_s": elapsed,
        "predictions": [p.to_dict() for p in preds],
    }


def does_not_fit(pred, changes: str) -> str:
    """The one error line of a layout that does not fit: the batch, the
    predicted and usable memory, the largest batch that fits (or why none
    does) and ``changes`` that would fit (:func:`format_changes`)."""
    largest = largest_fitting_batch(pred)
    state = sum(pred.memory[k] for k in ("parameters", "gradients", "optimizer"))
    if largest:
        hint = f"largest batch that fits: about {largest}"
    elif state > pred.usable_bytes:
        hint = "no batch fits: the model state alone is too large"
    else:
        hint = "no batch fits at this --seq and --ac"
    return (
        f"--batch {pred.layout.batch} does not fit on {pred.hardware}: predicted "
        f"{pred.peak_bytes / GiB:.2f} GiB of {pred.usable_bytes / GiB:.2f} GiB usable per "
        f"GPU; {hint}" + (f"; {changes}" if changes else "")
    )


def main(argv: list[str] | None = None) -> int:
    """``simplefsdp plan``: returns the exit status (2: a bad input or a layout
    that does not fit, with one error line)."""
    ns = _parser().parse_args(argv)
    logging.getLogger("torch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TORCH_LOGS", "-all")
    if ns.calibrate:
        from simplefsdp.plan.calibrate import calibrate_main

        if ns.calibrate_rounds < 1:
            print(
                f"simplefsdp plan: error: --calibrate-rounds must be >= 1, got {ns.calibrate_rounds}",
                file=sys.stderr,
            )
            return 2
        return calibrate_main(ns)
    start = time.perf_counter()
    try:
        from simplefsdp.plan.predict import predict

        spec, config = resolve_model(ns)
        check_flags(ns, spec)
        predict_fn = functools.partial(predict, spec)
        hw = get_profile(ns.hardware)
        values, defaulted = plan_defaults(
            ns, spec, config, hw.memory_bytes * hw.usable_memory_fraction
        )
        base = make_layout(ns, spec, values)
        validate_layout(spec, config, base)
        # the defaults came from the flavor's published layout, not generic ones
        preset = ns.config is None and reference_layout(spec, config) is not None
        measured = None
        if ns.measure:
            from simplefsdp.plan.measure import measure_errors, measure_step

            if ns.sweep:
                raise ValueError("--measure measures one layout; leave out --sweep")
            errors = measure_errors(base)
            if errors:
                raise ValueError(errors[0])
        if ns.sweep:
            if spec.plan_method == "analytic":
                layouts = sweep_expert_layouts(spec, config, base)
            else:
                layouts = sweep_layouts(config, base, hw.gpus_per_node)
            preds, skipped = sweep_predictions(config, layouts, hw, predict_fn)
            preds.sort(key=lambda p: (not p.fits, -p.tokens_per_s_per_gpu))
        else:
            first = None
            if "ep" in defaulted and not preset and spec.plan_method == "analytic":
                # a generic EP degree: the fastest that fits
                first = fastest_default_ep(spec, config, base, defaulted, hw, predict_fn)
                if first is not None and first.layout.ep != values["ep"]:
                    first.notes.append(
                        f"--ep {first.layout.ep}: the fastest EP degree that fits this "
                        "layout (--sweep ranks the others)"
                    )
                    values["ep"] = first.layout.ep
            if first is None:
                first = fit_defaults(
                    config, predict_fn(config, base, hw), defaulted, hw, predict_fn
                )
            preds = [first]
            skipped = []
            values["ac"] = preds[0].layout.ac
        shown = ", ".join(
            f"--{name} {values[name]}"
            for name in ("gpus", "tp", "ep", "batch", "seq", "ac")
            if name in defaulted and not (name in ("tp", "ep") and values[name] == 1)
        )
        if shown:
            source = "published layout" if preset else "generic"
            preds[0].notes.insert(0, f"defaults ({source}): {shown}")
        pred = preds[0]
        if not ns.sweep and not pred.fits:
            changes = format_changes(*fitting_changes(spec, config, pred, hw, predict_fn))
    except ValueError as exc:
        print(f"simplefsdp plan: error: {exc}", file=sys.stderr)
        return 2
    elapsed = time.perf_counter() - start
    if not ns.sweep and not pred.fits:
        print(format_prediction(pred))  # the breakdown shows what to cut
        print(f"simplefsdp plan: error: {does_not_fit(pred, changes)}", file=sys.stderr)
        return 2
    if ns.measure:
        measured = measure_step(spec, config, pred.layout)
    result = _result(config, hw, elapsed, preds)
    if measured is not None:
        result["measured"] = dataclasses.asdict(measured)
    if ns.sweep:
        result["skipped"] = skipped
    if ns.json:
        print(json.dumps(result, indent=2, default=str))
    elif ns.sweep:
        print(format_sweep(preds))
        if skipped:
            print(format_skipped(skipped))
    else:
        print(format_prediction(pred))
        if measured is not None:
            from simplefsdp.plan.measure import format_measured

            print(format_measured(measured, pred))
    if ns.out:
        out = Path(ns.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "plan.json").write_text(json.dumps(result, indent=2, default=str))
        png = write_png(preds, out / "plan.png")
        if not ns.json:
            print(f"wrote {out / 'plan.json'}" + (f" and {out / 'plan.png'}" if png else ""))
    if not ns.json:
        print(f"planned in {elapsed:.1f} s")
    return 0


if __name__ == "__main__":
    exit_quickly(main())
