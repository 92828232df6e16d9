"""Is float8 fast on this CPU? One timed matmul of each kind at start-up.

Note: [Float8 on CPU]
    Whether ``torch._scaled_mm`` (the float8 matmul) is fast on a CPU depends
    on the CPU and on torch's kernels for it: on one CPU it ran about twice as
    fast as bf16, on another (AMX-bf16, no float8 units) one 1024x256x768
    product took 20 s against 0.02 s in bf16, and a small model's first step
    ran for over ten minutes. With ``float8.enable`` on a CPU the trainer
    times one bf16 and one float8 product of the model's width on a few rows
    (so that the probe itself stays short however slow float8 is: the float8
    one runs in a thread and is given up on after a cap) and says in one line
    how much slower float8 is, with the flag that turns it off.
"""

from __future__ import annotations

import threading
import time

import torch

#: float8 this many times slower than bf16 gets the warning.
FLOAT8_SLOW_FACTOR = 2.0
_ROWS = 16  # rows of the probe's products: enough to time, few enough to stay short


def _timed(fn) -> float:
    fn()  # warm-up: kernel selection, first-touch of the operands
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def float8_slowdown(dim: int, hidden: int, *, cap_s: float = 2.0) -> tuple[float, bool] | None:
    """How many times slower a float8 matmul is than a bf16 one on this CPU.

    Times ``(16, dim) @ (dim, hidden)`` in bf16 and with ``torch._scaled_mm``
    (float8 e4m3, tensorwise scales). The float8 products run in a daemon
    thread, waited for at most ``cap_s`` seconds.

    Returns:
        ``(factor, capped)``: ``capped`` when float8 did not finish within
        ``cap_s`` (``factor`` is then a lower bound); ``None`` when this torch
        has no CPU float8 matmul.
    """
    dim, hidden = max(16, dim // 16 * 16), max(16, hidden // 16 * 16)
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(_ROWS, dim, generator=gen)
    b = torch.randn(hidden, dim, generator=gen)
    bf16_s = max(_timed(lambda: a.bfloat16() @ b.bfloat16().t()), 1e-6)
    try:
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
        one = torch.tensor(1.0)
        torch._scaled_mm(a8[:16, :16], b8[:16, :16].t(), one, one, out_dtype=torch.bfloat16)
    except (RuntimeError, AttributeError, TypeError, NotImplementedError):
        return None
    result: list[float] = []

    def run() -> None:
        result.append(
            _timed(lambda: torch._scaled_mm(a8, b8.t(), one, one, out_dtype=torch.bfloat16))
        )

    thread = threading.Thread(target=run, name="simplefsdp-float8-probe", daemon=True)
    start = time.perf_counter()
    thread.start()
    thread.join(cap_s)
    if result:
        return result[0] / bf16_s, False
    return (time.perf_counter() - start) / 2 / bf16_s, True


def float8_warning(dim: int, hidden: int, *, cap_s: float = 2.0) -> str | None:
    """The one-line warning when float8 is much slower than bf16 here, else ``None``."""
    measured = float8_slowdown(dim, hidden, cap_s=cap_s)
    if measured is None:
        return None
    factor, capped = measured
    if factor < FLOAT8_SLOW_FACTOR:
        return None
    times = f"over {factor:.0f}x" if capped else f"{factor:.0f}x"
    return (
        f"float8 matmuls are {times} slower than bf16 on this CPU (measured at start-up on "
        f"16x{dim}x{hidden}); training will be slow: --float8.enable false trains without float8"
    )
