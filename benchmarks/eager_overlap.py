"""Does the eager executor overlap communication with compute? A measurement.

Injects a fixed delay into every collective of ``simplefsdp.eager`` and times
training steps on 2 CPU processes (gloo):

- ``compute``: the same model and local batch in one process, no communication;
- ``comm (injected)``: the number of collectives per step times the delay;
- ``sequential``: eager with every collective waited on as soon as it is issued
  (compute and communication strictly in sequence; measured);
- ``no prefetch``: eager, asynchronous collectives, prefetching off;
- ``prefetch``: eager with forward and backward prefetch (the default).

The delay models a serial link: a collective issued at ``t`` completes at
``max(t, link free) + delay``; its ``wait()`` first waits for the real gloo
work (asynchronous, ``async_op=True``) and then sleeps until that time. The
step overlaps when ``prefetch`` is clearly shorter than ``sequential``.
A benchmark, not a test: it prints numbers and never fails on a time.

Usage::

    python benchmarks/eager_overlap.py [--delay-ms 15] [--rounds 4] [--steps 3] [--dim 512]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import simplefsdp
from simplefsdp import get_eager_executor
from simplefsdp.testing import run_distributed


class _Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(x))


class _Model(nn.Module):
    def __init__(self, dim: int, n_blocks: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block(dim) for _ in range(n_blocks))
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class _LinkWork:
    def __init__(self, inner, done_at_s: float) -> None:
        self.inner = inner
        self.done_at_s = done_at_s

    def wait(self):
        result = self.inner.wait()
        remaining_s = self.done_at_s - time.monotonic()
        if remaining_s > 0:
            time.sleep(remaining_s)
        return result


class DelayedCollectives:
    """Wraps the executor's collectives: each takes ``delay_s`` more on a serial link.

    With ``blocking=True`` every collective is waited on when issued, which
    serialises communication and compute (the no-overlap baseline).
    """

    def __init__(self, inner, delay_s: float, blocking: bool) -> None:
        self.inner = inner
        self.delay_s = delay_s
        self.blocking = blocking
        self.link_free_at_s = 0.0
        self.issued = 0

    def _delayed(self, work):
        self.issued += 1
        self.link_free_at_s = max(time.monotonic(), self.link_free_at_s) + self.delay_s
        delayed = _LinkWork(work, self.link_free_at_s)
        if self.blocking:
            delayed.wait()
        return delayed

    def all_gather(self, *args):
        return self._delayed(self.inner.all_gather(*args))

    def reduce_scatter(self, *args):
        return self._delayed(self.inner.reduce_scatter(*args))

    def all_reduce(self, *args):
        return self._delayed(self.inner.all_reduce(*args))


class _Runner:
    """One configuration: a model, its optimizer, and its measured step times."""

    def __init__(self, model: nn.Module, delayed: DelayedCollectives | None) -> None:
        self.model = model
        self.delayed = delayed
        self.opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        self.times_s: list[float] = []
        self.collectives = 0

    def step(self, batch: torch.Tensor, measure: bool) -> None:
        issued_before = self.delayed.issued if self.delayed else 0
        start = time.perf_counter()
        self.model(batch).square().mean().backward()
        self.opt.step()
        self.opt.zero_grad()
        if measure:
            self.times_s.append(time.perf_counter() - start)
            if self.delayed:
                self.collectives = self.delayed.issued - issued_before


def _eager_runner(args, prefetch: bool, delay_s: float, blocking: bool) -> _Runner:
    torch.manual_seed(0)
    model = simplefsdp.data_parallel(_Model(args.dim, args.blocks))
    simplefsdp.eager(model, forward_prefetch=prefetch, backward_prefetch=prefetch)
    executor = get_eager_executor(model)
    executor.comm = delayed = DelayedCollectives(executor.comm, delay_s, blocking)
    return _Runner(model, delayed)


def _measure(args) -> dict[str, float]:
    delay_s = args.delay_ms / 1e3
    torch.manual_seed(0)
    runners = {"compute": _Runner(_Model(args.dim, args.blocks), None)}
    for name, prefetch, delay, blocking in (
        ("real gloo, no prefetch", False, 0.0, False),
        ("real gloo, prefetch", True, 0.0, False),
        ("sequential", False, delay_s, True),
        ("no prefetch", False, delay_s, False),
        ("prefetch", True, delay_s, False),
    ):
        runners[name] = _eager_runner(args, prefetch, delay, blocking)
    torch.manual_seed(dist.get_rank())
    batch = torch.randn(args.batch, args.dim)
    # Rounds interleave the configurations, so drifting machine load (other
    # jobs) affects them alike; the first round warms up (and records orders).
    for round_index in range(args.rounds + 1):
        for runner in runners.values():
            dist.barrier()
            for _ in range(args.steps):
                runner.step(batch, measure=round_index > 0)
    results = {name: statistics.median(r.times_s) for name, r in runners.items()}
    results["collectives per step"] = runners["prefetch"].collectives
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--delay-ms", type=float, default=15.0)
    parser.add_argument("--steps", type=int, default=3, help="per configuration and round")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--batch", type=int, default=512, help="per rank")
    args = parser.parse_args()
    per_rank = run_distributed(_measure, 2, args=(args,), timeout_s=900)
    # The slower rank sets the pace of a step.
    result = {k: max(r[k] for r in per_rank) for k in per_rank[0]}
    n_collectives = result["collectives per step"]
    comm_s = n_collectives * args.delay_ms / 1e3
    compute_s = result["compute"]
    print(
        f"2 ranks (gloo), {args.blocks} blocks of Linear({args.dim}, {args.dim}), "
        f"batch {args.batch}/rank, delay {args.delay_ms:.1f} ms x {n_collectives:.0f} "
        "collectives per step"
    )
    rows = [
        ("compute only (1 process, no comm)", compute_s),
        ("injected communication", comm_s),
        ("compute + communication, summed", compute_s + comm_s),
        ("eager, sequential (wait at issue)", result["sequential"]),
        ("eager, async, no prefetch", result["no prefetch"]),
        ("eager, async, prefetch", result["prefetch"]),
        ("eager, real gloo only, no prefetch", result["real gloo, no prefetch"]),
        ("eager, real gloo only, prefetch", result["real gloo, prefetch"]),
    ]
    for label, seconds in rows:
        print(f"  {label:<38} {seconds * 1e3:9.1f} ms")
    hidden_s = result["sequential"] - result["prefetch"]
    hideable_s = min(compute_s, comm_s)
    print(
        f"  hidden by overlap: {hidden_s * 1e3:.1f} ms (at most min(compute, comm) = "
        f"{hideable_s * 1e3:.1f} ms can be hidden); prefetch step / sequential step = "
        f"{result['prefetch'] / result['sequential']:.2f}"
    )


if __name__ == "__main__":
    main()
