"""GPT-OSS's attention (sinks; a sliding window on alternate layers) as ``attend`` runs it.

``attend`` runs attention with sinks or a sliding window as one SDPA call
over a boolean mask, a sink as one more key, and a window under half the
sequence in chunks (Note: [Sinks as one more key] in
``simplefsdp/context_parallel/attention.py``). This times one attention of
GPT-OSS 20B's shape (64 query heads, 8 key/value heads, head dim 64), forward
and backward, compiled (Inductor), on one device: a full layer (sinks) and a
sliding layer (window 128, sinks), beside SDPA's causal kernel without sinks
(the speed of light: what FlashAttention gives plain causal attention) and
the explicit softmax over materialized scores (what ran before; skipped where
it does not fit). One JSON line: the median of each, ratios to the causal
kernel, and on CUDA the peak allocated memory of each (beyond the inputs);
a check that ``attend``'s gradients equal the explicit ones at a small size
on this device.

    PYTHONPATH=src python benchmarks/gpt_oss_attention.py            # CUDA, bf16, 8,192 tokens
    PYTHONPATH=src python benchmarks/gpt_oss_attention.py --cpu      # 8 heads, 2,048 tokens, fp32

About 2 minutes on one H100; the CPU shape about 1.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def _explicit(q, k, v, sinks, window):
    """The softmax over materialized float32 scores (GPT-OSS's reference)."""
    n_rep = q.shape[1] // k.shape[1]
    k, v = (x.repeat_interleave(n_rep, dim=1) for x in (k, v))
    t = q.shape[2]
    scores = (q @ k.transpose(-2, -1)).float() * q.shape[-1] ** -0.5
    pos = torch.arange(t, device=q.device)
    allowed = pos[None, :] <= pos[:, None]
    if window is not None:
        allowed = allowed & (pos[None, :] > pos[:, None] - window)
    scores = scores.masked_fill(~allowed, float("-inf"))
    sink = sinks.float().reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return probs.to(v.dtype) @ v


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="a small shape on the CPU")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    import torch.nn.functional as F

    from simplefsdp.models.common.attention import attend

    cuda = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda" if cuda else "cpu")
    heads, kv_heads, d = (64, 8, 64) if cuda else (8, 2, 64)
    seq, dtype = (8192, torch.bfloat16) if cuda else (2048, torch.float32)
    window = 128

    def leaves(t: int) -> list[torch.Tensor]:
        g = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(1, heads, t, d, generator=g, device=device, dtype=dtype)
        k, v = (
            torch.randn(1, kv_heads, t, d, generator=g, device=device, dtype=dtype)
            for _ in range(2)
        )
        sinks = torch.randn(heads, generator=g, device=device)
        return [x.requires_grad_() for x in (q, k, v, sinks)]

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    # gradients against the explicit softmax, small, on this device
    small = leaves(512)
    errors = {}
    for name, w in (("full", None), ("sliding", window)):
        got = []
        for fn in (attend, _explicit):
            q, k, v, s = small
            out = fn(q, k, v, sinks=s, sliding_window=w) if fn is attend else fn(q, k, v, s, w)
            out.float().square().sum().backward()
            got.append([out.detach().float()] + [x.grad.float().clone() for x in small])
            for x in small:
                x.grad = None
        errors[name] = max(
            ((a - b).abs().max() / b.abs().max()).item() for a, b in zip(*got, strict=True)
        )

    def causal(q, k, v, s):
        n_rep = q.shape[1] // k.shape[1]
        k, v = (x.repeat_interleave(n_rep, dim=1) for x in (k, v))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    cases = {
        "causal_no_sinks": causal,
        "full_sinks": lambda q, k, v, s: attend(q, k, v, sinks=s),
        "sliding_sinks": lambda q, k, v, s: attend(q, k, v, sinks=s, sliding_window=window),
        "explicit_full": lambda q, k, v, s: _explicit(q, k, v, s, None),
    }
    times: dict[str, float] = {}
    peaks: dict[str, float] = {}
    x = leaves(seq)
    for name, fn in cases.items():
        torch._dynamo.reset()
        step = torch.compile(fn)
        try:
            for _ in range(3):
                step(*x).float().sum().backward()
            sync()
            if cuda:
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            took = []
            for _ in range(args.steps):
                start = time.perf_counter()
                step(*x).float().sum().backward()
                sync()
                took.append(time.perf_counter() - start)
            times[name] = statistics.median(took)
            if cuda:
                peaks[name] = (torch.cuda.max_memory_allocated() - base) / 2**30
        except torch.OutOfMemoryError:
            times[name] = float("nan")
            torch.cuda.empty_cache()
        for leaf in x:
            leaf.grad = None
    light = times["causal_no_sinks"]
    print(
        json.dumps(
            {
                "device": torch.cuda.get_device_name() if cuda else "cpu",
                "torch": torch.__version__,
                "shape": {"heads": heads, "kv_heads": kv_heads, "head_dim": d, "seq": seq},
                "grad_rel_error_vs_explicit": {k: f"{v:.1e}" for k, v in errors.items()},
                **{f"fw_bw_s_{k}": round(v, 5) for k, v in times.items()},
                **{f"{k}_over_causal": round(v / light, 2) for k, v in times.items()},
                **{f"peak_gib_{k}": round(v, 2) for k, v in peaks.items()},
            }
        )
    )


if __name__ == "__main__":
    main()
