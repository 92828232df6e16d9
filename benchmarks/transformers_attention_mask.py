"""Compiled steps of a ``transformers`` model with and without its attention mask.

The ``transformers`` family calls SDPA with ``is_causal=True`` and no mask
under ``torch.compile`` for plain causal attention over whole sequences (see
Note: [Causal attention without a mask under compile] in
``simplefsdp/models/hf_transformers/model.py``); ``transformers`` itself
builds a ``(B, 1, T, T)`` boolean mask when traced. This times both in one
process on one device: a Mistral-shaped model through
:class:`TransformersCausalLM`, compiled (Inductor), forward and backward of
a summed loss, with ``whole_sequence_mask`` on (ours) and off
(``transformers``' mask), alternated twice; then the same model with a
sliding window of half the sequence (its mask kept, as the trainer runs
it) and with a window of an eighth of it (in chunks: Note: [Sliding
windows of transformers models in chunks]), beside the compute time
``simplefsdp plan`` predicts for each and for the model without a window
on this GPU's profile (one GPU, no AC). One
JSON line: the median step of each, the ratios, the planned ratio, and on
CUDA the peak allocated memory of each.

    PYTHONPATH=src python benchmarks/transformers_attention_mask.py            # CUDA, bf16
    PYTHONPATH=src python benchmarks/transformers_attention_mask.py --cpu      # small, fp32

About 3 minutes on one H100 (compiles and the two plans included); the CPU
shape about 1.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="a small model on the CPU")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    import transformers

    from simplefsdp.models.hf_transformers.config import config_from_hf
    from simplefsdp.models.hf_transformers.model import TransformersCausalLM

    cuda = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda" if cuda else "cpu")
    if cuda:  # about 1.1B parameters, 2 x 4,096 tokens
        shape = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                     num_attention_heads=16, num_key_value_heads=8)  # fmt: skip
        batch, seq, dtype = 2, 4096, torch.bfloat16
    else:
        shape = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
        batch, seq, dtype = 1, 2048, torch.float32

    def build(window: int | None) -> TransformersCausalLM:
        hf = transformers.MistralConfig(
            vocab_size=32000, max_position_embeddings=seq, sliding_window=window, **shape
        ).to_dict()
        torch.manual_seed(0)
        with torch.device(device):
            return TransformersCausalLM(config_from_hf(hf)).to(dtype)

    model = build(None)
    if not model.whole_sequence_mask:
        raise SystemExit("this transformers version keeps its masks: nothing to compare")
    tokens = torch.randint(0, 32000, (batch, seq), device=device)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    times: dict[str, list[float]] = {"no_mask": [], "mask": [], "window": [], "short_window": []}
    peaks: dict[str, int] = {}
    windowed, short = build(seq // 2), build(seq // 8)
    runs = [(model, True, "no_mask"), (model, False, "mask")] * 2
    runs += [(windowed, True, "window"), (short, True, "short_window")]
    for which, whole, name in runs:
        which.whole_sequence_mask = whole
        torch._dynamo.reset()
        step = torch.compile(which, fullgraph=True)
        for _ in range(3):  # compile and warm up
            step(tokens).float().sum().backward()
        sync()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        for _ in range(args.steps):
            start = time.perf_counter()
            step(tokens).float().sum().backward()
            sync()
            times[name].append(time.perf_counter() - start)
        if cuda:
            peaks[name] = torch.cuda.max_memory_allocated()
        which.zero_grad(set_to_none=True)
    planned = _planned_window_ratio(shape, batch, seq, seq // 2) if cuda else None
    planned_short = _planned_window_ratio(shape, batch, seq, seq // 8) if cuda else None
    med = {k: statistics.median(v) for k, v in times.items()}
    print(
        json.dumps(
            {
                "device": torch.cuda.get_device_name() if cuda else "cpu",
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "tokens": batch * seq,
                "step_s_no_mask": round(med["no_mask"], 4),
                "step_s_mask": round(med["mask"], 4),
                "step_s_window": round(med["window"], 4),
                "mask_over_no_mask": round(med["mask"] / med["no_mask"], 3),
                "window_over_no_mask": round(med["window"] / med["no_mask"], 3),
                "planned_window_over_no_mask": planned,
                "step_s_short_window": round(med["short_window"], 4),
                "short_window_over_no_mask": round(med["short_window"] / med["no_mask"], 3),
                "planned_short_window_over_no_mask": planned_short,
                **{f"peak_gib_{k}": round(v / 2**30, 2) for k, v in peaks.items()},
            }
        )
    )


def _planned_window_ratio(shape: dict, batch: int, seq: int, window: int) -> float | None:
    """``simplefsdp plan``'s compute time of the model with a ``window`` over
    the model without one, one GPU of this machine's profile (H100 or H200
    by name), no AC."""
    import tempfile
    from pathlib import Path

    from simplefsdp.plan import cli as plan_cli
    from simplefsdp.plan import hardware
    from simplefsdp.plan.layout import Layout
    from simplefsdp.plan.predict import predict

    name = torch.cuda.get_device_name().lower()
    profile = "h200" if "h200" in name else "h100" if "h100" in name else None
    if profile is None:
        return None
    computes = []
    for size in (None, window):
        fields = dict(
            model_type="mistral", architectures=["MistralForCausalLM"], vocab_size=32000,
            max_position_embeddings=seq, sliding_window=size, **shape,
        )  # fmt: skip
        with tempfile.TemporaryDirectory() as folder:
            (Path(folder) / "config.json").write_text(json.dumps(fields))
            spec, config = plan_cli.resolve_model(
                plan_cli._parser().parse_args(["--model", folder])
            )
            layout = Layout(gpus=1, batch=batch, seq=seq, ac="none")
            computes.append(
                predict(spec, config, layout, hardware.get_profile(profile)).time["compute"]
            )
    return round(computes[1] / computes[0], 3)


if __name__ == "__main__":
    main()
