"""Host time per eager op, with and without selective AC (``simplefsdp plan``'s
``host_forward_op_s`` and ``host_selective_ac_op_s``; Note: [Host-bound
steps] in ``simplefsdp/plan/host.py``).

A family's block structure at minimal widths (so that each CPU kernel costs
next to nothing beside the Python, dispatcher and autograd work around it)
runs forward and backward eagerly in bfloat16 on this machine's CPU. The
kernels of each pass are counted with the planner's own recorder, and the
time of one block is the difference between models of one and of three
blocks past the dense ones. Printed per flavor and AC mode: microseconds
per forward op, per backward op and (selective AC) per recomputed op, the
last taking the backward ops at their cost without AC.

    PYTHONPATH=src python benchmarks/host_ops.py [--flavors deepseek_v3_16b llama3_8b]

About 10 s per flavor; run it on a quiet machine (one thread).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from simplefsdp.engines.activation import apply_activation_checkpointing
from simplefsdp.models.registry import resolve_flavor
from simplefsdp.plan.host import _KernelRecorder, _one_kernel_attention

#: the minimal widths each field takes where a config has it
MINIMAL = dict(
    dim=32,
    n_heads=2,
    n_kv_heads=2,
    dense_hidden_dim=32,
    moe_hidden_dim=16,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=8,
    head_dim=16,
    multiple_of=16,
    vocab_size=64,
)


def minimal(config):
    """``config`` at the smallest widths of ``MINIMAL`` it has fields for."""
    names = {f.name for f in dataclasses.fields(config)}
    return dataclasses.replace(config, **{k: v for k, v in MINIMAL.items() if k in names})


def build(spec, config, ac: str):
    torch.manual_seed(0)
    with torch.device("meta"):
        model = spec.build(config)
    model.to_empty(device="cpu")
    spec.init_weights(model, "cpu")
    model.to(torch.bfloat16)
    for module in model.modules():
        if hasattr(module, "use_grouped_mm"):
            module.use_grouped_mm = True
    apply_activation_checkpointing(model, ac)
    return model


def measure(spec, config, ac: str, seq: int, repeats: int) -> tuple[dict, float, float]:
    """(kernels per pass, forward s, backward s) of one step, median of ``repeats``."""
    model = build(spec, config, ac)
    tokens = torch.randint(0, config.vocab_size, (1, seq))

    def step():
        loss = model(tokens).float().logsumexp(-1).mean()
        return loss

    with _one_kernel_attention():
        recorder = _KernelRecorder(lambda *_: 0.0, saves_attention=ac == "selective")
        with recorder:
            loss = step()
            recorder.backward = True
            loss.backward()
        counts = {
            p: sum(1 for op in recorder.ops if op[0] == p)
            for p in ("forward", "backward", "recompute")
        }
        fw, bw = [], []
        for i in range(repeats + 3):
            t0 = time.perf_counter()
            loss = step()
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            if i >= 3:
                fw.append(t1 - t0)
                bw.append(t2 - t1)
    return counts, statistics.median(fw), statistics.median(bw)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavors", nargs="+", default=["deepseek_v3_16b", "llama3_8b"])
    parser.add_argument("--seq", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for flavor in args.flavors:
        spec, config = resolve_flavor(flavor)
        config = minimal(config)
        n_dense = getattr(config, "n_dense_layers", 0)
        per_op = {}
        for ac in ("none", "selective"):
            runs = [
                measure(
                    spec,
                    dataclasses.replace(config, n_layers=n_dense + n),
                    ac,
                    args.seq,
                    args.repeats,
                )
                for n in (1, 3)
            ]
            (c1, f1, b1), (c3, f3, b3) = runs
            ops = {p: (c3[p] - c1[p]) / 2 for p in c1}
            fw_us = 1e6 * (f3 - f1) / 2 / ops["forward"]
            bw_s = (b3 - b1) / 2
            if ac == "none":
                bw_us = 1e6 * bw_s / ops["backward"]
                per_op["backward"] = bw_us
                print(f"{flavor} ac=none: forward {fw_us:.1f} us/op ({ops['forward']:.0f} ops), "
                      f"backward {bw_us:.1f} us/op ({ops['backward']:.0f} ops)")  # fmt: skip
            else:
                rc_us = (
                    1e6 * (bw_s - 1e-6 * per_op["backward"] * ops["backward"]) / ops["recompute"]
                )
                print(f"{flavor} ac=selective: forward {fw_us:.1f} us/op, recomputed "
                      f"{rc_us:.1f} us/op ({ops['recompute']:.0f} ops)")  # fmt: skip


if __name__ == "__main__":
    main()
