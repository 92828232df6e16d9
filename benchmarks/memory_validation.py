"""Predicted vs measured peak memory of one training step (forward + backward).

Run: ``python benchmarks/memory_validation.py`` (2 CPU processes, gloo).

Prediction: the compiler's liveness estimate (``simplefsdp.compiler.memory_estimate``)
of the final forward and backward graphs: ``max(forward peak, tensors saved
for backward + backward peak)``. Measurement: peak RSS above the RSS at the
start of the step, with glibc's mmap threshold lowered so freed tensors leave
the RSS (see ``simplefsdp.engines.memory``). Graphs run under ``aot_eager`` so that
tensors live exactly as the graph says (Inductor fuses away intermediates).
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist

import simplefsdp
from simplefsdp.compiler import CostModel
from simplefsdp.engines.memory import MemoryProbe, lower_mmap_threshold
from simplefsdp.models.llama3 import Transformer, get_config
from simplefsdp.testing import run_distributed


class WideStack(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(1024, 1024) for _ in range(8))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _build(name: str):
    torch.manual_seed(0)
    if name == "wide-mlp":
        return WideStack(), lambda: torch.randn(4, 1024)
    model = Transformer(get_config("debug"))
    return model, lambda: torch.randint(0, 260, (4, 256))


def _measure(model_name: str, bucketing: str) -> dict:
    lower_mmap_threshold(64 * 1024)
    model, batch = _build(model_name)
    simplefsdp.data_parallel(model)
    simplefsdp.compile(model, backend="aot_eager", bucketing=bucketing, cost_model=CostModel())
    x = batch()
    model(x).float().sum().backward()  # compile
    for p in model.parameters():
        p.grad = None
    peaks = []
    for _ in range(3):
        with MemoryProbe("cpu") as peak:
            model(x).float().sum().backward()
        for p in model.parameters():
            p.grad = None
        peaks.append(peak.peak)
    report = simplefsdp.comm_report(model)
    fw, bw = report.graph("forward").predicted, report.graph("backward").predicted
    predicted = max(fw["peak_bytes"], fw["output_bytes"] + bw["peak_bytes"])
    return {
        "model": model_name,
        "bucketing": bucketing,
        "rank": dist.get_rank(),
        "predicted_bytes": predicted,
        "measured_bytes": min(peaks),
    }


def main() -> None:
    argparse.ArgumentParser(
        description="Predicted (the compiler's liveness estimate) against measured peak memory "
        "of one forward+backward, 2 CPU processes (gloo), two models and two bucket plans."
    ).parse_args()
    rows = []
    for model_name in ("wide-mlp", "llama3-debug"):
        for bucketing in ("none", "per_block"):
            rows.append(run_distributed(_measure, 2, args=(model_name, bucketing))[0])
    print(f"{'model':<14} {'plan':<10} {'predicted MiB':>14} {'measured MiB':>13} {'error':>7}")
    for r in rows:
        error = (r["predicted_bytes"] - r["measured_bytes"]) / max(r["measured_bytes"], 1)
        print(
            f"{r['model']:<14} {r['bucketing']:<10} {r['predicted_bytes'] / 2**20:>14.2f} "
            f"{r['measured_bytes'] / 2**20:>13.2f} {100 * error:>6.1f}%"
        )
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
