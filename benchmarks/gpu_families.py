"""One GPU, one call: every model family from a Hugging Face folder, compiled.

For each native family (and one model through ``transformers``) this writes a
tiny random ``transformers`` model with ``save_pretrained``, trains it with
``simplefsdp train --checkpoint.init_from_hf`` on one rank (compiled with the
device's default backend: Inductor on CUDA), exports it with ``--format hf``
and loads the export with ``from_pretrained``; then it runs ``simplefsdp plan
--measure`` beside its prediction. It prints one line per run (first and last
loss, the median tokens/s, the exit codes) and keeps each run's log under ``OUT``.
On a CPU it runs the same (slowly), which is how it is tested.

    PYTHONPATH=src OUT=/tmp/out python benchmarks/gpu_families.py [--steps 20]

About 1-2 minutes per family on one H100 (most of it compiling).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

#: flavor whose shape the tiny folder takes -> extra ``simplefsdp train`` flags
FAMILIES = {
    "llama3_debug": [],
    "qwen3_debug": [],
    "qwen3_moe_debug": [],
    "gpt_oss_debug": [],
    "deepseek_v3_debug": [],
}


def _folder(flavor: str, out: Path) -> Path:
    import dataclasses

    import torch
    import transformers

    from simplefsdp.checkpoint.hf import hf_config_from_model_args
    from simplefsdp.models.registry import resolve_flavor

    spec, config = resolve_flavor(flavor)
    if "load_balance" in {f.name for f in dataclasses.fields(config)}:
        config = dataclasses.replace(config, load_balance="none")  # exportable everywhere
    hf = transformers.AutoConfig.for_model(**hf_config_from_model_args(config))
    torch.manual_seed(0)
    folder = out / f"hf_{flavor}"
    transformers.AutoModelForCausalLM.from_config(hf).save_pretrained(folder)
    return folder


def _mistral_folder(out: Path) -> Path:
    import torch
    import transformers

    config = transformers.MistralConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, vocab_size=260, max_position_embeddings=1024,
    )  # fmt: skip
    torch.manual_seed(0)
    folder = out / "hf_mistral"
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def _run(argv: list[str], log: Path) -> tuple[int, float]:
    start = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.call([sys.executable, "-m", "simplefsdp.cli", *argv], stdout=f, stderr=f)
    return rc, time.perf_counter() - start


def _run_folder(run_root: Path) -> Path | None:
    folders = sorted(p.parent for p in run_root.glob("*/metrics.jsonl"))
    return folders[-1] if folders else None


def _losses(run_root: Path) -> tuple[float | None, float | None, float | None]:
    """First and last loss, and the median tokens/s after the first step."""
    files = sorted(run_root.glob("*/metrics.jsonl"))
    if not files:
        return None, None, None
    rows = [json.loads(line) for line in files[-1].read_text().splitlines()]
    steps = [r for r in rows if "event" not in r and "loss" in r]
    if not steps:
        return None, None, None
    rates = sorted(r["tokens_per_s_per_rank"] for r in steps[1:] if "tokens_per_s_per_rank" in r)
    return steps[0]["loss"], steps[-1]["loss"], (rates[len(rates) // 2] if rates else None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    out = Path(os.environ.get("OUT", "./gpu_families_out")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    folders = {flavor: _folder(flavor, out) for flavor in FAMILIES}
    folders["mistral (transformers)"] = _mistral_folder(out)
    common = [
        "--nproc", "1", "--data.max_bytes", "400000", "--data.seq_len", "256",
        "--data.batch_size", "4", "--training.steps", str(args.steps),
        "--training.warmup_steps", "2", "--metrics.log_interval", "1",
        "--metrics.val_interval", "0", "--checkpoint.interval", str(args.steps),
    ]  # fmt: skip
    print(f"{'model':24s} {'train':>5s} {'export':>6s} {'load':>5s} {'loss first':>10s} "
          f"{'last':>7s} {'tok/s':>8s} {'wall s':>7s}")  # fmt: skip
    for name, folder in folders.items():
        tag = name.split()[0]
        runs = out / f"runs_{tag}"
        extra = FAMILIES.get(name, [])
        rc, wall = _run(
            ["train", *common, "--checkpoint.init_from_hf", str(folder),
             "--metrics.output_dir", str(runs), *extra],
            out / f"{tag}_train.log",
        )  # fmt: skip
        first, last, step = _losses(runs)
        erc = lrc = None
        if rc == 0 and _run_folder(runs) is not None:
            erc, _ = _run(
                ["export", "--checkpoint", str(_run_folder(runs)), "--format", "hf", "--out",
                 str(out / f"{tag}_export")],
                out / f"{tag}_export.log",
            )  # fmt: skip
        if erc == 0:
            code = (
                "import sys, transformers; "
                "transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1])"
            )
            lrc = subprocess.call(
                [sys.executable, "-c", code, str(out / f"{tag}_export")],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
        print(
            f"{name:24s} {rc:5d} {fmt(erc, 'd'):>6s} {fmt(lrc, 'd'):>5s} "
            f"{fmt(first, '.4f'):>10s} {fmt(last, '.4f'):>7s} {fmt(step, '.0f'):>8s} "
            f"{wall:7.1f}"
        )
    rc, wall = _run(
        ["plan", "--model", "llama3_debug", "--gpus", "8", "--batch", "2", "--seq", "256",
         "--measure"],
        out / "plan_measure.log",
    )  # fmt: skip
    print(f"\nsimplefsdp plan --measure: exit {rc} in {wall:.1f} s")
    print("".join((out / "plan_measure.log").read_text().splitlines(keepends=True)[-8:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
