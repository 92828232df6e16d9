"""Float8 on a CPU without fast float8 matmuls: one start-up line with the
measured factor and the flag (Note: [Float8 on CPU]); the first step's
heartbeat says "compiling" only while torch compiles."""

from __future__ import annotations

import time

import torch

from simplefsdp.train import float8_probe
from simplefsdp.train.metrics import CompileWatch


def test_slow_float8_is_one_line_with_the_factor_and_the_flag_and_the_probe_is_capped(
    monkeypatch,
):
    real = torch._scaled_mm

    def slow_scaled_mm(a, b, *args, **kwargs):
        if a.shape[0] > 16 or a.shape[1] > 16:  # the probe's product, not the support check
            time.sleep(5)
        return real(a, b, *args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", slow_scaled_mm)
    start = time.perf_counter()
    warning = float8_probe.float8_warning(256, 768, cap_s=0.5)
    assert time.perf_counter() - start < 3  # capped, never the 10 s of the two slow products
    assert warning is not None and "slower than bf16 on this CPU" in warning, warning
    assert "over " in warning and "x slower" in warning
    assert "--float8.enable false" in warning


def test_fast_float8_says_nothing(monkeypatch):
    monkeypatch.setattr(float8_probe, "float8_slowdown", lambda *a, **k: (1.1, False))
    assert float8_probe.float8_warning(256, 768) is None


def test_the_heartbeat_says_compiling_only_while_compiling():
    seen = []

    def f(x):
        seen.append(watch.message(12.0))  # runs while dynamo traces (compiles) it
        return x * 2

    with CompileWatch() as watch:
        assert watch.message(3.0).startswith("  running the compiled step: 3s")
        torch.compile(f, backend="eager")(torch.ones(2))
        assert watch.message(40.0).startswith("  running the compiled step: 40s")
    assert seen and seen[0] == "  still compiling: 12s"
