"""``simplefsdp plan``: predict per-GPU memory and throughput of a training job.

Examples::

    simplefsdp plan --model llama3_8b                 # torchtitan's 8B layout: 8 GPUs
    simplefsdp plan --model llama3_70b                # 64 GPUs, TP 8, full AC
    simplefsdp plan --model llama3_8b --gpus 8 --hardware h100 --batch 2 --seq 8192
    simplefsdp plan --model llama3_405b --gpus 512 --tp 8 --pp 8 --microbatches 8 \\
        --batch 32 --ac full --out plans/405b
    simplefsdp plan --model llama3_8b --gpus 8 --sweep
    simplefsdp plan --model llama3_8b --gpus 8 --batch 2 --float8
    simplefsdp plan --model deepseek_v3_16b --gpus 8 --ep 2 --batch 1 --seq 4096
    simplefsdp plan --calibrate --out profiles/   # measure this machine (gloo, CPU)

Runs in one process on this machine: the model is traced on the meta device
with a fake process group of the target size (see ``simplefsdp.plan.trace``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from simplefsdp.plan.hardware import get_profile, profile_names

GiB = 2**30

MODEL_ALIASES = {
    "llama3_8b": "8B",
    "llama3_70b": "70B",
    "llama3_405b": "405B",
    "llama3_debug": "debug",
    "llama3_small": "small",
}


# torchtitan's published layouts of the Llama 3 models (the defaults of
# ``simplefsdp plan`` for them): local batch, sequence length and AC mode of
# its train configs (torchtitan/models/llama3/train_configs/llama3_{8b,70b,
# 405b}.toml), TP degree and GPU count of the runs its docs/performance.md
# reports (8B on 8 GPUs, 70B on 64 with TP 8, 405B on 128 with TP 8).
# Other models default to ``GENERIC_DEFAULTS``.
PLAN_DEFAULTS = {
    "8B": {"gpus": 8, "tp": 1, "batch": 1, "seq": 8192, "ac": "selective"},
    "70B": {"gpus": 64, "tp": 8, "batch": 8, "seq": 8192, "ac": "full"},
    "405B": {"gpus": 128, "tp": 8, "batch": 2, "seq": 8192, "ac": "full"},
}
GENERIC_DEFAULTS = {"gpus": 8, "tp": 1, "batch": 2, "seq": 8192, "ac": "selective"}


def model_args(model: str | None, config: str | None):
    """``ModelArgs`` from ``--model`` (a name) or ``--config`` (a JSON file of
    ``ModelArgs`` fields, optionally with ``"base"``: a config name)."""
    from simplefsdp.models.llama3 import LLAMA3_CONFIGS, get_config

    if config is not None:
        try:
            data = json.loads(Path(config).read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot read --config {config!r}: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError(
                f"--config {config!r} must hold a JSON object of ModelArgs fields, "
                f"got a {type(data).__name__}"
            )
        base = data.pop("base", "8B")
        return get_config(MODEL_ALIASES.get(base, base), **data)
    name = MODEL_ALIASES.get(model or "llama3_8b", model or "8B")
    if name not in LLAMA3_CONFIGS:
        valid = ", ".join([*MODEL_ALIASES, *LLAMA3_CONFIGS])
        raise ValueError(f"unknown --model {model!r}; valid: {valid}, or --config FILE.json")
    return get_config(name)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="simplefsdp plan",
        description="Predict per-GPU peak memory, step time, tokens/s and MFU of a Llama 3 "
        "training job from its traced graphs, or of a mixture-of-experts job from its "
        "shapes, without GPUs.",
    )
    p.add_argument(
        "--model",
        default="llama3_8b",
        help="llama3_8b (default), llama3_70b, llama3_405b, llama3_debug, llama3_small; "
        "mixture of experts: moe_debug, moe_small, deepseek_v3_16b, deepseek_v3_671b, "
        "llama4_scout",
    )
    p.add_argument("--config", help="JSON file of ModelArgs fields (optional key 'base')")
    p.add_argument(
        "--gpus",
        type=int,
        default=None,
        help="default: torchtitan's count for the model (8B: 8, 70B: 64, 405B: 128), else 8",
    )
    p.add_argument(
        "--hardware", default="h100", help=f"{', '.join(profile_names())} or a .json profile"
    )
    p.add_argument(
        "--batch",
        type=int,
        default=None,
        help="per data-parallel rank, per step (default: torchtitan's local batch for the "
        "model, 8B: 1, 70B: 8, 405B: 2, else 2; lowered to the largest that fits)",
    )
    p.add_argument("--seq", type=int, default=None, help="sequence length (default 8192)")
    p.add_argument(
        "--ac",
        default=None,
        help="none, selective, full (default: torchtitan's, 8B: selective, 70B and 405B: full)",
    )
    p.add_argument(
        "--tp",
        type=int,
        default=None,
        help="tensor-parallel degree (default: torchtitan's, 70B and 405B: 8, else 1)",
    )
    p.add_argument("--pp", type=int, default=1)
    p.add_argument(
        "--ep",
        type=int,
        default=None,
        help="expert-parallel degree of a mixture-of-experts --model (default 1): each rank "
        "holds num_experts / ep experts, sharded over the dp / ep ranks holding the same ones",
    )
    p.add_argument(
        "--expert-imbalance",
        type=float,
        default=1.0,
        help="MoE: routed tokens of the most loaded EP rank over the mean (default 1.0: balanced)",
    )
    p.add_argument(
        "--microbatches",
        type=int,
        default=None,
        help="per step: 1F1B microbatches with --pp (default pp), else gradient "
        "accumulation (default 1); --batch is split among them",
    )
    p.add_argument("--engine", default="simplefsdp", help="simplefsdp (compiled) or fsdp2")
    p.add_argument("--dtype", default="bf16", help="bf16 (mixed precision, default) or fp32")
    p.add_argument(
        "--loss-parallel",
        action="store_true",
        help="with --tp: the logits stay sharded over the vocabulary for the loss "
        "(simplefsdp train --parallel.loss_parallel true; torchtitan's default)",
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


def plan_defaults(ns: argparse.Namespace) -> tuple[dict, set[str]]:
    """The values of ``--gpus``, ``--tp``, ``--batch``, ``--seq`` and ``--ac``:
    those given, the rest from ``PLAN_DEFAULTS`` for a ``--model`` that has
    them (torchtitan's layouts), else ``GENERIC_DEFAULTS``. Returns the values
    and the names of those taken as defaults.

    A default TP degree that does not divide the GPUs given is lowered to the
    largest power of two that does.
    """
    preset = GENERIC_DEFAULTS
    if ns.config is None:
        preset = PLAN_DEFAULTS.get(MODEL_ALIASES.get(ns.model, ns.model), GENERIC_DEFAULTS)
    values, defaulted = {}, set()
    for name, default in preset.items():
        given = getattr(ns, name)
        values[name] = default if given is None else given
        if given is None:
            defaulted.add(name)
    if "tp" in defaulted and values["gpus"] >= 1:
        while values["tp"] > 1 and values["gpus"] % values["tp"]:
            values["tp"] //= 2
    return values, defaulted


def _layout(ns: argparse.Namespace, values: dict | None = None):
    from simplefsdp.plan.predict import Layout

    if values is None:
        values, _ = plan_defaults(ns)
    return Layout(
        gpus=values["gpus"],
        batch=values["batch"],
        seq=values["seq"],
        tp=values["tp"],
        pp=ns.pp,
        ac=values["ac"],
        microbatches=ns.microbatches if ns.microbatches is not None else max(ns.pp, 1),
        reshard_after_forward=not ns.no_reshard,
        bucketing=ns.bucketing,
        engine=ns.engine,
        dtype=ns.dtype,
        float8=ns.float8,
        loss_parallel=ns.loss_parallel,
    )


def format_prediction(pred) -> str:
    """A terminal table of one prediction."""
    lines = [
        f"{pred.layout.describe()}  batch={pred.layout.batch}x{pred.layout.seq}  "
        f"engine={pred.layout.engine}  hardware={pred.hardware}",
        f"  peak memory / GPU     {pred.peak_bytes / GiB:8.1f} GiB  "
        f"(usable {pred.usable_bytes / GiB:.1f} GiB){'' if pred.fits else '  DOES NOT FIT'}",
    ]
    for name, value in pred.memory.items():
        lines.append(f"    {name:<20}{value / GiB:8.2f} GiB")
    if getattr(pred, "params", None):
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
    if not getattr(pred, "params", None):  # MoE plans have no traced bucket plan
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
    header = (
        f"{'#':>3} {'layout':<44} {'peak GiB':>9} {'step s':>9} {'tok/s/GPU':>10} {'MFU%':>6}  why"
    )
    lines = [header]
    for i, p in enumerate(ranked, 1):
        reason = why_loses(p, best) if best is not None else why_loses(p, p)
        lines.append(
            f"{i:>3} {p.layout.describe():<44} {p.peak_bytes / GiB:>9.3g} {p.step_s:>9.4g} "
            f"{p.tokens_per_s_per_gpu:>10.0f} {100 * p.mfu:>6.1f}  {reason}"
        )
    return "\n".join(lines)


def sweep_layouts(args, base, gpus_per_node: int = 8) -> list:
    """Layouts and options around ``base``: AC modes, bucketing, reshard
    policy, TP degree (``base.tp`` and every power of two up to a node,
    ``gpus_per_node``: TP's collectives are on every layer's critical path,
    so it stays on the intra-node link), PP degree (1 and ``base.pp``) and
    microbatches (``pp`` and ``2 * pp``); invalid ones (a degree that does
    not divide the GPUs or the model's heads) are left out."""
    from simplefsdp.plan.predict import validate

    tps = {1, base.tp}
    degree = 2
    while degree <= min(gpus_per_node, base.gpus):
        tps.add(degree)
        degree *= 2
    tps = sorted(tps)
    pps = sorted({1, base.pp})
    layouts = []
    for tp in tps:
        for pp in pps:
            micro = [1] if pp == 1 else sorted({pp, 2 * pp})
            for m in micro:
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
                            )
                            try:
                                validate(args, layout)
                            except ValueError:
                                continue
                            if layout.dp == 1 and (bucketing != "auto" or not reshard):
                                continue  # nothing to gather: these options do not apply
                            layouts.append(layout)
    return layouts


def sweep_predictions(args, layouts, hw, predict_fn) -> tuple[list, list[dict]]:
    """Predict the sweep's ``layouts`` with ``predict_fn(args, layout, hw)``
    (``simplefsdp.plan.predict.predict``); returns ``(predictions, skipped)``.

    Layouts that share TP, PP and microbatches are predicted with full AC and
    resharding after forward first, the least memory any of them can need
    (less AC saves more activations, keeping parameters gathered holds more).
    When none of those fits, the group's other options cannot either, and
    they are not traced: each is in ``skipped`` (``layout``, ``reason``)
    instead. A 405B sweep on 512 GPUs otherwise spends most of its time on
    layouts without pipeline parallelism that need terabytes.
    """
    groups: dict[tuple, list] = {}
    for layout in layouts:
        groups.setdefault((layout.tp, layout.pp, layout.microbatches), []).append(layout)
    preds, skipped = [], []
    for group in groups.values():
        leanest = [lay for lay in group if lay.ac == "full" and lay.reshard_after_forward]
        rest = [lay for lay in group if lay not in leanest]
        first = [predict_fn(args, lay, hw) for lay in leanest]
        preds.extend(first)
        if first and not any(p.fits for p in first):
            need = min(p.peak_bytes for p in first)
            reason = (
                f"not traced: full AC with resharding already needs {need / GiB:.1f} "
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


def _candidate_changes(args, pred, gpus_per_node: int) -> list[list[tuple[str, object]]]:
    """Single changes to a layout that does not fit, as ladders: each ladder
    is tried in order until one fits (the cheapest of its kind). Only
    changes away from what was given: a leaner AC mode, resharding after
    forward, bf16, a larger TP degree within a node, a deeper pipeline, more
    GPUs (when the sharded state is what overflows)."""
    from simplefsdp.plan.layout import AC_MODES, validate

    layout = pred.layout
    replace = dataclasses.replace
    ladders: list[list[tuple[str, object]]] = []
    for ac in AC_MODES[AC_MODES.index(layout.ac) + 1 :]:
        ladders.append([(f"--ac {ac}", replace(layout, ac=ac))])
    if not layout.reshard_after_forward:
        ladders.append([("no --no-reshard", replace(layout, reshard_after_forward=True))])
    if layout.dtype != "bf16":
        ladders.append([("--dtype bf16", replace(layout, dtype="bf16"))])
    tps, tp = [], layout.tp * 2
    while tp <= gpus_per_node:
        tps.append((f"--tp {tp}", replace(layout, tp=tp)))
        tp *= 2
    ladders.append(tps)
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
                validate(args, candidate)
            except ValueError:
                continue
            kept.append((text, candidate))
        if kept:
            valid.append(kept)
    return valid


def fitting_changes(args, pred, hw, predict_fn) -> tuple[list[tuple[str, object]], list[str]]:
    """Single changes to ``pred``'s layout that fit, fastest first, each with
    its prediction; and the kinds of change tried (``--ac``, ``--tp``, ...).

    Each candidate (``_candidate_changes``) is predicted, not estimated;
    none repeats a value given (a leaner AC mode than the one given, a larger
    TP degree, ...).
    """
    found, tried = [], []
    for ladder in _candidate_changes(args, pred, hw.gpus_per_node):
        tried.append(ladder[0][0].split()[0] if ladder[0][0].startswith("--") else ladder[0][0])
        for text, layout in ladder:
            candidate = predict_fn(args, layout, hw)
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


def main(argv: list[str] | None = None) -> int:
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
    from simplefsdp.plan.moe import is_moe_model

    if ns.config is None and is_moe_model(ns.model):
        return _moe_main(ns, start)
    try:
        from simplefsdp.plan.predict import predict, validate

        if ns.ep is not None and ns.ep != 1:
            raise ValueError(
                f"--ep {ns.ep} needs a mixture-of-experts --model (moe_debug, moe_small, "
                f"deepseek_v3_16b, deepseek_v3_671b, llama4_scout); {ns.config or ns.model!r} "
                "is dense"
            )

        args = model_args(ns.model, ns.config)
        hw = get_profile(ns.hardware)
        values, defaulted = plan_defaults(ns)
        base = _layout(ns, values)
        validate(args, base)
        if ns.sweep:
            layouts = sweep_layouts(args, base, hw.gpus_per_node)
            preds, skipped = sweep_predictions(args, layouts, hw, predict)
            preds.sort(key=lambda p: (not p.fits, -p.tokens_per_s_per_gpu))
        else:
            preds, skipped = [predict(args, base, hw)], []
            if "batch" in defaulted and not preds[0].fits:
                # The default batch (torchtitan's) lowered to what fits.
                fitted = fit_default_batch(args, preds[0], hw, predict)
                if fitted is not None:
                    fitted.notes.append(
                        f"--batch {fitted.layout.batch}: the default {base.batch} is predicted "
                        f"to need {preds[0].peak_bytes / GiB:.1f} GiB of "
                        f"{preds[0].usable_bytes / GiB:.1f} GiB usable"
                    )
                    preds = [fitted]
        shown = ", ".join(
            f"--{name} {values[name]}"
            for name in ("gpus", "tp", "batch", "seq", "ac")
            if name in defaulted and not (name == "tp" and values["tp"] == 1)
        )
        if shown:
            preset = ns.config is None and MODEL_ALIASES.get(ns.model, ns.model) in PLAN_DEFAULTS
            source = "torchtitan's layout" if preset else "generic"
            preds[0].notes.insert(0, f"defaults ({source}): {shown}")
        pred = preds[0]
        if not ns.sweep and not pred.fits:
            largest = largest_fitting_batch(pred)
            changes, tried = fitting_changes(args, pred, hw, predict)
    except ValueError as exc:
        print(f"simplefsdp plan: error: {exc}", file=sys.stderr)
        return 2
    elapsed = time.perf_counter() - start
    if not ns.sweep and not pred.fits:
        hint = (
            f"largest batch that fits: about {largest}"
            if largest
            else "no batch fits: the model state alone is too large"
        )
        advice = format_changes(changes, tried)
        print(format_prediction(pred))  # the breakdown shows what to cut
        print(
            f"simplefsdp plan: error: --batch {pred.layout.batch} does not fit on "
            f"{hw.name}: predicted {pred.peak_bytes / GiB:.2f} GiB of "
            f"{pred.usable_bytes / GiB:.2f} GiB usable per GPU; {hint}"
            + (f"; {advice}" if advice else ""),
            file=sys.stderr,
        )
        return 2
    result = _result(args, hw, elapsed, preds)
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


def _moe_main(ns: argparse.Namespace, start: float) -> int:
    """``simplefsdp plan`` for a mixture-of-experts ``--model`` (Note: [MoE
    plan model] in ``simplefsdp.plan.moe``)."""
    from simplefsdp.plan.moe import MoELayout, moe_args, predict_moe

    try:
        for flag, bad in (
            ("--tp", ns.tp not in (None, 1)),
            ("--pp", ns.pp != 1),
            ("--microbatches", ns.microbatches not in (None, 1)),
            ("--float8", ns.float8),
            ("--sweep", ns.sweep),
            ("--dtype", ns.dtype != "bf16"),
            ("--bucketing", ns.bucketing != "auto"),
        ):
            if bad:
                raise ValueError(
                    f"{flag} is not planned for mixture-of-experts models ({ns.model}); "
                    "valid: --gpus, --ep, --batch, --seq, --ac, --engine, --no-reshard, "
                    "--expert-imbalance, --hardware"
                )
        args = moe_args(ns.model)
        hw = get_profile(ns.hardware)
        layout = MoELayout(
            gpus=ns.gpus if ns.gpus is not None else GENERIC_DEFAULTS["gpus"],
            batch=ns.batch if ns.batch is not None else 1,
            seq=ns.seq if ns.seq is not None else min(args.max_seq_len, 4096),
            ep=ns.ep if ns.ep is not None else 1,
            ac=ns.ac or "selective",
            engine=ns.engine,
            reshard_after_forward=not ns.no_reshard,
            imbalance=ns.expert_imbalance,
        )
        pred = predict_moe(args, layout, hw)
    except ValueError as exc:
        print(f"simplefsdp plan: error: {exc}", file=sys.stderr)
        return 2
    elapsed = time.perf_counter() - start
    if not pred.fits:
        largest = largest_fitting_batch(pred)
        print(format_prediction(pred))
        state = sum(pred.memory[k] for k in ("parameters", "gradients", "optimizer"))
        if largest:
            hint = f"about {largest}"
        elif state > pred.usable_bytes:
            hint = "none: the model state alone is too large (more --gpus)"
        else:
            hint = "none at this --seq and --ac (a leaner --ac or a shorter --seq)"
        print(
            f"simplefsdp plan: error: --batch {layout.batch} does not fit on {hw.name}: "
            f"predicted {pred.peak_bytes / GiB:.2f} GiB of {pred.usable_bytes / GiB:.2f} GiB "
            f"usable per GPU; largest batch that fits: {hint}",
            file=sys.stderr,
        )
        return 2
    result = _result(args, hw, elapsed, [pred])
    if ns.json:
        print(json.dumps(result, indent=2, default=str))
    else:
        print(format_prediction(pred))
    if ns.out:
        out = Path(ns.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "plan.json").write_text(json.dumps(result, indent=2, default=str))
        if not ns.json:
            print(f"wrote {out / 'plan.json'}")
    if not ns.json:
        print(f"planned in {elapsed:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
